"""Idempotency keys are settled in the transaction that does the work (tier 2 and e2e).

The key costs no transaction of its own, a retry sent while the first request
runs waits for it and gets its answer, and an answer is committed with what it
describes: after a crash right behind the commit, the retry replays it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import jwt
import pytest
from sqlalchemy import event

from sandlot.broker.idempotency import fingerprint
from tests.broker.conftest import Harness, MakeHarness
from tests.figures import RecordProperty, report
from tests.pg import postgres_cluster
from tests.servers import SandlotServer

BODY = {"thread_id": "thr_idem", "mode": "ensure"}


async def settled(h: Harness, headers: dict[str, str]) -> dict[str, Any]:
    """Ensure once and wait until the sandbox is active (no background writes left)."""
    r = await h.client.post("/v1/sandbox/sessions", json=BODY, headers=headers)
    assert r.status_code == 200, r.text
    sid = r.json()["session_id"]
    deadline = time.monotonic() + 10
    while True:
        snap = (await h.client.get(f"/v1/sandbox/sessions/{sid}", headers=headers)).json()
        if snap["binding"]["state"] == "active":
            return snap
        assert time.monotonic() < deadline, snap
        await asyncio.sleep(0.02)


async def test_key_costs_no_transaction_of_its_own(
    harness: Harness, record_property: RecordProperty
) -> None:
    alice = harness.key("alice")
    await settled(harness, alice)
    commits: list[float] = []

    def on_commit(conn: Any) -> None:
        # Write transactions only (the revocation poller reads in the background).
        if conn.info.get("immediate"):
            commits.append(time.monotonic())

    event.listen(harness.broker.store.engine, "commit", on_commit)
    try:
        plain = await harness.client.post("/v1/sandbox/sessions", json=BODY, headers=alice)
        assert plain.status_code == 200, plain.text
        without_key = len(commits)
        commits.clear()
        keyed = {**alice, "Idempotency-Key": str(uuid.uuid4())}
        first = await harness.client.post("/v1/sandbox/sessions", json=BODY, headers=keyed)
        assert first.status_code == 200, first.text
        with_key = len(commits)
        commits.clear()
        again = await harness.client.post("/v1/sandbox/sessions", json=BODY, headers=keyed)
        replayed = len(commits)
    finally:
        event.remove(harness.broker.store.engine, "commit", on_commit)
    assert again.headers.get("idempotent-replayed") == "true"
    assert again.json() == first.json()
    assert (without_key, with_key) == (1, 1), (without_key, with_key)
    assert replayed == 1
    report(
        record_property,
        f"ensure on a live binding: {without_key} commit without a key, {with_key} with a "
        f"fresh Idempotency-Key, {replayed} for its replay",
    )


async def test_a_quota_refusal_is_not_replayed_once_the_quota_frees(
    make_harness: MakeHarness,
) -> None:
    # A 429 QUOTA_EXCEEDED was stored under its key: after the user freed a sandbox, the
    # same request (same key, same body) stayed refused, replayed.
    h = await make_harness(max_live_sandboxes_per_user=1)
    carol = h.key("carol")
    first = await h.client.post("/v1/sandbox/sessions", json=BODY, headers=carol)
    assert first.status_code == 200, first.text
    keyed = {**carol, "Idempotency-Key": str(uuid.uuid4())}
    other = {"thread_id": "thr_idem_2", "mode": "ensure"}
    refused = await h.client.post("/v1/sandbox/sessions", json=other, headers=keyed)
    assert refused.status_code == 429, refused.text
    assert refused.json()["error"]["code"] == "QUOTA_EXCEEDED"
    sid = first.json()["session_id"]
    r = await h.client.delete(f"/v1/sandbox/sessions/{sid}?terminate=true", headers=carol)
    assert r.status_code in (200, 202, 204), r.text
    deadline = time.monotonic() + 10
    while True:
        again = await h.client.post("/v1/sandbox/sessions", json=other, headers=keyed)
        if again.status_code == 200 or time.monotonic() > deadline:
            break
        assert again.headers.get("idempotent-replayed") != "true", again.text
        await asyncio.sleep(0.05)  # the terminated sandbox leaves the count
    assert again.status_code == 200, again.text


async def test_retry_while_running_waits_and_replays(
    make_harness: MakeHarness, record_property: RecordProperty
) -> None:
    h = await make_harness()
    alice = h.key("alice")
    await settled(h, alice)
    sessions = h.broker.sessions
    orig = sessions._negotiate_in
    inside = threading.Event()
    gate = threading.Event()

    def slow(*a: Any, **kw: Any) -> Any:
        # Runs in the first request's transaction, holding the store's write lock.
        if not inside.is_set():
            inside.set()
            assert gate.wait(10)
        return orig(*a, **kw)

    sessions._negotiate_in = slow  # type: ignore[method-assign]
    try:
        headers = {**alice, "Idempotency-Key": "same"}
        first = asyncio.create_task(
            h.client.post("/v1/sandbox/sessions", json=BODY, headers=headers)
        )
        while not inside.is_set():
            await asyncio.sleep(0.01)
        second = asyncio.create_task(
            h.client.post("/v1/sandbox/sessions", json=BODY, headers=headers)
        )
        await asyncio.sleep(0.3)
        assert not second.done(), (await second).text
        gate.set()
        r1, r2 = await first, await second
    finally:
        gate.set()
        sessions._negotiate_in = orig  # type: ignore[method-assign]
    assert r1.status_code == r2.status_code == 200, (r1.text, r2.text)
    assert r2.headers.get("idempotent-replayed") == "true"
    assert r2.json() == r1.json()
    report(
        record_property,
        "idempotency: a retry sent while the first request runs waits for it and gets its "
        "answer (replayed, identical)",
    )


async def test_claim_in_flight_is_409(harness: Harness) -> None:
    """A key claimed outside one transaction (as a resume after ensure leaves it) answers
    409 IDEMPOTENCY_IN_FLIGHT, retryable, until it is settled."""
    alice = harness.key("alice")
    r = await harness.client.post("/v1/sandbox/sessions", json=BODY, headers=alice)
    assert r.status_code == 200, r.text
    who = jwt.decode(r.json()["token"], options={"verify_signature": False})["sub"]
    fp = fingerprint("POST", "/v1/sandbox/sessions", json.dumps(BODY).encode())
    assert harness.broker.idempotency.begin(who, "held", fp) is None
    held = {**alice, "Idempotency-Key": "held"}
    r = await harness.client.post("/v1/sandbox/sessions", json=BODY, headers=held)
    assert r.status_code == 409, r.text
    err = r.json()["error"]
    assert err["code"] == "IDEMPOTENCY_IN_FLIGHT" and err["retryable"] is True
    harness.broker.idempotency.finish(who, "held", 200, {"done": True})
    r = await harness.client.post("/v1/sandbox/sessions", json=BODY, headers=held)
    assert r.status_code == 200 and r.json() == {"done": True}


@pytest.mark.reliability
def test_answer_committed_with_the_work(tmp_path: Path, record_property: RecordProperty) -> None:
    """kill -9 right after the binding's commit: the retry gets the committed answer."""
    srv = SandlotServer(tmp_path / "d", env={"SANDLOT_FAILPOINTS": "after_binding_insert"})
    srv.start()
    try:
        headers = {**srv.headers("alice"), "Idempotency-Key": "crash-1"}
        body = {"thread_id": "thr_crash", "mode": "ensure"}
        with pytest.raises(httpx.TransportError):
            httpx.post(f"{srv.url}/v1/sandbox/sessions", json=body, headers=headers, timeout=30)
        assert srv.proc is not None and srv.proc.wait(10) == -9
        srv.restart(SANDLOT_FAILPOINTS="")
        r = httpx.post(f"{srv.url}/v1/sandbox/sessions", json=body, headers=headers, timeout=30)
        assert r.status_code == 200, r.text
        assert r.headers.get("idempotent-replayed") == "true"
        again = httpx.post(f"{srv.url}/v1/sandbox/sessions", json=body, headers=headers, timeout=30)
        assert again.json() == r.json()
        report(
            record_property,
            "kill -9 right after ensure's commit: the retry with the same Idempotency-Key "
            "replays the answer committed with the binding",
        )
    finally:
        srv.stop()
        srv.cleanup()


STORM_CONFIG = """
[quotas]
negotiation_rate_per_second = 100000
negotiation_burst = 100000
"""


async def same_key_storm(url: str, headers: dict[str, str], n: int) -> list[httpx.Response]:
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=60) as client:
        return await asyncio.gather(
            *(
                client.post(
                    "/v1/sandbox/sessions",
                    json={"thread_id": "storm", "mode": "ensure"},
                    headers=headers,
                )
                for _ in range(n)
            )
        )


@pytest.mark.reliability
@pytest.mark.timeout(240)
@pytest.mark.parametrize("store", ["sqlite", "postgresql"])
def test_same_key_storm_across_workers(
    tmp_path: Path, store: str, record_property: RecordProperty
) -> None:
    """100 concurrent retries of one request (same key, same body) on 4 worker processes:
    one runs, every other one waits for it and gets its answer."""
    with contextlib.ExitStack() as stack:
        config = STORM_CONFIG
        if store == "postgresql":
            url = stack.enter_context(postgres_cluster())
            config += f'\n[server]\nstore_url = "{url}"\n'
        srv = SandlotServer(tmp_path / "d", workers=4, config=config).start()
        stack.callback(srv.cleanup)
        stack.callback(srv.stop)
        headers = {**srv.headers("storm"), "Idempotency-Key": str(uuid.uuid4())}
        results = asyncio.run(same_key_storm(srv.url, headers, 100))
        codes = sorted({r.status_code for r in results})
        assert codes == [200], [r.text for r in results if r.status_code != 200][:3]
        assert len({r.content for r in results}) == 1
        replayed = sum(r.headers.get("idempotent-replayed") == "true" for r in results)
        assert replayed == 99
        report(
            record_property,
            f"100 concurrent identical requests with one Idempotency-Key, 4 workers ({store}): "
            "1 ran, 99 got its answer replayed, 0 conflicts",
        )
