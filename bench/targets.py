"""The issues' performance targets, each reported by the benchmark that measures it.

A benchmark calls :func:`report` once per target with the figure it measured
in that run. ``python -m bench`` names a file in ``SANDLOT_BENCH_TARGETS``,
collects the reports (JSON lines) and puts them in one table at the top of
docs/BENCHMARKS.md, so every target is visibly met or missed, and a missed one
says what limits it. Run on its own, a benchmark prints its reports to stderr.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

ENV = "SANDLOT_BENCH_TARGETS"


@dataclass
class Target:
    area: str  #: what the target is about, e.g. "broker", "dataplane"
    target: str  #: the target as the issue states it
    measured: str  #: the figure of this run
    met: bool
    limit: str = ""  #: for a missed target: what limits it, with figures of this run


def report(area: str, target: str, measured: str, met: bool, limit: str = "") -> None:
    """Record one target's outcome for the summary (stderr when run on its own)."""
    entry = Target(area, target, measured, met, "" if met else limit)
    path = os.environ.get(ENV)
    if path:
        with open(path, "a", encoding="utf-8") as out:
            out.write(json.dumps(asdict(entry)) + "\n")
    else:
        verdict = "met" if met else f"missed: {limit}"
        print(f"target {area}: {target}: {measured} ({verdict})", file=sys.stderr)


def load(path: Path) -> list[Target]:
    if not path.exists():
        return []
    return [Target(**json.loads(line)) for line in path.read_text().splitlines() if line]


def table(targets: list[Target]) -> str:
    """The Markdown summary: one row per target, in the order the benchmarks reported them."""
    met = sum(t.met for t in targets)
    lines = [
        f"{met} of {len(targets)} targets met in this run.\n",
        "| area | target | measured | met | what limits it |",
        "|---|---|---|---|---|",
    ]
    for t in targets:
        lines.append(
            f"| {t.area} | {t.target} | {t.measured} | {'yes' if t.met else '**no**'} | {t.limit} |"
        )
    return "\n".join(lines)
