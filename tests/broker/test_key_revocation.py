"""Revoking an API key (or all of a user's keys) revokes every token minted with it.

Against a real ``sandlot serve`` (one process, and several worker processes on one
SQLite file): a token minted with a key holds an exec WebSocket and a shell open;
``sandlot keys revoke``, run as its own process while the server runs, must close
both with 4401 within a second of the revocation (measured from the time the store
recorded it), and the token, the key and nothing else stop working. The revocation
outlives a restart of the server.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import websockets

from tests.figures import RecordProperty, report
from tests.servers import SandlotServer, running


def cli(srv: SandlotServer, *args: str) -> str:
    argv = [sys.executable, "-m", "sandlot.cli.main", *args, "--data-dir", str(srv.data_dir)]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


def new_key(srv: SandlotServer, user: str, actor: str = "human") -> tuple[str, str]:
    made = json.loads(cli(srv, "keys", "create", "--user", user, "--actor", actor, "--json"))
    return made["key"], made["id"]


def negotiate(
    srv: SandlotServer, key: str, thread: str, extra: dict[str, str] | None = None
) -> dict[str, Any]:
    r = httpx.post(
        f"{srv.url}/v1/sandbox/sessions",
        json={"thread_id": thread, "mode": "ensure"},
        headers={"Authorization": f"Bearer {key}", **(extra or {})},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    grant: dict[str, Any] = r.json()
    return grant


def wait_active(grant: dict[str, Any]) -> None:
    dp = grant["dataplane"]["http_base_url"]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        r = exec_true(grant)
        if r.status_code == 200:
            return
        assert r.status_code == 423, r.text
        time.sleep(0.1)
    raise AssertionError(f"{dp} never became active")


def exec_true(grant: dict[str, Any]) -> httpx.Response:
    return httpx.post(
        f"{grant['dataplane']['http_base_url']}/exec",
        json={"command": "true"},
        headers={"Authorization": f"Bearer {grant['token']}"},
        timeout=30,
    )


async def hold_sockets(grant: dict[str, Any], shell: str | None) -> list[Any]:
    """An exec WebSocket running ``sleep`` and a shell, both authenticated with the token."""
    ws_base = grant["dataplane"]["ws_base_url"]
    auth = json.dumps({"type": "auth", "token": grant["token"]})
    ex = await websockets.connect(f"{ws_base}/exec/ws")
    await ex.send(auth)
    assert json.loads(await ex.recv())["type"] == "auth_ok"
    await ex.send(json.dumps({"type": "start", "command": "sleep 60"}))
    while json.loads(await ex.recv())["type"] != "ready":
        pass
    if shell is None:
        return [ex]
    sh = await websockets.connect(f"{ws_base}/shell/ws?session={shell}")
    await sh.send(auth)
    assert json.loads(await sh.recv())["type"] == "auth_ok"
    return [ex, sh]


async def pong(ws: Any) -> None:
    """The socket is open and served: a ping gets its pong."""
    await ws.send(json.dumps({"type": "ping"}))
    while True:
        frame = await asyncio.wait_for(ws.recv(), 10)
        if isinstance(frame, str) and json.loads(frame).get("type") == "pong":
            return


async def closed_at(ws: Any) -> tuple[int | None, float]:
    """Wait for the server to close ``ws``: (close code, wall-clock time); (None, inf) if it
    is still open 10 s later."""
    deadline = time.monotonic() + 10
    try:
        while True:
            await asyncio.wait_for(ws.recv(), max(0.0, deadline - time.monotonic()))
    except websockets.ConnectionClosed as exc:
        return (exc.rcvd.code if exc.rcvd else None), time.time()
    except TimeoutError:
        return None, float("inf")


async def revoke_and_watch(srv: SandlotServer, sockets: list[Any], *args: str) -> list[Any]:
    watchers = [asyncio.ensure_future(closed_at(ws)) for ws in sockets]
    await asyncio.sleep(0.2)
    assert not any(w.done() for w in watchers), "a socket closed before the revocation"
    await asyncio.to_thread(cli, srv, "keys", "revoke", *args)
    return list(await asyncio.gather(*watchers))


def revoked_at(srv: SandlotServer, key_ids: list[str]) -> float:
    """When the store recorded the revocation (the CLI's clock, same machine)."""
    with sqlite3.connect(srv.data_dir / "sandlot.db") as conn:
        marks = [
            conn.execute("SELECT revoked_at FROM api_keys WHERE id = ?", (k,)).fetchone()[0]
            for k in key_ids
        ]
    assert all(m is not None for m in marks)
    return float(max(marks))


def broker_status(srv: SandlotServer, key: str) -> int:
    """The key at the broker, after the servers' key cache (1 s) has passed."""
    deadline = time.monotonic() + 3
    while True:
        r = httpx.get(f"{srv.url}/v1/sandboxes", headers={"Authorization": f"Bearer {key}"})
        if r.status_code == 401 or time.monotonic() > deadline:
            return r.status_code
        time.sleep(0.1)


@pytest.mark.reliability
@pytest.mark.timeout(300)
@pytest.mark.parametrize("workers", [1, 2])
def test_revoking_a_key_revokes_its_tokens(
    tmp_path: Path, workers: int, record_property: RecordProperty
) -> None:
    with running(tmp_path / "data", workers=workers) as srv:
        key, key_id = new_key(srv, "alice")
        other_key, _ = new_key(srv, "alice")
        grant = negotiate(srv, key, "thr_revoke")
        wait_active(grant)
        # Another key of the same user, on the same sandbox: it is not revoked.
        other = negotiate(srv, other_key, "thr_revoke")
        assert other["sandbox"]["id"] == grant["sandbox"]["id"]

        async def run() -> list[Any]:
            sockets = await hold_sockets(grant, "revoke")
            kept = await hold_sockets(other, "kept")
            try:
                closes = await revoke_and_watch(srv, sockets, key_id)
                # The other key's sockets stay open.
                for ws in kept:
                    await pong(ws)
            finally:
                for ws in sockets + kept:
                    await ws.close()
            return closes

        closes = asyncio.run(run())
        latency = max(t for _, t in closes) - revoked_at(srv, [key_id])
        assert [code for code, _ in closes] == [4401, 4401]
        assert latency < 1.0, f"sockets closed {latency:.3f} s after the revocation"
        r = exec_true(grant)
        assert r.status_code == 401 and r.json()["error"]["code"] == "UNAUTHENTICATED"
        assert broker_status(srv, key) == 401
        assert exec_true(other).status_code == 200
        assert broker_status(srv, other_key) == 200
        # A restarted server still refuses the revoked token (at the dataplane's address
        # after the restart: with workers it may have moved).
        srv.restart()
        fresh = negotiate(srv, other_key, "thr_revoke")
        assert exec_true({**grant, "dataplane": fresh["dataplane"]}).status_code == 401
        assert exec_true(fresh).status_code == 200
    report(
        record_property,
        f"key revocation ({workers} worker{'s' if workers > 1 else ''}): exec and shell "
        f"sockets of its token closed (4401) {latency * 1000:.0f} ms after `sandlot keys "
        "revoke` recorded it; the token 401 (also after a restart), the key 401, another "
        "key of the same user unaffected",
    )


@pytest.mark.reliability
@pytest.mark.timeout(300)
def test_revoking_a_user_revokes_tokens_minted_for_them(
    tmp_path: Path, record_property: RecordProperty
) -> None:
    with running(tmp_path / "data") as srv:
        bob_key, bob_key_id = new_key(srv, "bob")
        svc_key, _ = new_key(srv, "platform", "service")
        own = negotiate(srv, bob_key, "thr_bob")
        wait_active(own)
        # A service acting for bob: its token acts for bob, though minted with the service's key.
        for_bob = negotiate(srv, svc_key, "thr_bob", {"X-Sandlot-On-Behalf-Of": "bob"})
        for_carol = negotiate(srv, svc_key, "thr_carol", {"X-Sandlot-On-Behalf-Of": "carol"})
        wait_active(for_carol)
        assert exec_true(for_bob).status_code == 200

        async def run() -> list[Any]:
            sockets = await hold_sockets(own, "bob1")
            sockets += await hold_sockets(for_bob, None)
            try:
                return await revoke_and_watch(srv, sockets, "--user", "bob")
            finally:
                for ws in sockets:
                    await ws.close()

        closes = asyncio.run(run())
        latency = max(t for _, t in closes) - revoked_at(srv, [bob_key_id])
        assert [code for code, _ in closes] == [4401, 4401, 4401]
        assert latency < 1.0, f"sockets closed {latency:.3f} s after the revocation"
        assert exec_true(own).status_code == 401
        assert exec_true(for_bob).status_code == 401
        assert broker_status(srv, bob_key) == 401
        # The service and what it does for others are untouched.
        assert exec_true(for_carol).status_code == 200
        assert broker_status(srv, svc_key) == 200
    report(
        record_property,
        f"user revocation: bob's keys revoked, and the sockets of his own and of a service's "
        f"token acting for him closed (4401) {latency * 1000:.0f} ms after; the service "
        "keeps working for others",
    )


def test_a_key_revoked_meanwhile_mints_nothing(tmp_path: Path) -> None:
    """A server trusts a looked-up key for a second: within it, a key revoked by another
    process must not mint a token that its revocation did not see."""
    from sandlot.broker.keys import KeyService
    from sandlot.broker.store import Store

    with running(tmp_path / "data") as srv:
        key, key_id = new_key(srv, "ivan")
        grant = negotiate(srv, key, "thr_race")
        store = Store(f"sqlite:///{srv.data_dir / 'sandlot.db'}")
        try:
            # As `sandlot keys revoke` does, from another process's point of view.
            KeyService(store).revoke(key_id)
        finally:
            store.dispose()
        r = httpx.post(
            f"{srv.url}/v1/sandbox/sessions",
            json={"thread_id": "thr_race", "mode": "ensure"},
            headers={"Authorization": f"Bearer {key}"},
        )
        assert r.status_code == 401, r.text
        with sqlite3.connect(srv.data_dir / "sandlot.db") as conn:
            live = conn.execute(
                "SELECT jti FROM tokens WHERE key_id = ? AND revoked_at IS NULL", (key_id,)
            ).fetchall()
        assert live == [], "a token minted with a revoked key is live"
        assert grant["token"]


@pytest.mark.reliability
@pytest.mark.timeout(120)
def test_revoking_a_key_closes_what_it_opened_directly_on_the_dataplane(
    tmp_path: Path, record_property: RecordProperty
) -> None:
    """The LangSmith surface takes the API key itself (``X-Api-Key``): a revoked key stops
    working there within a second and the sockets it opened close, as a token's do."""
    with running(tmp_path / "data") as srv:
        key, key_id = new_key(srv, "alice", "agent")
        grant = negotiate(srv, key, "thr_direct_key")
        wait_active(grant)
        dp = grant["dataplane"]["http_base_url"]
        ws_base = grant["dataplane"]["ws_base_url"]
        headers = {"X-Api-Key": key}
        r = httpx.post(f"{dp}/execute", json={"command": "true"}, headers=headers, timeout=30)
        assert r.status_code == 200, r.text

        async def run() -> list[Any]:
            ws = await websockets.connect(f"{ws_base}/execute/ws", additional_headers=headers)
            await ws.send(json.dumps({"type": "execute", "command": "sleep 60"}))
            while json.loads(await ws.recv())["type"] != "started":
                pass
            try:
                return await revoke_and_watch(srv, [ws], key_id)
            finally:
                await ws.close()

        [(code, closed)] = asyncio.run(run())
        latency = closed - revoked_at(srv, [key_id])
        assert code == 4401
        assert latency < 1.0, f"socket closed {latency:.3f} s after the revocation"
        r = httpx.post(f"{dp}/execute", json={"command": "true"}, headers=headers, timeout=30)
        assert r.status_code == 401, r.text
    report(
        record_property,
        f"key revocation on the dataplane (X-Api-Key): its socket closed (4401) "
        f"{latency * 1000:.0f} ms after `sandlot keys revoke`, the key 401 at once",
    )
