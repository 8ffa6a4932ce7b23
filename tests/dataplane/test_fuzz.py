"""Client mistakes never produce a 5xx: junk bodies, types and parameters on every route."""

from __future__ import annotations

import random

import httpx

from tests.dataplane.conftest import Server

ROUTES = [
    ("POST", "/exec"),
    ("POST", "/execute"),
    ("GET", "/execs"),
    ("GET", "/execs/ex_x"),
    ("POST", "/execs/ex_x/signal"),
    ("GET", "/shells"),
    ("DELETE", "/shells/x"),
    ("GET", "/fs/list"),
    ("GET", "/fs/read"),
    ("PUT", "/fs/write"),
    ("POST", "/fs/edit"),
    ("POST", "/fs/glob"),
    ("POST", "/fs/grep"),
    ("GET", "/fs/stat"),
    ("DELETE", "/fs"),
    ("POST", "/fs/mkdir"),
    ("POST", "/fs/move"),
    ("POST", "/files/upload"),
    ("GET", "/files/download"),
    ("POST", "/files/archive"),
    ("GET", "/files/archive"),
    ("POST", "/upload"),
    ("GET", "/download"),
    ("POST", "/glob"),
    ("POST", "/grep"),
]

JUNK_BODIES: list[bytes] = [
    b"",
    b"{",
    b"[]",
    b"null",
    b'"x"',
    b"\xff\xfe",
    b'{"command": 5}',
    b'{"command": [], "timeout": -1}',
    b'{"command": "true", "timeout": "abc"}',
    b'{"path": 5, "content": null}',
    b'{"path": "a", "content": "x", "encoding": "base64"}',
    b'{"path": "a", "content": "!!", "encoding": "base64"}',
    b'{"path": "a", "content": "x", "encoding": "rot13"}',
    b'{"path": "a", "old_string": "", "new_string": "x"}',
    b'{"pattern": "[", "path": "/workspace", "regex": true}',
    b'{"pattern": "{a,b", "path": "/workspace"}',
    b'{"pattern": "' + b"{a,b}" * 20 + b'", "path": "/workspace"}',
    b'{"src": "/", "dst": "/workspace/x"}',
    b'{"signal": "SIGNOPE"}',
    b'{"path": "\\u0000"}',
    b'{"path": "\\ud800"}',
]

JUNK_PARAMS = [
    {},
    {"path": ""},
    {"path": "\x00"},
    {"path": "/" * 5000},
    {"path": "a", "offset": "-1"},
    {"path": "a", "limit": "0"},
    {"path": "a", "depth": "999"},
    {"path": "a", "recursive": "maybe"},
    {"after": "x"},
    {"after": "-5"},
    {"path": "%zz"},
]


def test_junk_never_5xx(server: Server, client: httpx.Client) -> None:
    (server.workspace / "a").write_text("hello")
    rng = random.Random(3)
    for method, path in ROUTES:
        for _ in range(12):
            body = rng.choice(JUNK_BODIES)
            params = rng.choice(JUNK_PARAMS)
            headers = {"Content-Type": rng.choice(["application/json", "multipart/form-data"])}
            r = client.request(
                method, server.url(path), params=params, content=body, headers=headers, timeout=5
            )
            assert r.status_code < 500, (method, path, params, body, r.status_code, r.text)
            if r.status_code >= 400:
                assert r.json()["error"]["code"]
                assert "Traceback" not in r.text
    for after in ("x", "-5", "1e9x"):
        r = client.get(server.url("/events"), params={"after": after})
        assert r.status_code == 400, r.text
    for body in (b'{"path": "\\ud800", "content": "x"}', b'{"path": "a", "content": "\\ud800"}'):
        r = client.put(server.url("/fs/write"), content=body)
        assert r.status_code == 400, r.text


def test_junk_frames_get_errors_not_crashes(server: Server) -> None:
    import asyncio
    import json

    import websockets

    async def run() -> None:
        url = server.ws_url("/exec/ws")
        # Junk as the first frame: refused with a close code, not a server error (1011).
        for junk in (b"\xff\x00", "not json", '{"type": "nope"}', "[]"):
            async with websockets.connect(url) as ws:
                await ws.send(junk)
                try:
                    while True:
                        await asyncio.wait_for(ws.recv(), 5)
                except websockets.ConnectionClosed as exc:
                    assert exc.rcvd is not None and exc.rcvd.code == 4401
        async with websockets.connect(url, additional_headers=server.headers()) as ws:
            await ws.send(json.dumps({"type": "start", "command": "cat"}))
            assert json.loads(await ws.recv())["type"] == "ready"
            for junk in (b"\xff", "{", '{"type": "stdin"}', '{"type": "resize", "cols": 0}'):
                await ws.send(junk)
                frame = json.loads(await ws.recv())
                assert frame["type"] == "error" and frame["code"] == "INVALID_REQUEST"
            await ws.send(b'{"type": "stdin", "data": "bin\\n"}')
            assert json.loads(await ws.recv())["data"] == "bin\n"
            await ws.send(json.dumps({"type": "close_stdin"}))
            while json.loads(await ws.recv())["type"] != "exit":
                pass

    asyncio.run(run())
