"""Benchmark of the docker provider on a private Docker Engine; prints a Markdown table.

Run as root on Linux: ``python bench/docker_bench.py [--quick]``. It starts its own
``dockerd`` and builds the sandbox image as the tests do (``tests/dockerengine.py``).

Figures, each side by side with the engine's own operation in the same run:

- create → ready: ``DockerProvider.create`` until the dataplane in the container
  answers, against ``docker run`` of the same image (create and start a container whose
  process is ``true``, until it exited: a process that ran), and against the same
  ``docker run`` with the sandbox container's own settings (limits, user, mounts,
  read-only root): the engine's part alone;
- ensure of a new thread served from a warm pool (``bench/pooled.py``): ``sandlot serve``
  with the provider and a pool of ready containers, the SDK's ``ensure`` until the
  binding is active, and until its first ``exec true`` answered — what a user waits for
  when a pool is configured;
- ``exec true`` through the relay and the dataplane in the container (the SDK's
  ``run``), against ``docker exec`` (the engine's exec create, start and inspect);
- the dataplane's Python start-up in the container (``python -X importtime``), where
  most of create → ready goes.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from measure import ainterleave, ms, ratio, stats
from pooled import Pooled, pool_config, pooled_ensures
from targets import report
from tests.dockerengine import Engine, build_image
from tests.providers.dockerharness import Harness, serving
from tests.providers.test_docker_serve import docker_config, remove_sandboxes
from tests.servers import SandlotServer

from sandlot.broker.templates import with_disk_limit
from sandlot.protocol.sessions import Template
from sandlot.protocol.states import SandboxState
from sandlot.providers.base import SandboxSpec

PYTHONPATH = "/opt/sandlot/lib"
IMPORT = (
    "from sandlot.dataplane.prelude import prepare; prepare(); import sandlot.dataplane.standalone"
)


def container_cpu(container_id: str) -> float | None:
    """CPU seconds a running container has used so far (its cgroup v1 ``cpuacct``): the
    work of its start, whatever the machine's load did to the wall clock."""
    path = Path("/sys/fs/cgroup/cpuacct/docker") / container_id / "cpuacct.usage"
    try:
        return int(path.read_text()) / 1e9
    except (OSError, ValueError):
        return None


async def create_ready(h: Harness, n: int) -> tuple[float, float, float | None]:
    """One sandbox from create to a dataplane that answers, the CPU its container used
    until then, and its first ``exec true`` right then (then deleted, not timed): ready
    must mean ready."""
    sid = f"sb_bench{n}"
    sandbox = h.sandbox(sid)
    t0 = time.perf_counter()
    # With the workspace disk a template gets through the broker (its default size).
    template = with_disk_limit(Template(name="t", image="host"))
    await h.provider.create(SandboxSpec(sid, 1, template))
    # Status read every 5 ms, as the harness's listener only records changes.
    while (await h.provider.status(sid)).state is not SandboxState.ACTIVE:  # noqa: ASYNC110
        await asyncio.sleep(0.005)
    took = time.perf_counter() - t0
    cpu = container_cpu(h.container(sid).id)
    async with sandbox as sb:
        t1 = time.perf_counter()
        await sb.run("true")
        first = time.perf_counter() - t1
    await h.provider.delete(sid)
    return took, first, cpu


def docker_run(engine: Engine, image: str) -> float:
    """``docker run --network none IMAGE true``: create, start, wait (removal not timed)."""
    client = engine.client
    t0 = time.perf_counter()
    container = client.containers.create(image, ["true"], network_mode="none")
    container.start()
    container.wait()
    took = time.perf_counter() - t0
    container.remove(force=True)
    return took


def docker_run_as_sandbox(engine: Engine, h: Harness) -> float:
    """``docker run`` of ``true`` with everything a sandbox's container has (its limits,
    user, mounts, read-only root, ``/tmp``, no network): what the engine's part of
    create → ready costs, for comparison with the bare ``docker run``."""
    spec = SandboxSpec("sb_asrun", 1, Template(name="t", image="host"))
    h.provider._prepare_dirs(spec.sandbox_id)
    config = h.provider._container_config(spec)
    for key in ("name", "labels", "detach"):
        del config[key]
    config["command"] = ["true"]
    client = engine.client
    t0 = time.perf_counter()
    container = client.containers.create(**config)
    container.start()
    container.wait()
    took = time.perf_counter() - t0
    container.remove(force=True, v=True)
    return took


def import_profile(engine: Engine, image: str) -> tuple[float, list[tuple[str, float]]]:
    """The dataplane's imports in the container: total and the heaviest ones (ms)."""
    out = engine.client.containers.run(
        image,
        # As ``python -m sandlot.dataplane`` imports it: its prelude first.
        ["python3", "-X", "importtime", "-c", IMPORT],
        environment={"PYTHONPATH": PYTHONPATH},
        network_mode="none",
        remove=True,
        stdout=False,
        stderr=True,
    ).decode()
    top: list[tuple[str, float]] = []
    total = 0.0
    for line in out.splitlines():
        m = re.match(r"import time:\s+\d+ \|\s+(\d+) \| ( *)(\S+)", line)
        if m is None:
            continue
        cumulative, depth, name = int(m.group(1)) / 1000, len(m.group(2)), m.group(3)
        if depth == 0:
            total += cumulative
        # What the dataplane's module imports itself.
        if depth == 2 and name.split(".")[0] not in {"encodings", "site"}:
            top.append((name, cumulative))
    top.sort(key=lambda t: -t[1])
    return total, top[:8]


def python_bare(engine: Engine, image: str) -> float:
    """``python3 -c pass`` in the container (the interpreter alone), as ``docker run``."""
    client = engine.client
    t0 = time.perf_counter()
    container = client.containers.create(image, ["python3", "-c", "pass"], network_mode="none")
    container.start()
    container.wait()
    took = time.perf_counter() - t0
    container.remove(force=True)
    return took


async def run(args: argparse.Namespace) -> None:
    rng = random.Random(7)
    engine = Engine()
    try:
        image = build_image(engine)
        with tempfile.TemporaryDirectory(prefix="sandlot-docker-bench-") as tmp:
            pooled = await served_from_pool(engine, image, Path(tmp) / "served", args)
            async with serving(engine, image, Path(tmp)) as h:
                await table(h, engine, image, args, rng, pooled)
    finally:
        engine.stop()


async def served_from_pool(
    engine: Engine, image: str, data_dir: Path, args: argparse.Namespace
) -> Pooled:
    """``ensure`` of new threads through ``sandlot serve`` with a pool of ready containers."""
    config = docker_config(engine, image) + pool_config("warm", "default", args.pool)
    server = SandlotServer(data_dir, config=config).start()
    try:
        key = await asyncio.to_thread(server.key, "bench", "agent")
        return await pooled_ensures(server.url, key, args.pooled, "warm", args.pool)
    finally:
        server.stop()
        remove_sandboxes(engine, data_dir)


async def table(
    h: Harness,
    engine: Engine,
    image: str,
    args: argparse.Namespace,
    rng: random.Random,
    pooled: Pooled,
) -> None:
    # create → ready, interleaved with docker run (both from this process's client).
    sandbox: list[float] = []
    first_exec: list[float] = []
    cpu_ready: list[float] = []
    direct: list[float] = []
    as_sandbox: list[float] = []
    bare: list[float] = []
    counter = iter(range(1_000_000))

    async def one_sandbox() -> None:
        took, first, cpu = await create_ready(h, next(counter))
        sandbox.append(took)
        first_exec.append(first)
        if cpu is not None:
            cpu_ready.append(cpu)

    async def one_run() -> None:
        direct.append(await asyncio.to_thread(docker_run, engine, image))

    async def one_run_as_sandbox() -> None:
        as_sandbox.append(await asyncio.to_thread(docker_run_as_sandbox, engine, h))

    async def one_python() -> None:
        bare.append(await asyncio.to_thread(python_bare, engine, image))

    await one_sandbox()  # warm: the image's layers in the page cache
    await one_run()
    sandbox.clear()
    first_exec.clear()
    cpu_ready.clear()
    direct.clear()
    for _ in range(args.creates):
        round_ = [one_sandbox, one_run, one_run_as_sandbox, one_python]
        rng.shuffle(round_)
        for op in round_:
            await op()

    # exec true: the SDK through the relay, against docker exec on the same container.
    await h.create("sb_exec")
    container: Any = h.container("sb_exec")
    via_sandlot: list[float] = []
    via_docker: list[float] = []
    async with h.sandbox("sb_exec") as sb:

        async def sandlot_exec() -> None:
            await sb.run("true")

        async def docker_exec() -> None:
            result = await asyncio.to_thread(container.exec_run, ["true"], user="1000:1000")
            assert result.exit_code == 0

        await ainterleave(
            [(via_sandlot, sandlot_exec, 1), (via_docker, docker_exec, 1)], args.execs, rng
        )
    await h.provider.delete("sb_exec")
    imports, heaviest = await asyncio.to_thread(import_profile, engine, image)

    c50, d50 = statistics.median(sandbox), statistics.median(direct)
    p50 = statistics.median(bare)
    f50 = statistics.median(first_exec) * 1000
    e50, _ = stats(via_sandlot)
    x50, _ = stats(via_docker)
    print("| operation | docker provider | engine directly | ratio |")
    print("|---|---|---|---|")
    print(
        f"| create → ready (median of {len(sandbox)}) | {ms(c50 * 1000)} | "
        f"{ms(d50 * 1000)} (`docker run … true`) | {ratio(c50, d50)} |"
    )
    s50 = statistics.median(as_sandbox)
    print(
        f"| … against `docker run … true` with the sandbox's own container settings (limits, "
        f"user, mounts, read-only root; median of {len(as_sandbox)}) | {ms(c50 * 1000)} | "
        f"{ms(s50 * 1000)} | {ratio(c50, s50)} |"
    )
    q50 = statistics.median(pooled.ensure)
    g50 = statistics.median(pooled.first_exec)
    n = len(pooled.ensure)
    print(
        f"| ensure of a new thread from a warm pool → active (median of {n}, "
        f"{pooled.from_pool} from the pool) | {ms(q50 * 1000)} | {ms(d50 * 1000)} "
        f"(`docker run … true`) | {ratio(q50, d50)} |"
    )
    print(
        f"| … and its first `exec true` answered (median of {n}) | {ms(g50 * 1000)} | "
        f"{ms(d50 * 1000)} | {ratio(g50, d50)} |"
    )
    print(
        f"| `exec true` (median of {len(via_sandlot)}) | {ms(e50)} | {ms(x50)} (`docker exec`)"
        f" | {ratio(e50, x50)} |"
    )
    print()
    print(
        f"The first `exec true` of a sandbox just ready: {ms(f50)} (median of "
        f"{len(first_exec)}; later ones {ms(e50)})."
    )
    if cpu_ready:
        print(
            "CPU its container used from start to ready (cgroup `cpuacct`, median): "
            f"{ms(statistics.median(cpu_ready) * 1000)}."
        )
    print(
        f"`docker run … python3 -c pass` (the interpreter alone): {ms(p50 * 1000)}. "
        f"The dataplane's imports in the container (`python -X importtime`): {ms(imports)}; "
        "heaviest: " + ", ".join(f"`{name}` {ms(v)}" for name, v in heaviest) + "."
    )
    start_up = c50 - d50
    report(
        "docker",
        "create → ready ≤ 1.2x docker run of the same image (cold: no pool)",
        f"{ms(c50 * 1000)} vs {ms(d50 * 1000)} ({ratio(c50, d50)})",
        c50 <= 1.2 * d50,
        f"the dataplane's Python start-up in the container: imports {ms(imports)}, "
        f"{ms(start_up * 1000)} over `docker run` in all",
    )
    report(
        "docker",
        "ensure → ready ≤ 1.2x docker run of the same image (a warm pool configured)",
        f"{ms(g50 * 1000)} to the first `exec true` vs {ms(d50 * 1000)} ({ratio(g50, d50)})",
        g50 <= 1.2 * d50 and pooled.from_pool == n,
        "the pool was empty: sandboxes were created cold",
    )
    report(
        "docker",
        "exec true through the dataplane ≤ 0.3x docker exec",
        f"{ms(e50)} vs {ms(x50)} ({ratio(e50, x50)})",
        e50 <= 0.3 * x50,
        "the relay's extra hop over the dataplane's own time",
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    ap.add_argument("--creates", type=int, default=None, help="create → ready rounds")
    ap.add_argument("--execs", type=int, default=None, help="exec samples per contender")
    ap.add_argument("--pooled", type=int, default=None, help="ensures from the warm pool")
    ap.add_argument("--pool", type=int, default=3, help="the pool's min_ready")
    args = ap.parse_args()
    if args.creates is None:
        args.creates = 5 if args.quick else 20
    if args.pooled is None:
        args.pooled = 10 if args.quick else 30
    if args.execs is None:
        args.execs = 30 if args.quick else 200
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
