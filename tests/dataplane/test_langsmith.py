"""The LangSmith-compatible surface, with the shapes langsmith 0.15's client sends and reads."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import websockets

from tests.dataplane.conftest import Server


async def _recv(ws: Any) -> dict[str, Any]:
    return json.loads(await asyncio.wait_for(ws.recv(), 10))


def test_execute_ws_without_command_id_then_reconnect(server: Server) -> None:
    async def run() -> None:
        hdr = {"X-Api-Key": server.token()}
        url = server.ws_url("/execute/ws")
        async with websockets.connect(url, additional_headers=hdr) as ws:
            await ws.send(
                json.dumps(
                    {
                        "type": "execute",
                        "command": "echo a; sleep 0.3; echo b >&2",
                        "timeout_seconds": 60,
                        "shell": "/bin/bash",
                        "idle_timeout_seconds": 300,
                        "kill_on_disconnect": False,
                        "ttl_seconds": 600,
                        "close_stdin": True,
                    }
                )
            )
            started = await _recv(ws)
            assert started["type"] == "started" and started["command_id"]
            assert (await _recv(ws))["data"] == "a\n"
        async with websockets.connect(url, additional_headers=hdr) as ws:
            await ws.send(
                json.dumps(
                    {
                        "type": "reconnect",
                        "command_id": started["command_id"],
                        "stdout_offset": 2,
                        "stderr_offset": 0,
                    }
                )
            )
            assert (await _recv(ws))["command_id"] == started["command_id"]
            frame = await _recv(ws)
            assert frame == {"type": "stderr", "data": "b\n", "offset": 0}
            assert (await _recv(ws)) == {
                "type": "exit",
                "exec_id": frame.get("exec_id", started["exec_id"]),
                "exit_code": 0,
                "signal": None,
                "timed_out": False,
                "oom_killed": False,
            }
        async with websockets.connect(url, additional_headers=hdr) as ws:
            await ws.send(json.dumps({"type": "reconnect", "command_id": "cmd_missing"}))
            err = await _recv(ws)
            assert err["type"] == "error" and err["error_type"] == "CommandNotFound"

    asyncio.run(run())


def test_files_glob_grep_download(server: Server) -> None:
    hdr = {"X-Api-Key": server.token()}
    with httpx.Client(headers=hdr) as c:
        r = c.post(
            server.url("/upload"), params={"path": "d/f.txt"}, files={"file": ("file", b"hello")}
        )
        assert r.status_code == 201
        c.post(server.url("/upload"), params={"path": "top.txt"}, files={"file": ("file", b"x")})
        # `ls` is glob("*"): one level, directories included.
        g = c.post(server.url("/glob"), json={"pattern": "*", "path": "/workspace"}).json()
        assert {(m["path"], m["is_dir"]) for m in g["matches"]} == {
            ("/workspace/d", True),
            ("/workspace/top.txt", False),
        }
        assert all("size_bytes" in m for m in g["matches"])
        g = c.post(
            server.url("/glob"), json={"pattern": "**/*.txt", "path": "/workspace", "limit": 1}
        )
        assert len(g.json()["matches"]) == 1 and g.json()["truncated"] is True
        gr = c.post(server.url("/grep"), json={"pattern": "hell", "path": "/workspace", "limit": 5})
        assert gr.json()["matches"] == [{"path": "/workspace/d/f.txt", "line": 1, "text": "hello"}]
        head = c.head(server.url("/download"), params={"path": "d/f.txt"})
        etag = head.headers["etag"]
        assert head.headers["content-length"] == "5" and head.headers["last-modified"]
        same = c.get(
            server.url("/download"), params={"path": "d/f.txt"}, headers={"If-None-Match": etag}
        )
        assert same.status_code == 304
        part = c.get(
            server.url("/download"),
            params={"path": "d/f.txt"},
            headers={"Range": "bytes=1-", "If-Range": etag},
        )
        assert part.status_code == 206 and part.content == b"ello"
        stale = c.get(
            server.url("/download"),
            params={"path": "d/f.txt"},
            headers={"Range": "bytes=1-", "If-Range": '"old"'},
        )
        assert stale.status_code == 200 and stale.content == b"hello"
        assert c.get(server.url("/download"), params={"path": "nope"}).status_code == 404
