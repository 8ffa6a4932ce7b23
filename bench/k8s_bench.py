"""Benchmark of the kubernetes provider on the cluster of ``scripts/k8s-cluster``; prints a
Markdown table.

Run as root on Linux: ``python bench/k8s_bench.py [--creates N] [--execs N]``. It brings
the cluster up as the tests do (``tests/k8scluster.py``: reused when one is up) and builds
the sandbox image in the node's engine.

Figures, each side by side with Kubernetes' own operation in the same run:

- create → ready: ``KubernetesProvider.create`` until the dataplane in the pod answers,
  against ``kubectl run`` of the same image (``--restart=Never``, a ``sleep``) followed
  by ``kubectl wait --for=condition=Ready``; the provider with its default
  ``requests_fraction`` (1.0: the pod is ``Guaranteed``, its CPU weight a core's) unless
  ``--requests-fraction`` says otherwise (the tests' 0.01 gives the pod a hundredth of a
  core's weight: on a loaded node the dataplane's Python start then waits for CPU);
- ensure of a new thread served from a warm pool (``bench/pooled.py``): ``sandlot serve``
  with the provider and a pool of ready pods, the SDK's ``ensure`` until the binding is
  active, and until its first ``exec true`` answered;
- ``exec true`` through the relay and the dataplane in the pod (the SDK's ``run``),
  against ``kubectl exec POD -- true`` on the same pod.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from measure import ainterleave, ms, ratio, stats
from pooled import Pooled, pool_config, pooled_ensures
from targets import report
from tests.k8scluster import Cluster, node_image
from tests.k8scluster import start as start_cluster
from tests.k8scluster import stop as stop_cluster
from tests.providers.k8sharness import NAMESPACE, Harness, core_api, serving
from tests.providers.test_kubernetes_serve import k8s_config, live_pods
from tests.servers import SandlotServer

from sandlot.protocol.sessions import Template
from sandlot.protocol.states import SandboxState
from sandlot.providers.base import SandboxSpec


def k8s_bin() -> str:
    """Where the cluster's binaries are (``scripts/k8s-cluster env``)."""
    script = Path(__file__).resolve().parents[1] / "scripts" / "k8s-cluster"
    out = subprocess.run([script, "env"], check=True, capture_output=True, text=True).stdout
    for line in out.splitlines():
        key, _, value = line.removeprefix("export ").partition("=")
        if key == "SANDLOT_K8S_BIN":
            return value
    raise RuntimeError("scripts/k8s-cluster env names no SANDLOT_K8S_BIN")


def kubectl(cluster: Cluster, *args: str) -> None:
    binary = os.environ.get("SANDLOT_K8S_BIN", "") or k8s_bin()
    subprocess.run(
        [f"{binary}/kubectl", "--kubeconfig", cluster.kubeconfig, "-n", NAMESPACE, *args],
        check=True,
        capture_output=True,
    )


async def create_ready(h: Harness, n: int) -> float:
    sid = f"sb_bench{n}"
    t0 = time.perf_counter()
    await h.provider.create(
        SandboxSpec(sid, 1, Template(name="t", image="host", resources={"memory_mb": 256}))
    )
    while (await h.provider.status(sid)).state is not SandboxState.ACTIVE:  # noqa: ASYNC110
        await asyncio.sleep(0.005)
    took = time.perf_counter() - t0
    await h.provider.delete(sid)
    return took


def kubectl_run(cluster: Cluster, image: str, n: int) -> float:
    name = f"bench-run-{n}"
    t0 = time.perf_counter()
    kubectl(cluster, "run", name, f"--image={image}", "--restart=Never",
            "--image-pull-policy=Never", "--command", "--", "sleep", "600")  # fmt: skip
    kubectl(cluster, "wait", "--for=condition=Ready", f"pod/{name}", "--timeout=120s")
    took = time.perf_counter() - t0
    kubectl(cluster, "delete", "pod", name, "--grace-period=0", "--force", "--wait=false")
    return took


async def run(args: argparse.Namespace) -> None:
    rng = random.Random(7)
    cluster = start_cluster()
    try:
        image = node_image(cluster)
        with tempfile.TemporaryDirectory(prefix="sandlot-k8s-bench-") as tmp:
            pooled = await served_from_pool(cluster, image, Path(tmp) / "served", args)
            config = {"requests_fraction": args.requests_fraction}
            async with serving(cluster, image, Path(tmp), **config) as h:
                await table(h, cluster, image, args, rng, pooled)
    finally:
        stop_cluster(cluster)


async def served_from_pool(
    cluster: Cluster, image: str, data_dir: Path, args: argparse.Namespace
) -> Pooled:
    """``ensure`` of new threads through ``sandlot serve`` with a pool of ready pods."""
    config = k8s_config(cluster, image) + pool_config("warm", "default", args.pool)
    server = SandlotServer(data_dir, config=config).start()
    core = core_api(cluster)
    try:
        key = await asyncio.to_thread(server.key, "bench", "agent")
        return await pooled_ensures(server.url, key, args.pooled, "warm", args.pool)
    finally:
        server.stop()
        for pod in live_pods(core, data_dir):
            core.delete_namespaced_pod(pod.metadata.name, NAMESPACE, grace_period_seconds=0)
        core.api_client.close()


async def table(
    h: Harness,
    cluster: Cluster,
    image: str,
    args: argparse.Namespace,
    rng: random.Random,
    pooled: Pooled,
) -> None:
    sandbox: list[float] = []
    direct: list[float] = []
    counter = iter(range(1_000_000))

    async def one_sandbox() -> None:
        sandbox.append(await create_ready(h, next(counter)))

    async def one_run() -> None:
        direct.append(await asyncio.to_thread(kubectl_run, cluster, image, next(counter)))

    await one_sandbox()
    await one_run()
    sandbox.clear()
    direct.clear()
    for _ in range(args.creates):
        round_ = [one_sandbox, one_run]
        rng.shuffle(round_)
        for op in round_:
            await op()

    # The claim alone: the label update naming the pod's resourceVersion (given back,
    # untimed, between samples; the watch's copy is then fresh again).
    await h.provider.create(
        SandboxSpec("sb_claim", 1, Template(name="t", image="host", resources={"memory_mb": 256}),
                    pool="warm")
    )  # fmt: skip
    await h.wait("sb_claim", SandboxState.ACTIVE)
    claims: list[float] = []
    for _ in range(args.pooled):
        await h.provider.release_pooled("sb_claim", "warm")
        await asyncio.sleep(0.2)
        t0 = time.perf_counter()
        assert await h.provider.claim_pooled("sb_claim")
        claims.append(time.perf_counter() - t0)
    await h.provider.delete("sb_claim")

    await h.create("sb_exec")
    pod = h.pod("sb_exec").metadata.name
    via_sandlot: list[float] = []
    via_kubectl: list[float] = []
    async with h.sandbox("sb_exec") as sb:

        async def sandlot_exec() -> None:
            await sb.run("true")

        async def kubectl_exec() -> None:
            await asyncio.to_thread(kubectl, cluster, "exec", pod, "--", "true")

        await ainterleave(
            [(via_sandlot, sandlot_exec, 1), (via_kubectl, kubectl_exec, 1)], args.execs, rng
        )
    await h.provider.delete("sb_exec")

    c50, d50 = statistics.median(sandbox), statistics.median(direct)
    e50, _ = stats(via_sandlot)
    x50, _ = stats(via_kubectl)
    print("| operation | kubernetes provider | Kubernetes directly | ratio |")
    print("|---|---|---|---|")
    print(
        f"| create → ready (median of {len(sandbox)}) | {ms(c50 * 1000)} | "
        f"{ms(d50 * 1000)} (`kubectl run` + `kubectl wait`) | {ratio(c50, d50)} |"
    )
    p50 = statistics.median(pooled.ensure)
    f50 = statistics.median(pooled.first_exec)
    n = len(pooled.ensure)
    print(
        f"| ensure of a new thread from a warm pool → active (median of {n}, "
        f"{pooled.from_pool} from the pool) | {ms(p50 * 1000)} | {ms(d50 * 1000)} "
        f"(`kubectl run` + `kubectl wait`) | {ratio(p50, d50)} |"
    )
    print(
        f"| … and its first `exec true` answered (median of {n}) | {ms(f50 * 1000)} | "
        f"{ms(d50 * 1000)} | {ratio(f50, d50)} |"
    )
    print(
        f"| the claim alone: a label update naming the resourceVersion (median of "
        f"{len(claims)}) | {ms(statistics.median(claims) * 1000)} | | |"
    )
    print(
        f"| `exec true` (median of {len(via_sandlot)}) | {ms(e50)} | {ms(x50)} (`kubectl exec`)"
        f" | {ratio(e50, x50)} |"
    )
    report(
        "kubernetes",
        "ensure from a warm pool: p50 ≤ 50 ms",
        f"{ms(p50 * 1000)} (create → ready {ms(c50 * 1000)}, `kubectl run` {ms(d50 * 1000)})",
        p50 <= 0.05 and pooled.from_pool == n,
        "the claim's label update at the API server and the broker's ensure",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--creates", type=int, default=5)
    parser.add_argument("--execs", type=int, default=30)
    parser.add_argument(
        "--requests-fraction",
        type=float,
        default=1.0,
        help="the provider's requests_fraction (its default 1.0: Guaranteed pods)",
    )
    parser.add_argument("--pooled", type=int, default=20, help="ensures from the warm pool")
    parser.add_argument("--pool", type=int, default=3, help="the pool's min_ready")
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
