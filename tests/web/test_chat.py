"""boring-ui's agent chat over a real ``sandlot serve``: a stream-JSON echo program of the
test's own, registered as a template, runs in the sandbox through the dataplane's
streaming exec; the browser can only ever start a template's argv."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from sandlot.protocol.errors import InvalidRequest
from sandlot.sdk import Grant, Sandbox, Sandlot
from sandlot.web.chat import chat_routes
from sandlot.web.chat_templates import (
    CLAUDE,
    ChatTemplate,
    ChatTemplates,
    Parameter,
    load_chat_templates,
)
from sandlot.web.limits import SocketGate, SocketLimits
from sandlot.web.session_tokens import SessionTokens
from sandlot.web.settings import ConfigError, load_web_settings
from sandlot.web.terminals import terminal_routes
from tests.servers import SandlotServer, running
from tests.web.browser import (
    Browser,
    GrantWorkspace,
    Socket,
    dataplane_gateway,
    web_app,
    workspace_of,
)
from tests.web.conftest import assert_not_leaked

THREAD = "thr_webchat"
AGENT = "/workspace/.agents/echo_agent.py"
#: A stand-in for an agent CLI in stream-JSON mode: says how it was started, then answers
#: every user message with an assistant message and a result.
ECHO_AGENT = r"""
import json, os, signal, sys

def say(**frame):
    print(json.dumps(frame), flush=True)

# Written straight to the fd: the handler may run while a print() is under way.
INTERRUPTED = b'{"type": "system", "subtype": "agent_interrupted"}\n'
signal.signal(signal.SIGINT, lambda *_: os.write(1, INTERRUPTED))
say(type="system", subtype="init", argv=sys.argv[1:], env=os.environ.get("ECHO_ENV"))
print("a line that is not JSON", flush=True)
print("a word on stderr", file=sys.stderr, flush=True)
for line in sys.stdin:
    message = json.loads(line)
    if message.get("type") != "user":
        say(type="system", subtype="received", message=message)
        continue
    content = message["message"]["content"]
    text = " ".join(b.get("text", "") for b in content) if isinstance(content, list) else content
    block = {"type": "text", "text": "echo: " + text}
    say(type="assistant", message={"role": "assistant", "content": [block]})
    say(type="result", subtype="success", result="echo: " + text)
"""

ECHO = ChatTemplate(
    id="echo",
    argv=("python3", AGENT, "{model}", "{mode}", "{allowed_tools}"),
    parameters={
        "model": Parameter("model", pattern=r"[a-z0-9.-]{1,40}", flag="--model"),
        "mode": CLAUDE.parameters["mode"],
        "allowed_tools": CLAUDE.parameters["allowed_tools"],
    },
    env={"ECHO_ENV": "from-the-template"},
)
MISSING = ChatTemplate(id="missing", argv=("no-such-agent-program", "--print"))
TEMPLATES = ChatTemplates({"echo": ECHO, "missing": MISSING, "claude": CLAUDE}, "echo")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SandlotServer]:
    with running(tmp_path_factory.mktemp("webchat") / "d") as srv:
        yield srv


@pytest.fixture(scope="module")
def alice_key(server: SandlotServer) -> str:
    return server.key("alice")


@pytest.fixture(scope="module")
def sandbox(server: SandlotServer, alice_key: str) -> Iterator[Sandbox]:
    with Sandlot(server.url, alice_key, auto_refresh=False) as client:
        sandbox = client.ensure(THREAD)
        sandbox.write(AGENT, ECHO_AGENT)
        yield sandbox


@pytest.fixture(scope="module")
def grant(sandbox: Sandbox) -> Grant:
    return sandbox.grant


@contextlib.asynccontextmanager
async def app(
    server: SandlotServer, grant: Grant, *, limits: SocketLimits | None = None
) -> AsyncIterator[tuple[Browser, SessionTokens]]:
    """The chat and the terminal routes sharing one gate, as ``sandlot web`` wires them."""
    workspace = GrantWorkspace(THREAD, grant)
    gate = SocketGate(limits)
    async with dataplane_gateway(server) as gateway:

        def routes(auth: Any, tokens: SessionTokens) -> list[Any]:
            common = {
                "gateway": gateway,
                "tokens": tokens,
                "auth": auth,
                "workspace_of": workspace_of(workspace),
                "limits": gate,
            }
            return [*chat_routes(templates=TEMPLATES, **common), *terminal_routes(**common)]

        async with web_app(routes) as (browser, tokens):
            yield browser, tokens


def chat(browser: Browser, **query: Any) -> Any:
    return browser.socket("/ws/claude-stream", **query)


async def connected(sock: Socket) -> dict[str, Any]:
    frame = await sock.until(lambda f: f["type"] == "system")
    assert frame["subtype"] == "connected", frame
    return frame


def is_text(text: str) -> Any:
    def done(frame: dict[str, Any]) -> bool:
        return frame.get("type") == "result" and frame.get("result") == text

    return done


# --- what runs -------------------------------------------------------------------------


async def test_a_user_message_goes_through_the_template_program_as_stream_json(
    server: SandlotServer,
    grant: Grant,
    alice_key: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    async with (
        app(server, grant) as (browser, _),
        chat(browser, model="m1.5", mode="act", allowedTools="Read, Edit") as sock,
    ):
        hello = await connected(sock)
        assert hello["resumed"] is False and hello["session_id"].startswith("ey")
        assert hello["settings"] == {
            "template": "echo",
            "model": "m1.5",
            "mode": "act",
            "allowed_tools": "Read, Edit",
        }
        init = await sock.until(lambda f: f.get("subtype") == "init")
        # Each value its own argument, after its flag; the mode as the agent spells it.
        assert init["argv"] == [
            "--model",
            "m1.5",
            "--permission-mode",
            "acceptEdits",
            "--allowedTools",
            "Read,Edit",
        ]
        assert init["env"] == "from-the-template"
        assert (await sock.until(lambda f: f["type"] == "raw")) == {
            "type": "raw",
            "data": "a line that is not JSON",
        }
        await sock.send({"type": "user", "message": "hello there"})
        answer = await sock.until(lambda f: f["type"] == "assistant")
        assert answer["message"]["content"] == [{"type": "text", "text": "echo: hello there"}]
        await sock.until(is_text("echo: hello there"))
        # Text that is not JSON is a user message; content blocks pass as they are.
        await sock.send("plain text")
        await sock.until(is_text("echo: plain text"))
        await sock.send({"type": "user", "message": {"content": [{"type": "text", "text": "b"}]}})
        await sock.until(is_text("echo: b"))
        # A message larger than one stdin frame of the dataplane reaches the agent whole.
        long = "long-" + "y" * 1_500_000
        await sock.send({"type": "user", "message": long})
        await sock.until(is_text("echo: " + long))
        await sock.send({"type": "ping"})
        await sock.until(lambda f: f["type"] == "pong")
        stderr = [f for f in sock.frames if f.get("subtype") == "stderr"]
        assert stderr == [{"type": "system", "subtype": "stderr", "data": "a word on stderr"}]
    assert any("template echo" in r.getMessage() for r in caplog.records)
    assert_not_leaked(
        caplog.records,
        browser.received,
        credentials=[grant.token, alice_key],
        session_values=[browser.cookie, browser.csrf],
    )


def exec_commands_between(sandbox: Sandbox, action: Any) -> tuple[list[Any], Any]:
    """The commands the sandbox started while ``action()`` ran (from its event log,
    between two marker files), and what ``action`` returned."""

    def marker_sequence(after: int) -> tuple[int, list[Any]]:
        name = f"/workspace/marker-{secrets.token_hex(4)}"
        sandbox.write(name, "")
        started = []
        with sandbox.events(after=after, timeout=30) as events:
            for event in events:
                if event.kind == "exec" and event.event_type == "exec.started":
                    started.append(event.details["exec"]["command"])
                if event.kind == "fs" and event.details["fs"].get("path") == name:
                    return event.sequence, started
        raise AssertionError("the marker never showed")

    before, _ = marker_sequence(0)
    result = action()
    _, started = marker_sequence(before)
    return started, result


async def test_the_browser_never_runs_a_command_of_its_own(
    server: SandlotServer, grant: Grant, sandbox: Sandbox
) -> None:
    async def attempts() -> list[dict[str, Any]]:
        errors: list[dict[str, Any]] = []
        async with app(server, grant) as (browser, _):
            # Values that do not pass their pattern refuse the request: nothing starts.
            for query in (
                {"model": "m1; touch /workspace/pwned"},
                {"model": "$(touch /workspace/pwned)"},
                {"mode": "act --dangerously-skip-permissions"},
                {"allowedTools": "Read,Bash(touch /workspace/pwned) && x"},
                {"provider": "../../bin/sh"},
            ):
                async with chat(browser, **query) as sock:
                    code, frames = await sock.closed()
                assert code in (1008, 4003), (query, code)
                assert frames[-1]["type"] == "system" and frames[-1]["subtype"] == "error"
                errors.append(frames[-1])
            async with chat(browser, model="m2", command="touch /workspace/pwned") as sock:
                await connected(sock)
                await sock.until(lambda f: f.get("subtype") == "init")
                for frame in (
                    {"type": "command", "command": "touch /workspace/pwned"},
                    {"type": "command", "command": "/x\ntouch /workspace/pwned"},
                    {"type": "start", "command": ["touch", "/workspace/pwned"]},
                    {"type": "exec", "command": "touch /workspace/pwned"},
                    {"type": "control", "subtype": "set_permission_mode", "mode": "bypass"},
                    {"type": "control", "subtype": "set_model", "model": "a;b"},
                ):
                    await sock.send(frame)
                    error = await sock.until(lambda f: f.get("subtype") == "error")
                    errors.append(error)
                # A slash command is typed to the agent, as a user message: never run.
                await sock.send({"type": "command", "command": "/compact now"})
                await sock.until(is_text("echo: /compact now"))
        return errors

    loop = asyncio.get_running_loop()

    def action() -> list[dict[str, Any]]:
        return asyncio.run_coroutine_threadsafe(attempts(), loop).result(120)

    started, errors = await asyncio.to_thread(exec_commands_between, sandbox, action)
    assert started == [f"python3 {AGENT} --model m2 --permission-mode default"]
    assert not await asyncio.to_thread(sandbox.exists, "/workspace/pwned")
    assert all("pwned" not in e["message"] for e in errors)  # values are never echoed


# --- sessions --------------------------------------------------------------------------


async def test_a_chat_is_reattached_by_its_id_and_forged_ids_are_not_found(
    server: SandlotServer, grant: Grant
) -> None:
    async with app(server, grant) as (browser, tokens):
        async with chat(browser) as sock:
            first = await connected(sock)
            await sock.send({"type": "user", "message": "one"})
            await sock.until(is_text("echo: one"))
        async with chat(browser, session_id=first["session_id"], resume=1) as sock:
            again = await connected(sock)
            assert again["resumed"] is True
            # The conversation so far is replayed, then it goes on.
            await sock.until(is_text("echo: one"))
            await sock.send({"type": "user", "message": "two"})
            await sock.until(is_text("echo: two"))
            assert len([f for f in sock.frames if f.get("subtype") == "init"]) == 1
        listed = (await browser.request("GET", "/api/sessions")).json()["sessions"]
        streams = [s for s in listed if s["type"] == "stream"]
        assert streams and all(s["alive"] for s in streams)
        async with chat(browser, session_id=streams[0]["id"], resume=1) as sock:
            assert (await connected(sock))["resumed"] is True
        forged = tokens.issue(
            provider="echo", exec_id="ex_nope", kind="stream", user="alice", workspace=THREAD
        )
        other_user = tokens.issue(
            provider="echo", exec_id="ex_x", kind="stream", user="bob", workspace=THREAD
        )
        for session_id in (forged, other_user, first["session_id"][:-2] + "xx"):
            async with chat(browser, session_id=session_id, resume=1) as sock:
                code, frames = await sock.closed()
            assert code == 4404
            assert frames == [{"type": "system", "subtype": "session_not_found"}]
        # force_new: another agent, the previous one stopped.
        async with chat(browser, session_id=first["session_id"], force_new=1) as sock:
            fresh = await connected(sock)
            assert fresh["resumed"] is False and fresh["session_id"] != first["session_id"]
        async with chat(browser, session_id=first["session_id"], resume=1) as sock:
            await connected(sock)
            end = await sock.until(lambda f: f.get("subtype") == "exited")
            assert end["exit_code"] is not None


async def test_interrupt_and_restart(server: SandlotServer, grant: Grant) -> None:
    async with app(server, grant) as (browser, _), chat(browser) as sock:
        first = await connected(sock)
        await sock.until(lambda f: f.get("subtype") == "init")
        await sock.send({"type": "interrupt"})
        await sock.until(lambda f: f.get("subtype") == "interrupted")
        await sock.until(lambda f: f.get("subtype") == "agent_interrupted")
        await sock.send({"type": "restart"})
        restarted = await sock.until(lambda f: f.get("subtype") == "restarted")
        assert restarted["session_id"] != first["session_id"]
        await sock.until(lambda f: f.get("subtype") == "init")
        await sock.send({"type": "user", "message": "after restart"})
        await sock.until(is_text("echo: after restart"))


async def test_an_unknown_provider_or_a_missing_program_is_said(
    server: SandlotServer, grant: Grant
) -> None:
    async with app(server, grant) as (browser, _):
        async with chat(browser, provider="codex") as sock:
            code, frames = await sock.closed()
        assert code == 4003 and frames[-1]["subtype"] == "error"
        async with chat(browser, provider="missing") as sock:
            code, frames = await sock.closed()
        assert frames[-1]["subtype"] == "error"
        assert "not installed" in frames[-1]["message"] and "missing" in frames[-1]["message"]


async def test_chat_input_beyond_its_budget_is_dropped_and_said(
    server: SandlotServer, grant: Grant
) -> None:
    limits = SocketLimits(input_burst_bytes=1000, input_bytes_per_second=1)
    async with app(server, grant, limits=limits) as (browser, _), chat(browser) as sock:
        await connected(sock)
        await sock.send({"type": "user", "message": "small"})
        await sock.until(is_text("echo: small"))
        await sock.send({"type": "user", "message": "big " + "x" * 2000})
        refused = await sock.until(lambda f: f.get("subtype") == "error")
        assert refused["code"] == "RATE_LIMITED"
        await sock.send({"type": "user", "message": "again"})
        await sock.until(is_text("echo: again"))
        assert not [f for f in sock.frames if "big" in str(f.get("result", ""))]


# --- templates -------------------------------------------------------------------------


def test_the_claude_template_builds_its_argv_from_checked_values() -> None:
    argv = CLAUDE.build(
        {"model": ["opus"], "mode": ["plan"], "allowed_tools": ["Read,Bash(git:*)"]}
    )
    assert argv == [
        "claude",
        "-p",
        "--input-format",
        "stream-json",
        "--output-format",
        "stream-json",
        "--verbose",
        "--model",
        "opus",
        "--permission-mode",
        "plan",
        "--allowedTools",
        "Read,Bash(git:*)",
    ]
    assert CLAUDE.build({})[-2:] == ["--permission-mode", "default"]
    for values in (
        {"model": ["opus --dangerously-skip-permissions"]},
        {"model": ["-rf"]},
        {"mode": ["bypassPermissions"]},
        {"allowed_tools": ["Read;rm"]},
        {"model": ["a\nb"]},
    ):
        with pytest.raises(InvalidRequest) as refused:
            CLAUDE.build(values)
        assert next(iter(values.values()))[0] not in refused.value.message


def test_templates_from_a_file(tmp_path: Path) -> None:
    path = tmp_path / "templates.toml"
    path.write_text(
        """
default = "echo"

[templates.echo]
argv = ["python3", "/opt/echo.py", "{model}"]
env = { NO_COLOR = "1" }

[templates.echo.parameters.model]
flag = "--model"
pattern = "[a-z0-9.-]{1,40}"

[templates.tools]
argv = ["agent", "{tools}"]

[templates.tools.parameters.tools]
pattern = "[A-Za-z]+"
list = true
"""
    )
    templates = load_chat_templates(path)
    assert templates.default == "echo" and set(templates.templates) == {"echo", "tools"}
    assert templates.templates["echo"].build({"model": ["x1"]}) == [
        "python3",
        "/opt/echo.py",
        "--model",
        "x1",
    ]
    assert templates.templates["tools"].build({"tools": ["A, B", "C"]}) == ["agent", "A,B,C"]
    assert load_chat_templates(None).default == "claude"
    settings = load_web_settings({"SANDLOT_WEB_CHAT_TEMPLATES": str(path)})
    assert load_chat_templates(settings.chat_templates_file) == templates
    for bad in (
        '[templates.x]\nargv = ["sh", "-c", "run {model}"]',  # a value spliced into text
        '[templates.x]\nargv = ["{model}"]\n[templates.x.parameters.model]\npattern = "a"',
        '[templates.x]\nargv = ["a", "{nope}"]',
        '[templates.x]\nargv = ["a"]\nshell = true',
        '[templates.x]\nargv = ["a", "{m}"]\n[templates.x.parameters.m]\nflag = "--m"',
        'default = "y"\n[templates.x]\nargv = ["a"]',
    ):
        path.write_text(bad)
        with pytest.raises(ConfigError):
            load_chat_templates(path)
