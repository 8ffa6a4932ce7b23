"""What the reliability suite reports: the figure each test measured, and its size.

``FULL`` is set by ``SANDLOT_RELIABILITY_FULL=1`` (``python bench/reliability.py --full``);
CI runs the quick sizes. A test reports its figure with :func:`report`, which prints it
and stores it in the JUnit report that bench/reliability.py turns into docs/RELIABILITY.md.
"""

from __future__ import annotations

import os
from collections.abc import Callable

FULL = os.environ.get("SANDLOT_RELIABILITY_FULL") == "1"

RecordProperty = Callable[[str, object], None]


def report(record_property: RecordProperty, figure: str) -> None:
    print(figure)
    record_property("figure", figure)
