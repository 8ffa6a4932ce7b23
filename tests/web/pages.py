"""The workspace page in a real browser: Debian's Chromium driven by Playwright, the page
served by a real ``sandlot serve`` (``sandbox`` mode) or a real ``sandlot web`` (``local``
mode), and an agent working in the same workspace.

- :class:`Site` is one running server and what a test needs of its workspace: a one-time
  sign-in link (``POST /api/auth/links``), and an agent that writes files, runs commands
  and reads files (the SDK with an agent-actor key, as the deepagents backend does, in
  ``sandbox`` mode; a process of the machine working in the folder, in ``local`` mode).
- :class:`Watch` fails a test on any console error, uncaught page error, CSP violation or
  dialog the page shows (a test names the console errors it causes on purpose).
- The helpers read the page through the data-testids and window hooks the page promises
  (the tree, the editor, the feed, the terminal's xterm.js buffer) and drop a real folder
  on it (:func:`drop_folder`).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol

import httpx
from playwright.sync_api import (
    Browser,
    BrowserContext,
    ConsoleMessage,
    Dialog,
    Locator,
    Page,
    ViewportSize,
    expect,
)

from sandlot.sdk import Sandbox, Sandlot
from tests.servers import SandlotServer

CHROMIUM = "/usr/bin/chromium"
SANDLOT = [sys.executable, "-m", "sandlot.cli.main"]
USER = "ada"
THREAD = "thr_page"
#: The size of every page the tests open, and of the screenshots in docs/images.
VIEWPORT: ViewportSize = {"width": 1280, "height": 720}
ROOT = Path(__file__).resolve().parents[2]
IMAGES = ROOT / "docs" / "images"
Scheme = Literal["light", "dark"]


# --- who works in the workspace besides the page ------------------------------------------


class Agent(Protocol):
    """Someone working in the workspace beside the browser (paths relative to its root)."""

    #: The actor the page shows for its work, or None where it cannot know (local mode).
    actor: str | None

    def write(self, path: str, text: str) -> None: ...
    def run(self, command: str) -> None: ...
    def read(self, path: str) -> str: ...


@dataclass
class SdkAgent:
    """The SDK with an agent-actor API key, as sandlot's deepagents backend calls it
    (``write``: ``PUT /fs/write``; ``run``: ``POST /exec``; ``read``: the file's bytes)."""

    sandbox: Sandbox
    actor: str | None = "agent"

    def write(self, path: str, text: str) -> None:
        self.sandbox.write(f"/workspace/{path}", text)

    def run(self, command: str) -> None:
        self.sandbox.exec(command, cwd="/workspace")

    def read(self, path: str) -> str:
        return self.sandbox.read_text(f"/workspace/{path}")


@dataclass
class FolderAgent:
    """A program of the machine working in the served folder (local mode has no agent
    API: whatever edits the folder, the page sees through the folder's watcher)."""

    root: Path
    actor: str | None = None

    def write(self, path: str, text: str) -> None:
        target = self.root / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)

    def run(self, command: str) -> None:
        subprocess.run(["sh", "-c", command], cwd=self.root, check=True, timeout=30)

    def read(self, path: str) -> str:
        return (self.root / path).read_text()


@dataclass
class Site:
    """A running server of the page in one workspace mode."""

    mode: str
    #: The server's own URL (a test may reach it through a proxy instead).
    url: str
    #: Where the page opens the workspace.
    entry: str
    #: A human API key of :data:`USER`, the browser's (and the CLI's) credential.
    key: str
    agent: Agent
    #: The environment for ``sandlot`` commands against this server (sandbox mode).
    cli_env: dict[str, str] = field(default_factory=dict)
    #: The server's output so far (for a failure to be understood).
    output: Callable[[], str] = lambda: ""

    def link(self, base: str | None = None, *, to: str | None = None) -> str:
        """A one-time sign-in link to ``to`` (default :attr:`entry`), made by the server (as
        ``sandlot open`` asks for one), on ``base`` (the URL the browser reaches it by)."""
        base = base or self.url
        r = httpx.post(
            f"{base}/api/auth/links",
            json={"next": to or self.entry},
            headers={"Authorization": f"Bearer {self.key}"},
            timeout=30,
        )
        assert r.status_code == 201, r.text
        url = str(r.json()["url"])
        assert url.startswith(f"{base}/login?token="), url
        return url


@contextlib.contextmanager
def sandbox_site(tmp: Path) -> Iterator[Site]:
    """``sandlot serve`` (isolated sandboxes where the tests run as root): the page opens
    :data:`THREAD`, whose sandbox an agent-actor SDK client ensured first."""
    server = SandlotServer(tmp / "d").start()
    try:
        human = server.key(USER)
        with Sandlot(server.url, server.key(USER, "agent"), auto_refresh=False) as client:
            sandbox = client.ensure(THREAD)
            env = {
                **os.environ,
                "SANDLOT_URL": server.url,
                "SANDLOT_API_KEY": human,
                "HOME": str(tmp),
                "XDG_CACHE_HOME": str(tmp / ".cache"),
                "XDG_CONFIG_HOME": str(tmp / ".config"),
            }
            yield Site(
                mode="sandbox",
                url=server.url,
                entry=f"/?thread={THREAD}",
                key=human,
                agent=SdkAgent(sandbox),
                cli_env=env,
                output=lambda: "".join(server.output),
            )
    finally:
        server.stop()
        # In a thread of its own: the removal runs an event loop, and Playwright's sync API
        # holds the test thread's.
        with ThreadPoolExecutor(1) as pool:
            pool.submit(server.cleanup).result()


@contextlib.contextmanager
def local_site(tmp: Path) -> Iterator[Site]:
    """``sandlot web --mode local`` over a fresh folder, accepting the API keys of a
    broker data directory made for it (so a test gets a link per browser)."""
    folder = tmp / "folder"
    folder.mkdir()
    data = tmp / "data"
    env = {**os.environ, "HOME": str(tmp), "SANDLOT_WORKSPACE_MODE": ""}
    made = subprocess.run(
        [*SANDLOT, "keys", "create", "--user", USER, "--data-dir", str(data), "--json"],
        env=env,
        capture_output=True,
        check=True,
        timeout=60,
    )
    key = str(json.loads(made.stdout)["key"])
    log = tmp / "web.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [
                *SANDLOT,
                "web",
                "--mode",
                "local",
                "--root",
                str(folder),
                "--port",
                "0",
                "--user",
                USER,
                "--data-dir",
                str(data),
            ],
            env=env,
            cwd=tmp,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        url = ""
        deadline = time.monotonic() + 30
        while not url and time.monotonic() < deadline and proc.poll() is None:
            if m := re.search(r"sandlot web listening on (\S+)", log.read_text()):
                url = m.group(1)
            time.sleep(0.05)
        assert url, f"sandlot web did not start:\n{log.read_text()}"
        yield Site(
            mode="local",
            url=url,
            entry="/",
            key=key,
            agent=FolderAgent(folder),
            output=log.read_text,
        )
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# --- the browser ----------------------------------------------------------------------------

#: Reports every CSP violation of the page to the test (the page cannot block this: it is
#: added by the browser before any of the page's own scripts).
_CSP_LISTENER = """
document.addEventListener("securitypolicyviolation", (e) => {
  window.__sandlotCspViolation(
    `${e.violatedDirective} blocked ${e.blockedURI || "(inline)"}` +
      ` at ${e.sourceFile}:${e.lineNumber}`
  );
});
"""


@dataclass
class Watch:
    """What went wrong in a page: console errors, uncaught errors, CSP violations, dialogs.

    A test that causes a console error on purpose (a save refused with 412 is logged by
    Chromium as a failed resource load) names it with :meth:`expect`; any other fails it."""

    console: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    csp: list[str] = field(default_factory=list)
    dialogs: list[str] = field(default_factory=list)
    expected: list[re.Pattern[str]] = field(default_factory=list)

    def expect(self, pattern: str) -> None:
        self.expected.append(re.compile(pattern))

    def on_console(self, message: ConsoleMessage) -> None:
        if message.type == "error":
            where = message.location.get("url", "")
            self.console.append(f"{message.text} ({where})")

    def on_dialog(self, dialog: Dialog) -> None:
        self.dialogs.append(f"{dialog.type}: {dialog.message}")
        with contextlib.suppress(Exception):
            dialog.dismiss()

    def problems(self) -> list[str]:
        unexpected = [c for c in self.console if not any(p.search(c) for p in self.expected)]
        return (
            [f"console error: {c}" for c in unexpected]
            + [f"page error: {e}" for e in self.errors]
            + [f"CSP violation: {v}" for v in self.csp]
            + [f"dialog opened: {d}" for d in self.dialogs]
        )


@dataclass
class Tab:
    context: BrowserContext
    page: Page
    watch: Watch


@contextlib.contextmanager
def tab(browser: Browser, *, color_scheme: Scheme = "light") -> Iterator[Tab]:
    """A fresh browser profile (no cookie) and a page in it, watched."""
    context = browser.new_context(viewport=VIEWPORT, color_scheme=color_scheme)
    watch = Watch()
    context.expose_binding("__sandlotCspViolation", lambda _source, text: watch.csp.append(text))
    context.add_init_script(_CSP_LISTENER)
    page = context.new_page()
    page.on("console", watch.on_console)
    page.on("pageerror", lambda error: watch.errors.append(str(error)))
    page.on("dialog", watch.on_dialog)
    try:
        yield Tab(context, page, watch)
    finally:
        context.close()


def sign_in(page: Page, link: str, *, connected: bool = True) -> None:
    """Follows a one-time link: the server sets the session cookie and sends the browser
    to the link's page (a workspace, which connects, unless ``connected`` is false)."""
    page.goto(link)
    if connected:
        expect_connected(page)


# --- reading the page -----------------------------------------------------------------------


def css_string(value: str) -> str:
    """``value`` as a quoted CSS string (for attribute selectors)."""
    return json.dumps(value)


def node(page: Page, path: str) -> Locator:
    """The tree's node for ``path`` (relative to the workspace root)."""
    return page.locator(f'[data-testid="tree-node"][data-path={css_string(path)}]')


def feed_item(page: Page, kind: str, **attrs: str) -> Locator:
    selector = f'[data-testid="feed-item"][data-kind={css_string(kind)}]'
    for name, value in attrs.items():
        selector += f"[data-{name}={css_string(value)}]"
    return page.locator(selector)


def expect_connected(page: Page, timeout: float = 15_000) -> None:
    expect(page.get_by_test_id("connection")).to_have_attribute(
        "data-state", "connected", timeout=timeout
    )


def open_file(page: Page, path: str) -> Locator:
    """Opens ``path`` (a root-level file) in the editor; answers the editable area."""
    node(page, path).click()
    expect(page.get_by_test_id("editor-path")).to_contain_text(path, timeout=10_000)
    content = page.get_by_test_id("editor").locator(".cm-content")
    expect(content).to_be_visible()
    return content


_TERMINAL_LINES = """() => {
  const term = window.sandlotTerminal;
  if (!term) return null;
  const buffer = term.buffer.active;
  const lines = [];
  for (let i = 0; i < buffer.length; i++) {
    const line = buffer.getLine(i);
    if (line) lines.push(line.translateToString(true));
  }
  return lines;
}"""


def terminal_lines(page: Page) -> list[str]:
    """The active terminal's lines, as xterm.js holds them (wrapped lines apart)."""
    lines = page.evaluate(_TERMINAL_LINES)
    return list(lines or [])


def wait_for_terminal_line(page: Page, pattern: str, timeout: float = 10_000) -> list[str]:
    """Waits until a line of the active terminal matches ``pattern`` (a JavaScript regular
    expression, tested on each line); answers the lines."""
    page.wait_for_function(
        f"""(pattern) => {{
          const lines = ({_TERMINAL_LINES})();
          return lines !== null && lines.some((l) => new RegExp(pattern).test(l));
        }}""",
        arg=pattern,
        timeout=timeout,
    )
    return terminal_lines(page)


def open_terminal(page: Page) -> str:
    """The page's terminal with a shell ready to type in (a new tab if none is open);
    answers the shell's name (the dataplane's, as ``sandlot shell --session`` takes it)."""
    terminal = page.get_by_test_id("terminal")
    expect(terminal).to_be_visible(timeout=10_000)
    if page.get_by_test_id("terminal-tab").count() == 0:
        page.get_by_test_id("terminal-new").click()
    page.wait_for_function(
        "() => window.sandlotTerminal && window.sandlotTerminalSession", timeout=15_000
    )
    # The prompt: the shell runs and the page shows its output.
    wait_for_terminal_line(page, r"[$#]\s*$", timeout=15_000)
    name = page.evaluate("() => window.sandlotTerminalSession")
    assert isinstance(name, str) and name, name
    return name


def type_in_terminal(page: Page, text: str) -> None:
    """Types ``text`` and Enter into the active terminal, as a user at the keyboard."""
    page.get_by_test_id("terminal").locator(".xterm").first.click()
    page.keyboard.type(text)
    page.keyboard.press("Enter")


# --- a folder dropped from the desktop --------------------------------------------------------


def drop_folder(page: Page, target: Locator, folder: Path) -> list[dict[str, object]]:
    """Drops ``folder`` from "the desktop" on an empty spot of ``target``; answers the drag
    events the page saw (type, target, items and files, whether the page took them).

    This is the browser's own drop of a real folder (Chrome DevTools'
    ``Input.dispatchDragEvent`` with the folder's path, what the OS hands the browser when
    a user drags a folder in), not an event made up in the page: the page receives
    ``dragenter``, ``dragover`` and ``drop`` with a ``DataTransfer`` whose one item is the
    folder. ``dataTransfer.files`` holds the folder as one unreadable ``File``; its
    contents are reached only through the entries API: the page must read a drop with
    ``item.webkitGetAsEntry()`` (a ``FileSystemDirectoryEntry``, walked with
    ``createReader().readEntries()`` until it answers an empty batch, each file with
    ``entry.file()``), and must call ``preventDefault()`` on ``dragenter``/``dragover``
    for the drop to happen at all.

    The drop is aimed at the lowest empty spot of the tree, and let go only once the page
    has taken the drag there; if the layout moved under the pointer meanwhile, the drag is
    cancelled and aimed again, as a person would. A drop the page saw is never repeated.
    """
    # As a person would: onto a tree that has listed the workspace (its first listing no
    # longer moves what is under the pointer).
    expect(target).to_have_attribute("aria-busy", "false", timeout=10_000)
    # What the page made of each drag event, seen after its own handlers (bubbling to the
    # window), for the test's diagnosis.
    page.evaluate(
        """() => {
          const seen = (window.sandlotDrags = []);
          for (const type of ["dragenter", "dragover", "dragleave", "drop"])
            window.addEventListener(type, (e) => seen.push({
              type,
              target: e.target instanceof Element
                ? (e.target.getAttribute("data-testid") ?? e.target.className)
                : String(e.target),
              at: [e.clientX, e.clientY],
              items: e.dataTransfer ? e.dataTransfer.items.length : -1,
              files: e.dataTransfer ? e.dataTransfer.files.length : -1,
              taken: e.defaultPrevented,
            }));
        }"""
    )
    data = {"items": [], "files": [str(folder)], "dragOperationsMask": 1}  # copy
    # One DevTools session for the whole drag, kept until the page has seen the drop:
    # closing it ends the browser's drag state.
    cdp = page.context.new_cdp_session(page)
    try:
        for _attempt in range(3):
            point = _drop_point(page, target)
            before = page.evaluate("() => window.sandlotDrags.length")
            for kind in ("dragEnter", "dragOver"):
                cdp.send(
                    "Input.dispatchDragEvent",
                    {"type": kind, "x": point[0], "y": point[1], "data": data},
                )
            page.wait_for_function(
                "(n) => window.sandlotDrags.slice(n).some((e) => e.type === 'dragover')",
                arg=before,
                timeout=10_000,
            )
            # The page moved under the pointer (a panel beside the tree grew between the
            # aim and the drag): the page did not take the drag there, so, as a person
            # would, let go elsewhere and aim again.
            if not page.evaluate("() => window.sandlotDrags.at(-1).taken"):
                cdp.send(
                    "Input.dispatchDragEvent",
                    {"type": "dragCancel", "x": point[0], "y": point[1], "data": data},
                )
                time.sleep(0.2)
                continue
            cdp.send(
                "Input.dispatchDragEvent",
                {"type": "drop", "x": point[0], "y": point[1], "data": data},
            )
            break
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            seen: list[dict[str, object]] = page.evaluate("() => window.sandlotDrags")
            if any(event["type"] == "drop" for event in seen):
                break
            time.sleep(0.05)
        return page.evaluate("() => window.sandlotDrags")  # type: ignore[no-any-return]
    finally:
        cdp.detach()


def _drop_point(page: Page, target: Locator) -> tuple[float, float]:
    """The lowest point of ``target`` that shows no node of the tree (a drop on a folder
    node uploads into that folder; on the tree's empty space, into the root)."""
    box = target.bounding_box()
    assert box is not None, "the drop target is not shown"
    point = page.evaluate(
        """([x, top, bottom]) => {
          for (let y = bottom - 4; y > top; y -= 4) {
            const hit = document.elementFromPoint(x, y);
            const tree = hit && hit.closest('[data-testid="tree"]');
            if (tree && !hit.closest('[data-testid="tree-node"]')) return [x, y];
          }
          return null;
        }""",
        [box["x"] + box["width"] / 2, box["y"], box["y"] + box["height"]],
    )
    assert point is not None, "the tree has no empty spot to drop on"
    return point[0], point[1]


# --- screenshots ------------------------------------------------------------------------------


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def screenshot(page: Page, name: str, into: Path) -> Path:
    """``workspace-<name>.png`` of the whole viewport, into ``into``, or into docs/images
    with ``SANDLOT_UPDATE_SCREENSHOTS=1`` (the images docs/WORKSPACE.md shows)."""
    if os.environ.get("SANDLOT_UPDATE_SCREENSHOTS") == "1":
        into = IMAGES
    into.mkdir(parents=True, exist_ok=True)
    target = into / f"workspace-{name}.png"
    data = page.screenshot(path=target, animations="disabled", caret="initial")
    assert png_size(data) == (VIEWPORT["width"], VIEWPORT["height"])
    return target
