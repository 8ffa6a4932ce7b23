"""The generated sync client against a real server, background thread included."""

from __future__ import annotations

import threading
import time
import uuid

import pytest

from sandlot.protocol.errors import CommandExitError, SessionNotFound
from sandlot.sdk import Sandbox, Sandlot
from tests.servers import SandlotServer

pytestmark = pytest.mark.timeout(60)


def test_sync_client_end_to_end(server: SandlotServer, human_key: str) -> None:
    with Sandlot(server.url, human_key) as client:
        with pytest.raises(SessionNotFound):
            client.get(f"thr_{uuid.uuid4().hex[:8]}")
        sandbox = client.ensure(f"thr_{uuid.uuid4().hex[:8]}")
        assert isinstance(sandbox, Sandbox)
        assert sandbox.run("echo sync").stdout == "sync\n"
        with pytest.raises(CommandExitError):
            sandbox.run("exit 1")
        etag = sandbox.write("s.txt", "a\n")
        assert sandbox.read("s.txt").etag == etag
        assert [m.line for m in sandbox.grep("a", "/workspace/s.txt")] == [1]
        cmd = sandbox.stream("for i in 1 2 3; do echo $i; sleep 0.05; done")
        chunks = []
        for chunk in cmd:
            chunks.append(chunk.data)
            if len(chunks) == 1:
                cmd._ws.socket.shutdown(2)  # drop the connection under the client
        assert "".join(chunks) == "1\n2\n3\n" and cmd.reconnects >= 1
        with sandbox.shell("s") as sh:
            sh.send("echo sync-shell\n")
            assert "sync-shell" in sh.read_until("sync-shell")
        with sandbox.events(after=0, timeout=10) as events:
            first = next(iter(events))
        assert first.sequence == 1


def test_sync_background_refresh_runs_on_a_daemon_thread(
    server: SandlotServer, human_key: str
) -> None:
    with Sandlot(server.url, human_key) as client:
        sandbox = client.ensure(f"thr_{uuid.uuid4().hex[:8]}")
        threads = [t for t in threading.enumerate() if t.name.startswith("sandlot-lease-")]
        assert threads and all(t.daemon for t in threads)
        first = sandbox.grant.token
        deadline = time.monotonic() + 15
        while sandbox.grant.token == first and time.monotonic() < deadline:
            time.sleep(0.2)
        assert sandbox.grant.token != first
        assert sandbox.exec("echo fresh").stdout == "fresh\n"
    mine = f"sandlot-lease-{sandbox.grant.session_id}"
    assert not [t for t in threading.enumerate() if t.name == mine]
