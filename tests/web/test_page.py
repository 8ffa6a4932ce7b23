"""The workspace page in a real browser (Debian's Chromium, headless, driven by Playwright),
against a real ``sandlot serve`` with real sandboxes (``sandbox`` mode) and a real
``sandlot web`` over a folder (``local`` mode), with an agent working in the same
workspace: the SDK with an agent-actor key (as the deepagents backend calls it) in sandbox
mode, a process of the machine in local mode.

Every test opens a fresh browser profile signed in through a one-time link and fails on
any console error, uncaught error, CSP violation or dialog of the page. Deadlines are
Playwright's auto-waiting ``expect(...)`` timeouts; the one timing promised to users is
asserted as such: what the agent does shows in the page within 1 s.

With ``SANDLOT_UPDATE_SCREENSHOTS=1`` the screenshots of docs/WORKSPACE.md are written to
docs/images (otherwise to the test's temporary folder: they are taken either way).
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator
from pathlib import Path

import pexpect
import pytest
from axe_playwright_python.sync_playwright import Axe
from playwright.sync_api import Browser, Page, expect, sync_playwright

from sandlot.sdk import Sandlot
from tests import faultproxy
from tests.web.pages import (
    CHROMIUM,
    SANDLOT,
    THREAD,
    Scheme,
    Site,
    Tab,
    drop_folder,
    expect_connected,
    feed_item,
    local_site,
    node,
    open_file,
    open_terminal,
    sandbox_site,
    screenshot,
    sign_in,
    tab,
    terminal_lines,
    type_in_terminal,
    wait_for_terminal_line,
)

pytestmark = pytest.mark.timeout(120)

#: What the agent's work must take at most to show in the page.
LIVE = 1_000
#: How long the page may take to do what a user asked (a request or two on loopback, on a
#: loaded CI machine): a bound against hangs, not a figure.
SOON = 10_000
HOSTILE = "<img src=x onerror=alert(1)>.py"


@pytest.fixture(scope="module")
def chromium() -> Iterator[Browser]:
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: apt-get install -y chromium (scripts/test does)")
    with sync_playwright() as p:
        # Chromium's own sandbox needs user namespaces it is not given as root.
        args = ["--no-sandbox"] if os.geteuid() == 0 else []
        browser = p.chromium.launch(executable_path=CHROMIUM, args=args)
        yield browser
        browser.close()


@pytest.fixture(scope="module", params=["sandbox", "local"])
def site(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Site]:
    tmp = tmp_path_factory.mktemp(f"page-{request.param}")
    make = sandbox_site if request.param == "sandbox" else local_site
    with make(tmp) as running_site:
        yield running_site


@contextlib.contextmanager
def watched(chromium: Browser, *, color_scheme: Scheme = "light") -> Iterator[Tab]:
    """A fresh profile; at the end, nothing went wrong in its page."""
    with tab(chromium, color_scheme=color_scheme) as t:
        yield t
        problems = t.watch.problems()
        assert not problems, "\n".join(problems)


@pytest.fixture
def browser_tab(chromium: Browser, site: Site) -> Iterator[Tab]:
    """A fresh profile signed in through a one-time link, on the workspace."""
    with watched(chromium) as t:
        sign_in(t.page, site.link())
        expect(t.page.get_by_test_id("tree")).to_be_visible(timeout=SOON)
        yield t


def unique(stem: str) -> str:
    return f"{stem}-{secrets.token_hex(3)}"


# --- sign in, open a thread ----------------------------------------------------------------


def test_a_one_time_link_signs_in_once(chromium: Browser, site: Site) -> None:
    link = site.link()
    with watched(chromium) as t:
        sign_in(t.page, link)
        expect(t.page.get_by_test_id("tree")).to_be_visible(timeout=SOON)
        assert t.page.url.endswith(site.entry), t.page.url
    # Spent: another browser following it is refused, and the page then asks for a key.
    with watched(chromium) as t:
        t.watch.expect(r"status of 401")
        answer = t.page.goto(link)
        assert answer is not None and answer.status == 401
        t.page.goto(f"{site.url}{site.entry}")
        expect(t.page.get_by_test_id("login")).to_be_visible(timeout=SOON)


def test_the_sign_in_form_takes_an_api_key(chromium: Browser, site: Site) -> None:
    with watched(chromium) as t:
        # Before signing in the page's first calls are refused (401), as they should be.
        t.watch.expect(r"status of 401")
        t.page.goto(f"{site.url}{site.entry}")
        expect(t.page.get_by_test_id("login")).to_be_visible(timeout=SOON)
        t.page.get_by_test_id("login-key").fill("sl_not_a_key")
        with t.page.expect_response("**/api/auth/login") as refused:
            t.page.get_by_test_id("login-submit").click()
        assert refused.value.status == 401
        expect(t.page.get_by_test_id("login")).to_be_visible()
        t.page.get_by_test_id("login-key").fill(site.key)
        t.page.get_by_test_id("login-submit").click()
        expect(t.page.get_by_test_id("login")).to_be_hidden(timeout=SOON)
        expect_connected(t.page)
        # The key is the server's to keep: the page never stores it.
        stored = t.page.evaluate(
            "() => JSON.stringify([Object.entries(localStorage), Object.entries(sessionStorage),"
            " document.cookie])"
        )
        assert site.key not in stored


def test_opening_a_thread_shows_its_workspace(chromium: Browser, site: Site) -> None:
    name = unique("opened")
    site.agent.write(f"{name}/inside.txt", "in a folder\n")
    site.agent.write(f"{name}.md", "# at the root\n")
    with watched(chromium) as t:
        page = t.page
        if site.mode == "sandbox":
            # Signed in on the page that lists the user's workspaces, the thread is opened
            # from the list.
            sign_in(page, site.link(to="/"), connected=False)
            item = page.locator(f'[data-testid="workspace-item"][data-thread="{THREAD}"]')
            expect(item).to_be_visible(timeout=SOON)
            item.get_by_role("link").click()
            expect_connected(page)
        else:
            sign_in(page, site.link())
        expect(node(page, f"{name}.md")).to_be_visible(timeout=SOON)
        folder = node(page, name)
        expect(folder).to_have_attribute("data-kind", "dir")
        folder.click()
        expect(node(page, f"{name}/inside.txt")).to_be_visible(timeout=SOON)
        expect(node(page, f"{name}/inside.txt")).to_have_attribute("data-kind", "file")


def test_a_link_to_a_thread_without_a_sandbox_makes_none_until_asked(
    chromium: Browser, site: Site
) -> None:
    """A link (from anyone: another site can send the browser to it) opens what exists;
    a thread with no sandbox gets one only from the user's click."""
    thread = unique("thr-fresh")
    with watched(chromium) as t:
        page = t.page
        sign_in(page, site.link(to=f"/?thread={thread}"), connected=False)
        if site.mode == "local":
            # One folder, whatever the link names.
            expect_connected(page)
            expect(page.get_by_test_id("workspace-absent")).to_have_count(0)
            return
        absent = page.get_by_test_id("workspace-absent")
        expect(absent).to_be_visible(timeout=SOON)
        expect(absent).to_contain_text(thread)
        with Sandlot(site.url, site.key, auto_refresh=False) as broker:
            assert f"thread:{thread}" not in {b.scope for b in broker.list_sandboxes()}
            page.get_by_test_id("workspace-create").click()
            expect_connected(page)
            expect(page.get_by_test_id("tree")).to_be_visible(timeout=SOON)
            assert f"thread:{thread}" in {b.scope for b in broker.list_sandboxes()}
        # Opened again, it is there at once.
        page.goto(f"{site.url}/?thread={thread}")
        expect_connected(page)
        # The page without a workspace makes a new thread's sandbox and opens it.
        other = unique("thr-new")
        page.goto(f"{site.url}/")
        page.get_by_test_id("new-thread").fill(other)
        page.get_by_test_id("new-thread-create").click()
        expect_connected(page)
        expect(page.locator(".workspace-name")).to_have_text(other)
        assert page.url.endswith(f"/?thread={other}")


# --- the agent's work, live ------------------------------------------------------------------


def test_the_agents_file_and_command_show_within_a_second(
    browser_tab: Tab, site: Site, tmp_path: Path
) -> None:
    page = browser_tab.page
    name = unique("agent-notes") + ".md"
    site.agent.write(name, "# Plan\n\n1. read the code\n2. write the tests\n")
    expect(node(page, name)).to_be_visible(timeout=LIVE)
    if site.agent.actor is None:
        return  # local mode: no agent API, so no actor for the feed to show
    expect(feed_item(page, "file", actor=site.agent.actor, path=name).first).to_be_visible(
        timeout=LIVE
    )
    command = f"echo ran-by-the-agent-{secrets.token_hex(3)}"
    site.agent.run(command)
    ran = feed_item(page, "exec", actor=site.agent.actor).filter(has_text=command)
    expect(ran.first).to_be_visible(timeout=LIVE)
    expect(ran.first).to_have_attribute("data-exit", "0", timeout=SOON)
    if site.mode == "sandbox":
        open_file(page, name)
        screenshot(page, "agent", tmp_path)
    # The tree marks what the agent changed (for a minute: the mark is still there).
    expect(node(page, name)).to_have_attribute("data-changed", site.agent.actor, timeout=LIVE)


# --- the editor --------------------------------------------------------------------------------


def test_a_file_saved_in_the_editor_is_what_the_agent_reads(browser_tab: Tab, site: Site) -> None:
    page = browser_tab.page
    name = unique("saved") + ".md"
    site.agent.write(name, "first line\n")
    expect(node(page, name)).to_be_visible(timeout=SOON)
    content = open_file(page, name)
    expect(content).to_contain_text("first line")
    content.click()
    page.keyboard.press("Control+End")
    page.keyboard.type("added in the browser")
    page.keyboard.press("Control+s")
    expect(page.get_by_test_id("editor-status")).to_contain_text("saved", timeout=SOON)
    assert site.agent.read(name) == "first line\nadded in the browser"


def test_an_agents_edit_under_the_editor_is_a_conflict_and_nothing_is_lost(
    browser_tab: Tab, site: Site, tmp_path: Path
) -> None:
    page = browser_tab.page
    # The refused save is a 412, which Chromium logs as a failed load.
    browser_tab.watch.expect(r"status of 412")
    name = unique("shared") + ".py"
    site.agent.write(name, "def greet():\n    return 'hello'\n")
    expect(node(page, name)).to_be_visible(timeout=SOON)
    content = open_file(page, name)
    expect(content).to_contain_text("return 'hello'")
    content.click()
    page.keyboard.press("Control+End")
    page.keyboard.type("# typed in the browser")
    theirs = "def greet():\n    return 'hello, from the agent'\n"
    site.agent.write(name, theirs)
    page.keyboard.press("Control+s")
    conflict = page.get_by_test_id("conflict")
    expect(conflict).to_be_visible(timeout=SOON)
    diff = page.get_by_test_id("conflict-diff")
    expect(diff).to_contain_text("hello, from the agent")
    expect(diff).to_contain_text("# typed in the browser")
    # Nothing is lost: the agent's version is on disk, the browser's still in the editor.
    assert site.agent.read(name) == theirs
    expect(content).to_contain_text("# typed in the browser")
    if site.mode == "sandbox":
        screenshot(page, "conflict", tmp_path)
    page.get_by_test_id("conflict-overwrite").click()
    expect(conflict).to_be_hidden(timeout=SOON)
    expect(page.get_by_test_id("editor-status")).to_contain_text("saved", timeout=SOON)
    assert site.agent.read(name) == "def greet():\n    return 'hello'\n# typed in the browser"


# --- the terminal ------------------------------------------------------------------------------


def test_what_is_typed_in_the_terminal_runs_in_the_workspace(browser_tab: Tab, site: Site) -> None:
    page = browser_tab.page
    open_terminal(page)
    type_in_terminal(page, "echo hi")
    lines = wait_for_terminal_line(page, r"^hi$", timeout=SOON)
    assert any(line.endswith("echo hi") for line in lines), lines
    name = unique("from-the-terminal")
    type_in_terminal(page, f"echo made > {name}.txt")
    expect(node(page, f"{name}.txt")).to_be_visible(timeout=SOON)
    assert site.agent.read(f"{name}.txt") == "made\n"


def _cli(site: Site, *args: str) -> pexpect.spawn:
    return pexpect.spawn(
        SANDLOT[0],
        [*SANDLOT[1:], *args],
        env=site.cli_env,
        encoding="utf-8",
        timeout=30,
        dimensions=(24, 100),
    )


@pytest.mark.parametrize("site", ["sandbox"], indirect=True)
def test_the_terminal_is_the_shell_the_cli_attaches_to(
    browser_tab: Tab, site: Site, tmp_path: Path
) -> None:
    page = browser_tab.page
    shell = open_terminal(page)
    observer = _cli(site, "shell", THREAD, "--session", shell, "--observe")
    driver = None
    try:
        observer.expect(r"[$#] ")  # attached: the shell's history, its prompt
        type_in_terminal(page, "echo hi")
        wait_for_terminal_line(page, r"^hi$", timeout=SOON)
        observer.expect(r"\rhi\r\n")
        driver = _cli(site, "shell", THREAD, "--session", shell)
        driver.expect(r"[$#] ")
        driver.sendline("echo typed-in-the-cli-$((6*7))")
        wait_for_terminal_line(page, r"^typed-in-the-cli-42$", timeout=SOON)
        observer.expect(r"typed-in-the-cli-42\r\n")
        screenshot(page, "terminal", tmp_path)
    finally:
        for child in (observer, driver):
            if child is not None:
                child.terminate(force=True)


def test_a_dropped_connection_reconnects_and_shows_what_was_missed(
    chromium: Browser, site: Site
) -> None:
    """The network between the browser and the server goes (every connection reset, new
    ones refused for a few seconds, as a proxy restarting or a route flapping would): the
    page says so, reconnects by itself and shows the output its shell wrote meanwhile,
    once."""
    host, port = site.url.removeprefix("http://").rsplit(":", 1)
    with faultproxy.serving(seed=7) as proxy, watched(chromium) as t:
        proxy.upstream = (host, int(port))
        page = t.page
        # Loads refused while the network is down are logged by Chromium.
        t.watch.expect(r"net::ERR_|WebSocket connection to .* failed")
        sign_in(page, site.link(proxy.url))
        shell = open_terminal(page)
        type_in_terminal(page, "sleep 2; echo missed-$((40+2))")
        wait_for_terminal_line(page, r"sleep 2; echo missed-", timeout=SOON)
        proxy.outage(4)
        expect(page.get_by_test_id("connection")).not_to_have_attribute(
            "data-state", "connected", timeout=3_000
        )
        expect_connected(page, timeout=30_000)
        lines = wait_for_terminal_line(page, r"^missed-42$", timeout=SOON)
        assert [line for line in lines if line == "missed-42"] == ["missed-42"], lines
        assert page.evaluate("() => window.sandlotTerminalSession") == shell
        # And the terminal works on.
        type_in_terminal(page, "echo after-$((50+5))")
        wait_for_terminal_line(page, r"^after-55$", timeout=SOON)
    assert proxy.stats.resets > 0, "the proxy never cut a connection"


# --- uploads, hostile names --------------------------------------------------------------------


def test_a_folder_dropped_on_the_tree_is_uploaded(
    browser_tab: Tab, site: Site, tmp_path: Path
) -> None:
    page = browser_tab.page
    name = unique("dropped")
    folder = tmp_path / name
    (folder / "src" / "deep").mkdir(parents=True)
    (folder / "README.md").write_text("# dropped\n")
    (folder / "src" / "main.py").write_text("print('dropped')\n")
    (folder / "src" / "deep" / "data.bin").write_bytes(bytes(range(256)))
    drags = drop_folder(page, page.get_by_test_id("tree"), folder)
    progress = page.get_by_test_id("upload-progress")
    try:
        expect(progress).to_have_attribute("data-state", "done", timeout=SOON)
    except AssertionError as e:
        told = progress.evaluate("(e) => [e.hidden, e.dataset.state, e.textContent]")
        raise AssertionError(f"no upload: status {told}, drag events {drags}") from e
    expect(progress).to_contain_text("Uploaded 3 files")
    expect(node(page, name)).to_be_visible(timeout=SOON)
    expect(node(page, name)).to_have_attribute("data-kind", "dir")
    node(page, name).click()
    expect(node(page, f"{name}/README.md")).to_be_visible(timeout=SOON)
    node(page, f"{name}/src").click()
    expect(node(page, f"{name}/src/main.py")).to_be_visible(timeout=SOON)
    assert site.agent.read(f"{name}/src/main.py") == "print('dropped')\n"
    assert site.agent.read(f"{name}/README.md") == "# dropped\n"
    node(page, f"{name}/src/deep").click()
    expect(node(page, f"{name}/src/deep/data.bin")).to_be_visible(timeout=SOON)


def test_a_hostile_file_name_shows_as_text(browser_tab: Tab, site: Site) -> None:
    page = browser_tab.page
    site.agent.write(HOSTILE, "print('harmless')\n")
    hostile = node(page, HOSTILE)
    expect(hostile).to_be_visible(timeout=SOON)
    expect(hostile).to_contain_text(HOSTILE)
    open_file(page, HOSTILE)
    expect(page.get_by_test_id("editor-path")).to_contain_text(HOSTILE)
    if site.agent.actor is not None:
        site.agent.run("cat '<img src=x onerror=alert(1)>.py'")
        expect(
            feed_item(page, "exec", actor=site.agent.actor).filter(has_text=HOSTILE).first
        ).to_be_visible(timeout=SOON)
    # The name was never markup: no element was made of it, no handler ran.
    assert page.locator("img[src='x']").count() == 0
    assert browser_tab.watch.dialogs == []


# --- accessibility -------------------------------------------------------------------------------


def _serious(page: Page) -> list[str]:
    results = Axe().run(page, options={"resultTypes": ["violations"]}).response
    return [
        f"{v['id']} ({v['impact']}): {v['help']}\n"
        + "\n".join(
            f"  {', '.join(n['target'])}: {n['html'][:160]}\n    {n.get('failureSummary', '')}"
            for n in v["nodes"][:5]
        )
        for v in results["violations"]
        if v["impact"] in ("serious", "critical")
    ]


@pytest.mark.parametrize("scheme", ["light", "dark"])
def test_no_serious_accessibility_violation(chromium: Browser, site: Site, scheme: Scheme) -> None:
    with watched(chromium, color_scheme=scheme) as t:
        page = t.page
        t.watch.expect(r"status of 401")
        page.goto(f"{site.url}{site.entry}")
        expect(page.get_by_test_id("login")).to_be_visible(timeout=SOON)
        assert _serious(page) == [], "the sign-in form"
        sign_in(page, site.link())
        assert page.evaluate("() => document.documentElement.dataset.theme") == scheme
        name = unique("a11y") + ".md"
        site.agent.write(name, "# checked\n")
        expect(node(page, name)).to_be_visible(timeout=SOON)
        open_file(page, name)
        open_terminal(page)
        violations = _serious(page)
        assert violations == [], "\n".join(violations)


def test_terminal_lines_read_the_active_terminal(browser_tab: Tab) -> None:
    """The window hooks the tests read are the page's own (not stale after a new tab)."""
    page = browser_tab.page
    first = open_terminal(page)
    type_in_terminal(page, "echo first-tab")
    wait_for_terminal_line(page, r"^first-tab$", timeout=SOON)
    tabs = page.get_by_test_id("terminal-tab").count()
    page.get_by_test_id("terminal-new").click()
    page.wait_for_function(
        "(first) => window.sandlotTerminalSession && window.sandlotTerminalSession !== first",
        arg=first,
        timeout=SOON,
    )
    wait_for_terminal_line(page, r"[$#]\s*$", timeout=SOON)
    assert "first-tab" not in terminal_lines(page)
    expect(page.get_by_test_id("terminal-tab")).to_have_count(tabs + 1)
