"""``python -m sandlot.dataplane``: see :mod:`sandlot.dataplane.standalone`."""

import gc

# Imports create many objects and few cycles: collecting meanwhile costs a sixth of the
# start. ``main`` freezes what they made and turns the collector back on.
gc.disable()

from sandlot.dataplane.standalone import main  # noqa: E402

main()
