"""Opening a user's workspace: grants negotiated with a real broker for the user and
refreshed before they expire, the broker's refusals in the browser's terms, and the local
folder's dataplane with the tokens it mints."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from sandlot.protocol.errors import (
    Forbidden,
    InvalidRequest,
    NotFound,
    ResourceNotFound,
    Unauthenticated,
)
from sandlot.sdk import Grant, Sandlot
from sandlot.web.auth import BrowserSession
from sandlot.web.gateway import Gateway
from sandlot.web.localplane import LocalDataplane, LocalSigner, LocalState
from sandlot.web.workspaces import LocalWorkspaces, SandboxWorkspace, SandboxWorkspaces
from tests.servers import SandlotServer


def session(user: str, credential: str | None) -> BrowserSession:
    now = time.time()
    return BrowserSession(
        user_id=user,
        credential=credential,
        csrf_token="csrf",
        created_at=now,
        last_seen=now,
        expires_at=now + 3600,
        checked_at=now,
        key=f"k-{user}",
    )


@pytest.fixture
async def workspaces(
    dataplane: tuple[SandlotServer, Grant],
) -> AsyncIterator[SandboxWorkspaces]:
    server, _ = dataplane
    spaces = SandboxWorkspaces(server.url)
    try:
        yield spaces
    finally:
        await spaces.stop()


async def _list(gateway: Gateway, workspace: SandboxWorkspace | object) -> int:
    dp = await workspace.dataplane()  # type: ignore[attr-defined]
    r = await gateway.request("GET", f"{dp.http_base_url}/fs/list?path=/workspace", token=dp.token)
    return r.status_code


async def test_the_grant_is_the_users_and_refreshed_before_it_expires(
    dataplane: tuple[SandlotServer, Grant], workspaces: SandboxWorkspaces
) -> None:
    server, _ = dataplane
    ada = session("ada", server.key("ada"))
    # Opening a thread that has no sandbox does not make one: only a creating open does.
    absent = await workspaces.open(ada, thread="thr_ws_refresh", sandbox=None)
    with pytest.raises(ResourceNotFound) as none_yet:
        await absent.dataplane()
    assert none_yet.value.metadata == {"workspace": "thr_ws_refresh", "creatable": True}
    with Sandlot(server.url, server.key("ada")) as broker:
        assert "thread:thr_ws_refresh" not in {b.scope for b in broker.list_sandboxes()}
    created = await workspaces.open(ada, thread="thr_ws_refresh", sandbox=None, create=True)
    made = await created.dataplane()
    workspace = await workspaces.open(ada, thread="thr_ws_refresh", sandbox=None)
    assert isinstance(workspace, SandboxWorkspace) and workspace.id == "thr_ws_refresh"
    first = await workspace.dataplane()
    assert first.sandbox_id == made.sandbox_id
    assert first.sandbox_id.startswith("sb_") and "shell" in first.capabilities
    assert (await workspace.dataplane()).token == first.token  # cached, not negotiated again
    async with Gateway(workspaces.upstreams()) as gateway:
        assert await _list(gateway, workspace) == 200
        # Less than a third of its lifetime left: refreshed before it is handed out.
        sandbox = await workspace._open()
        sandbox.grant.expires_at = time.time() + 60
        second = await workspace.dataplane()
        assert second.token != first.token and sandbox.grant.seconds_left() > 600
        assert await _list(gateway, workspace) == 200
        third = await workspace.renewed()
        assert third.token not in (first.token, second.token)
        assert await _list(gateway, workspace) == 200
    by_id = await workspaces.open(ada, thread=None, sandbox=first.sandbox_id)
    assert (await by_id.dataplane()).sandbox_id == first.sandbox_id


async def test_the_brokers_refusals_in_the_browsers_terms(
    dataplane: tuple[SandlotServer, Grant], workspaces: SandboxWorkspaces
) -> None:
    server, _ = dataplane
    ada = session("ada", server.key("ada"))
    await (await workspaces.open(ada, thread="thr_ws_ada", sandbox=None, create=True)).dataplane()
    bob = session("bob", server.key("bob"))
    for create in (False, True):
        with pytest.raises(Forbidden) as refused:
            await (
                await workspaces.open(bob, thread="thr_ws_ada", sandbox=None, create=create)
            ).dataplane()
        assert refused.value.metadata == {"workspace": "thr_ws_ada"}
    with pytest.raises(NotFound):
        await (await workspaces.open(ada, thread=None, sandbox="sb_nonesuch")).dataplane()
    with pytest.raises(Unauthenticated):
        await workspaces.open(session("ada", None), thread="thr_ws_ada", sandbox=None)
    for thread, sandbox in ((None, None), ("thr_1", "sb_1"), ("thr 1", None), ("x" * 300, None)):
        with pytest.raises(InvalidRequest):
            await workspaces.open(ada, thread=thread, sandbox=sandbox)
    # A key revoked since sign-in: the user is told to sign in again.
    out = subprocess.run(
        [sys.executable, "-m", "sandlot.cli.main", "keys", "create", "--user", "cy",
         "--data-dir", str(server.data_dir), "--json"],
        capture_output=True, check=True, timeout=60,
    )  # fmt: skip
    created = json.loads(out.stdout)
    cy = session("cy", created["key"])
    await (await workspaces.open(cy, thread="thr_ws_cy", sandbox=None, create=True)).dataplane()
    subprocess.run(
        [sys.executable, "-m", "sandlot.cli.main", "keys", "revoke", created["id"],
         "--data-dir", str(server.data_dir)],
        capture_output=True, check=True, timeout=60,
    )  # fmt: skip
    with pytest.raises(Unauthenticated) as gone:
        await (
            await workspaces.open(cy, thread="thr_ws_cy2", sandbox=None, create=True)
        ).dataplane()
    assert "sign in again" in gone.value.message
    assert workspaces.readiness()["ready"] is True


async def test_the_local_folder_is_served_to_its_users_with_tokens_it_mints(
    tmp_path: Path,
) -> None:
    (tmp_path / "a.txt").write_text("a")
    plane = LocalDataplane(tmp_path, signer=LocalSigner(ttl_seconds=3))
    spaces = LocalWorkspaces(tmp_path, frozenset({"ada"}), plane)
    assert plane.state is LocalState.STOPPED
    await spaces.start()
    try:
        assert spaces.readiness() == {
            "ready": True,
            "mode": "local",
            "local_dataplane": "running",
        }
        with pytest.raises(Forbidden):
            await spaces.open(session("bob", None), thread=None, sandbox=None)
        workspace = await spaces.open(session("ada", None), thread="ignored", sandbox=None)
        first = await workspace.dataplane()
        assert first.http_base_url == f"http://127.0.0.1:{plane.port}/v1"
        assert (await workspace.dataplane()).token == first.token
        async with Gateway(spaces.upstreams()) as gateway:
            assert await _list(gateway, workspace) == 200
            await asyncio.sleep(2.1)  # less than a third of the 3 s lifetime left: minted again
            assert (await workspace.dataplane()).token != first.token
            assert await _list(gateway, workspace) == 200
    finally:
        await spaces.stop()
    assert plane.state is LocalState.STOPPED
    with pytest.raises(RuntimeError):
        await plane.start()  # the port is given back: a stopped dataplane stays stopped
