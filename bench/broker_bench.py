"""Broker benchmark: negotiation warm, cold and from a warm pool, against a real ``sandlot serve``.

Run: ``.venv/bin/python bench/broker_bench.py [--n 2000] [--cold 60]``

The server is ``sandlot serve`` as users run it (``bench/served.py``: isolated
sandboxes when root, the broker and the dataplane in one process, the shipped
configuration with its per-user limits raised, plus a warm pool). Every
``ensure`` carries a fresh ``Idempotency-Key``, as clients do (PROTOCOL.md
recommends one; the SDK always sends one): through the SDK
(``Sandlot.ensure``) and through a stock httpx client; the same without a key
is shown beside it. Each figure is measured side by side in one run with the
HTTP floor (``GET /healthz`` on the same server and client), interleaved in
blocks. Prints a Markdown table, then what the warm figure is made of: the
server's own time in the negotiation (its ``/metrics``), the HTTP floor, the
key's cost.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from measure import interleave, pct
from served import Served, metric_sums
from targets import report

CONFIG = """
[pools.warm]
template = "pooled"
min_ready = 8
max_ready = 8
[templates.pooled]
image = "host"
resources = { cpu = 1.0, memory_mb = 512, pids = 256 }
[policy]
reaper_interval_seconds = 0.2
"""

WARM = {"scope": {"type": "thread", "id": "warm"}, "mode": "ensure"}
NEGOTIATE = "/v1/sandbox/sessions"


def keyed(headers: dict[str, str]) -> dict[str, str]:
    """The headers with a fresh ``Idempotency-Key``, as a client sends with each ensure."""
    return {**headers, "Idempotency-Key": str(uuid.uuid4())}


def ms(samples: list[float]) -> float:
    """Median of samples in seconds, in ms."""
    return statistics.median(samples) * 1000


def row(name: str, client: str, samples: list[float], floor: list[float], notes: str = "") -> str:
    ratio = f"{ms(samples) / ms(floor):.1f}x" if floor else ""
    return (
        f"| {name} | {client} | {ms(samples):.2f} | {pct(samples, 0.95) * 1000:.2f} | "
        f"{pct(samples, 0.99) * 1000:.2f} | {ratio} | {notes} |"
    )


def wait_active(client: httpx.Client, headers: dict[str, str], grant: dict[str, Any]) -> None:
    if grant["binding"]["state"] == "active":
        return
    sid = grant["session_id"]
    after = grant["binding"]["last_event_sequence"]
    with client.stream(
        "GET", f"{NEGOTIATE}/{sid}/events?after={after}", headers=headers, timeout=30
    ) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: "):
                phase = json.loads(line[6:])["details"].get("phase")
                if phase and phase["to"] in ("active", "failed"):
                    assert phase["to"] == "active", phase
                    return


async def raw_throughput(
    port: int, key: str, seconds: float, concurrency: int, with_key: bool
) -> float:
    """Requests per second from keep-alive connections driven by a minimal HTTP/1.1 client
    (a few microseconds per request, like wrk), so the figure is the server's, not the
    client's: on two cores an httpx client spends about as much CPU per request as the
    server does."""
    done = 0
    stop = time.monotonic() + seconds
    body = json.dumps(WARM).encode()
    head = (
        f"POST {NEGOTIATE} HTTP/1.1\r\nHost: bench\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
    )

    async def worker() -> None:
        nonlocal done
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        while time.monotonic() < stop:
            extra = f"Idempotency-Key: {uuid.uuid4()}\r\n" if with_key else ""
            writer.write(f"{head}{extra}\r\n".encode() + body)
            head_in = await reader.readuntil(b"\r\n\r\n")
            assert head_in.startswith(b"HTTP/1.1 200"), head_in[:60]
            length = 0
            for line in head_in.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            await reader.readexactly(length)
            done += 1
        writer.close()

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return done / seconds


async def throughput(url: str, headers: dict[str, str], seconds: float, concurrency: int) -> float:
    done = 0
    stop = time.monotonic() + seconds

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal done
        while time.monotonic() < stop:
            r = await client.post(NEGOTIATE, json=WARM, headers=keyed(headers))
            assert r.status_code == 200
            done += 1

    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    return done / seconds


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=2000, help="warm samples per contender")
    ap.add_argument("--cold", type=int, default=60, help="cold and pooled samples per client")
    args = ap.parse_args()
    from sandlot.sdk import Sandlot

    with tempfile.TemporaryDirectory() as tmp:
        served = Served(Path(tmp), config=CONFIG).start()
        try:
            key = served.key
            headers = {"Authorization": f"Bearer {key}"}
            client = httpx.Client(base_url=served.url, timeout=30)
            # The SDK's ensure negotiates on the first call for a scope (then it keeps the
            # grant fresh in the background): each sample is such a first call.
            sdk = Sandlot(served.url, key, auto_refresh=False)

            def sdk_ensure() -> None:
                sdk._leases.clear()
                sdk.ensure("warm")

            def post(h: dict[str, str]) -> None:
                r = client.post(NEGOTIATE, json=WARM, headers=h)
                assert r.status_code == 200, r.text

            post(headers)
            floor: list[float] = []
            sdk_warm: list[float] = []
            httpx_key: list[float] = []
            httpx_plain: list[float] = []
            contenders: list[tuple[list[float], Callable[[], Any], int]] = [
                (floor, lambda: client.get("/healthz").raise_for_status(), 1),
                (sdk_warm, sdk_ensure, 1),
                (httpx_key, lambda: post(keyed(headers)), 1),
                (httpx_plain, lambda: post(headers), 1),
            ]
            labels = {"mode": "ensure"}
            before = metric_sums(served.url, "sandlot_negotiation_seconds", labels)
            interleave(contenders, args.n, random.Random(11))
            after = metric_sums(served.url, "sandlot_negotiation_seconds", labels)
            in_server = (after[0] - before[0]) / max(1.0, after[1] - before[1]) * 1000
            rps = asyncio.run(throughput(served.url, headers, 5.0, 16))
            raw_rps = asyncio.run(raw_throughput(served.server.port, key, 5.0, 16, True))
            raw_rps_plain = asyncio.run(raw_throughput(served.server.port, key, 5.0, 16, False))

            cold_sdk: list[float] = []
            cold_httpx: list[float] = []
            for i in range(args.cold):
                t0 = time.perf_counter()
                sdk.ensure(f"cold-sdk-{i}")
                cold_sdk.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                body = {"scope": {"type": "thread", "id": f"cold-httpx-{i}"}, "mode": "ensure"}
                g = client.post(NEGOTIATE, json=body, headers=keyed(headers)).json()
                wait_active(client, headers, g)
                cold_httpx.append(time.perf_counter() - t0)
            pooled_sdk: list[float] = []
            pooled_httpx: list[float] = []
            for i in range(args.cold):
                for side in ("sdk", "httpx"):
                    # Let the pool refill between claims, as a pool sized for the load would be.
                    while client.get("/v1/pools/warm", headers=headers).json()["ready"] < 1:
                        time.sleep(0.05)
                    t0 = time.perf_counter()
                    if side == "sdk":
                        sdk.ensure(f"pool-sdk-{i}", template="pooled")
                        pooled_sdk.append(time.perf_counter() - t0)
                    else:
                        body = {
                            "scope": {"type": "thread", "id": f"pool-httpx-{i}"},
                            "mode": "ensure",
                            "template": "pooled",
                        }
                        g = client.post(NEGOTIATE, json=body, headers=keyed(headers)).json()
                        wait_active(client, headers, g)
                        pooled_httpx.append(time.perf_counter() - t0)
            sdk.close()
            client.close()
        finally:
            mode = served.mode
            served.stop()

    print(
        f"\n### Negotiation (`sandlot serve`, {mode} sandboxes, 1 worker; every ensure with "
        "a fresh Idempotency-Key unless said otherwise)\n"
    )
    print("| operation | client | p50 ms | p95 ms | p99 ms | vs HTTP floor | notes |")
    print("|---|---|---|---|---|---|---|")
    print(row("HTTP floor: GET /healthz", "httpx", floor, []))
    warm_name = "ensure, existing binding (token + audit + idempotency record)"
    print(
        row(
            warm_name,
            "SDK (`Sandlot.ensure`)",
            sdk_warm,
            floor,
            "a negotiation as the SDK makes it for a scope it holds no fresh grant of; "
            "target p50 <= 3 ms",
        )
    )
    print(
        row(
            warm_name,
            "httpx",
            httpx_key,
            floor,
            f"{raw_rps:.0f} req/s at 16 concurrent keep-alive connections ({rps:.0f} req/s "
            "when the load comes from an httpx client on the same 2 cores); "
            "target >= 500 req/s",
        )
    )
    print(
        row(
            "ensure, existing binding, no Idempotency-Key",
            "httpx",
            httpx_plain,
            floor,
            f"{raw_rps_plain:.0f} req/s at 16 concurrent keep-alive connections",
        )
    )
    print(row("cold ensure -> active", "SDK", cold_sdk, floor, "target p50 <= 30 ms"))
    print(row("cold ensure -> active", "httpx", cold_httpx, floor))
    print(row("ensure from a warm pool -> active", "SDK", pooled_sdk, floor, "target p50 <= 8 ms"))
    print(row("ensure from a warm pool -> active", "httpx", pooled_httpx, floor))
    key_cost = ms(httpx_key) - ms(httpx_plain)
    sdk_extra = ms(sdk_warm) - ms(httpx_key)
    made_of = (
        f"the server's own time in the negotiation (one transaction: binding, lease, event, "
        f"token, audit, idempotency record; `/metrics`, mean) {in_server:.2f} ms, the HTTP "
        f"floor {ms(floor):.2f} ms; the key adds {key_cost:.2f} ms (httpx with a key "
        f"{ms(httpx_key):.2f} ms, without {ms(httpx_plain):.2f} ms); the SDK "
        f"{'adds' if sdk_extra >= 0 else 'saves'} {abs(sdk_extra):.2f} ms against httpx"
    )
    print(f"\nWarm ensure, what it is made of: {made_of}.")

    report(
        "broker",
        "ensure on an existing binding (token + audit) with an Idempotency-Key: p50 ≤ 3 ms",
        f"{ms(sdk_warm):.2f} ms through the SDK; httpx {ms(httpx_key):.2f} ms "
        f"(without a key {ms(httpx_plain):.2f} ms)",
        ms(sdk_warm) <= 3,
        made_of,
    )
    report(
        "broker",
        "ensure on an existing binding: ≥ 500 requests/s (2 cores)",
        f"{raw_rps:.0f} req/s with a key each (without: {raw_rps_plain:.0f}; httpx load "
        f"generator: {rps:.0f})",
        raw_rps >= 500,
        f"client and server share the 2 cores; the server's own time per negotiation "
        f"{in_server:.2f} ms",
    )
    report(
        "broker",
        "cold ensure → active (local provider): p50 ≤ 30 ms",
        f"{ms(cold_sdk):.1f} ms through the SDK; httpx {ms(cold_httpx):.1f} ms",
        ms(cold_sdk) <= 30,
        "sandbox creation (its disk included) and the binding's activation",
    )
    report(
        "broker",
        "ensure from a warm pool → active: p50 ≤ 8 ms",
        f"{ms(pooled_sdk):.2f} ms through the SDK; httpx {ms(pooled_httpx):.2f} ms",
        ms(pooled_sdk) <= 8,
        "claiming the pooled sandbox and activating the binding",
    )


if __name__ == "__main__":
    main()
