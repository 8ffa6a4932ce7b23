"""The browser workspace as the commands serve it: ``sandlot serve`` (beside the broker and
the dataplane, on one port), ``sandlot web`` (alone, a local folder) and ``sandlot open``
(a one-time link from a running server)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import select
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from sandlot.cli.server import WebDispatch
from tests.servers import SandlotServer, running
from tests.web.browser import Browser
from tests.web.leaks import leak_scan, scanned  # noqa: F401  (the web suite's leak scan)
from tests.web.test_terminals import opened

SANDLOT = [sys.executable, "-m", "sandlot.cli.main"]
LINK = re.compile(r"(http://\S+/login\?token=\S+)")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SandlotServer]:
    with running(tmp_path_factory.mktemp("web-serve") / "d") as srv:
        yield srv


def sign_in_with(link: str) -> httpx.Client:
    """A browser that followed ``link``: its session cookie set."""
    base = link.split("/login", 1)[0]
    client = httpx.Client(base_url=base, timeout=60)
    r = client.get(link, follow_redirects=False)
    assert r.status_code == 303, r.text
    assert client.cookies, "the link set no session cookie"
    return client


def create_workspace(browser: httpx.Client, thread: str) -> None:
    """What the page's "Create its sandbox" does for a thread that has none."""
    csrf = browser.get("/api/auth/me").json()["csrf_token"]
    origin = str(browser.base_url).rstrip("/")
    made = browser.post(
        "/api/v1/workspace",
        params={"thread": thread},
        headers={"X-CSRF-Token": csrf, "Origin": origin},
    )
    assert made.status_code == 200, made.text


def test_serve_serves_the_web_app_beside_the_broker_and_the_dataplane(
    server: SandlotServer,
) -> None:
    key = server.key("ada")
    with httpx.Client(base_url=server.url, timeout=60) as c:
        # The broker's and the dataplane's own routes are untouched.
        assert c.get("/healthz").status_code == 200
        assert c.get("/readyz").json()["store"]["ok"] is True
        auth = {"Authorization": f"Bearer {key}"}
        assert c.get("/v1/templates", headers=auth).status_code == 200
        assert c.get("/dp/__meta/version").json()["api_version"] == "1"
        # Nothing the broker serves is under the web app's paths.
        paths = c.get("/openapi.json").json()["paths"]
        assert paths and not [p for p in paths if WebDispatch.is_web(p)]
        # The web app's.
        assert c.get("/api/healthz").json()["status"] == "ok"
        ready = c.get("/api/readyz").json()
        assert ready["ready"] is True and ready["mode"] == "sandbox"
        assert ready["gateway"] == {"dataplane": "closed"}
        page = c.get("/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        csp = page.headers["content-security-policy"]
        assert "script-src 'self'" in csp and "connect-src 'self'" in csp
        assert "unsafe" not in csp
        r = c.get("/login", params={"token": "nope.nope"}, follow_redirects=False)
        assert r.status_code == 401 and r.json()["error"]["code"] == "UNAUTHENTICATED"
        assert c.get("/api/tree", params={"thread": "thr_1"}).status_code == 401
        # The gateway's figures join the broker's at /metrics.
        assert "sandlot_gateway_breaker_state" in c.get("/metrics").text


def cli_env(url: str, key: str, home: Path) -> dict[str, str]:
    """The environment of a CLI command run against ``url`` with ``key``."""
    return {
        **os.environ,
        "SANDLOT_URL": url,
        "SANDLOT_API_KEY": key,
        "HOME": str(home),
        "XDG_CONFIG_HOME": str(home / ".config"),
    }


def test_open_prints_a_link_that_signs_in_once(server: SandlotServer, tmp_path: Path) -> None:
    env = cli_env(server.url, server.key("ada"), tmp_path)
    done = subprocess.run(
        [*SANDLOT, "open", "thr_open", "--print"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    link = done.stdout.strip()
    assert LINK.fullmatch(link), link
    with contextlib.closing(sign_in_with(link)) as browser:
        # Opening the link made no sandbox: the page offers to.
        absent = browser.get("/api/v1/workspace", params={"thread": "thr_open"})
        assert absent.json()["workspace"] is None, absent.text
        create_workspace(browser, "thr_open")
        r = browser.get("/api/tree", params={"path": ".", "thread": "thr_open"})
        assert r.status_code == 200, r.text
        assert r.json() == {"entries": [], "path": "."}
        # The shared terminals and the chat are served too.
        features = browser.get("/api/capabilities").json()["features"]
        assert features["pty"] is True and features["chat_claude_code"] is True
    again = httpx.get(link, follow_redirects=False)
    assert again.status_code == 401  # spent by its first use
    bad = subprocess.run(
        [*SANDLOT, "open", "thr_open", "--print", "--api-key", "sl_wrong"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 1 and "UNAUTHENTICATED" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_serve_keeps_browser_sessions_in_its_store_across_a_restart(tmp_path: Path) -> None:
    srv = SandlotServer(tmp_path / "d").start()
    try:
        key = srv.key("ada")
        made = httpx.post(
            f"{srv.url}/api/auth/links",
            headers={"Authorization": f"Bearer {key}"},
            json={"next": "/?thread=thr_kept"},
            timeout=60,
        )
        assert made.status_code == 201, made.text
        with contextlib.closing(sign_in_with(made.json()["url"])) as browser:
            cookie = {"Cookie": f"sandlot_session={browser.cookies['sandlot_session']}"}

        def me() -> httpx.Response:
            return httpx.get(f"{srv.url}/api/auth/me", headers=cookie, timeout=60)

        before = me()
        assert before.status_code == 200, before.text
        # A restart signs nobody out.
        srv.stop()
        srv.start()
        after = me()
        assert after.status_code == 200, after.text
        assert after.json() == before.json()
        # Nothing in the store would sign a browser in: no cookie id, no key in clear.
        with sqlite3.connect(srv.data_dir / "sandlot.db") as db:
            rows = db.execute("SELECT * FROM web_sessions").fetchall()
        assert len(rows) == 1
        assert key not in str(rows) and browser.cookies["sandlot_session"] not in str(rows)
    finally:
        srv.stop()
        srv.cleanup()


@pytest.mark.timeout(180)
async def test_serve_with_workers_serves_the_workspace_on_its_port_from_every_worker(
    tmp_path: Path,
) -> None:
    srv = SandlotServer(tmp_path / "d", workers=3)
    await asyncio.to_thread(srv.start)
    try:
        key = await asyncio.to_thread(srv.key, "ada")
        env = cli_env(srv.url, key, tmp_path)
        done = await asyncio.to_thread(
            subprocess.run,
            [*SANDLOT, "open", "thr_workers", "--print"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        link = done.stdout.strip()
        assert link.startswith(f"{srv.url}/login?token="), link
        with contextlib.closing(sign_in_with(link)) as signed_in:
            cookie = signed_in.cookies["sandlot_session"]
            await asyncio.to_thread(create_workspace, signed_in, "thr_workers")
        headers = {"Cookie": f"sandlot_session={cookie}"}
        # A connection of its own each time: any of the workers may answer, and each
        # knows the session.
        for _ in range(30):
            async with httpx.AsyncClient(base_url=srv.url, timeout=60) as client:
                me = await client.get("/api/auth/me", headers=headers)
                assert me.status_code == 200, me.text
                tree = await client.get(
                    "/api/tree", params={"path": ".", "thread": "thr_workers"}, headers=headers
                )
                assert tree.status_code == 200, tree.text
        browser = Browser(srv.url, None, cookie, me.json()["csrf_token"])
        created = await browser.request(
            "POST", "/api/sessions", params={"thread": "thr_workers"}, json={"shell": "w"}
        )
        assert created.status_code == 201, created.text
        session_id = created.json()["session_id"]
        for _ in range(3):  # attached again, through whichever worker
            async with browser.socket(
                thread="thr_workers", session_id=session_id, resume=1
            ) as sock:
                assert (await opened(sock))["name"] == "w"
                await sock.type("echo from-$((6*7))\r")
                await sock.until_output("from-42")
    finally:
        await asyncio.to_thread(srv.stop)
        await asyncio.to_thread(srv.cleanup)


def _start_web(
    args: list[str], env: dict[str, str], cwd: Path
) -> tuple[subprocess.Popen[bytes], str]:
    proc = subprocess.Popen(
        [*SANDLOT, "web", *args],
        env=env,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    out = b""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and proc.poll() is None:
        ready, _, _ = select.select([fd], [], [], 0.1)
        if ready:
            out += os.read(fd, 65536)
            if m := LINK.search(out.decode(errors="replace")):
                return proc, m.group(1)
    proc.kill()
    proc.wait()
    proc.stdout.close()
    raise AssertionError(f"sandlot web printed no link:\n{out.decode(errors='replace')}")


def test_web_local_mode_prints_a_link_that_signs_in(tmp_path: Path) -> None:
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "README.md").write_text("# hello\n")
    env = {**os.environ, "HOME": str(tmp_path), "SANDLOT_WORKSPACE_MODE": ""}
    proc, link = _start_web(
        ["--mode", "local", "--root", str(folder), "--port", "0", "--user", "ada"],
        env,
        tmp_path,
    )
    try:
        with contextlib.closing(sign_in_with(link)) as browser:
            me = browser.get("/api/auth/me").json()
            assert me["user"] == "ada"
            tree = browser.get("/api/tree", params={"path": "."}).json()
            assert tree["entries"] == [
                {"name": "README.md", "path": "README.md", "is_dir": False, "size": 8}
            ]
            ready = browser.get("/api/readyz").json()
            assert ready["local_dataplane"] == "running" and ready["ready"] is True
            capabilities = browser.get("/api/capabilities").json()
            assert capabilities["mode"] == "local"
            assert capabilities["features"]["pty"] is True
        assert httpx.get(link, follow_redirects=False).status_code == 401
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(30)
        assert proc.stdout is not None
        proc.stdout.close()
    assert code == 0


def test_web_mode_comes_from_the_flag_or_the_environment(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "HOME": str(tmp_path),
        "XDG_CONFIG_HOME": str(tmp_path / ".config"),
        "SANDLOT_WORKSPACE_MODE": "sandbox",
        "SANDLOT_API_KEY": "",
    }
    done = subprocess.run(
        [*SANDLOT, "web", "--port", "0"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "no API key" in done.stderr, done.stderr
    done = subprocess.run(
        [*SANDLOT, "web", "--mode", "elsewhere"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "local or sandbox" in done.stderr
    assert "Traceback" not in done.stderr
