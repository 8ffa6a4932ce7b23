from __future__ import annotations

import httpx

from tests.dataplane.conftest import Server


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
