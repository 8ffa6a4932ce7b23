"""Sandlot through its integrations, side by side with sandlot on its own.

Run: ``.venv/bin/python bench/integrations_bench.py [--n 2000] [--mcp 500] [--ops 200]``

Starts three servers on loopback, all as users run them (isolated sandboxes when
root, the shipped templates, the per-user limits of ``bench/served.py`` raised
in all): ``sandlot serve``; ``langgraph dev`` serving ``examples/langgraph``
(sandlot's app mounted in the LangGraph server, its auth handler, its threads;
``tests/servers.py``, from the virtualenv ``SANDLOT_LANGGRAPH_VENV``), with its
development settings; and the same example served with LangGraph's production
settings (``bench/langgraph_production.py``: the server app under uvicorn as the
production image runs it, JSON logs, no private-network middleware; the in-memory
runtime still). Measures, each interleaved in blocks of calls (a new order every
round):

1. **ensure** on a thread whose sandbox is live (``POST /v1/sandbox/sessions``
   with a fresh ``Idempotency-Key``, a stock httpx client): as a LangGraph user
   (LangGraph's auth, then sandlot's check that the user may see the thread:
   LangGraph's threads operation in process with the user's auth context) and with
   a sandlot API key (which skips LangGraph's auth), through both LangGraph
   servers, and on ``sandlot serve``.
2. **exec ``true``** through MCP (the official client, one session kept open) and
   through the SDK's ``AsyncSandbox.exec`` on the same sandbox; the same through
   the LangGraph server (``/sandlot/mcp``, ``/dp``).
3. **deepagents** ``read``/``write``/``edit`` through the backend a LangGraph-run
   agent uses (``SandlotBackend.from_run()``, called in a LangGraph graph's node run
   with ``configurable.thread_id``: each call resolves the run's sandbox from the
   run's config), against the LangGraph server as alice; vs deepagents'
   ``BaseSandbox`` script defaults over the same backend's ``execute`` and the same
   sandbox (``bench/deepagents_bench.py``'s); the backend on ``sandlot serve`` beside.

Prints Markdown tables (median and p95 in ms) and reports three targets.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import tempfile
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypedDict

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from deepagents_bench import ScriptSandbox, file_ops
from measure import ainterleave, interleave, pct
from served import Served
from targets import report
from tests.servers import LANGGRAPH_VENV, LangGraphDev

PRODUCTION = Path(__file__).resolve().parent / "langgraph_production.py"


class LangGraphProduction(LangGraphDev):
    """The same example served as LangGraph's production image runs its server
    (``bench/langgraph_production.py``: uvicorn, JSON logs, no development settings)."""

    def server_argv(self) -> list[str]:
        python = LANGGRAPH_VENV / "bin" / "python"
        return [str(python), str(PRODUCTION), "127.0.0.1", str(self.port)]


NEGOTIATE = "/v1/sandbox/sessions"
#: A body of about 3 KiB, as ``deepagents_bench`` reads and writes.
BODY = "".join(f"line {i}: the quick brown fox\n" for i in range(100))
OPS = ("read", "write", "edit")


def ms(samples: list[float]) -> float:
    """Median of samples in seconds, in ms."""
    return statistics.median(samples) * 1000


def p95(samples: list[float]) -> float:
    return pct(samples, 0.95) * 1000


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def keyed(headers: dict[str, str]) -> dict[str, str]:
    """The headers with a fresh ``Idempotency-Key``, as a client sends with each ensure."""
    return {**headers, "Idempotency-Key": str(uuid.uuid4())}


class Setting:
    """The servers and what the measurements share: alice's LangGraph thread and its
    live sandbox, her sandlot key on the LangGraph server, keys on ``sandlot serve``;
    on the LangGraph server with production settings, her thread and key there."""

    def __init__(self, served: Served, lg: LangGraphDev, prod: LangGraphDev) -> None:
        self.served = served
        self.lg = lg
        self.prod = prod
        self.alice = lg.users["alice"]
        self.lg_key = lg.key("alice")
        self.prod_key = prod.key("alice")
        self.agent_key = served.server.key("bench", "agent")
        self.thread = thread(lg.url, self.alice)
        self.sandbox = live(lg.url, self.alice, self.thread)
        self.prod_thread = thread(prod.url, self.alice)
        live(prod.url, self.alice, self.prod_thread)


def thread(url: str, token: str) -> str:
    """A new LangGraph thread of the token's user."""
    created = httpx.post(f"{url}/threads", json={}, headers=bearer(token), timeout=30)
    created.raise_for_status()
    return str(created.json()["thread_id"])


def live(url: str, key: str, thread: str) -> str:
    """The thread's sandbox, ensured and active (so that a warm ensure finds it)."""
    from sandlot.sdk import Sandlot

    with Sandlot(url, key, auto_refresh=False) as sdk:
        return sdk.ensure(thread).id


# --- 1. ensure ---------------------------------------------------------------------------


class EnsureFigures(TypedDict):
    lg_user: list[float]
    lg_key: list[float]
    prod_user: list[float]
    prod_key: list[float]
    serve: list[float]
    lg_thread: list[float]
    lg_floor: list[float]
    prod_floor: list[float]
    serve_floor: list[float]
    cpu: dict[str, float]


#: Calls in a row per path for its server's CPU time per request.
CPU_CALLS = 300


def process_cpu(pid: int) -> float:
    """CPU seconds (user + system, all threads) the process has used so far (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_per_call(pid: int | None, call: Callable[[], None]) -> float:
    """The server's CPU ms per call over :data:`CPU_CALLS` calls in a row (NaN without
    a process to read)."""
    if pid is None:
        return float("nan")
    start = process_cpu(pid)
    for _ in range(CPU_CALLS):
        call()
    return (process_cpu(pid) - start) * 1000 / CPU_CALLS


def measure_ensure(s: Setting, n: int, rng: random.Random) -> EnsureFigures:
    serve_thread = "bench-ensure"
    live(s.served.url, s.served.key, serve_thread)
    lg = httpx.Client(base_url=s.lg.url, timeout=30)
    prod = httpx.Client(base_url=s.prod.url, timeout=30)
    serve = httpx.Client(base_url=s.served.url, timeout=30)
    sandboxes: dict[str, set[str]] = {"lg": set(), "prod": set(), "serve": set()}
    thread_path, alice = f"/threads/{s.thread}", bearer(s.alice)

    def ensure(client: httpx.Client, token: str, thread: str, side: str) -> Callable[[], None]:
        body = {"thread_id": thread, "mode": "ensure"}
        headers = bearer(token)

        def call() -> None:
            r = client.post(NEGOTIATE, json=body, headers=keyed(headers))
            assert r.status_code == 200, r.text
            sandboxes[side].add(r.json()["sandbox"]["id"])

        return call

    figures: EnsureFigures = {
        "lg_user": [],
        "lg_key": [],
        "prod_user": [],
        "prod_key": [],
        "serve": [],
        "lg_thread": [],
        "lg_floor": [],
        "prod_floor": [],
        "serve_floor": [],
        "cpu": {},
    }
    calls = {
        "lg_user": ensure(lg, s.alice, s.thread, "lg"),
        "lg_key": ensure(lg, s.lg_key, s.thread, "lg"),
        "prod_user": ensure(prod, s.alice, s.prod_thread, "prod"),
        "prod_key": ensure(prod, s.prod_key, s.prod_thread, "prod"),
        "serve": ensure(serve, s.served.key, serve_thread, "serve"),
    }
    interleave(
        [
            (figures["lg_user"], calls["lg_user"], 1),
            (figures["lg_key"], calls["lg_key"], 1),
            (figures["prod_user"], calls["prod_user"], 1),
            (figures["prod_key"], calls["prod_key"], 1),
            (figures["serve"], calls["serve"], 1),
            (
                figures["lg_thread"],
                lambda: lg.get(thread_path, headers=alice).raise_for_status(),
                1,
            ),
            (figures["lg_floor"], lambda: lg.get("/ok").raise_for_status(), 1),
            (figures["prod_floor"], lambda: prod.get("/ok").raise_for_status(), 1),
            (figures["serve_floor"], lambda: serve.get("/healthz").raise_for_status(), 1),
        ],
        n,
        rng,
    )
    # Each server's own CPU time per ensure, path by path (calls in a row): what the
    # server spends, whatever else the shared machine runs meanwhile.
    pids = {
        "lg": s.lg.proc.pid if s.lg.proc else None,
        "prod": s.prod.proc.pid if s.prod.proc else None,
        "serve": s.served.server.proc.pid if s.served.server.proc else None,
    }
    for name, call in calls.items():
        figures["cpu"][name] = cpu_per_call(pids[name.partition("_")[0]], call)
    for client in (lg, prod, serve):
        client.close()
    # Every ensure found the one live sandbox of its thread (a warm ensure, not a new one).
    assert all(len(ids) == 1 for ids in sandboxes.values()), sandboxes
    return figures


def print_ensure(f: EnsureFigures, n: int) -> float:
    base = ms(f["serve"])
    print(
        f"\n### ensure on a thread with a live sandbox: through the LangGraph server vs "
        f"`sandlot serve` ({n} each, httpx, a fresh Idempotency-Key each)\n"
    )
    print(
        "`langgraph dev` runs with its development settings (colored console logs, a "
        "private-network CORS middleware); *production settings* is the same app and "
        "in-memory runtime as LangGraph's production image runs its server "
        "(`bench/langgraph_production.py`: uvicorn, JSON logs, none of those).\n"
    )
    print("| path | p50 ms | p95 ms | vs `sandlot serve` | server CPU ms per call |")
    print("|---|---|---|---|---|")
    cpu, table = f["cpu"], dict(f)
    rows = [
        ("`langgraph dev`, as a LangGraph user (its auth + thread visibility)", "lg_user"),
        ("`langgraph dev`, sandlot API key (skips LangGraph's auth)", "lg_key"),
        ("LangGraph, production settings, as a LangGraph user", "prod_user"),
        ("LangGraph, production settings, sandlot API key", "prod_key"),
        ("`sandlot serve`, sandlot API key", "serve"),
        ("LangGraph's own `GET /threads/{id}` as the user (`langgraph dev`)", "lg_thread"),
        ("HTTP floor: LangGraph's `GET /ok` (`langgraph dev`)", "lg_floor"),
        ("HTTP floor: LangGraph's `GET /ok` (production settings)", "prod_floor"),
        ("HTTP floor: `sandlot serve`'s `GET /healthz`", "serve_floor"),
    ]
    for name, which in rows:
        samples: list[float] = table[which]
        spent = f"{cpu[which]:.2f}" if which in cpu else ""
        print(
            f"| {name} | {ms(samples):.2f} | {p95(samples):.2f} | {ms(samples) / base:.2f}x "
            f"| {spent} |"
        )
    user, key = ms(f["lg_user"]), ms(f["lg_key"])
    prod_user, prod_key = ms(f["prod_user"]), ms(f["prod_key"])
    ratio, prod_ratio = user / base, prod_user / base
    made_of = (
        f"as a LangGraph user {prod_user:.2f} ms with production settings and {user:.2f} ms "
        f"under `langgraph dev`; with a sandlot key {prod_key:.2f} and {key:.2f} ms. A "
        "user's request passes LangGraph's middleware and authentication (its auth handler, "
        "and a log line LangGraph hands to a thread on every authenticated request), then "
        "sandlot's visibility check (LangGraph's threads operation in process, with the "
        "user's auth context); a key's request goes straight to sandlot, whose ownership "
        "check reads the thread through the same operation. `langgraph dev` adds its "
        "development settings to every request (colored console logging, a private-network "
        f"`BaseHTTPMiddleware`): HTTP floors {ms(f['lg_floor']):.2f} ms (`langgraph dev`), "
        f"{ms(f['prod_floor']):.2f} ms (production settings) and "
        f"{ms(f['serve_floor']):.2f} ms (`sandlot serve`); LangGraph answers its own "
        f"`GET /threads/{{id}}` over HTTP in {ms(f['lg_thread']):.2f} ms. Each server's "
        f"own CPU time per ensure: {cpu['prod_user']:.2f} ms as a LangGraph user and "
        f"{cpu['prod_key']:.2f} ms with a key (production settings), {cpu['lg_user']:.2f} "
        f"and {cpu['lg_key']:.2f} ms (`langgraph dev`), {cpu['serve']:.2f} ms "
        "(`sandlot serve`)"
    )
    print(f"\nWhere the time goes: {made_of}.")
    report(
        "integrations",
        "ensure through the LangGraph-mounted app (a LangGraph user) vs `sandlot serve`: "
        "\u2264 1.5\u00d7",
        f"{prod_ratio:.2f}\u00d7 with LangGraph's production settings ({prod_user:.2f} vs "
        f"{base:.2f} ms p50); {ratio:.2f}\u00d7 under `langgraph dev`'s development "
        f"settings ({user:.2f} ms); with a sandlot key {prod_key:.2f} and {key:.2f} ms",
        prod_ratio <= 1.5,
        made_of,
    )
    return ratio


# --- 2. MCP exec -------------------------------------------------------------------------


class ExecFigures(TypedDict):
    sdk: list[float]
    mcp: list[float]
    lg_mcp: list[float]
    lg_sdk: list[float]


async def measure_exec(s: Setting, n: int, rng: random.Random) -> ExecFigures:
    import httpx2
    from mcp import Client
    from mcp.client.streamable_http import streamable_http_client

    from sandlot.sdk import AsyncSandlot

    thread = "bench-mcp"
    figures: ExecFigures = {"sdk": [], "mcp": [], "lg_mcp": [], "lg_sdk": []}
    serve_http = httpx2.AsyncClient(headers=bearer(s.served.key), timeout=60)
    lg_http = httpx2.AsyncClient(headers=bearer(s.lg_key), timeout=60)
    serve_mcp = Client(streamable_http_client(f"{s.served.url}/mcp", http_client=serve_http))
    lg_mcp = Client(streamable_http_client(f"{s.lg.url}/sandlot/mcp", http_client=lg_http))
    async with (
        serve_http,
        lg_http,
        serve_mcp,
        lg_mcp,
        AsyncSandlot(s.served.url, s.served.key) as serve_sdk,
        AsyncSandlot(s.lg.url, s.lg_key) as lg_sdk,
    ):
        serve_sandbox = await serve_sdk.ensure(thread)
        lg_sandbox = await lg_sdk.ensure(s.thread)

        async def acquire(client: Client, thread_id: str, sandbox_id: str) -> str:
            got = await client.call_tool("environment_acquire", {"thread_id": thread_id})
            assert not got.is_error and got.structured_content is not None, got
            # The MCP session and the SDK's are on the one sandbox of the thread.
            assert got.structured_content["sandbox_id"] == sandbox_id, got
            return str(got.structured_content["session_id"])

        def mcp_exec(client: Client, session_id: str) -> Callable[[], Awaitable[None]]:
            args = {"session_id": session_id, "command": "true"}

            async def call() -> None:
                ran = await client.call_tool("exec", args)
                assert not ran.is_error and ran.structured_content is not None, ran
                assert ran.structured_content["exit_code"] == 0, ran

            return call

        def sdk_exec(sandbox: Any) -> Callable[[], Awaitable[None]]:
            async def call() -> None:
                result = await sandbox.exec("true")
                assert result.exit_code == 0, result

            return call

        serve_session = await acquire(serve_mcp, thread, serve_sandbox.id)
        lg_session = await acquire(lg_mcp, s.thread, lg_sandbox.id)
        await ainterleave(
            [
                (figures["sdk"], sdk_exec(serve_sandbox), 1),
                (figures["mcp"], mcp_exec(serve_mcp, serve_session), 1),
                (figures["lg_mcp"], mcp_exec(lg_mcp, lg_session), 1),
                (figures["lg_sdk"], sdk_exec(lg_sandbox), 1),
            ],
            n,
            rng,
        )
    return figures


def print_exec(f: ExecFigures, n: int) -> float:
    base = ms(f["sdk"])
    print(
        f"\n### exec `true`: MCP round trip vs the SDK's dataplane exec, same sandbox "
        f"({n} each; one MCP session kept open, the official `mcp` client)\n"
    )
    print("| path | p50 ms | p95 ms | vs SDK exec on `sandlot serve` |")
    print("|---|---|---|---|")
    rows = [
        ("SDK `AsyncSandbox.exec`, `sandlot serve`", f["sdk"]),
        ("MCP `call_tool('exec')`, `sandlot serve` `/mcp`", f["mcp"]),
        ("MCP `call_tool('exec')`, LangGraph server `/sandlot/mcp`", f["lg_mcp"]),
        ("SDK `AsyncSandbox.exec`, LangGraph server `/dp`", f["lg_sdk"]),
    ]
    for name, samples in rows:
        print(f"| {name} | {ms(samples):.2f} | {p95(samples):.2f} | {ms(samples) / base:.2f}x |")
    ratio = ms(f["mcp"]) / base
    made_of = (
        f"the MCP round trip adds {ms(f['mcp']) - base:.2f} ms to the dataplane exec it makes "
        f"({base:.2f} ms): JSON-RPC over streamable HTTP, the MCP server's session and tool "
        "dispatch, then the same SDK exec from the server's process"
    )
    print(f"\nWhere the time goes: {made_of}.")
    report(
        "integrations",
        "MCP `exec true` round trip vs the SDK's dataplane exec: ≤ 3\u00d7",
        f"{ratio:.2f}\u00d7 ({ms(f['mcp']):.2f} vs {base:.2f} ms p50; through the LangGraph "
        f"server's `/sandlot/mcp` {ms(f['lg_mcp']):.2f} ms)",
        ratio <= 3,
        made_of,
    )
    return ratio


# --- 3. deepagents in a LangGraph run -----------------------------------------------------


class RunState(TypedDict):
    sandbox: str


def measure_deepagents(
    s: Setting, n: int, rng: random.Random
) -> tuple[dict[tuple[str, str], list[float]], str]:
    from langgraph.graph import END, START, StateGraph

    from sandlot.integrations.deepagents import SandlotBackend

    base = "/workspace/bench"
    # The backend as the example's graph builds it, with the LangGraph server's URL and
    # alice's LangGraph token: its control-plane calls pass LangGraph's auth.
    run_backend = SandlotBackend.from_run(url=s.lg.url, api_key=s.alice)
    sides = {
        "run": run_backend,
        "BaseSandbox": ScriptSandbox(run_backend),
        "serve": SandlotBackend.for_thread(
            "bench-deepagents", url=s.served.url, api_key=s.agent_key
        ),
    }
    times: dict[tuple[str, str], list[float]] = {}

    def measure(state: RunState) -> RunState:
        for tag, backend in sides.items():
            backend.write(f"{base}/target.txt", BODY)
            backend.write(f"{base}/edit-{tag}.txt", "alpha\n" + BODY)
        ops = {tag: file_ops(backend, tag, base, BODY) for tag, backend in sides.items()}
        for op in OPS:
            contenders = []
            for tag in sides:
                samples = times.setdefault((op, tag), [])
                contenders.append((samples, ops[tag][op], 1))
            interleave(contenders, n, rng)
        return {"sandbox": run_backend.id}

    graph = StateGraph(RunState)
    graph.add_node("measure", measure)
    graph.add_edge(START, "measure")
    graph.add_edge("measure", END)
    try:
        out = graph.compile().invoke(
            {"sandbox": ""}, config={"configurable": {"thread_id": s.thread}}
        )
    finally:
        for backend in (run_backend, sides["serve"]):
            backend.close()
    return times, str(out["sandbox"])


def print_deepagents(
    times: dict[tuple[str, str], list[float]], sandbox: str, thread_sandbox: str, n: int
) -> float:
    print(
        f"\n### deepagents backend of a LangGraph-run agent vs BaseSandbox's script defaults "
        f"({n} calls each; `SandlotBackend.from_run()` in a graph node run with the thread's "
        "config, against the LangGraph server as alice)\n"
    )
    print(
        "| operation | from_run (LangGraph) p50 ms | p95 | BaseSandbox (same sandbox) p50 ms "
        "| p95 | speed-up | `for_thread` on `sandlot serve` p50 ms |"
    )
    print("|---|---|---|---|---|---|---|")
    ratios = {}
    for op in OPS:
        run, peer, serve = times[(op, "run")], times[(op, "BaseSandbox")], times[(op, "serve")]
        ratios[op] = ms(peer) / ms(run)
        print(
            f"| {op} | {ms(run):.2f} | {p95(run):.2f} | {ms(peer):.2f} | {p95(peer):.2f} | "
            f"{ratios[op]:.1f}x | {ms(serve):.2f} |"
        )
    worst = min(ratios, key=ratios.__getitem__)
    print(
        f"\nThe run's backend resolved sandbox {sandbox} from the run's config (the thread's: "
        f"{'the same' if sandbox == thread_sandbox else 'NOT the same as'} {thread_sandbox}); "
        "its dataplane calls go to the LangGraph server's `/dp`, which the app routes straight "
        "to the dataplane."
    )
    floor = ms(times[("read", "run")])
    report(
        "integrations",
        "deepagents read/write/edit through a LangGraph-run agent's backend vs BaseSandbox's "
        "script defaults: ≥ 10\u00d7 faster per call",
        f"{ratios[worst]:.1f}\u00d7 at worst (`{worst}`: {ms(times[(worst, 'run')]):.2f} vs "
        f"{ms(times[(worst, 'BaseSandbox')]):.2f} ms); "
        + ", ".join(f"{op} {r:.1f}\u00d7" for op, r in ratios.items()),
        ratios[worst] >= 10,
        f"10\u00d7 BaseSandbox's {ms(times[(worst, 'BaseSandbox')]):.2f} ms is "
        f"{ms(times[(worst, 'BaseSandbox')]) / 10:.2f} ms a call; one `read` through the "
        f"LangGraph server takes {floor:.2f} ms",
    )
    return ratios[worst]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=2000, help="ensure samples per path")
    ap.add_argument("--mcp", type=int, default=500, help="exec samples per path")
    ap.add_argument("--ops", type=int, default=200, help="deepagents calls per side and op")
    ap.add_argument(
        "--only",
        choices=("ensure", "exec", "deepagents"),
        action="append",
        help="measure only this (repeatable; default: all three)",
    )
    args = ap.parse_args()
    only = set(args.only or ("ensure", "exec", "deepagents"))
    rng = random.Random(20260501)
    with tempfile.TemporaryDirectory(prefix="sandlot-integrations-") as tmp:
        root = Path(tmp)
        served = Served(root / "serve").start()
        assert served.server.config_path is not None
        # The LangGraph servers' sandlot gets the same configuration (the raised limits).
        env = {"SANDLOT_CONFIG": str(served.server.config_path)}
        lg = LangGraphDev(root / "langgraph", root / "langgraph" / "sandlot-data", env=env)
        prod = LangGraphProduction(root / "prod", root / "prod" / "sandlot-data", env=env)
        started: list[LangGraphDev] = []
        try:
            for server in (lg, prod):
                started.append(server)
                server.start()
                if server.proc is not None:  # for a profiler to attach to
                    print(
                        f"{type(server).__name__} pid {server.proc.pid}",
                        file=sys.stderr,
                        flush=True,
                    )
            setting = Setting(served, lg, prod)
            ensure = exec_ = deepagents = None
            if "ensure" in only:
                ensure = measure_ensure(setting, args.n, rng)
            if "exec" in only:
                exec_ = asyncio.run(measure_exec(setting, args.mcp, rng))
            if "deepagents" in only:
                deepagents = measure_deepagents(setting, args.ops, rng)
        finally:
            mode = served.mode
            for server in started:
                server.stop()
                server.cleanup()
            served.stop()

    print(
        f"Sandlot's integrations ({mode} sandboxes, the shipped templates; `langgraph dev` "
        "serving examples/langgraph, and for ensure the same example with LangGraph's "
        "production settings, in the same run as `sandlot serve`)"
    )
    if ensure is not None:
        print_ensure(ensure, args.n)
    if exec_ is not None:
        print_exec(exec_, args.mcp)
    if deepagents is not None:
        print_deepagents(*deepagents, setting.sandbox, args.ops)


if __name__ == "__main__":
    main()
