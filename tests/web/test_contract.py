"""The workspace routes' contract, the same in both modes.

``local``: the web app in this process (uvicorn on loopback, in a thread) over a temporary
folder, served by its own loopback dataplane. ``sandbox``: a real ``sandlot serve``
(isolated sandboxes where the tests run as root), the web app reaching the thread's
sandbox through the broker's grant and the gateway, over real sockets. Either way a
browser signs in through the real auth routes with a real API key and sends the CSRF
token; the suite checks the golden shapes of every route, the error shapes, hostile file
names returned as data, the path-escape corpus of docs/TESTING.md (0 escapes), an etag
conflict (412), CSRF (403), and that no credential reaches any body or log line.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from sandlot.broker.keys import KeyService
from sandlot.broker.store import Store
from sandlot.protocol.common import PrincipalType
from sandlot.sdk import Sandlot
from sandlot.web.app import create_web_app
from sandlot.web.limits import RouteLimits
from sandlot.web.settings import WebSettings, WorkspaceMode
from tests.dataplane.test_security import ESCAPES
from tests.figures import RecordProperty, report
from tests.servers import SandlotServer
from tests.web.conftest import ThreadedServer, login_with_key

THREAD = "thr_contract"
SECRET = "TOP-SECRET-SENTINEL-WEB"
HOSTILE = "<script>alert(1)<b>\x1b[31mred&.txt"
#: A hard link is the file itself: whoever made it could write both places, and reading it
#: through the workspace reads the workspace's own file (the dataplane's suite shows a
#: sandbox user cannot read one to a file it may not read). Left out here.
CORPUS = [p for p in ESCAPES if p != "hardlink"] + [
    "..",
    "a/../..",
    "out_etc/passwd",
    "out_etc",
    "\\..\\..\\etc\\passwd",
    "./../outside/sentinel",
]
JWT = re.compile(r"eyJ[A-Za-z0-9_-]{4,}\.[A-Za-z0-9_-]{4,}\.")
ENVELOPE = {"code", "message", "retryable", "request_id", "domain", "metadata"}
TREE_MAX_NODES = 50
#: Budgets of the walking routes no test here exhausts: the corpus alone walks hundreds
#: of times (their limits are tests/web/test_limits.py's).
WALKS = {f"SANDLOT_WEB_{name}": "100000" for name in ("TREE_BURST", "SEARCH_BURST")}


# --- the two modes --------------------------------------------------------------------


class Collected(logging.Handler):
    """Every log line of the process, and those a server shows (INFO and above, or any of
    sandlot's): the test's own HTTP client logs the cookies it gets at DEBUG."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []
        self.served: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        line = self.format(record)
        self.lines.append(line)
        if record.levelno >= logging.INFO or record.name.startswith("sandlot"):
            self.served.append(line)


@dataclass
class Browser:
    """One signed-in browser, and what the test needs to know of its workspace."""

    mode: str
    base: str
    client: httpx.Client
    csrf: str
    #: Runs a shell command in the workspace's root (set-up only, never through the routes).
    run: Callable[[str], None]
    #: Signs another user in (a new browser).
    sign_in: Callable[[str], Browser]
    #: The host directory holding the sentinel, outside every workspace.
    outside: Path
    #: Strings that must appear in no answer (upstream URLs).
    hidden: list[str]
    #: Credentials (API keys, dataplane tokens): in no body, no log line.
    secrets: list[str]
    #: Session cookies: in no body, no line the server logs.
    cookies: list[str]
    #: (every log line, the lines the server shows)
    logs: Callable[[], tuple[list[str], list[str]]]
    #: Writes a file as an agent (``None`` where no agent reaches the workspace).
    agent_write: Callable[[str, str], None] | None = None
    bodies: list[str] = field(default_factory=list)

    def request(
        self,
        method: str,
        path: str,
        params: dict[str, Any] | None = None,
        *,
        json: Any = None,
        headers: dict[str, str] | None = None,
        csrf: bool = True,
        content: bytes | None = None,
    ) -> httpx.Response:
        sent = {"Origin": self.base}
        if csrf and method not in ("GET", "HEAD"):
            sent["X-CSRF-Token"] = self.csrf
        r = self.client.request(
            method,
            path,
            params={"thread": THREAD, **(params or {})},
            json=json,
            content=content,
            headers={**sent, **(headers or {})},
        )
        self.bodies.append(r.text)
        return r

    def get(self, route: str, **params: Any) -> httpx.Response:
        return self.request("GET", route, params)

    def ok(self, method: str, path: str, params: dict[str, Any] | None = None, **kw: Any) -> Any:
        r = self.request(method, path, params, **kw)
        assert r.status_code in (200, 201), (method, path, params, r.status_code, r.text)
        assert r.headers["content-type"] == "application/json"
        assert r.headers["x-content-type-options"] == "nosniff"
        return r.json()

    def put_file(self, path: str, content: str) -> None:
        self.ok("PUT", "/api/file", {"path": path}, json={"content": content})

    def activity(self, after: int = 0) -> tuple[list[dict[str, Any]], int]:
        """Every event after ``after`` (page by page), and the cursor past them."""
        events: list[dict[str, Any]] = []
        while True:
            page = self.ok("GET", "/api/v1/activity", {"after": after, "limit": 1000})
            events += page["events"]
            after = page["next_after"]
            if not page["has_more"]:
                return events, after


def _local(tmp: Path, outside: Path) -> Iterator[Browser]:
    root = tmp / "folder"
    root.mkdir()
    store = Store(f"sqlite:///{tmp / 'keys.db'}")
    store.migrate()
    keys = KeyService(store)
    settings = WebSettings(
        mode=WorkspaceMode.LOCAL,
        root=root,
        local_users=frozenset({"ada"}),
        data_dir=tmp / "data",
        tree_max_nodes=TREE_MAX_NODES,
        route_limits=RouteLimits(tree_burst=100_000, search_burst=100_000),
    )
    collected = Collected()
    rootlog = logging.getLogger()
    level = rootlog.level
    rootlog.addHandler(collected)
    rootlog.setLevel(logging.DEBUG)
    server = ThreadedServer(create_web_app(settings, broker_url=None, authenticator=keys))
    server.start()
    secrets: list[str] = []
    cookies: list[str] = []
    clients: list[httpx.Client] = []

    def sign_in(user: str) -> Browser:
        key, _ = keys.create(user_id=user, principal_type=PrincipalType.HUMAN)
        bodies: list[str] = []
        client, csrf, cookie = login_with_key(server.url, key, bodies)
        clients.append(client)
        secrets.append(key)
        cookies.append(cookie)
        return Browser(
            mode="local",
            base=server.url,
            client=client,
            csrf=csrf,
            run=lambda cmd: subprocess.run(["sh", "-c", cmd], cwd=root, check=True),
            sign_in=sign_in,
            outside=outside,
            hidden=[str(root)],
            secrets=secrets,
            cookies=cookies,
            logs=lambda: (collected.lines, collected.served),
            bodies=bodies,
        )

    try:
        browser = sign_in("ada")
        workspaces = server.server.config.app.state.web.workspaces
        browser.hidden.append(f"127.0.0.1:{workspaces.plane.port}")
        yield browser
    finally:
        for client in clients:
            client.close()
        server.stop()
        rootlog.removeHandler(collected)
        rootlog.setLevel(level)
        store.dispose()


def _sandbox(tmp: Path, outside: Path) -> Iterator[Browser]:
    server = SandlotServer(
        tmp / "d", env={"SANDLOT_WEB_TREE_MAX_NODES": str(TREE_MAX_NODES), **WALKS}
    ).start()
    secrets: list[str] = []
    cookies: list[str] = []
    clients: list[Any] = []
    human = Sandlot(server.url, server.key("ada"), auto_refresh=False)
    agent = Sandlot(server.url, server.key("ada", "agent"), auto_refresh=False)
    clients += [human, agent]
    sandbox = human.ensure(THREAD)
    agent_box = agent.ensure(THREAD)

    def sign_in(user: str) -> Browser:
        key = server.key(user)
        bodies: list[str] = []
        client, csrf, cookie = login_with_key(server.url, key, bodies)
        clients.append(client)
        secrets.append(key)
        cookies.append(cookie)
        return Browser(
            mode="sandbox",
            base=server.url,
            client=client,
            csrf=csrf,
            run=lambda cmd: sandbox.run(cmd, cwd="/workspace") and None,
            sign_in=sign_in,
            outside=outside,
            hidden=[f"{server.url}/dp", "/dp/sb_"],
            secrets=secrets,
            cookies=cookies,
            logs=lambda: ("".join(server.output).splitlines(),) * 2,
            agent_write=lambda path, text: agent_box.write(f"/workspace/{path}", text) and None,
            bodies=bodies,
        )

    try:
        secrets += [sandbox.grant.token, agent_box.grant.token]
        yield sign_in("ada")
    finally:
        for client in clients:
            client.close()
        server.stop()
        server.cleanup()


@pytest.fixture(scope="module", params=["local", "sandbox"])
def browser(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    tmp = tmp_path_factory.mktemp(f"contract-{request.param}")
    outside = tmp / "outside"
    outside.mkdir()
    (outside / "sentinel").write_text(SECRET)
    make = _local if request.param == "local" else _sandbox
    yield from make(tmp, outside)


def envelope(r: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert r.status_code == status, (r.status_code, r.text)
    assert r.headers["content-type"] == "application/json"
    error = r.json()["error"]
    assert set(error) == ENVELOPE
    assert error["code"] == code, error
    assert error["domain"] == "sandlot" and isinstance(error["message"], str)
    assert "Traceback" not in r.text
    return dict(error)


def _kinds(entry: dict[str, Any]) -> None:
    assert isinstance(entry["name"], str) and isinstance(entry["path"], str)
    assert isinstance(entry["is_dir"], bool)
    if entry["is_dir"]:
        assert set(entry) <= {"name", "path", "is_dir", "children"}
    else:
        assert set(entry) == {"name", "path", "is_dir", "size"}
        assert isinstance(entry["size"], int)


# --- golden shapes --------------------------------------------------------------------


def test_tree_lists_directories_first_then_names_case_insensitively(browser: Browser) -> None:
    for name in ("tree/b.txt", "tree/A.md", "tree/_x", "tree/c/f", "tree/Z/f", "tree/a/f"):
        browser.put_file(name, "x")
    tree = browser.ok("GET", "/api/tree", {"path": "tree"})
    assert set(tree) == {"entries", "path"} and tree["path"] == "tree"
    assert [e["name"] for e in tree["entries"]] == ["a", "c", "Z", "_x", "A.md", "b.txt"]
    for entry in tree["entries"]:
        _kinds(entry)
        assert entry["path"] == f"tree/{entry['name']}"
    assert tree["entries"][-1]["size"] == 1

    deep = browser.ok("GET", "/api/tree", {"path": "tree", "depth": 2})
    first = deep["entries"][0]
    assert first["name"] == "a" and first["children"] == [
        {"name": "f", "path": "tree/a/f", "is_dir": False, "size": 1}
    ]
    root = browser.ok("GET", "/api/tree", {"path": "."})
    assert root["path"] == "." and "tree" in [e["name"] for e in root["entries"]]
    assert browser.ok("GET", "/api/tree", {"path": "tree/../tree/./c"})["entries"] == [
        {"name": "f", "path": "tree/c/f", "is_dir": False, "size": 1}
    ]
    # A directory reached through a symlink is listed under the name it was asked by.
    browser.run("ln -s tree/c linked")
    assert browser.ok("GET", "/api/tree", {"path": "linked"})["entries"] == [
        {"name": "f", "path": "linked/f", "is_dir": False, "size": 1}
    ]


def test_tree_beyond_its_bounds_is_a_marked_partial_listing(browser: Browser) -> None:
    browser.run("mkdir -p big && for i in $(seq 1 60); do : > big/f$i; done")
    tree = browser.ok("GET", "/api/tree", {"path": "big"})
    assert tree["truncated"] is True and len(tree["entries"]) == TREE_MAX_NODES
    envelope(browser.get("/api/tree", path=".", depth=99), 400, "INVALID_REQUEST")
    envelope(browser.get("/api/tree", path=".", depth="two"), 400, "INVALID_REQUEST")
    envelope(browser.get("/api/tree", path="tree/b.txt"), 400, "INVALID_REQUEST")
    envelope(browser.get("/api/tree", path="missing"), 404, "FILE_NOT_FOUND")


def test_file_read_write_delete(browser: Browser) -> None:
    assert browser.ok("PUT", "/api/file", {"path": "f/one.txt"}, json={"content": "héllo\n"}) == {
        "success": True,
        "path": "f/one.txt",
    }
    assert browser.ok("GET", "/api/file", {"path": "f/one.txt"}) == {
        "content": "héllo\n",
        "path": "f/one.txt",
    }
    envelope(browser.get("/api/file", path="f"), 400, "INVALID_REQUEST")
    envelope(browser.get("/api/file", path="f/none.txt"), 404, "FILE_NOT_FOUND")
    envelope(browser.get("/api/file"), 400, "INVALID_REQUEST")
    assert browser.ok("DELETE", "/api/file", {"path": "f/one.txt"}) == {
        "success": True,
        "path": "f/one.txt",
    }
    envelope(browser.request("DELETE", "/api/file", {"path": "f/one.txt"}), 404, "FILE_NOT_FOUND")
    envelope(browser.request("DELETE", "/api/file", {"path": "."}), 400, "INVALID_REQUEST")
    # Client mistakes are 4xx, never 5xx.
    for body in (b"{", b"[1]", b'{"content": 3}', b"{}"):
        r = browser.request(
            "PUT",
            "/api/file",
            {"path": "f/x"},
            content=body,
            headers={"Content-Type": "application/json"},
        )
        envelope(r, 400, "INVALID_REQUEST")


def test_rename_and_move(browser: Browser) -> None:
    browser.put_file("mv/a.txt", "a")
    browser.put_file("mv/b.txt", "b")
    browser.put_file("mv/dir/keep", "k")
    assert browser.ok(
        "POST", "/api/file/rename", json={"old_path": "mv/a.txt", "new_path": "mv/c.txt"}
    ) == {"success": True, "old_path": "mv/a.txt", "new_path": "mv/c.txt"}
    r = browser.request(
        "POST", "/api/file/rename", json={"old_path": "mv/c.txt", "new_path": "mv/b.txt"}
    )
    envelope(r, 409, "CONFLICT")
    assert browser.ok("GET", "/api/file", {"path": "mv/b.txt"})["content"] == "b"
    r = browser.request(
        "POST", "/api/file/rename", json={"old_path": "mv/none", "new_path": "mv/x"}
    )
    envelope(r, 404, "FILE_NOT_FOUND")
    assert browser.ok(
        "POST", "/api/file/move", json={"src_path": "mv/c.txt", "dest_dir": "mv/dir"}
    ) == {"success": True, "old_path": "mv/c.txt", "dest_path": "mv/dir/c.txt"}
    browser.put_file("mv/c.txt", "again")
    r = browser.request(
        "POST", "/api/file/move", json={"src_path": "mv/c.txt", "dest_dir": "mv/dir"}
    )
    envelope(r, 409, "CONFLICT")
    r = browser.request(
        "POST", "/api/file/move", json={"src_path": "mv/c.txt", "dest_dir": "mv/b.txt"}
    )
    envelope(r, 400, "INVALID_REQUEST")
    r = browser.request("POST", "/api/file/move", json={"src_path": "mv/c.txt", "dest_dir": "nope"})
    envelope(r, 404, "FILE_NOT_FOUND")
    envelope(
        browser.request("POST", "/api/file/move", json={"src_path": 1}), 400, "INVALID_REQUEST"
    )


def test_search_matches_names_case_insensitively(browser: Browser) -> None:
    for name in ("s/Main.PY", "s/lib/util.py", "s/lib/readme.md", "s/py/x.txt"):
        browser.put_file(name, "x")
    found = browser.ok("GET", "/api/search", {"q": "*.py", "path": "s"})
    assert set(found) == {"results", "pattern", "path"}
    assert found["pattern"] == "*.py" and found["path"] == "s"
    assert found["results"] == [
        {"name": "util.py", "path": "s/lib/util.py", "dir": "s/lib"},
        {"name": "Main.PY", "path": "s/Main.PY", "dir": "s"},
    ]
    dirs = browser.ok("GET", "/api/search", {"q": "P?", "path": "s"})["results"]
    assert dirs == [{"name": "py", "path": "s/py", "dir": "s"}]
    envelope(browser.get("/api/search", path="s"), 400, "INVALID_REQUEST")


def test_git_outside_a_repository(browser: Browser) -> None:
    assert browser.ok("GET", "/api/git/status") == {"is_repo": False, "files": []}
    diff = browser.ok("GET", "/api/git/diff", {"path": "tree/b.txt"})
    assert diff["diff"] == "" and diff["path"] == "tree/b.txt" and "error" in diff
    assert browser.ok("GET", "/api/git/show", {"path": "tree/b.txt"}) == {
        "content": None,
        "path": "tree/b.txt",
        "error": "Not in HEAD",
    }


def test_git_status_diff_show(browser: Browser) -> None:
    browser.put_file("g/tracked.txt", "one\n")
    browser.put_file("g/gone.txt", "bye\n")
    browser.run(
        "git init -q . && git add -A && "
        "git -c user.email=t@example.com -c user.name=t commit -qm init"
    )
    browser.put_file("g/tracked.txt", "one\ntwo\n")
    browser.put_file("g/new.txt", "new\n")
    browser.ok("DELETE", "/api/file", {"path": "g/gone.txt"})
    status = browser.ok("GET", "/api/git/status")
    assert status["is_repo"] is True and status["available"] is True
    files = status["files"]
    assert files["g/tracked.txt"] == "M" and files["g/gone.txt"] == "D"
    assert files["g/new.txt"] == "U"
    assert set(files.values()) <= set("MADUC")
    diff = browser.ok("GET", "/api/git/diff", {"path": "g/tracked.txt"})
    assert set(diff) == {"diff", "path"} and "+two" in diff["diff"]
    assert browser.ok("GET", "/api/git/show", {"path": "g/tracked.txt"}) == {
        "content": "one\n",
        "path": "g/tracked.txt",
    }
    assert browser.ok("GET", "/api/git/show", {"path": "g/new.txt"})["content"] is None
    # A path that is pathspec magic to git is a plain name here.
    assert browser.ok("GET", "/api/git/diff", {"path": ":(top)*"})["diff"] == ""

    against = browser.ok("GET", "/api/v1/file/diff", {"path": "g/tracked.txt"})
    keys = {"path", "base", "is_repo", "in_head", "binary", "diff", "last_agent_change"}
    assert set(against) == keys
    assert against["base"] == "HEAD" and against["in_head"] is True and "+two" in against["diff"]
    new = browser.ok("GET", "/api/v1/file/diff", {"path": "g/new.txt"})
    assert new["in_head"] is False and "+new" in new["diff"]
    if browser.agent_write is not None:
        browser.agent_write("g/tracked.txt", "one\nagent\n")
        against = browser.ok("GET", "/api/v1/file/diff", {"path": "g/tracked.txt"})
        change = against["last_agent_change"]
        assert change["actor"]["type"] == "agent" and change["path"] == "g/tracked.txt"
        assert "+agent" in against["diff"]
    else:
        assert against["last_agent_change"] is None


def test_versioned_file_and_etag_conflict(browser: Browser) -> None:
    created = browser.request(
        "PUT",
        "/api/v1/file",
        {"path": "v/doc.txt"},
        json={"content": "v1"},
        headers={"If-None-Match": "*"},
    )
    assert created.status_code == 201, created.text
    assert set(created.json()) == {"path", "etag", "created"}
    first = browser.request("GET", "/api/v1/file", {"path": "v/doc.txt"})
    body = first.json()
    assert set(body) == {"path", "content", "encoding", "etag", "size"}
    assert body["content"] == "v1" and body["etag"] == created.json()["etag"]
    assert first.headers["etag"] == f'"{body["etag"]}"'
    etag = body["etag"]
    second = browser.ok(
        "PUT",
        "/api/v1/file",
        {"path": "v/doc.txt"},
        json={"content": "v2"},
        headers={"If-Match": f'"{etag}"'},
    )
    assert second["created"] is False and second["etag"] != etag
    # The other party's write with the etag it read before: 412, and nothing changes.
    stale = browser.request(
        "PUT",
        "/api/v1/file",
        {"path": "v/doc.txt"},
        json={"content": "lost"},
        headers={"If-Match": f'"{etag}"'},
    )
    error = envelope(stale, 412, "PRECONDITION_FAILED")
    assert error["metadata"]["etag"] == second["etag"]
    assert browser.ok("GET", "/api/file", {"path": "v/doc.txt"})["content"] == "v2"
    again = browser.request(
        "PUT",
        "/api/v1/file",
        {"path": "v/doc.txt"},
        json={"content": "x"},
        headers={"If-None-Match": "*"},
    )
    envelope(again, 412, "PRECONDITION_FAILED")
    r = browser.request(
        "PUT",
        "/api/v1/file",
        {"path": "v/doc.txt"},
        json={"content": "x"},
        headers={"If-Match": 'W/"x"'},
    )
    envelope(r, 400, "INVALID_REQUEST")


def test_grep_and_activity(browser: Browser) -> None:
    _, cursor = browser.activity()
    browser.put_file("act/notes.md", "alpha\nneedle here\nomega\n")
    found = browser.ok("GET", "/api/v1/grep", {"q": "needle", "path": "act"})
    assert found == {
        "matches": [{"path": "act/notes.md", "line": 2, "text": "needle here"}],
        "truncated": False,
        "query": "needle",
        "path": "act",
    }
    page = browser.ok("GET", "/api/v1/activity", {"after": cursor, "limit": 1000})
    assert set(page) == {"events", "after", "next_after", "has_more"}
    assert page["after"] == cursor and page["next_after"] > cursor
    mine = [e for e in page["events"] if e.get("path") == "act/notes.md"]
    assert mine, page
    event = mine[-1]
    assert set(event) >= {"sequence", "event_type", "timestamp", "actor", "details", "path"}
    assert event["actor"]["type"] == "human" and "ada" in event["actor"]["id"]
    assert event["details"]["fs"]["op"] in ("created", "modified")
    # The server's own git commands are not the workspace's activity.
    assert not [e for e in page["events"] if "web-git-" in str(e["details"])]
    later = browser.ok("GET", "/api/v1/activity", {"after": page["next_after"]})
    assert all(e["sequence"] > page["next_after"] for e in later["events"])
    small = browser.ok("GET", "/api/v1/activity", {"after": 0, "limit": 1})
    assert small["has_more"] is True and small["next_after"] >= 1
    envelope(browser.get("/api/v1/activity", after=-1), 400, "INVALID_REQUEST")
    envelope(browser.get("/api/v1/activity", limit=0), 400, "INVALID_REQUEST")
    envelope(browser.get("/api/v1/grep", path="act"), 400, "INVALID_REQUEST")


def test_capabilities(browser: Browser) -> None:
    caps = browser.ok("GET", "/api/capabilities")
    assert set(caps) == {"version", "mode", "features", "routers"}
    assert caps["mode"] == browser.mode
    assert caps["features"]["files"] is True and caps["features"]["git"] is True
    for router in caps["routers"]:
        assert set(router) == {"name", "prefix", "description", "enabled"}


def _stream_events(browser: Browser, after: int, until: Callable[[list[Any]], bool]) -> list[Any]:
    """Reads ``/api/v1/activity/stream`` until ``until(frames)``: ``(event, id, data)``."""
    frames: list[Any] = []
    params = {"thread": THREAD, "after": after}
    with browser.client.stream("GET", "/api/v1/activity/stream", params=params) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
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
                    frames.append((fields["event"], fields.get("id"), fields.get("data")))
            if until(frames):
                return frames
    raise AssertionError(f"the stream ended early: {frames}")


def test_activity_stream_sends_the_log_then_live_events(browser: Browser) -> None:
    import json as jsonlib
    import threading

    _, cursor = browser.activity()
    browser.put_file("live/before.txt", "1")
    later = threading.Timer(0.6, lambda: browser.put_file("live/after.txt", "2"))
    later.start()
    try:
        frames = _stream_events(
            browser,
            cursor,
            lambda fs: any(e == "message" and "live/after.txt" in str(d) for e, _, d in fs),
        )
    finally:
        later.join()
    names = [e for e, _, _ in frames]
    assert "ready" in names
    ready = names.index("ready")
    events = [(e, i, jsonlib.loads(d)) for e, i, d in frames if e == "message"]
    before = [ev for _, _, ev in events if ev.get("path") == "live/before.txt"]
    after = [ev for _, _, ev in events if ev.get("path") == "live/after.txt"]
    assert before and after
    # What the log held comes before "ready", what happened later after it.
    assert frames.index(next(f for f in frames if "live/after.txt" in str(f[2]))) > ready
    assert all(int(i) == ev["sequence"] and ev["sequence"] > cursor for _, i, ev in events)
    assert set(after[-1]) >= {"sequence", "event_type", "timestamp", "actor", "details", "path"}
    envelope(browser.get("/api/v1/activity/stream", after=-1), 400, "INVALID_REQUEST")


def test_workspaces_list_the_users_threads_and_sandboxes(browser: Browser) -> None:
    listed = browser.ok("GET", "/api/v1/workspaces")
    assert listed["mode"] == browser.mode
    entries = listed["workspaces"]
    assert entries
    for entry in entries:
        keys = {"id", "thread", "sandbox", "name", "state", "template", "created_at", "attached"}
        assert set(entry) == keys
    if browser.mode == "sandbox":
        mine = [e for e in entries if e["thread"] == THREAD]
        assert mine and mine[0]["sandbox"].startswith("sb") and mine[0]["template"]
    else:
        assert entries[0]["id"] == "local" and entries[0]["template"] == "local"
    with httpx.Client(base_url=browser.base) as anonymous:
        envelope(anonymous.get("/api/v1/workspaces"), 401, "UNAUTHENTICATED")


def test_only_a_creating_post_makes_a_threads_sandbox(browser: Browser) -> None:
    """Opening a workspace never creates one (a link, or another site sending the browser
    to one, would make sandboxes in the visitor's account): a thread with no sandbox is
    ``null`` on ``GET /api/v1/workspace`` and 404 on every other route until ``POST
    /api/v1/workspace`` (origin and CSRF token checked) makes it."""
    opened = browser.ok("GET", "/api/v1/workspace")
    assert opened["mode"] == browser.mode
    if browser.mode == "local":
        # One folder: ``?thread=`` is ignored, and there is nothing to create.
        assert opened["workspace"] == {"id": "local", "thread": None, "sandbox": None}
        fresh = {"thread": "thr_never_made"}
        assert browser.ok("GET", "/api/v1/workspace", fresh) == opened
        assert browser.ok("POST", "/api/v1/workspace", fresh) == opened
        return
    assert opened["workspace"]["thread"] == THREAD
    assert opened["workspace"]["sandbox"].startswith("sb_")
    thread = f"thr_fresh_{os.urandom(3).hex()}"
    fresh = {"thread": thread}

    def listed() -> set[str | None]:
        return {e["thread"] for e in browser.ok("GET", "/api/v1/workspaces")["workspaces"]}

    assert browser.ok("GET", "/api/v1/workspace", fresh) == {"workspace": None, "mode": "sandbox"}
    for route in ("/api/tree", "/api/v1/activity", "/api/git/status"):
        error = envelope(browser.request("GET", route, {**fresh, "path": "."}), 404, "NOT_FOUND")
        assert error["metadata"] == {"workspace": thread, "creatable": True}
    envelope(browser.request("POST", "/api/v1/workspace", fresh, csrf=False), 403, "FORBIDDEN")
    foreign = {"Origin": "https://elsewhere.example"}
    r = browser.request("POST", "/api/v1/workspace", fresh, headers=foreign)
    envelope(r, 403, "FORBIDDEN")
    assert thread not in listed()
    made = browser.ok("POST", "/api/v1/workspace", fresh)["workspace"]
    assert made["thread"] == thread and made["sandbox"].startswith("sb_")
    assert thread in listed()
    # Made once: the next POST, and every route, open the same sandbox.
    assert browser.ok("POST", "/api/v1/workspace", fresh)["workspace"] == made
    assert browser.ok("GET", "/api/v1/workspace", fresh)["workspace"] == made
    assert "entries" in browser.ok("GET", "/api/tree", {**fresh, "path": "."})
    # Another user's thread is theirs: neither opened nor made for someone else.
    bob = browser.sign_in("bob")
    for method in ("GET", "POST"):
        envelope(bob.request(method, "/api/v1/workspace", fresh), 403, "FORBIDDEN")


def test_download_archive_and_upload(browser: Browser) -> None:
    import io
    import tarfile

    browser.put_file("dl/a.txt", "alpha\n")
    browser.put_file("dl/sub/b.txt", "beta\n")
    r = browser.request("GET", "/api/v1/download", {"path": "dl/a.txt"})
    assert r.status_code == 200 and r.content == b"alpha\n"
    assert r.headers["content-disposition"].startswith("attachment;")
    r = browser.request("GET", "/api/v1/archive", {"path": "dl"})
    assert r.status_code == 200 and r.headers["content-type"] == "application/gzip"
    with tarfile.open(fileobj=io.BytesIO(r.content), mode="r:gz") as tar:
        names = {m.name.lstrip("./") for m in tar.getmembers() if m.isfile()}
    assert {"a.txt", "sub/b.txt"} <= names, names
    envelope(browser.get("/api/v1/download", path="dl"), 400, "INVALID_REQUEST")
    envelope(browser.get("/api/v1/archive", path="dl/a.txt"), 400, "INVALID_REQUEST")
    envelope(browser.get("/api/v1/download", path="dl/none"), 404, "FILE_NOT_FOUND")
    envelope(browser.get("/api/v1/download", path="../x"), 400, "INVALID_REQUEST")
    body = bytes(range(256)) * 64
    r = browser.request("POST", "/api/v1/upload", {"path": "up/deep/blob.bin"}, content=body)
    assert r.status_code == 201, r.text
    assert r.json()["path"] == "up/deep/blob.bin"
    r = browser.request("GET", "/api/v1/download", {"path": "up/deep/blob.bin"})
    assert r.content == body
    refused = browser.request("POST", "/api/v1/upload", {"path": "up/x"}, content=b"x", csrf=False)
    assert refused.status_code == 403


def test_the_page_is_served_with_a_strict_policy(browser: Browser) -> None:
    page = browser.client.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    csp = page.headers["content-security-policy"]
    assert "script-src 'self';" in csp and "connect-src 'self'" in csp and "unsafe" not in csp
    nonce = csp.split("'nonce-", 1)[1].split("'", 1)[0]
    assert f'content="{nonce}"' in page.text and "__CSP_NONCE__" not in page.text
    assert nonce not in browser.client.get("/").text
    script = browser.client.get("/assets/app.js", headers={"Accept-Encoding": "gzip"})
    assert script.status_code == 200 and script.headers["content-type"].startswith(
        "text/javascript"
    )
    again = browser.client.get("/assets/app.js", headers={"If-None-Match": script.headers["etag"]})
    assert again.status_code == 304
    assert script.headers["cache-control"] == "no-cache"
    # The chunks the page loads later (the editor) are named by their content: kept for good.
    chunks = re.findall(r'import\("\./(chunk-[A-Z0-9]+\.js)"\)', script.text)
    assert chunks, "the page's script loads no chunk"
    for name in sorted(set(chunks)):
        chunk = browser.client.get(f"/assets/{name}")
        assert chunk.status_code == 200, name
        assert "immutable" in chunk.headers["cache-control"], chunk.headers
    assert browser.client.get("/assets/nothing.js").status_code == 404
    # Browsers ask for an icon beside JSON answers: nothing, without an error.
    assert browser.client.get("/favicon.ico").status_code == 204


# --- hostile names, errors, CSRF ------------------------------------------------------


def test_hostile_file_names_are_data(browser: Browser) -> None:
    name = f"hostile/{HOSTILE}"
    content = "<script>alert('content')</script>\x1b]0;title\x07"
    _, cursor = browser.activity()
    browser.put_file(name, content)
    answers = [
        browser.request("GET", "/api/tree", {"path": "hostile"}),
        browser.request("GET", "/api/search", {"q": "*script*", "path": "hostile"}),
        browser.request("GET", "/api/file", {"path": name}),
        browser.request("GET", "/api/v1/grep", {"q": "alert", "path": "hostile"}),
        browser.request("GET", "/api/v1/activity", {"after": cursor, "limit": 1000}),
    ]
    for r in answers:
        assert r.status_code == 200, r.text
        assert r.headers["content-type"] == "application/json"
        assert r.headers["x-content-type-options"] == "nosniff"
        for raw in (b"<", b">", b"\x1b", b"\x07"):
            assert raw not in r.content
    tree, search, file, grep, activity = (r.json() for r in answers)
    size = len(content.encode())
    assert tree["entries"] == [{"name": HOSTILE, "path": name, "is_dir": False, "size": size}]
    assert search["results"][0]["name"] == HOSTILE
    assert file["content"].startswith("<script>") and file["content"].endswith("\x07")
    assert grep["matches"][0]["path"] == name
    assert name in [e.get("path") for e in activity["events"]]


def test_errors_are_envelopes_with_the_browsers_request_id(browser: Browser) -> None:
    r = browser.request(
        "GET", "/api/file", {"path": "nope"}, headers={"X-Request-Id": "req_browser_1"}
    )
    error = envelope(r, 404, "FILE_NOT_FOUND")
    assert error["request_id"] == "req_browser_1" == r.headers["x-request-id"]
    r = browser.request("GET", "/api/file", {"path": "nope"}, headers={"X-Request-Id": "<bad>"})
    assert r.headers["x-request-id"] != "<bad>"
    envelope(browser.get("/api/nothing-here"), 404, "NOT_FOUND")
    envelope(browser.request("PATCH", "/api/file", {"path": "x"}), 405, "INVALID_REQUEST")
    big = browser.request(
        "PUT", "/api/file", {"path": "big.txt"}, json={"content": "x" * (17 << 20)}
    )
    envelope(big, 413, "PAYLOAD_TOO_LARGE")


def test_csrf_origin_and_sign_in_are_required(browser: Browser) -> None:
    r = browser.request("PUT", "/api/file", {"path": "c.txt"}, json={"content": "x"}, csrf=False)
    envelope(r, 403, "FORBIDDEN")
    r = browser.request(
        "PUT",
        "/api/file",
        {"path": "c.txt"},
        json={"content": "x"},
        headers={"X-CSRF-Token": "wrong"},
    )
    envelope(r, 403, "FORBIDDEN")
    r = browser.client.put(
        "/api/file",
        params={"path": "c.txt", "thread": THREAD},
        json={"content": "x"},
        headers={"X-CSRF-Token": browser.csrf},
    )
    envelope(r, 403, "FORBIDDEN")  # no Origin, no Referer
    anonymous = httpx.get(f"{browser.base}/api/tree", params={"thread": THREAD})
    envelope(anonymous, 401, "UNAUTHENTICATED")
    assert browser.get("/api/file", path="c.txt").status_code == 404  # nothing was written


def test_another_users_workspace_is_refused(browser: Browser) -> None:
    bob = browser.sign_in("bob")
    envelope(bob.get("/api/tree", path="."), 403, "FORBIDDEN")
    if browser.mode == "sandbox":
        r = bob.client.get("/api/tree", params={"path": "."})
        envelope(r, 400, "INVALID_REQUEST")  # no workspace named


# --- the path-escape corpus -----------------------------------------------------------


def _plant(browser: Browser) -> None:
    outside = browser.outside
    browser.run(
        "rm -rf esc && mkdir esc && cd esc && "
        f"ln -s '{outside}' out_abs && "
        "ln -s ../../outside/sentinel out_rel && "
        f"ln -s '/proc/self/root{outside}' out_proc && "
        "ln -s /proc/self/cwd out_cwd && ln -s /etc out_etc && "
        "ln -s loop2 loop1 && ln -s loop1 loop2 && mkfifo fifo && "
        "echo inside > inside.txt && ln -s /workspace/esc/inside.txt ok_abs"
    )


@pytest.mark.reliability
def test_path_escape_corpus_through_every_route(
    browser: Browser, record_property: RecordProperty
) -> None:
    _plant(browser)
    assert browser.ok("GET", "/api/file", {"path": "esc/ok_abs"})["content"] == "inside\n"
    before = sorted(os.listdir(browser.outside))
    requests = 0
    for escape in CORPUS:
        p = escape if escape.startswith(("/", "..")) else f"esc/{escape}"
        browser.put_file("esc/victim.txt", "victim")
        answers = [
            browser.request("GET", "/api/tree", {"path": p}),
            browser.request("GET", "/api/tree", {"path": p, "depth": 3}),
            browser.request("GET", "/api/file", {"path": p}),
            browser.request("PUT", "/api/file", {"path": p}, json={"content": "pwned"}),
            browser.request("PUT", "/api/file", {"path": f"{p}/new"}, json={"content": "x"}),
            browser.request(
                "POST", "/api/file/rename", json={"old_path": p, "new_path": "esc/stolen"}
            ),
            browser.request(
                "POST",
                "/api/file/rename",
                json={"old_path": "esc/victim.txt", "new_path": f"{p}/moved"},
            ),
            browser.request("POST", "/api/file/move", json={"src_path": p, "dest_dir": "esc"}),
            browser.request(
                "POST", "/api/file/move", json={"src_path": "esc/victim.txt", "dest_dir": p}
            ),
            browser.request("GET", "/api/search", {"q": "*", "path": p}),
            browser.request("GET", "/api/git/diff", {"path": p}),
            browser.request("GET", "/api/git/show", {"path": p}),
            browser.request("GET", "/api/v1/file", {"path": p}),
            browser.request("PUT", "/api/v1/file", {"path": p}, json={"content": "pwned"}),
            browser.request("GET", "/api/v1/grep", {"q": "SENTINEL", "path": p}),
            browser.request("GET", "/api/v1/grep", {"q": "root", "path": p}),
            browser.request("GET", "/api/v1/file/diff", {"path": p}),
        ]
        if escape not in ("out_rel", "fifo", "loop1"):
            answers.append(browser.request("DELETE", "/api/file", {"path": f"{p}/sentinel"}))
        for r in answers:
            requests += 1
            assert r.status_code < 500, (escape, r.request.url, r.status_code, r.text)
            assert SECRET not in r.text, (escape, r.request.url)
            assert "root:x:0:0" not in r.text, (escape, r.request.url)
    assert (browser.outside / "sentinel").read_text() == SECRET
    assert sorted(os.listdir(browser.outside)) == before == ["sentinel"]
    report(
        record_property,
        f"{browser.mode} mode: {len(CORPUS)} escape paths through every workspace route "
        f"({requests} requests): 0 escapes, 0 server errors",
    )


# --- last: nothing leaked -------------------------------------------------------------


def test_no_credential_or_upstream_in_any_body_or_log_line(browser: Browser) -> None:
    bodies = browser.bodies
    lines, served = browser.logs()
    assert bodies and served, "nothing recorded: the scan would prove nothing"
    for secret in browser.secrets:
        assert secret
        assert not [b for b in bodies if secret in b]
        assert not [line for line in lines if secret in line]
    for cookie in browser.cookies:
        assert cookie
        assert not [b for b in bodies if cookie in b]
        assert not [line for line in served if cookie in line]
    assert not [b for b in bodies if JWT.search(b)]
    assert not [line for line in lines if JWT.search(line)]
    for hidden in browser.hidden:
        assert not [b for b in bodies if hidden in b], hidden
    assert "Traceback" not in "\n".join(lines)
