"""One command for the published benchmark figures: ``python -m bench [--quick]``.

Runs every benchmark of ``bench/`` (each starts its own servers on loopback
and measures side by side with the direct operation), then writes
docs/BENCHMARKS.md with the machine, the date and the command. Each module
stays runnable on its own: ``python bench/broker_bench.py --help``.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import targets  # noqa: E402

#: (module, arguments for a full run, arguments for a quick run, what it measures)
BENCHES = [
    ("broker_bench", [], ["--n", "500", "--cold", "20"], "negotiation warm, cold and pooled"),
    (
        "runtime_bench",
        [],
        ["--quick"],
        "local sandboxes: create, exec, PTY, memory, 200 concurrent",
    ),
    (
        "dataplane_bench",
        [],
        ["--n", "100", "--active-rounds", "3", "--peer-budget", "15"],
        "dataplane: files, listing, exec, shells, grep, transfers; jupyter_server side by side",
    ),
    (
        "growth_bench",
        [],
        ["--quick"],
        "cost growth: listing, reads, grep, exec output at 1x to 1,000x the work",
    ),
    ("deepagents_bench", [], ["--n", "50"], "deepagents backend vs BaseSandbox's script defaults"),
    (
        "integrations_bench",
        [],
        ["--n", "300", "--mcp", "100", "--ops", "30"],
        "integrations: ensure through a LangGraph server, MCP exec, a LangGraph run's deepagents",
    ),
    ("sync_bench", [], ["--rounds", "2"], "sync of 10,000 files vs local tar"),
    (
        "docker_bench",
        [],
        ["--quick"],
        "docker provider: create → ready and ensure from a warm pool vs docker run, "
        "exec vs docker exec",
    ),
    (
        "replicas_bench",
        [],
        ["--n", "200", "--seconds", "4"],
        "broker replicas: ensure through HAProxy to 3 replicas on PostgreSQL vs 1 on SQLite",
    ),
    (
        "relay_bench",
        [],
        ["--quick"],
        "the broker's relay for hosted boxes: exec true and a 4 KiB read vs the box directly",
    ),
    (
        "web_bench",
        [],
        ["--quick"],
        "browser workspace: /ws/pty echo, /api/tree, 200 browsers attached, 1,000 reattaches",
    ),
    (
        "page_bench",
        [],
        ["--quick"],
        "the workspace page in headless Chromium: load, script size, echo on screen, "
        "agent writes in the tree, a 10,000-file folder, 10 MB to the terminal",
    ),
]


def machine() -> str:
    mem = ""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem = f"{int(line.split()[1]) / 1024 / 1024:.0f} GiB"
    except OSError:
        pass
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (
        f"{os.cpu_count()} cores ({cpu or platform.machine()}), {mem} memory, "
        f"Linux {platform.release()}, Python {platform.python_version()}"
    )


def settle(seconds: float = 3.0) -> None:
    """Flush what the previous benchmark wrote and let the disk go quiet: its
    writeback (hundreds of MiB of transfers, thousands of files) would otherwise
    land on the next one's fsyncs and file creations."""
    os.sync()
    time.sleep(seconds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="fewer repetitions (minutes, not tens)")
    ap.add_argument("--only", nargs="*", help="run only these modules")
    ap.add_argument("--out", default=str(ROOT / "docs" / "BENCHMARKS.md"))
    args = ap.parse_args()
    sections = []
    scratch = tempfile.TemporaryDirectory(prefix="sandlot-bench-")
    targets_file = Path(scratch.name) / "targets.jsonl"
    env = {**os.environ, targets.ENV: str(targets_file)}
    for module, full, quick, what in BENCHES:
        if args.only and module not in args.only:
            continue
        argv = [
            sys.executable,
            str(ROOT / "bench" / f"{module}.py"),
            *(quick if args.quick else full),
        ]
        if module == "growth_bench":
            argv += ["--svg", str(Path(args.out).parent / "cost-growth.svg")]
        print(f"== {module}: {what}", file=sys.stderr, flush=True)
        settle()
        started = time.monotonic()
        proc = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, env=env, check=False)
        took = time.monotonic() - started
        body = proc.stdout.strip() or "(no output)"
        if proc.returncode != 0:
            tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
            body += f"\n\n**This benchmark failed** (exit {proc.returncode}):\n\n```\n{tail}\n```"
        command = f"python bench/{module}.py {' '.join(quick if args.quick else full)}".strip()
        sections.append(f"## {what}\n\n`{command}` ({took:.0f} s)\n\n{body}\n")
        print(body, flush=True)
    header = (
        "# Benchmarks\n\n"
        f"Generated by `python -m bench{' --quick' if args.quick else ''}` on "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.\n\n"
        f"Machine: {machine()}.\n\n"
        "Every figure is measured in the same run as the operation it is compared with "
        "(the direct operation on this machine, or a peer), interleaved so that drift "
        "cancels. Dataplane and broker figures are those of `sandlot serve` as users run "
        "it (isolated sandboxes when run as root, the broker in the same process, the "
        "shipped `default` template with its `/bin/bash -l` shells and its disk, file "
        "watching on, every `ensure` with a fresh `Idempotency-Key`), through the SDK and "
        "through a stock httpx client; the standalone, unisolated dataplane without a "
        "watcher that earlier figures came from is shown beside them as a labelled "
        "*stripped* column. Targets are the issues' own, evaluated on `sandlot serve` "
        "through the SDK; a missed one is reported as measured, with what limits it "
        "(the server's own time per request, the direct operation, the HTTP floor, "
        "measured in the same run).\n"
    )
    found = targets.load(targets_file)
    scratch.cleanup()
    summary = f"## Targets\n\n{targets.table(found)}\n" if found else ""
    if summary:
        print(summary, flush=True)
    Path(args.out).write_text(header + "\n" + summary + "\n" + "\n".join(sections))
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
