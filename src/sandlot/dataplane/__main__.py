"""``python -m sandlot.dataplane``: see :mod:`sandlot.dataplane.standalone`."""

from sandlot.dataplane.standalone import main

main()
