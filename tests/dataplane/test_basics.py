from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.dataplane.conftest import Server


@pytest.mark.local_only("the relay serves a sandbox's routes only: the root is the broker's")
def test_version_and_health(server: Server) -> None:
    for path in ("/healthz", "/__meta/version"):
        r = httpx.get(server.base + path)
        assert r.status_code == 200
        assert r.json()["api_version"] == "1"
        assert r.json()["server"].startswith("sandlot/")
    r = httpx.get(server.url("/healthz"))
    assert r.status_code == 200


def test_exec_roundtrip(server: Server, client: httpx.Client) -> None:
    r = client.post(server.url("/exec"), json={"command": "echo hi; echo err >&2; exit 3"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["stdout"] == "hi\n"
    assert body["stderr"] == "err\n"
    assert body["exit_code"] == 3
    assert r.headers["x-request-id"]


def test_fs_write_read(server: Server, client: httpx.Client) -> None:
    r = client.put(server.url("/fs/write"), json={"path": "a/b.txt", "content": "one\ntwo\n"})
    assert r.status_code == 201, r.text
    r = client.get(server.url("/fs/read"), params={"path": "/workspace/a/b.txt"})
    assert r.status_code == 200, r.text
    assert r.json()["content"] == "one\ntwo\n"
    assert (server.workspace / "a" / "b.txt").read_text() == "one\ntwo\n"


def test_unknown_routes_and_methods_use_the_envelope(server: Server) -> None:
    r = httpx.get(server.url("/nope"), headers=server.headers())
    assert r.status_code == 404 and r.json()["error"]["code"] == "NOT_FOUND"
    r = httpx.delete(server.url("/exec"), headers=server.headers())
    assert r.status_code == 405 and r.json()["error"]["code"] == "INVALID_REQUEST"
    r = httpx.get(server.url("/fs/list", "sb_unknown"), headers=server.headers())
    assert r.status_code == 404 and r.json()["error"]["code"] == "SANDBOX_NOT_FOUND"
    r = httpx.get(server.url("/fs/read"), headers={**server.headers(), "X-Request-Id": "abc-1"})
    assert r.status_code == 400 and r.headers["x-request-id"] == "abc-1"
    assert r.json()["error"]["request_id"] == "abc-1"


@pytest.mark.local_only("registers a second sandbox on the in-process host")
def test_activity_and_unregister_close_sockets(server: Server) -> None:
    import asyncio
    import json

    import pytest
    import websockets

    from sandlot.protocol.states import SandboxState

    server.call(server.host.register, "sb_two", 1, SandboxState.ACTIVE, server.runtime)
    token = server.keys.token("sb_two")

    async def run() -> None:
        async with websockets.connect(
            server.ws_url("/shell/ws?session=s", "sb_two"),
            additional_headers={"Authorization": f"Bearer {token}"},
        ) as ws:
            assert json.loads(await ws.recv())["type"] == "session"
            activity = await asyncio.to_thread(server.call, server.host.activity, "sb_two")
            assert activity.attached_clients == 1 and activity.busy
            assert activity.last_active_at is not None
            await asyncio.to_thread(server.call, server.host.unregister, "sb_two")
            with pytest.raises(websockets.ConnectionClosed) as info:
                while True:
                    await asyncio.wait_for(ws.recv(), 5)
            assert info.value.rcvd is not None and info.value.rcvd.code == 1001

    asyncio.run(run())
    r = httpx.get(server.url("/fs/list", "sb_two"), headers={"Authorization": f"Bearer {token}"})
    assert r.status_code == 404


@pytest.mark.local_only("a container's root is its whole image, not two mount points")
def test_list_root_shows_mount_points(server: Server, client: httpx.Client) -> None:
    r = client.get(server.url("/fs/list"), params={"path": "/"})
    assert r.status_code == 200
    assert [e["path"] for e in r.json()["entries"]] == ["/tmp", "/workspace"]
    assert client.get(server.url("/fs/read"), params={"path": "/etc/hostname"}).status_code == 404


def test_non_utf8_file_names_are_listed_escaped(server: Server, client: httpx.Client) -> None:
    import os

    os.close(os.open(os.fsencode(server.workspace) + b"/bad\xffname", os.O_CREAT | os.O_WRONLY))
    r = client.get(server.url("/fs/list"))
    assert r.status_code == 200
    assert "/workspace/bad\udcffname" in [e["path"] for e in r.json()["entries"]]
    g = client.post(server.url("/fs/glob"), json={"pattern": "bad*"})
    assert g.status_code == 200 and len(g.json()["matches"]) == 1
    # Sending the escaped name back in JSON is refused cleanly (strict JSON parsing).
    body = b'{"path": "/workspace/bad\\udcffname", "content": "y"}'
    assert client.put(server.url("/fs/write"), content=body).status_code == 400


@pytest.mark.local_only("compares the in-process host's two routers")
def test_routes_served_directly_answer_as_behind_the_router(
    server: Server, client: httpx.Client
) -> None:
    """Routes without a path parameter skip Starlette's router (``host._Direct``): the
    router's answers (405, 404), the request id and the error envelope stay."""
    direct = server.host.app
    assert ("POST", "/fs/grep") in direct.table and ("GET", "/fs/read") in direct.table
    r = client.get(server.url("/fs/grep"))
    assert r.status_code == 405 and r.json()["error"]["code"] == "INVALID_REQUEST"
    r = client.get(server.url("/fs/nope"))
    assert r.status_code == 404 and r.json()["error"]["code"] == "NOT_FOUND"
    r = client.get(
        server.url("/fs/stat"), params={"path": "/workspace"}, headers={"X-Request-Id": "req_mine"}
    )
    assert r.status_code == 200 and r.headers.get_list("x-request-id") == ["req_mine"]
    r = client.get(server.url("/fs/stat", sandbox_id="sb_other"), params={"path": "/workspace"})
    assert r.status_code in (401, 403, 404), r.text  # another sandbox's id: never this one's

    # An error that escapes an endpoint (and its response) is still the 500 envelope.
    class Broken:
        async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
            raise RuntimeError("boom")

    async def broken(request: Any) -> Any:
        return Broken()

    original = direct.table[("GET", "/fs/stat")]
    direct.table[("GET", "/fs/stat")] = broken
    try:
        r = client.get(server.url("/fs/stat"), params={"path": "/workspace"})
    finally:
        direct.table[("GET", "/fs/stat")] = original
    assert r.status_code == 500 and r.json()["error"]["code"] == "INTERNAL"
    assert "boom" not in r.text
