"""``/api/v1/activity/stream`` when the workspace's log no longer holds its oldest events.

``sandlot web`` (local mode) over a dataplane keeping 5 events: a page opening the stream
from the start gets what the log still holds and then live events (it used to get 410 at
every attempt, and stayed ``reconnecting``); a cursor older than the log gets ``expired``.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from sandlot.broker.keys import KeyService
from sandlot.broker.store import Store
from sandlot.protocol.common import PrincipalType
from sandlot.web import activity
from sandlot.web.app import create_web_app
from sandlot.web.settings import WebSettings, WorkspaceMode
from tests.web.conftest import ThreadedServer, login_with_key


@pytest.fixture
def client(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[httpx.Client, str]]:
    monkeypatch.setenv("SANDLOT_DP_EVENT_RETENTION", "5")
    root = tmp_path / "folder"
    root.mkdir()
    store = Store(f"sqlite:///{tmp_path / 'keys.db'}")
    store.migrate()
    keys = KeyService(store)
    settings = WebSettings(
        mode=WorkspaceMode.LOCAL,
        root=root,
        local_users=frozenset({"ada"}),
        data_dir=tmp_path / "data",
    )
    server = ThreadedServer(create_web_app(settings, broker_url=None, authenticator=keys))
    server.start()
    key, _ = keys.create(user_id="ada", principal_type=PrincipalType.HUMAN)
    http, csrf, _ = login_with_key(server.url, key, [])
    try:
        yield http, csrf
    finally:
        http.close()
        server.stop()
        store.dispose()


def put(http: httpx.Client, csrf: str, path: str) -> None:
    r = http.put(
        "/api/file",
        params={"path": path},
        json={"content": path},
        headers={"Origin": str(http.base_url).rstrip("/"), "X-CSRF-Token": csrf},
    )
    assert r.status_code in (200, 201), r.text


def frames(http: httpx.Client, after: int, until: str, **params: Any) -> list[tuple[str, Any]]:
    """``(event, data)`` of the stream until a frame whose data holds ``until``."""
    seen: list[tuple[str, Any]] = []
    params = {"after": after, **params}
    with http.stream("GET", "/api/v1/activity/stream", params=params) as r:
        assert r.status_code == 200, r.read()
        buffer = ""
        for chunk in r.iter_text():
            buffer += chunk
            while "\n\n" in buffer:
                frame, buffer = buffer.split("\n\n", 1)
                fields = dict(
                    line.split(": ", 1)
                    for line in frame.split("\n")
                    if ": " in line and line[0] != ":"
                )
                if "event" in fields:
                    seen.append((fields["event"], fields.get("data")))
                    if until in (fields.get("data") or "") or fields["event"] == "expired":
                        return seen
    raise AssertionError(f"the stream ended early: {seen}")


def test_the_stream_from_the_start_opens_when_the_log_dropped_its_oldest_events(
    client: tuple[httpx.Client, str],
) -> None:
    http, csrf = client
    for i in range(12):
        put(http, csrf, f"old-{i:02d}.txt")
    later = threading.Timer(0.6, lambda: put(http, csrf, "live.txt"))
    later.start()
    try:
        got = frames(http, 0, "live.txt")
    finally:
        later.join()
    names = [e for e, _ in got]
    assert "ready" in names and names[-1] == "message", names
    held = [json.loads(d)["path"] for e, d in got[: names.index("ready")] if e == "message"]
    # What the log still holds (the newest of the old writes), then the live one.
    assert held and held[-1] == "old-11.txt" and "old-00.txt" not in held, held
    assert json.loads(got[-1][1])["path"] == "live.txt"


def test_a_cursor_older_than_the_log_gets_expired(client: tuple[httpx.Client, str]) -> None:
    http, csrf = client
    for i in range(12):
        put(http, csrf, f"old-{i:02d}.txt")
    assert frames(http, 1, "never") == [("expired", "{}")]


def test_a_tail_sends_only_the_latest_of_the_backlog(client: tuple[httpx.Client, str]) -> None:
    http, csrf = client
    for i in range(4):
        put(http, csrf, f"old-{i:02d}.txt")
    later = threading.Timer(0.6, lambda: put(http, csrf, "live.txt"))
    later.start()
    try:
        got = frames(http, 0, "live.txt", tail=2)
    finally:
        later.join()
    names = [e for e, _ in got]
    held = [json.loads(d)["path"] for e, d in got[: names.index("ready")] if e == "message"]
    # The log's last two events only (of the last writes), in order; then live events.
    assert len(held) <= 2 and held[-1] == "old-03.txt", held
    assert "old-00.txt" not in held and "old-01.txt" not in held, held
    assert json.loads(got[-1][1])["path"] == "live.txt"
    # Nothing of the backlog with tail=0; a tail out of bounds is the browser's mistake.
    got = frames(http, 0, "", tail=0)
    assert got[0][0] == "ready", got
    r = http.get("/api/v1/activity/stream", params={"after": 0, "tail": 10_001})
    assert r.status_code == 400 and r.json()["error"]["code"] == "INVALID_REQUEST", r.text


def test_the_stream_is_ready_when_the_dataplane_says_its_backlog_is_through(
    client: tuple[httpx.Client, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``ready`` follows the backlog at once: the dataplane says where it ends (``: live``).
    It used to wait for a pause in the events, so a busy workspace's page stayed
    ``connecting``; the pause is made a minute long here, so only the dataplane's word can
    make the stream ready in time."""
    monkeypatch.setattr(activity, "SETTLE_SECONDS", 60.0)
    http, csrf = client
    for i in range(3):
        put(http, csrf, f"old-{i:02d}.txt")
    got: list[str] = []
    params = {"after": 0, "tail": 2}
    with http.stream("GET", "/api/v1/activity/stream", params=params, timeout=20) as r:
        assert r.status_code == 200, r.read()
        buffer = ""
        for chunk in r.iter_text():
            buffer += chunk
            while "\n\n" in buffer:
                frame, buffer = buffer.split("\n\n", 1)
                got += [line[7:] for line in frame.split("\n") if line.startswith("event: ")]
            if "ready" in got:
                break
    assert got[-1] == "ready" and got.count("message") == 2, got
