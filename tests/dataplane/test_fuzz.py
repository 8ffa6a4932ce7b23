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
