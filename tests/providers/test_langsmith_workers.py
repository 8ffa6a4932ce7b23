"""``sandlot serve --workers 2`` with two configured providers, ``local`` and a
``langsmith`` provider on a second ``sandlot serve``'s LangSmith-compatible surface:
each worker chooses among them, the sandbox host runs both (the hosted boxes' relay
with it), and a sandbox of either provider made through one worker is used, suspended
and ended through the other."""

from __future__ import annotations

import http.client
import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

from tests.providers.langsmithharness import Pair, pair

pytestmark = [pytest.mark.isolation, pytest.mark.slow, pytest.mark.timeout(300)]


class WorkerConn:
    """One kept-alive connection to the broker's port, and the worker process that
    accepted it (the process holding the server side of the socket)."""

    def __init__(self, url: str, key: str) -> None:
        host, port = url.removeprefix("http://").rsplit(":", 1)
        self.port = int(port)
        self.conn = http.client.HTTPConnection(host, self.port, timeout=60)
        self.headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
        self.pid = 0

    def call(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        data = None if body is None else json.dumps(body)
        self.conn.request(method, path, body=data, headers=self.headers)
        resp = self.conn.getresponse()
        raw = resp.read()
        assert resp.getheader("connection", "").lower() != "close"
        return resp.status, json.loads(raw) if raw else None

    def owner(self, candidates: list[int]) -> int:
        """The process among ``candidates`` that serves this connection."""
        local_port = self.conn.sock.getsockname()[1]
        inode = _server_socket_inode(self.port, local_port)
        for pid in candidates:
            try:
                fds = os.listdir(f"/proc/{pid}/fd")
            except OSError:
                continue
            for fd in fds:
                try:
                    if os.readlink(f"/proc/{pid}/fd/{fd}") == f"socket:[{inode}]":
                        return pid
                except OSError:
                    continue
        raise AssertionError(f"no worker holds the connection from port {local_port}")

    def close(self) -> None:
        self.conn.close()


def _server_socket_inode(server_port: int, client_port: int) -> str:
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, remote, inode = fields[1], fields[2], fields[9]
            if (
                int(local.rsplit(":", 1)[1], 16) == server_port
                and int(remote.rsplit(":", 1)[1], 16) == client_port
            ):
                return inode
    raise AssertionError(f"no server socket for the client port {client_port}")


def _children(pid: int) -> list[int]:
    found = []
    for task in os.listdir(f"/proc/{pid}/task"):
        text = Path(f"/proc/{pid}/task/{task}/children").read_text()
        found += [int(c) for c in text.split()]
    return found


def _two_workers(p: Pair, key: str) -> tuple[WorkerConn, WorkerConn]:
    """Connections until two of them are served by two different worker processes."""
    assert p.broker.proc is not None
    candidates = _children(p.broker.proc.pid)
    by_pid: dict[int, WorkerConn] = {}
    spare: list[WorkerConn] = []
    for _ in range(200):
        conn = WorkerConn(p.broker.url, key)
        status, _ = conn.call("GET", "/healthz")
        assert status == 200
        conn.pid = conn.owner(candidates)
        if conn.pid in by_pid:
            spare.append(conn)
        else:
            by_pid[conn.pid] = conn
        if len(by_pid) == 2:
            break
    for conn in spare:
        conn.close()
    assert len(by_pid) == 2, "the kernel never gave a connection to a second worker"
    a, b = by_pid.values()
    return a, b


def _ensure(conn: WorkerConn, thread: str, preference: str = "auto") -> dict[str, Any]:
    status, grant = conn.call(
        "POST",
        "/v1/sandbox/sessions",
        {"thread_id": thread, "mode": "ensure", "provider_preference": preference},
    )
    assert status == 200, grant
    return dict(grant)


def _wait_state(conn: WorkerConn, sandbox_id: str, wanted: str) -> dict[str, Any]:
    deadline = time.monotonic() + 60
    while True:
        status, snap = conn.call("GET", f"/v1/sandboxes/{sandbox_id}")
        assert status == 200, snap
        if snap["state"] == wanted:
            return dict(snap)
        assert time.monotonic() < deadline, snap
        time.sleep(0.05)


def _exec(grant: dict[str, Any], command: str) -> dict[str, Any]:
    """``POST /exec`` at the grant's dataplane (the sandbox host's port)."""
    url = grant["sandbox"]["http_base_url"]
    host, _, rest = url.removeprefix("http://").partition("/")
    conn = http.client.HTTPConnection(host, timeout=60)
    try:
        conn.request(
            "POST",
            f"/{rest}/exec",
            body=json.dumps({"command": command}),
            headers={"Authorization": f"Bearer {grant['token']}"},
        )
        resp = conn.getresponse()
        doc = json.loads(resp.read())
        assert resp.status == 200, doc
        return dict(doc)
    finally:
        conn.close()


def test_two_workers_serve_sandboxes_of_both_providers(tmp_path: Path) -> None:
    with pair(tmp_path, with_local=True, workers=2) as p:
        key = p.broker.key("alice", "agent")
        a, b = _two_workers(p, key)
        try:
            # Through worker A: one sandbox of each provider.
            local = _ensure(a, "thr_local")
            hosted = _ensure(a, "thr_hosted", "hosted")
            assert local["binding"]["provider"] == "local"
            assert hosted["binding"]["provider"] == "hosted"
            # Both are served by the sandbox host's port, not the workers'.
            for grant in (local, hosted):
                assert f":{p.broker.port}/" not in grant["sandbox"]["http_base_url"]
            # The box is made in the background of the ensure: there once it is active.
            _wait_state(a, hosted["sandbox"]["id"], "active")
            boxes = [x for x in p.boxes() if str(x["name"]).endswith(hosted["sandbox"]["id"][3:])]
            assert len(boxes) == 1 and not [
                x for x in p.boxes() if str(x["name"]).endswith(local["sandbox"]["id"][3:])
            ]
            # An unknown provider is refused by a worker as by one process.
            status, err = a.call(
                "POST",
                "/v1/sandbox/sessions",
                {"thread_id": "thr_x", "mode": "ensure", "provider_preference": "elsewhere"},
            )
            assert status == 400 and err["error"]["metadata"]["configured"] == ["hosted", "local"]

            # Through worker B, which made neither: the same bindings, usable.
            for grant in (local, hosted):
                _wait_state(b, grant["sandbox"]["id"], "active")
            local_b = _ensure(b, "thr_local")
            hosted_b = _ensure(b, "thr_hosted")
            assert local_b["sandbox"]["id"] == local["sandbox"]["id"]
            assert hosted_b["sandbox"]["id"] == hosted["sandbox"]["id"]
            assert hosted_b["binding"]["provider"] == "hosted"
            out = _exec(hosted_b, "echo hosted > /workspace/w; cat /workspace/w")
            assert (out["stdout"], out["exit_code"]) == ("hosted\n", 0)
            out = _exec(local_b, "echo local")
            assert (out["stdout"], out["exit_code"]) == ("local\n", 0)
            # A's tokens and B's reach the same relay state (one process holds it).
            status_a = _exec(hosted, "cat /workspace/w")
            assert status_a["stdout"] == "hosted\n"

            # Suspend through worker B: the hosted provider cannot (refused, as by one
            # process), the local one can; ensure through A resumes it.
            status, err = b.call("POST", f"/v1/sandboxes/{hosted['sandbox']['id']}/suspend")
            assert status == 400 and "cannot suspend" in err["error"]["message"]
            status, snap = b.call("POST", f"/v1/sandboxes/{local['sandbox']['id']}/suspend")
            assert status == 200 and snap["state"] == "suspended", snap
            again = _ensure(a, "thr_local")
            assert again["sandbox"]["id"] == local["sandbox"]["id"]
            _wait_state(a, local["sandbox"]["id"], "active")
            assert _exec(again, "echo back")["stdout"] == "back\n"

            # Ending the hosted thread through B deletes the box at the service.
            status, _ = b.call("DELETE", f"/v1/sandboxes/{hosted['sandbox']['id']}?wait=true")
            assert status in (202, 204)
            deadline = time.monotonic() + 30
            while any(str(x["name"]).endswith(hosted["sandbox"]["id"][3:]) for x in p.boxes()):
                assert time.monotonic() < deadline
                time.sleep(0.1)
        finally:
            a.close()
            b.close()
        logs = "".join(p.broker.output)
        assert p.service_key not in logs
        assert "Traceback" not in logs
