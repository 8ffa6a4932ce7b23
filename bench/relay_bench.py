"""Benchmark of the broker's relay for hosted boxes (the ``langsmith`` provider); prints a
Markdown table.

Run as root on Linux: ``python bench/relay_bench.py [--quick]``. Two ``sandlot serve``
run as the tests run them (``tests/providers/langsmithharness.py``): the second is the
LangSmith-compatible service, the first's ``langsmith`` provider makes a box there.
Each operation, side by side in one run, from one client with a kept-alive connection:

- through the relay: the normalized dataplane at the broker (``POST /exec``,
  ``GET /fs/read``) with the sandbox token, which the relay verifies and turns into the
  box's ``POST /execute`` and ``GET /download`` with the provider's key;
- directly: the same box's ``POST /execute`` and ``GET /download`` with the key, what
  a client holding the key would call.

The difference of the medians is the relay's added time (target ≤ 1 ms). On a loaded
machine that difference is mostly waiting for a core, so the broker's own CPU time per
relayed operation (``/proc/PID/stat`` of the broker's process over each loop, divided by
the relayed calls; the direct calls never reach the broker) is printed beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from measure import ainterleave, ms, ratio, stats
from targets import report
from tests.providers.langsmithharness import pair

from sandlot.sdk import AsyncSandlot

CONTENT = ("0123456789abcdef" * 4 + "\n") * 63 + "x" * 61 + "\n"  # 4 KiB of text


async def run(args: argparse.Namespace) -> None:
    rng = random.Random(11)
    # The broker's reaper (every 0.5 s in the tests) is not the relay's work: every 60 s
    # here, the broker's idle CPU taken off its figure is small and steady.
    with (
        tempfile.TemporaryDirectory(prefix="sandlot-relay-bench-") as tmp,
        pair(Path(tmp), reaper_interval=60.0) as p,
    ):
        client = AsyncSandlot(p.broker.url, p.broker.key("alice", "agent"), auto_refresh=False)
        try:
            sb = await client.ensure("thr_bench")
            await sb.write("/workspace/4k.txt", CONTENT)
            (box,) = [b for b in p.boxes() if str(b["name"]).endswith(sb.id.replace("_", "-"))]
            await measure(
                args, rng, sb.grant.http_base_url, sb.grant.token, str(box["dataplane_url"]), p
            )
        finally:
            await client.aclose()


def cpu_ms(pid: int) -> float:
    """CPU time of process ``pid``'s threads so far, in ms (the scheduler's nanosecond
    count: the clock ticks of ``/proc/PID/stat`` are 10 ms each)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            total += int((task / "schedstat").read_text().split()[0])
    return total / 1e6


async def measure(
    args: argparse.Namespace, rng: random.Random, relay: str, token: str, box: str, p: object
) -> None:
    key = p.service_key  # type: ignore[attr-defined]
    via_relay = {"Authorization": f"Bearer {token}"}
    direct = {"X-Api-Key": key}
    samples: dict[str, list[float]] = {k: [] for k in ("re", "de", "rr", "dr")}
    async with httpx.AsyncClient(timeout=30) as http:

        async def relay_exec() -> None:
            r = await http.post(f"{relay}/exec", json={"command": "true"}, headers=via_relay)
            assert r.status_code == 200 and r.json()["exit_code"] == 0

        async def direct_exec() -> None:
            r = await http.post(f"{box}/execute", json={"command": "true"}, headers=direct)
            assert r.status_code == 200 and r.json()["exit_code"] == 0

        async def relay_read() -> None:
            r = await http.get(
                f"{relay}/fs/read", params={"path": "/workspace/4k.txt"}, headers=via_relay
            )
            assert r.status_code == 200 and r.json()["content"] == CONTENT

        async def direct_read() -> None:
            r = await http.get(
                f"{box}/download", params={"path": "/workspace/4k.txt"}, headers=direct
            )
            assert r.status_code == 200 and r.text == CONTENT

        # The broker's CPU while idle (its reaper, its clocks), per ms, is taken off.
        pid = p.broker.proc.pid  # type: ignore[attr-defined]
        t0, c0 = time.monotonic(), cpu_ms(pid)
        await asyncio.sleep(3.0)
        t1, c1 = time.monotonic(), cpu_ms(pid)
        idle = (c1 - c0) / ((t1 - t0) * 1000)
        await ainterleave(
            [(samples["re"], relay_exec, 1), (samples["de"], direct_exec, 1)], args.n, rng
        )
        t2, c2 = time.monotonic(), cpu_ms(pid)
        await ainterleave(
            [(samples["rr"], relay_read, 1), (samples["dr"], direct_read, 1)], args.n, rng
        )
        t3, c3 = time.monotonic(), cpu_ms(pid)
        cpu_exec = (c2 - c1 - idle * (t2 - t1) * 1000) / len(samples["re"])
        cpu_read = (c3 - c2 - idle * (t3 - t2) * 1000) / len(samples["rr"])
        print(f"broker idle: {idle * 1000:.1f} ms of CPU per second")
        print(f"load average (1 min) at the end: {os.getloadavg()[0]:.1f}")
    re50, re99 = stats(samples["re"])
    de50, de99 = stats(samples["de"])
    rr50, rr99 = stats(samples["rr"])
    dr50, dr99 = stats(samples["dr"])
    print(
        "| operation | through the relay | the box directly | added | ratio | broker CPU per call |"
    )
    print("|---|---|---|---|---|---|")
    print(
        f"| `exec true` (median / p99 of {len(samples['re'])}) | {ms(re50)} / {ms(re99)} | "
        f"{ms(de50)} / {ms(de99)} (`POST /execute`) | {ms(re50 - de50)} | {ratio(re50, de50)} "
        f"| {ms(cpu_exec)} |"
    )
    print(
        f"| 4 KiB read (median / p99 of {len(samples['rr'])}) | {ms(rr50)} / {ms(rr99)} | "
        f"{ms(dr50)} / {ms(dr99)} (`GET /download`) | {ms(rr50 - dr50)} | {ratio(rr50, dr50)} "
        f"| {ms(cpu_read)} |"
    )
    for what, added in (("exec true", re50 - de50), ("a 4 KiB read", rr50 - dr50)):
        report(
            "relay",
            f"relay overhead on {what} ≤ 1 ms added",
            f"{ms(added)} added",
            added <= 1.0,
            "a second process on the way (its ASGI stack, the call to the box, its wake-ups)",
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    ap.add_argument("--n", type=int, default=None, help="samples per contender")
    args = ap.parse_args()
    if args.n is None:
        args.n = 100 if args.quick else 500
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
