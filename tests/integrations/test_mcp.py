"""The MCP server against a real ``sandlot serve``, driven by the official ``mcp`` client:
over streamable HTTP (``/mcp`` of the server) and over stdio (``sandlot mcp``)."""

from __future__ import annotations

import asyncio
import base64
import json
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import httpx2
import pytest
from mcp import Client
from mcp.client.stdio import StdioServerParameters
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError
from mcp_types import INVALID_PARAMS, CallToolResult, TextContent

from sandlot.integrations.mcp import Callers, build_server
from tests.servers import SandlotServer

TOOLS = {
    "environment_acquire",
    "environment_refresh",
    "environment_heartbeat",
    "environment_release",
    "exec",
    "read",
    "write",
    "edit",
    "ls",
    "glob",
    "grep",
    "upload",
    "download",
}


@asynccontextmanager
async def http_client(server: SandlotServer, key: str) -> AsyncIterator[Client]:
    http = httpx2.AsyncClient(headers={"Authorization": f"Bearer {key}"}, timeout=60)
    async with http, Client(streamable_http_client(f"{server.url}/mcp", http_client=http)) as c:
        yield c


@asynccontextmanager
async def stdio_client(server: SandlotServer, key: str) -> AsyncIterator[Client]:
    params = StdioServerParameters(
        command=sys.executable,
        args=["-m", "sandlot.cli.main", "mcp", "--url", server.url, "--api-key", key],
    )
    async with Client(params) as c:
        yield c


CLIENTS = {"http": http_client, "stdio": stdio_client}


def text(result: CallToolResult) -> str:
    block = result.content[0]
    assert isinstance(block, TextContent)
    return block.text


async def ok(client: Client, name: str, args: dict[str, Any], **kw: Any) -> dict[str, Any]:
    result = await client.call_tool(name, args, **kw)
    assert not result.is_error, text(result)
    assert result.structured_content is not None
    return result.structured_content


async def _ignore(progress: float, total: float | None, message: str | None) -> None:
    pass


async def failed(client: Client, name: str, args: dict[str, Any]) -> dict[str, Any]:
    result = await client.call_tool(name, args)
    assert result.is_error, result
    body: dict[str, Any] = json.loads(text(result))
    return body


@pytest.mark.parametrize("transport", ["http", "stdio"])
async def test_acquire_write_exec_read(
    server: SandlotServer, agent_key: str, transport: str
) -> None:
    async with CLIENTS[transport](server, agent_key) as client:
        names = {tool.name for tool in (await client.list_tools()).tools}
        assert names >= TOOLS
        thread = f"thr_mcp_{uuid.uuid4().hex[:8]}"
        grant = await ok(client, "environment_acquire", {"thread_id": thread})
        assert grant["session_id"].startswith("ssn_")
        assert grant["sandbox_id"].startswith("sb_")
        assert "fs_write" in grant["capabilities"]
        assert "token" not in grant
        session = grant["session_id"]
        await ok(client, "write", {"session_id": session, "path": "notes.txt", "content": "hi\n"})
        ran = await ok(
            client, "exec", {"session_id": session, "command": "cat notes.txt; echo there >&2"}
        )
        assert (ran["exit_code"], ran["stdout"], ran["stderr"]) == (0, "hi\n", "there\n")
        read = await ok(client, "read", {"session_id": session, "path": "/workspace/notes.txt"})
        assert read["content"].startswith("hi")
        edited = await ok(
            client,
            "edit",
            {"session_id": session, "path": "notes.txt", "old_string": "hi", "new_string": "ho"},
        )
        assert edited["occurrences"] == 1
        found = await ok(client, "grep", {"session_id": session, "pattern": "ho"})
        assert [m["path"] for m in found["matches"]] == ["/workspace/notes.txt"]
        listed = await ok(client, "ls", {"session_id": session})
        assert "/workspace/notes.txt" in [e["path"] for e in listed["entries"]]
        globbed = await ok(client, "glob", {"session_id": session, "pattern": "*.txt"})
        assert [e["path"] for e in globbed["matches"]] == ["/workspace/notes.txt"]
        blob = bytes(range(256))
        up = {"session_id": session, "path": "b.bin"}
        await ok(client, "upload", {**up, "content_base64": base64.b64encode(blob).decode()})
        down = await ok(client, "download", up)
        assert base64.b64decode(down["content_base64"]) == blob
        resource = await client.read_resource(f"sandlot://{session}/workspace/notes.txt")
        assert getattr(resource.contents[0], "text", None) == "ho\n"
        beat = await ok(client, "environment_heartbeat", {"session_id": session})
        assert beat["state"] in ("active", "idle")
        fresh = await ok(client, "environment_refresh", {"session_id": session})
        assert fresh["expires_at"]
        await ok(client, "environment_release", {"session_id": session, "terminate": True})


INITIALIZE = {
    "jsonrpc": "2.0",
    "id": 1,
    "method": "initialize",
    "params": {
        "protocolVersion": "2025-06-18",
        "capabilities": {},
        "clientInfo": {"name": "t", "version": "1"},
    },
}
MCP_ACCEPT = {"Accept": "application/json, text/event-stream"}


async def test_a_bad_key_is_unauthenticated(server: SandlotServer) -> None:
    # Over stdio the key is the process's: its first call says it is refused.
    async with stdio_client(server, "sl_not_a_key") as client:
        body = await failed(client, "environment_acquire", {"thread_id": "thr_nobody"})
        assert body["code"] == "UNAUTHENTICATED"
    # Over HTTP it opens no session: sessions are one pool for every client, and any
    # bearer value filled it (10,000), after which every user was refused.
    async with httpx.AsyncClient(timeout=30) as http:
        for _ in range(3):  # the broker's word is remembered: still 401
            r = await http.post(
                f"{server.url}/mcp",
                json=INITIALIZE,
                headers={**MCP_ACCEPT, "Authorization": "Bearer sl_not_a_key"},
            )
            assert r.status_code == 401, r.text
            assert r.json()["error"]["code"] == "UNAUTHENTICATED"


async def test_empty_ids_are_invalid_requests(server: SandlotServer) -> None:
    # session_id "" reached the sessions' list: its redirect read as a release done, for
    # any key at all (and the key's client was kept); scope.id "" was an internal error.
    callers = Callers(server.url, default_key="sl_not_a_key")
    try:
        async with Client(build_server(callers)) as client:
            for name, args in (
                ("environment_release", {"session_id": ""}),
                ("environment_release", {"session_id": "", "terminate": True}),
                ("environment_acquire", {"scope": {"type": "thread", "id": ""}}),
            ):
                body = await failed(client, name, args)
                assert body["code"] == "INVALID_REQUEST", (name, args, body)
        assert callers.by_key == {}
    finally:
        await callers.aclose()


def test_http_without_a_key_is_401(server: SandlotServer) -> None:
    resp = httpx.post(f"{server.url}/mcp", json={"jsonrpc": "2.0", "id": 1, "method": "ping"})
    assert resp.status_code == 401
    assert resp.json()["error"]["code"] == "UNAUTHENTICATED"


async def test_a_missing_capability_is_denied_by_the_dataplane(
    server: SandlotServer, agent_key: str
) -> None:
    async with http_client(server, agent_key) as client:
        grant = await ok(
            client,
            "environment_acquire",
            {"thread_id": f"thr_ro_{uuid.uuid4().hex[:8]}", "capabilities": ["fs_read", "exec"]},
        )
        assert "fs_write" not in grant["capabilities"]
        session = grant["session_id"]
        body = await failed(client, "write", {"session_id": session, "path": "x", "content": "x"})
        assert body["code"] == "CAPABILITY_DENIED"
        assert (await ok(client, "exec", {"session_id": session, "command": "true"}))[
            "exit_code"
        ] == 0
        no_exec = await ok(
            client,
            "environment_acquire",
            {"thread_id": f"thr_nx_{uuid.uuid4().hex[:8]}", "capabilities": ["fs_read"]},
        )
        run = {"session_id": no_exec["session_id"], "command": "true"}
        assert (await failed(client, "exec", run))["code"] == "CAPABILITY_DENIED"
        # With a progress token too: the dataplane's own refusal, not a broken socket.
        streamed = await client.call_tool("exec", run, progress_callback=_ignore)
        assert streamed.is_error, text(streamed)
        assert json.loads(text(streamed))["code"] == "CAPABILITY_DENIED", text(streamed)
        with pytest.raises(MCPError) as info:
            await client.read_resource(f"sandlot://{session}/workspace/missing.txt")
        assert info.value.error.data["code"] == "FILE_NOT_FOUND"
        assert info.value.error.data["uri"] == f"sandlot://{session}/workspace/missing.txt"
        # Not an id a sandlot:// URI can carry: refused before the broker is asked.
        with pytest.raises(MCPError) as info:
            await client.read_resource("sandlot://not%20an%20id/workspace/a.txt")
        assert info.value.error.code == INVALID_PARAMS
        assert "not a session or sandbox id" in info.value.error.message
        await ok(client, "environment_release", {"session_id": session, "terminate": True})


@pytest.mark.parametrize("transport", ["http", "stdio"])
async def test_a_long_exec_reports_progress(
    server: SandlotServer, agent_key: str, transport: str
) -> None:
    seen: list[tuple[float, str | None]] = []

    async def progress(value: float, total: float | None, message: str | None) -> None:
        seen.append((value, message))

    async with CLIENTS[transport](server, agent_key) as client:
        thread = f"thr_long_{uuid.uuid4().hex[:8]}"
        command = "for i in 1 2 3; do echo $i; sleep 0.3; done"
        ran = await ok(
            client, "exec", {"thread_id": thread, "command": command}, progress_callback=progress
        )
        assert ran["stdout"] == "1\n2\n3\n"
        assert len(seen) >= 2  # the chunks came while the command ran, not at the end
        assert "".join(m or "" for _, m in seen) == "1\n2\n3\n"
        assert [v for v, _ in seen] == sorted(v for v, _ in seen)


async def test_refused_keys_do_not_pile_up(server: SandlotServer, agent_key: str) -> None:
    # In process (the official client drives the server object directly), against the
    # real broker: a refused key's client is dropped, a working key's is kept.
    bad = Callers(server.url, default_key="sl_not_a_key")
    async with Client(build_server(bad)) as client:
        body = await failed(client, "environment_acquire", {"thread_id": "thr_nobody"})
        assert body["code"] == "UNAUTHENTICATED"
    assert bad.by_key == {}
    good = Callers(server.url, default_key=agent_key)
    try:
        async with Client(build_server(good)) as client:
            thread = f"thr_keep_{uuid.uuid4().hex[:8]}"
            grant = await ok(client, "environment_acquire", {"thread_id": thread})
            assert list(good.by_key) == [agent_key]
            assert list(good.by_key[agent_key].sandboxes) == [grant["session_id"]]
            await ok(client, "environment_release", {"session_id": grant["session_id"]})
            assert good.by_key[agent_key].sandboxes == {}
    finally:
        await good.aclose()


async def test_no_call_leaves_a_client_a_command_or_a_session_it_did_not_ask_for(
    server: SandlotServer, agent_key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Calls refused before the broker is asked (no session named) keep no client of the
    # key either: they were kept, one per key ever sent.
    bad = Callers(server.url, default_key="sl_not_a_key")
    async with Client(build_server(bad)) as client:
        for name in ("exec", "read", "ls"):
            args = {"command": "true"} if name == "exec" else {"path": "."}
            assert (await failed(client, name, args))["code"] == "INVALID_REQUEST"
    assert bad.by_key == {}
    # A command given no timeout gets one (made short here): it never runs on unseen.
    monkeypatch.setattr("sandlot.integrations.mcp.EXEC_TIMEOUT_SECONDS", 1.0)
    good = Callers(server.url, default_key=agent_key)
    try:
        async with Client(build_server(good)) as client:
            grant = await ok(client, "environment_acquire", {"thread_id": "thr_mcp_bounds"})
            sid = grant["session_id"]
            body = await ok(client, "exec", {"session_id": sid, "command": "sleep 60; echo late"})
            assert body["exit_code"] == 124 and body["timed_out"] is True
            assert body["stdout"] == ""
            # A session id is one id: what follows a ? in it is no query of the release.
            forged = {"session_id": f"{sid}?terminate=true&wait=false#", "terminate": False}
            refused = await failed(client, "environment_release", forged)
            assert refused["code"] == "SESSION_NOT_FOUND"
            beat = await ok(client, "environment_heartbeat", {"session_id": sid})
            assert beat["state"] == "active"
            await ok(client, "environment_release", {"session_id": sid})
    finally:
        await good.aclose()


async def test_a_session_no_call_uses_is_let_go_and_taken_up_again(
    server: SandlotServer, agent_key: str
) -> None:
    # Its lease was held for the server's life, heartbeat after heartbeat: the sandbox of
    # an MCP client that went away never went idle.
    callers = Callers(server.url, default_key=agent_key, idle=1.0)
    try:
        async with Client(build_server(callers)) as client:
            grant = await ok(client, "environment_acquire", {"thread_id": "thr_mcp_idle"})
            sid = grant["session_id"]
            caller = callers.by_key[agent_key]
            assert list(caller.sandboxes) == [sid] and caller.client._leases
            async with asyncio.timeout(20):
                while caller.sandboxes or caller.client._leases:
                    await asyncio.sleep(0.1)
            # Named again, the session is taken up (attached), and held again.
            body = await ok(client, "exec", {"session_id": sid, "command": "echo again"})
            assert body["stdout"] == "again\n"
            caller = callers.by_key[agent_key]
            assert list(caller.sandboxes) == [sid] and caller.client._leases
            await ok(client, "environment_release", {"session_id": sid})
        # With nothing held and no call, the key's client goes too.
        async with asyncio.timeout(20):
            while callers.by_key:
                await asyncio.sleep(0.1)
    finally:
        await callers.aclose()


async def test_a_listing_cut_at_its_cap_says_so(server: SandlotServer, agent_key: str) -> None:
    # The dataplane lists 10,000 entries at most and said so; the SDK dropped the flag,
    # and a model took the first 10,000 files for all there were.
    callers = Callers(server.url, default_key=agent_key)
    try:
        async with Client(build_server(callers)) as client:
            grant = await ok(client, "environment_acquire", {"thread_id": "thr_mcp_many"})
            sid = grant["session_id"]
            make = "python3 -c \"[open(f'many/{i}.txt', 'w') for i in range(10050)]\""
            await ok(client, "exec", {"session_id": sid, "command": f"mkdir many && {make}"})
            listed = await ok(client, "ls", {"session_id": sid, "path": "many"})
            found = await ok(client, "glob", {"session_id": sid, "pattern": "many/*.txt"})
            assert (len(listed["entries"]), listed["truncated"]) == (10_000, True)
            assert (len(found["matches"]), found["truncated"]) == (10_000, True)
            few = await ok(client, "ls", {"session_id": sid, "path": "."})
            assert few["truncated"] is False
            await ok(client, "environment_release", {"session_id": sid, "terminate": True})
    finally:
        await callers.aclose()


async def test_scopes_modes_and_the_token(server: SandlotServer, agent_key: str) -> None:
    async with http_client(server, agent_key) as client:
        scope = {"type": "thread", "id": f"thr_modes_{uuid.uuid4().hex[:8]}"}
        missing = await failed(client, "environment_acquire", {"scope": scope, "mode": "attach"})
        assert missing["code"] == "SESSION_NOT_FOUND"
        made = await ok(client, "environment_acquire", {"scope": scope, "mode": "create"})
        assert made["scope"] == scope
        again = await failed(client, "environment_acquire", {"scope": scope, "mode": "create"})
        assert again["code"] == "SESSION_CONFLICT"
        attached = await ok(
            client, "environment_acquire", {"scope": scope, "mode": "attach", "include_token": True}
        )
        assert attached["session_id"] == made["session_id"]
        assert attached["token"] and attached["http_base_url"].startswith(server.url)
        nothing = await failed(client, "exec", {"command": "true"})
        assert nothing["code"] == "INVALID_REQUEST"
        await ok(
            client, "environment_release", {"session_id": made["session_id"], "terminate": True}
        )


async def test_a_session_from_another_process_is_adopted(
    server: SandlotServer, agent_key: str
) -> None:
    thread = f"thr_adopt_{uuid.uuid4().hex[:8]}"
    async with stdio_client(server, agent_key) as first:
        session = (await ok(first, "environment_acquire", {"thread_id": thread}))["session_id"]
        await ok(first, "write", {"session_id": session, "path": "a.txt", "content": "kept"})
    async with stdio_client(server, server.key("mallory", "agent")) as stranger:
        body = await failed(stranger, "read", {"session_id": session, "path": "a.txt"})
        assert body["code"] == "FORBIDDEN", body
    async with stdio_client(server, agent_key) as second:
        read = await ok(second, "read", {"session_id": session, "path": "a.txt"})
        assert read["content"] == "kept"
        await ok(second, "environment_release", {"session_id": session, "terminate": True})
        renewed = await ok(second, "environment_acquire", {"thread_id": thread})
        assert renewed["session_id"] != session
    async with stdio_client(server, agent_key) as third:
        # The old session names the scope that is bound anew: never the new session.
        body = await failed(third, "read", {"session_id": session, "path": "a.txt"})
        assert body["code"] == "SESSION_EXPIRED", body


def test_without_the_extra_sandlot_mcp_names_it() -> None:
    code = (
        "import sys; sys.modules['mcp'] = None\n"
        "from sandlot.cli.main import main\n"
        "sys.argv = ['sandlot', 'mcp', '--url', 'http://127.0.0.1:9', '--api-key', 'k']\n"
        "main()\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "sandlot[mcp]" in out.stderr


async def test_with_workers_mcp_is_at_the_sandbox_hosts_port(tmp_path: Any) -> None:
    # MCP sessions live in one process: the broker's port names where they are.
    srv = SandlotServer(tmp_path / "d", workers=2).start()
    try:
        key = srv.key("alice", "agent")
        async with httpx.AsyncClient(timeout=30) as plain:
            resp = await plain.post(
                f"{srv.url}/mcp", json={}, headers={"Authorization": f"Bearer {key}"}
            )
        assert resp.status_code == 404
        error = resp.json()["error"]
        assert error["code"] == "NOT_FOUND"
        mcp_url = error["metadata"]["mcp_url"]
        http = httpx2.AsyncClient(headers={"Authorization": f"Bearer {key}"}, timeout=60)
        async with http, Client(streamable_http_client(mcp_url, http_client=http)) as client:
            grant = await ok(client, "environment_acquire", {"thread_id": "thr_workers"})
            ran = await ok(client, "exec", {"session_id": grant["session_id"], "command": "echo w"})
            assert ran["stdout"] == "w\n"
    finally:
        srv.stop()
