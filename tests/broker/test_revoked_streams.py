"""An open event stream ends once the API key that opened it is revoked.

Against a real ``sandlot serve``: carol, a member of alice's scope, follows the
binding's events (and her own sandbox's); ``sandlot keys revoke``, run as its own
process while the server runs, revokes her key. Her key is refused on new calls, and
her open streams must end (with an ``error`` event, then cleanly) within about a
second, delivering nothing that happened after the revocation (alice refreshing).
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from tests.servers import SandlotServer, running

#: Generous: a stream must end within about a second of the revocation.
DEADLINE = 20.0


def cli(srv: SandlotServer, *args: str) -> str:
    argv = [sys.executable, "-m", "sandlot.cli.main", *args, "--data-dir", str(srv.data_dir)]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


def new_key(srv: SandlotServer, user: str) -> dict[str, str]:
    made = json.loads(cli(srv, "keys", "create", "--user", user, "--actor", "human", "--json"))
    return {"Authorization": f"Bearer {made['key']}"}


class Follower:
    """Reads an SSE stream in a thread: the events it delivered (with when), how it ended."""

    def __init__(self, url: str, headers: dict[str, str]) -> None:
        self.url = url
        self.headers = headers
        self.status: int | None = None
        self.events: list[tuple[float, dict[str, Any]]] = []
        #: The ``error`` event that ended the stream, if one did.
        self.error: dict[str, Any] | None = None
        self.ended: str | None = None
        self.opened = threading.Event()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()
        assert self.opened.wait(DEADLINE), "the stream never opened"
        assert self.status == 200, self.ended

    def _read(self) -> None:
        try:
            with httpx.stream("GET", self.url, headers=self.headers, timeout=None) as r:
                self.status = r.status_code
                self.opened.set()
                kind = ""
                for line in r.iter_lines():
                    if line.startswith("event:"):
                        kind = line[6:].strip()
                    elif line.startswith("data:") and kind == "error":
                        self.error = json.loads(line[5:])
                    elif line.startswith("data:"):
                        self.events.append((time.time(), json.loads(line[5:])))
            self.ended = "cleanly"
        except Exception as exc:  # how it ended is what the test looks at
            self.ended = repr(exc)
        finally:
            self.opened.set()

    def wait_ended(self, timeout: float) -> bool:
        self.thread.join(timeout)
        return not self.thread.is_alive()


def _ensure(srv: SandlotServer, headers: dict[str, str], thread: str) -> dict[str, Any]:
    r = httpx.post(
        f"{srv.url}/v1/sandbox/sessions",
        json={"thread_id": thread, "mode": "ensure"},
        headers=headers,
        timeout=60,
    )
    assert r.status_code == 200, r.text
    grant: dict[str, Any] = r.json()
    return grant


def test_revoking_a_key_ends_the_event_streams_it_opened(tmp_path: Path) -> None:
    with running(tmp_path / "data") as srv:
        alice, carol = new_key(srv, "alice"), new_key(srv, "carol")
        grant = _ensure(srv, alice, "thr_shared")
        session = grant["session_id"]
        r = httpx.post(
            f"{srv.url}/v1/sandbox/scopes/thread/thr_shared/members",
            json={"user_id": "carol"},
            headers=alice,
            timeout=30,
        )
        assert r.status_code in (200, 201), r.text
        own = httpx.post(f"{srv.url}/v1/sandboxes", json={}, headers=carol, timeout=60)
        assert own.status_code == 201, own.text
        own_id = own.json()["id"]

        binding = Follower(f"{srv.url}/v1/sandbox/sessions/{session}/events?after=0", carol)
        sandbox = Follower(f"{srv.url}/v1/sandboxes/{own_id}/events?after=0", carol)
        # Both streams are live: alice's refresh reaches carol's binding stream.
        r = httpx.post(f"{srv.url}/v1/sandbox/sessions/{session}/refresh", headers=alice)
        assert r.status_code == 200, r.text
        deadline = time.monotonic() + DEADLINE
        while not any(e["event_type"] == "binding.refreshed" for _, e in binding.events):
            assert time.monotonic() < deadline, binding.events
            time.sleep(0.05)

        cli(srv, "keys", "revoke", "--user", "carol")
        # Once carol's key is refused, the revocation has taken effect at the server.
        deadline = time.monotonic() + DEADLINE
        while httpx.get(f"{srv.url}/v1/sandboxes", headers=carol).status_code != 401:
            assert time.monotonic() < deadline, "the revoked key still works"
            time.sleep(0.05)
        refused = time.time()

        # What happens after the revocation must not reach carol's streams.
        for _ in range(3):
            r = httpx.post(f"{srv.url}/v1/sandbox/sessions/{session}/refresh", headers=alice)
            assert r.status_code == 200, r.text

        assert binding.wait_ended(DEADLINE), "the binding's stream stayed open"
        assert sandbox.wait_ended(DEADLINE), "the sandbox's stream stayed open"
        assert binding.ended == "cleanly", binding.ended
        assert sandbox.ended == "cleanly", sandbox.ended
        assert [e for t, e in binding.events if t > refused] == []
        assert [e for t, e in sandbox.events if t > refused] == []
        # Told why, as the SDK reads it (it raises Unauthenticated).
        for stream in (binding, sandbox):
            assert stream.error is not None and stream.error["code"] == "UNAUTHENTICATED"


def test_a_member_removed_from_a_scope_is_told_so_in_its_open_stream(tmp_path: Path) -> None:
    # Its stream ended by an error raised once the response had started: the server
    # logged "response already started" and the client read a cut chunked body.
    with running(tmp_path / "data") as srv:
        alice, carol = new_key(srv, "alice"), new_key(srv, "carol")
        session = _ensure(srv, alice, "thr_unshared")["session_id"]
        members = f"{srv.url}/v1/sandbox/scopes/thread/thr_unshared/members"
        r = httpx.post(members, json={"user_id": "carol"}, headers=alice, timeout=30)
        assert r.status_code in (200, 201), r.text
        stream = Follower(f"{srv.url}/v1/sandbox/sessions/{session}/events?after=0", carol)
        r = httpx.delete(f"{members}/carol", headers=alice, timeout=30)
        assert r.status_code == 204, r.text
        r = httpx.post(f"{srv.url}/v1/sandbox/sessions/{session}/refresh", headers=alice)
        assert r.status_code == 200, r.text
        assert stream.wait_ended(DEADLINE), "the stream stayed open"
        assert stream.ended == "cleanly", stream.ended
        assert stream.error is not None and stream.error["code"] == "FORBIDDEN", stream.error
        assert "response already started" not in "".join(srv.output)
