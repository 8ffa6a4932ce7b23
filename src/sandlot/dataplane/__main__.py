"""``python -m sandlot.dataplane``: see :mod:`sandlot.dataplane.standalone`."""

import gc
import os

# Imports create many objects and few cycles: collecting meanwhile costs a sixth of the
# start. ``main`` freezes what they made and turns the collector back on.
gc.disable()
# pydantic looks for plugins among every installed distribution's entry points (a scan
# of each one's metadata) before it builds its first model: none serves the dataplane.
# (Its commands get the template's environment, never this one.)
os.environ.setdefault("PYDANTIC_DISABLE_PLUGINS", "1")

from sandlot.dataplane.standalone import main  # noqa: E402

main()
