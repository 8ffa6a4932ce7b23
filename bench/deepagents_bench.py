"""The deepagents backend's native calls vs deepagents' own script-over-execute defaults.

Run: ``.venv/bin/python bench/deepagents_bench.py [--n 200]``

Starts ``sandlot serve`` on 127.0.0.1, ensures one sandbox as an agent, and
times ``read``, ``write``, ``edit`` and ``grep`` two ways on that same sandbox,
interleaved in blocks of ``--block`` calls (a new order each round):

- **sandlot**: :class:`~sandlot.integrations.deepagents.SandlotBackend`, one
  native ``/fs/*`` call each;
- **BaseSandbox**: deepagents' ``BaseSandbox`` implementations (a Python or
  shell script run through ``execute``, uploads through ``upload_files``),
  over the very same transport (``execute`` → ``POST /exec``).

Prints a Markdown table: median and p95 in ms and the ratio of medians.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deepagents.backends.protocol import (
    ExecuteResponse,
    FileDownloadResponse,
    FileUploadResponse,
)
from deepagents.backends.sandbox import BaseSandbox
from targets import report
from tests.servers import isolation_mode, running

from sandlot.integrations.deepagents import SandlotBackend

#: Files in the tree ``grep`` searches.
FILES = 50


class ScriptSandbox(BaseSandbox):
    """deepagents' defaults: every file operation is a script run through ``execute``."""

    def __init__(self, native: SandlotBackend) -> None:
        self.native = native

    @property
    def id(self) -> str:
        return self.native.id

    def execute(self, command: str, *, timeout: int | None = None) -> ExecuteResponse:
        return self.native.execute(command, timeout=timeout)

    def upload_files(self, files: list[tuple[str, bytes]]) -> list[FileUploadResponse]:
        return self.native.upload_files(files)

    def download_files(self, paths: list[str]) -> list[FileDownloadResponse]:
        return self.native.download_files(paths)


def file_ops(b: Any, tag: str, base: str, body: str) -> dict[str, Callable[[], Any]]:
    """The timed calls on backend ``b``: each checks its answer (a failed call is never a
    sample); ``edit`` flips a word back and forth in a file of its own (``edit-TAG.txt``)."""
    state = {"flip": False}

    def edit() -> Any:
        state["flip"] = not state["flip"]
        old, new = ("alpha", "omega") if state["flip"] else ("omega", "alpha")
        result = b.edit(f"{base}/edit-{tag}.txt", old, new)
        assert result.error is None, result.error
        return result

    def read() -> Any:
        result = b.read(f"{base}/target.txt")
        assert result.error is None, result.error
        return result

    def write() -> Any:
        result = b.write(f"{base}/out-{tag}.txt", body)
        assert result.error is None, result.error
        return result

    def grep() -> Any:
        result = b.grep("line 42:", f"{base}/src")
        assert result.error is None and len(result.matches) == FILES, result
        return result

    return {"read": read, "write": write, "edit": edit, "grep": grep}


def limit_of(op: str, peer_ms: float, floor_ms: float, search_ms: float) -> str:
    """What stands between a call and 10x the peer's speed, in this run's figures."""
    goal = peer_ms / 10
    head = f"10\u00d7 BaseSandbox's {peer_ms:.2f} ms is {goal:.2f} ms a call"
    if goal < floor_ms:
        return f"{head}, below one round trip of the SDK to the dataplane here (`read`)"
    if op == "grep":
        return (
            f"{head}; one round trip of the SDK (`read`) takes {floor_ms:.2f} ms and "
            f"opening and reading the {FILES} files takes {search_ms:.2f} ms on its own "
            "(the dataplane's C search, timed in this process on a copy of the tree)"
        )
    return (
        f"{head}; one round trip (`read`) takes {floor_ms:.2f} ms and `{op}` adds a durable write"
    )


def search_alone(body: str, pattern: str, rounds: int = 2000) -> float:
    """Median ms of the dataplane's own C search of a copy of the tree, in this process."""
    from sandlot.dataplane.services import native

    lib = native.library()
    if lib is None:
        return float("nan")
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(FILES):
            Path(tmp, f"m{i}.py").write_text(body)
        fd = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY)
        try:
            times = []
            for _ in range(rounds):
                t0 = time.perf_counter()
                lib.grep(
                    fd,
                    b"/workspace/bench/src",
                    pattern.encode(),
                    None,
                    cap=10_000,
                    count_limit=256,
                    max_files=256,
                    max_bytes=4 << 20,
                )
                times.append((time.perf_counter() - t0) * 1000)
        finally:
            os.close(fd)
    return statistics.median(times)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=200)
    parser.add_argument("--block", type=int, default=10, help="calls per side in a row")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, running(Path(tmp) / "d") as srv:
        backend = SandlotBackend.for_thread("thr_bench", url=srv.url, api_key=srv.key("b", "agent"))
        script = ScriptSandbox(backend)
        base = "/workspace/bench"
        body = "".join(f"line {i}: the quick brown fox\n" for i in range(100))  # ~3 KiB
        for i in range(FILES):
            backend.write(f"{base}/src/m{i}.py", body)
        backend.write(f"{base}/target.txt", body)
        for tag in ("sandlot", "BaseSandbox"):
            backend.write(f"{base}/edit-{tag}.txt", "alpha\n" + body)

        sides = {
            "sandlot": file_ops(backend, "sandlot", base, body),
            "BaseSandbox": file_ops(script, "BaseSandbox", base, body),
        }
        times: dict[tuple[str, str], list[float]] = {}
        order = random.Random(20261123)
        for op in ("read", "write", "edit", "grep"):
            for side in sides:  # warm-up
                for _ in range(5):
                    sides[side][op]()
            for _ in range(max(1, args.n // args.block)):
                # Interleaved in blocks of calls, in a new order each round, so that
                # drift cancels while each side's own background work (a script's
                # process exit, the watcher reporting the file it changed, tens of ms
                # later) lands mostly on its own calls rather than on the other side's.
                round_ = list(sides.items())
                order.shuffle(round_)
                for side, table in round_:
                    for _ in range(args.block):
                        t0 = time.perf_counter()
                        table[op]()
                        took = (time.perf_counter() - t0) * 1000
                        times.setdefault((op, side), []).append(took)
        # The dataplane keeps a copy of a small tree it searched until something in the tree
        # changes; right after a change, a grep reads every file again.
        cold: list[float] = []
        for i in range(max(20, args.n // 2)):
            backend.write(f"{base}/src/m{i % FILES}.py", body)
            t0 = time.perf_counter()
            sides["sandlot"]["grep"]()
            cold.append((time.perf_counter() - t0) * 1000)
        backend.close()

    print(
        f"deepagents backend, {args.n} calls each, interleaved in blocks of {args.block}; "
        f"`sandlot serve` as shipped ({isolation_mode()} sandboxes, the `default` template, "
        f"file watching on); {platform.machine()}, Python {platform.python_version()}\n"
    )
    print("| operation | sandlot median | p95 | BaseSandbox median | p95 | speed-up |")
    print("|---|---|---|---|---|---|")
    floor = statistics.median(times[("read", "sandlot")])
    search_ms = search_alone(body, "line 42:")
    for op in ("read", "write", "edit", "grep"):
        a, b = times[(op, "sandlot")], times[(op, "BaseSandbox")]
        ma, mb = statistics.median(a), statistics.median(b)
        print(
            f"| {op} | {ma:.2f} ms | {pct(a, 0.95):.2f} ms | {mb:.2f} ms | "
            f"{pct(b, 0.95):.2f} ms | {mb / ma:.1f}x |"
        )
        report(
            "deepagents",
            f"backend `{op}` vs BaseSandbox's script default: ≥ 10\u00d7 faster per call",
            f"{mb / ma:.1f}\u00d7 ({ma:.2f} vs {mb:.2f} ms)",
            mb / ma >= 10,
            limit_of(op, mb, floor, search_ms),
        )
    peer = statistics.median(times[("grep", "BaseSandbox")])
    print(
        f"\nThe `grep` tree is {FILES} files of 3 KiB, one match each. The dataplane keeps a "
        "copy of a small tree it searched, dropped on the first change in the tree (inotify); "
        f"a grep right after a write in the tree reads every file again: median "
        f"{statistics.median(cold):.2f} ms, p95 {pct(cold, 0.95):.2f} ms "
        f"({peer / statistics.median(cold):.1f}x BaseSandbox's). "
        f"The dataplane's C search of the tree's files, called in this process (no HTTP, no "
        f"identity switch, no copy): {search_ms:.2f} ms."
    )


if __name__ == "__main__":
    main()
