"""``python -m sandlot.dataplane``: see :mod:`sandlot.dataplane.standalone`."""

from sandlot.dataplane.prelude import prepare

prepare()

from sandlot.dataplane.standalone import main  # noqa: E402

main()
