"""``/fs/grep`` against a real ``sandlot serve``: ripgrep runs inside the sandbox (its
cgroup), rejects a regex too large to compile, stops at its deadline, when its client
goes away and when the server dies, and never outlives the server."""

from __future__ import annotations

import contextlib
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
import pytest

from sandlot.runtime.cgroups import CgroupLayout
from sandlot.runtime.local import LocalRuntimeManager, RuntimeSettings
from sandlot.sdk import Sandbox, Sandlot
from tests.figures import RecordProperty, report
from tests.servers import SandlotServer, isolation_mode

pytestmark = [pytest.mark.timeout(180), pytest.mark.reliability]

#: Lower-case words without a digit nor a non-ASCII character, ~11 MiB per file: the
#: patterns below match nothing in them, and take ripgrep several seconds per file.
GENERATE = """
import random
random.seed(7)
words = ["".join(random.choices("abcdefghijklmnopqrstuvwxyz", k=random.randint(1, 10)))
         for _ in range(5000)]
with open("slow/words0.txt", "w") as f:
    for _ in range(150000):
        f.write(" ".join(random.choices(words, k=12)) + "\\n")
"""

#: Slow files of the long searches: over a minute of ripgrep on two cores, so that a search
#: nothing stops is still running long after the bounds these tests assert.
LONG_FILES = 16

#: Linear-time for ripgrep, but its lazy DFA gives up on it: ~1 MiB/s, and no match.
SLOW = r"(?:.{0,40}a){10}[^\x00-\x7f]"


@dataclass
class Box:
    server: SandlotServer
    client: Sandlot
    sandbox: Sandbox

    @property
    def grep_url(self) -> str:
        return f"{self.sandbox.grant.http_base_url}/fs/grep"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.sandbox.grant.token}"}

    def cgroup_pids(self) -> set[int]:
        tag = LocalRuntimeManager(
            RuntimeSettings(
                run_dir=self.server.data_dir / "run",
                workspaces_dir=self.server.data_dir / "workspaces",
                volumes_dir=self.server.data_dir / "volumes",
            )
        ).tag
        return set(CgroupLayout(tag).sandbox(self.sandbox.grant.sandbox_id).pids())


def _start(tmp: Path, files: int, env: dict[str, str], mode: str | None = None) -> Box:
    server = SandlotServer(tmp, env=env, mode=mode).start()
    client = Sandlot(server.url, server.key("alice"), timeout=60)
    sandbox = client.ensure(f"thr_{uuid.uuid4().hex[:10]}")
    copies = "; ".join(f"cp words0.txt words{i}.txt" for i in range(1, files))
    # Relative paths: the working directory is the workspace, also where it is a plain
    # directory of the host (unisolated).
    sandbox.run(f"mkdir -p slow && python3 -c '{GENERATE}' && cd slow && {copies or 'true'}")
    return Box(server, client, sandbox)


def _stop(box: Box) -> None:
    box.client.close()
    box.server.stop()
    box.server.cleanup()


@pytest.fixture(scope="module")
def short(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Box]:
    """A server whose greps have a 3 s deadline; one slow file (~9 s of ripgrep)."""
    box = _start(
        tmp_path_factory.mktemp("grep-short") / "d", 1, {"SANDLOT_DP_GREP_TIMEOUT_SECONDS": "3"}
    )
    yield box
    _stop(box)


@pytest.fixture
def long(tmp_path: Path) -> Iterator[Box]:
    """A server with the default deadline (30 s) and :data:`LONG_FILES` slow files."""
    box = _start(tmp_path / "d", LONG_FILES, {})
    yield box
    _stop(box)


def _marked(pattern: str) -> tuple[str, str]:
    """``pattern`` plus an alternative that never matches and names this search, so that its
    processes can be told apart from any other ripgrep on the machine."""
    marker = f"qq{uuid.uuid4().hex}"
    return f"{pattern}|{marker}[^\\x00-\\x7f]", marker


def _processes(marker: str) -> list[psutil.Process]:
    """Live processes (ripgrep and anything around it) whose argv names ``marker``."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        try:
            if proc.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            if any(marker in arg for arg in proc.info["cmdline"] or ()):
                found.append(proc)
        except psutil.Error:
            continue
    return found


def _wait_for(marker: str, timeout: float = 20.0) -> list[psutil.Process]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = _processes(marker)
        if any(p.name() == "rg" for p in found):
            return found
        time.sleep(0.05)
    raise AssertionError("ripgrep never started")


def _wait_gone(marker: str, timeout: float) -> float:
    """Seconds until no process names ``marker`` (fails after ``timeout``)."""
    t0 = time.monotonic()
    while _processes(marker):
        assert time.monotonic() - t0 < timeout, [p.cmdline()[:3] for p in _processes(marker)]
        time.sleep(0.05)
    return time.monotonic() - t0


def test_a_regex_too_large_to_compile_is_a_400_at_once(
    short: Box, record_property: RecordProperty
) -> None:
    t0 = time.monotonic()
    resp = httpx.post(
        short.grep_url,
        json={"pattern": "a{1000}{1000}", "regex": True, "path": "/workspace"},
        headers=short.headers,
        timeout=20,
    )
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["code"] == "INVALID_REQUEST"
    assert "too large" in resp.json()["error"]["message"]
    took = time.monotonic() - t0
    assert took < 10  # ripgrep would have run for minutes
    report(record_property, f"grep a{{1000}}{{1000}}: 400 in {took * 1000:.0f} ms")


@pytest.mark.parametrize(
    "body",
    [
        {"pattern": "a(", "regex": True},
        {"pattern": "x", "glob": "a["},  # a small tree, a literal: the same answer
        {"pattern": "x", "glob": "[z-a]", "path": "/workspace/slow"},
    ],
)
def test_invalid_regex_or_glob_is_a_400(short: Box, body: dict[str, object]) -> None:
    resp = httpx.post(short.grep_url, json=body, headers=short.headers, timeout=20)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["code"] == "INVALID_REQUEST"


def test_searches_by_ripgrep_in_the_sandbox(short: Box) -> None:
    """Regexes, case folding, globs, a single file, /tmp and truncation: ripgrep's answers
    as before, now from inside the sandbox."""
    sb = short.sandbox
    sb.write("re/a.py", "def foo():\n    return 1\nDEF BAR():\n")
    sb.write("re/sub/b.txt", "nothing\ndef baz(x):\n")
    sb.run("printf 'x\\ndef tmp():\\n' > /tmp/t.py && ln -sf /tmp/t.py re/link.py")

    def grep(**body: object) -> dict:
        resp = httpx.post(short.grep_url, json=body, headers=short.headers, timeout=20)
        assert resp.status_code == 200, resp.text
        return dict(resp.json())

    def hits(answer: dict) -> list[tuple[str, int, str]]:
        return sorted((m["path"], m["line"], m["text"]) for m in answer["matches"])

    found = grep(pattern=r"def \w+\(", path="/workspace/re", regex=True)
    assert hits(found) == [
        ("/workspace/re/a.py", 1, "def foo():"),
        ("/workspace/re/sub/b.txt", 2, "def baz(x):"),
    ]  # the symlink is not followed
    assert not found["truncated"]
    found = grep(pattern="def", path="re", ignore_case=True, glob="*.py")
    assert [(p, n) for p, n, _ in hits(found)] == [
        ("/workspace/re/a.py", 1),
        ("/workspace/re/a.py", 3),
    ]
    found = grep(pattern="^D", path="/workspace/re/a.py", regex=True)
    assert hits(found) == [("/workspace/re/a.py", 3, "DEF BAR():")]
    found = grep(pattern=r"t\w+\(", path="/tmp", regex=True)
    assert hits(found) == [("/tmp/t.py", 2, "def tmp():")]
    found = grep(pattern="[a-z]", path="/workspace/re", regex=True, max_count=2)
    assert len(found["matches"]) == 2 and found["truncated"]
    if isolation_mode() == "isolated":
        # The programs the runtime binds for it: there, and out of the sandbox's reach.
        check = sb.exec(
            "test -x /.sandlot/rg && test -x /.sandlot/sandlot-limit && touch /.sandlot/x"
        )
        assert check.exit_code != 0 and "Read-only file system" in check.stderr, check


def test_ripgrep_runs_in_the_sandbox_cgroup_and_stops_at_its_deadline(
    short: Box, record_property: RecordProperty
) -> None:
    pattern, marker = _marked(SLOW)
    answer: dict[str, httpx.Response] = {}

    def grep() -> None:
        answer["resp"] = httpx.post(
            short.grep_url,
            json={"pattern": pattern, "regex": True, "path": "/workspace/slow"},
            headers=short.headers,
            timeout=60,
        )

    t0 = time.monotonic()
    thread = threading.Thread(target=grep)
    thread.start()
    try:
        procs = _wait_for(marker)
        members = short.cgroup_pids()
        rg = [p.pid for p in procs if p.name() == "rg"]
        if isolation_mode() == "isolated":
            assert rg and set(rg) <= members, (rg, members)
            for p in procs:
                # Everything started for the search runs as the sandbox's uid, never root.
                assert p.uids().real != 0
    finally:
        thread.join(60)
    elapsed = time.monotonic() - t0
    resp = answer["resp"]
    assert resp.status_code == 200, resp.text
    assert resp.json() == {"matches": [], "truncated": True}
    assert elapsed < 3 + 10  # the deadline, not the 9 s ripgrep would take
    _wait_gone(marker, 5)
    report(record_property, f"grep past its 3 s deadline: answered in {elapsed:.2f} s")
    # The sandbox is fine afterwards, and so is grep.
    found = short.sandbox.grep("words", "/workspace")
    assert found == []


def test_a_client_going_away_stops_ripgrep(long: Box, record_property: RecordProperty) -> None:
    pattern, marker = _marked(SLOW)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            long.grep_url,
            json={"pattern": pattern, "regex": True, "path": "/workspace/slow"},
            headers=long.headers,
            timeout=httpx.Timeout(20, read=2),
        )
    # The client closed its connection 2 s in; the deadline is 30 s away.
    gone = _wait_gone(marker, 10)
    report(record_property, f"grep whose client went away: ripgrep gone {gone:.2f} s later")
    # The server serves the next one.
    assert long.sandbox.grep("nothing-like-this", "/workspace") == []


@pytest.mark.parametrize(
    ("mode", "sig"),
    [
        ("isolated", signal.SIGKILL),
        ("unisolated", signal.SIGKILL),
        ("isolated", signal.SIGTERM),
    ],
    ids=["isolated-kill9", "unisolated-kill9", "isolated-sigterm"],
)
def test_no_ripgrep_outlives_a_stopped_server(
    tmp_path: Path, mode: str, sig: int, record_property: RecordProperty
) -> None:
    """The server killed (or stopped) mid-search: the search ends with it, although an
    isolated sandbox stays up for the next server to adopt."""
    if mode == "isolated" and isolation_mode() != "isolated":
        pytest.skip("isolated sandboxes need root")
    box = _start(tmp_path / "d", LONG_FILES, {}, mode=mode)
    try:
        pattern, marker = _marked(SLOW)

        def grep() -> None:
            with contextlib.suppress(httpx.HTTPError):  # the server is killed under it
                httpx.post(
                    box.grep_url,
                    json={"pattern": pattern, "regex": True, "path": "/workspace/slow"},
                    headers=box.headers,
                    timeout=60,
                )

        thread = threading.Thread(target=grep, daemon=True)
        thread.start()
        _wait_for(marker)
        t0 = time.monotonic()
        box.server.stop(sig)
        thread.join(30)
        # Well before the 30 s deadline: nothing of the search is left.
        _wait_gone(marker, 10)
        gone = time.monotonic() - t0
        assert gone < 20
        name = signal.Signals(sig).name
        report(record_property, f"grep, server {name} ({mode}): ripgrep gone {gone:.2f} s later")
    finally:
        box.client.close()
        box.server.stop()
        box.server.cleanup()
