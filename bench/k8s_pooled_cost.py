"""What one ``ensure`` served from a warm pool of pods costs the broker: CPU time and round
trips, on the cluster of ``scripts/k8s-cluster``; prints a Markdown table.

Run as root on Linux: ``python bench/k8s_pooled_cost.py [--ensures N]``. ``sandlot
serve`` runs with the kubernetes provider and a pool of ready pods under
``bench/counted_serve.py``, which counts the server's requests to the API server and to
dataplanes, its SQL statements and its hops to worker threads, and reads its CPU time
(every thread). Each sample waits (untimed) for the pool to be full and the server idle,
then takes the counts, the SDK's ``ensure`` of a new thread (returns once the binding is
active), the counts again, the first ``exec true`` through the relay, and the counts a
third time. The figures are medians over the samples (the CPU) and means (the counts):
what the load of the machine does not change, unlike the wall time, also printed.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import secrets
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pooled import pool_config, pool_full
from tests.k8scluster import node_image
from tests.k8scluster import start as start_cluster
from tests.k8scluster import stop as stop_cluster
from tests.providers.k8sharness import NAMESPACE, core_api
from tests.providers.test_kubernetes_serve import k8s_config, live_pods
from tests.servers import SandlotServer

from sandlot.sdk import AsyncSandlot

HERE = Path(__file__).resolve().parent


class CountedServer(SandlotServer):
    """``sandlot serve`` under ``bench/counted_serve.py``."""

    def __init__(self, data_dir: Path, config: str) -> None:
        self.counts_file = data_dir.parent / f"{data_dir.name}-counts.json"
        super().__init__(
            data_dir, config=config, env={"SANDLOT_COUNTS_FILE": str(self.counts_file)}
        )
        self._seq = 0

    def argv(self) -> list[str]:
        argv = super().argv()
        assert argv[1:3] == ["-m", "sandlot.cli.main"]
        return [argv[0], str(HERE / "counted_serve.py"), *argv[3:]]

    def snapshot(self) -> dict[str, Any]:
        assert self.proc is not None
        self._seq += 1
        self.proc.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                doc = json.loads(self.counts_file.read_text())
                if doc["seq"] >= self._seq:
                    return dict(doc)
            except (OSError, ValueError):
                pass
            time.sleep(0.002)
        raise RuntimeError("the server did not write its counts")


def delta(before: dict[str, Any], after: dict[str, Any]) -> tuple[float, collections.Counter[str]]:
    counts: collections.Counter[str] = collections.Counter(after["counts"])
    counts.subtract(before["counts"])
    return after["cpu"] - before["cpu"], +counts


async def measure(server: CountedServer, key: str, n: int, pool: int) -> dict[str, Any]:
    out: dict[str, Any] = {"ensure_cpu": [], "exec_cpu": [], "ensure_wall": [], "exec_wall": []}
    ensure_counts: collections.Counter[str] = collections.Counter()
    exec_counts: collections.Counter[str] = collections.Counter()
    run = secrets.token_hex(3)
    client = AsyncSandlot(server.url, key, auto_refresh=False)
    try:
        for i in range(n + 1):  # the first warms the connections
            await pool_full(server.url, key, "warm", pool)
            await asyncio.sleep(0.5)  # the refill's watch events and probes are over
            s0 = server.snapshot()
            t0 = time.perf_counter()
            sb = await client.ensure(f"thr_cost_{run}_{i}")
            t1 = time.perf_counter()
            s1 = server.snapshot()
            t2 = time.perf_counter()
            await sb.run("true")
            t3 = time.perf_counter()
            s2 = server.snapshot()
            if i:
                cpu, counts = delta(s0, s1)
                out["ensure_cpu"].append(cpu)
                out["ensure_wall"].append(t1 - t0)
                ensure_counts.update(counts)
                cpu, counts = delta(s1, s2)
                out["exec_cpu"].append(cpu)
                out["exec_wall"].append(t3 - t2)
                exec_counts.update(counts)
            assert sb.grant.session_id is not None
            await client.release(sb.grant.session_id, terminate=True)
    finally:
        await client.aclose()
    out["ensure_counts"] = {k: v / n for k, v in sorted(ensure_counts.items())}
    out["exec_counts"] = {k: v / n for k, v in sorted(exec_counts.items())}
    return out


async def run(args: argparse.Namespace) -> None:
    cluster = start_cluster()
    try:
        image = node_image(cluster)
        with tempfile.TemporaryDirectory(prefix="sandlot-k8s-cost-") as tmp:
            data_dir = Path(tmp) / "served"
            config = k8s_config(cluster, image) + pool_config("warm", "default", args.pool)
            server = CountedServer(data_dir, config).start()
            core = core_api(cluster)
            try:
                key = await asyncio.to_thread(server.key, "bench", "agent")
                found = await measure(server, key, args.ensures, args.pool)
            finally:
                server.stop()
                for pod in live_pods(core, data_dir):
                    core.delete_namespaced_pod(pod.metadata.name, NAMESPACE, grace_period_seconds=0)
                core.api_client.close()
    finally:
        stop_cluster(cluster)
    n = args.ensures
    print(f"load average: {os.getloadavg()[0]:.1f}\n")
    print(
        f"| per pooled `ensure` (median or mean of {n}) | `ensure` → active "
        "| its first `exec true` |"
    )
    print("|---|---|---|")
    ms = lambda xs: f"{statistics.median(xs) * 1000:.2f} ms"  # noqa: E731
    print(
        f"| the server's CPU time (median) | {ms(found['ensure_cpu'])} | {ms(found['exec_cpu'])} |"
    )
    print(f"| wall time (median) | {ms(found['ensure_wall'])} | {ms(found['exec_wall'])} |")
    for name in sorted(set(found["ensure_counts"]) | set(found["exec_counts"])):
        e = found["ensure_counts"].get(name, 0.0)
        x = found["exec_counts"].get(name, 0.0)
        print(f"| {name} (mean) | {e:.2f} | {x:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ensures", type=int, default=20)
    parser.add_argument("--pool", type=int, default=3, help="the pool's min_ready")
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
