"""Benchmark of the isolated local runtime; prints a Markdown table.

Run as root on Linux: ``python bench/runtime_bench.py [--quick]``.

Figures: create → ready (p50/p95; with the 1 GiB disk of the shipped ``default``
template, and without one), a one-shot ``true`` in a sandbox against
``subprocess.run(["true"])`` (interleaved, same run), PTY shell start to its
first prompt, idle memory per sandbox (PSS of bubblewrap's monitor + the init),
and N concurrent creates for N = 1, 50, 200.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from targets import report

from sandlot.protocol.sessions import Resources, Template
from sandlot.runtime.base import ProcessSpec, SandboxRuntime
from sandlot.runtime.local import IsolatedRuntime, LocalRuntimeManager, RuntimeSettings


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.2f} ms"


async def one_shot(rt: SandboxRuntime) -> float:
    started = time.perf_counter()
    proc = await rt.spawn(ProcessSpec(argv=["true"]))
    for fd in (proc.stdin_fd, proc.stdout_fd, proc.stderr_fd):
        if fd is not None:
            os.close(fd)
    await proc.wait()
    return time.perf_counter() - started


async def pty_start(rt: SandboxRuntime) -> float:
    loop = asyncio.get_running_loop()
    started = time.perf_counter()
    proc = await rt.spawn(ProcessSpec(argv=["/bin/sh", "-i"], env={"PS1": "$ "}, pty=(80, 24)))
    fd = proc.pty_fd
    assert fd is not None
    seen = b""
    ready = loop.create_future()

    def readable() -> None:
        nonlocal seen
        try:
            seen += os.read(fd, 4096)
        except BlockingIOError:
            return
        if b"$ " in seen and not ready.done():
            ready.set_result(time.perf_counter())

    loop.add_reader(fd, readable)
    try:
        prompt_at = await asyncio.wait_for(ready, 10)
    finally:
        loop.remove_reader(fd)
    proc.send_signal(9)
    await proc.wait()
    os.close(fd)
    return prompt_at - started


def pss_kib(pid: int) -> int:
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return 0
    for line in text.splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1])
    return 0


async def main(quick: bool) -> None:
    root = Path(tempfile.mkdtemp(prefix="sandlot-bench-", dir="/tmp"))
    os.chmod(root, 0o711)  # bubblewrap runs as the sandbox uids and must walk in
    settings = RuntimeSettings(
        run_dir=root / "run", workspaces_dir=root / "ws", volumes_dir=root / "vol"
    )
    mgr = LocalRuntimeManager(settings)
    mgr.preflight()
    # As the shipped ``default`` template: a 1 GiB disk for /workspace and /tmp.
    template = Template(name="bench", image="host", resources=Resources(disk_mb=1024))
    no_disk = Template(name="bench-no-disk", image="host")
    rows: list[tuple[str, str]] = []
    n = 20 if quick else 100
    try:
        creates, plain_creates = [], []
        for i in range(n):
            # Interleaved: the same machine load for both.
            started = time.perf_counter()
            await mgr.create(f"c{i}", 1, template, {})
            creates.append(time.perf_counter() - started)
            started = time.perf_counter()
            await mgr.create(f"p{i}", 1, no_disk, {})
            plain_creates.append(time.perf_counter() - started)
        destroys, plain_destroys = [], []
        for i in range(n):
            started = time.perf_counter()
            await mgr.destroy(f"c{i}")
            destroys.append(time.perf_counter() - started)
            started = time.perf_counter()
            await mgr.destroy(f"p{i}")
            plain_destroys.append(time.perf_counter() - started)
        rows.append(
            ("create → ready (p50 / p95)", f"{ms(pct(creates, 0.5))} / {ms(pct(creates, 0.95))}")
        )
        rows.append(
            (
                "create → ready without a disk (`disk_mb` unset; p50 / p95)",
                f"{ms(pct(plain_creates, 0.5))} / {ms(pct(plain_creates, 0.95))}",
            )
        )
        rows.append(("destroy (p50)", ms(pct(destroys, 0.5))))
        rows.append(("destroy without a disk (p50)", ms(pct(plain_destroys, 0.5))))
        report(
            "runtime",
            "create → ready: p50 ≤ 15 ms",
            ms(pct(creates, 0.5)),
            pct(creates, 0.5) <= 0.015,
            "bubblewrap start, cgroup setup, the sandbox's disk and the init's ready message",
        )

        rt = await mgr.create("exec", 1, template, {})
        sandboxed, direct = [], []
        for _ in range(n * 2):
            sandboxed.append(await one_shot(rt))
            started = time.perf_counter()
            subprocess.run(["true"], check=True)
            direct.append(time.perf_counter() - started)
        ratio = pct(sandboxed, 0.5) / pct(direct, 0.5)
        rows.append(
            (
                "one-shot `true`: sandbox vs subprocess.run (p50)",
                f"{ms(pct(sandboxed, 0.5))} vs {ms(pct(direct, 0.5))} ({ratio:.2f}x)",
            )
        )
        report(
            "runtime",
            "one-shot `true` in the sandbox: within 1.5\u00d7 of `subprocess.run(['true'])`",
            f"{ratio:.2f}\u00d7 ({ms(pct(sandboxed, 0.5))} vs {ms(pct(direct, 0.5))})",
            ratio <= 1.5,
            "entering the sandbox's namespaces and cgroup through its init",
        )
        rows.append(
            (
                "one-shot `true`: sandbox vs subprocess.run (p95)",
                f"{ms(pct(sandboxed, 0.95))} vs {ms(pct(direct, 0.95))}",
            )
        )
        ptys = [await pty_start(rt) for _ in range(n)]
        rows.append(
            (
                "PTY shell start → prompt (p50 / p95)",
                f"{ms(pct(ptys, 0.5))} / {ms(pct(ptys, 0.95))}",
            )
        )
        report(
            "runtime",
            "PTY shell start → first prompt: ≤ 3 ms",
            ms(pct(ptys, 0.5)),
            pct(ptys, 0.5) <= 0.003,
            "PTY allocation and the shell's start inside the sandbox",
        )
        await mgr.destroy("exec")

        idle = [await mgr.create(f"idle{i}", 1, template, {}) for i in range(20)]
        await asyncio.sleep(0.2)
        per_sandbox = []
        for rt in idle:
            assert isinstance(rt, IsolatedRuntime)
            per_sandbox.append(sum(pss_kib(p) for p in rt.cgroup.pids()))
        rows.append(
            (
                "idle memory per sandbox (PSS, median of 20)",
                f"{statistics.median(per_sandbox) / 1024:.2f} MiB",
            )
        )
        report(
            "runtime",
            "idle memory per sandbox: ≤ 2 MiB",
            f"{statistics.median(per_sandbox) / 1024:.2f} MiB (PSS)",
            statistics.median(per_sandbox) <= 2048,
            "the sandbox's init process",
        )
        for rt in idle:
            await mgr.destroy(rt.sandbox_id)

        for batch in (1, 50, 200):

            async def timed(i: int, batch: int = batch) -> float:
                started = time.perf_counter()
                await mgr.create(f"b{batch}-{i}", 1, template, {})
                return time.perf_counter() - started

            started = time.perf_counter()
            latencies = await asyncio.gather(*(timed(i) for i in range(batch)))
            wall = time.perf_counter() - started
            rows.append(
                (
                    f"{batch} concurrent creates: p50 / max / all ready",
                    f"{ms(pct(latencies, 0.5))} / {ms(max(latencies))} / {ms(wall)}",
                )
            )
            if batch == 200:
                report(
                    "runtime",
                    "200 concurrent sandboxes (2 cores, 24 GiB): all ready within 2 s",
                    f"all ready in {ms(wall)} (p50 {ms(pct(latencies, 0.5))})",
                    wall <= 2.0,
                    "two cores starting 200 bubblewrap sandboxes",
                )
            for i in range(batch):
                await mgr.destroy(f"b{batch}-{i}")
    finally:
        await mgr.cleanup_leftovers(set())
        shutil.rmtree(root, ignore_errors=True)

    print(
        f"Machine: {platform.node()} {platform.machine()}, {os.cpu_count()} cores, "
        f"kernel {platform.release()}, Python {platform.python_version()}; n={n}\n"
    )
    print("| measure | result |\n|---|---|")
    for name, value in rows:
        print(f"| {name} | {value} |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    asyncio.run(main(parser.parse_args().quick))
