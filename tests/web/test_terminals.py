"""boring-ui's terminals over a real ``sandlot serve``: ``/ws/pty`` sessions are the
sandbox's shared shells (the CLI's included), reattach without loss, ids that cannot be
forged or outlive their shell, origins, ``/api/sessions``, limits, and no credential in
any frame, body or log line."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import shutil
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import jwt
import pexpect
import pytest
from websockets.exceptions import InvalidStatus

from sandlot.sdk import Grant, Sandlot
from sandlot.web.app import create_web_app
from sandlot.web.chat import chat_routes
from sandlot.web.gateway import Gateway
from sandlot.web.limits import FrameQueue, QueueOverflow, SocketGate, SocketLimits
from sandlot.web.ptyoutput import BULK, Output, OutputFrames, ShellOutput
from sandlot.web.session_tokens import SessionTokens
from sandlot.web.settings import WebSettings
from sandlot.web.terminals import terminal_routes
from tests.servers import SandlotServer, running
from tests.web.browser import (
    Browser,
    GrantWorkspace,
    Socket,
    dataplane_gateway,
    sign_in,
    web_app,
    workspace_of,
)
from tests.web.conftest import Clock, assert_not_leaked, serving

THREAD = "thr_webterm"
SANDLOT = [sys.executable, "-m", "sandlot.cli.main"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SandlotServer]:
    with running(tmp_path_factory.mktemp("webterm") / "d") as srv:
        yield srv


@pytest.fixture(scope="module")
def alice_key(server: SandlotServer) -> str:
    return server.key("alice")


@pytest.fixture(scope="module")
def grant(server: SandlotServer, alice_key: str) -> Grant:
    with Sandlot(server.url, alice_key, auto_refresh=False) as client:
        return client.ensure(THREAD).grant


@pytest.fixture(scope="module")
def renewed(server: SandlotServer, alice_key: str, grant: Grant) -> Grant:
    """Another grant to the same sandbox: another token, as a renewal gives."""
    with Sandlot(server.url, alice_key, auto_refresh=False) as client:
        again = client.ensure(THREAD).grant
    assert again.sandbox_id == grant.sandbox_id and again.token != grant.token
    return again


@contextlib.asynccontextmanager
async def app(
    server: SandlotServer,
    grant: Grant,
    *,
    clock: Clock | None = None,
    limits: SocketLimits | SocketGate | None = None,
    user: str = "alice",
    refresh_seconds: float = 60.0,
    others: tuple[Grant, ...] = (),
    workspace: GrantWorkspace | None = None,
    gateway: Gateway | None = None,
) -> AsyncIterator[tuple[Browser, SessionTokens]]:
    workspace = workspace or GrantWorkspace(THREAD, grant, others)
    async with gateway or dataplane_gateway(server) as gateway:
        routes = web_app(
            lambda auth, tokens: terminal_routes(
                gateway=gateway,
                tokens=tokens,
                auth=auth,
                workspace_of=workspace_of(workspace),
                limits=limits,
                refresh_seconds=refresh_seconds,
            ),
            clock=clock,
            user=user,
        )
        async with routes as (browser, tokens):
            yield browser, tokens


async def opened(sock: Socket) -> dict[str, Any]:
    """The ``session`` frame, once the shell's prompt has shown."""
    session = await sock.until(lambda f: f["type"] in ("session", "error", "session_not_found"))
    assert session["type"] == "session", session
    return session


def stream_of(chunks: list[tuple[int, str]]) -> bytes:
    """The output as the page pieces it together by offset: every chunk must start where
    the previous one ended (no byte twice, none missing)."""
    out = b""
    start = chunks[0][0] if chunks else 0
    for offset, data in chunks:
        assert offset == start + len(out), f"chunk at {offset}, expected {start + len(out)}"
        out += data.encode()
    return out


# --- shared shells --------------------------------------------------------------------


async def test_the_cli_shell_and_a_browser_terminal_are_one_shell(
    server: SandlotServer, grant: Grant, alice_key: str, tmp_path: Path
) -> None:
    env = {
        **os.environ,
        "SANDLOT_URL": server.url,
        "SANDLOT_API_KEY": alice_key,
        "HOME": str(tmp_path),
        "XDG_CACHE_HOME": str(tmp_path / ".cache"),
        "XDG_CONFIG_HOME": str(tmp_path / ".config"),
    }
    cli = pexpect.spawn(
        SANDLOT[0], [*SANDLOT[1:], "shell", THREAD], env=env, encoding="utf-8", timeout=30
    )
    try:
        await asyncio.to_thread(cli.expect, r"\$ ")
        async with app(server, grant) as (browser, _), browser.socket(shell="main") as web:
            session = await opened(web)
            assert session["name"] == "main" and session["role"] == "driver"
            await web.type("echo typed-in-the-browser-$((6*7))\r")
            await asyncio.to_thread(cli.expect, "typed-in-the-browser-42")
            cli.sendline("echo typed-in-the-cli-$((7*7))")
            await web.until_output("typed-in-the-cli-49")
            # The same bytes: the browser's own echo reached the CLI, the CLI's the browser.
            assert "typed-in-the-browser-42" in web.output()
    finally:
        cli.terminate(force=True)


async def test_two_browser_tabs_on_one_session_see_the_same_bytes(
    server: SandlotServer, grant: Grant
) -> None:
    async with app(server, grant) as (browser, _), browser.socket() as one:
        session = await opened(one)
        assert session["name"].startswith("web-")
        async with browser.socket(session_id=session["session_id"], resume=1) as two:
            again = await opened(two)
            assert again["name"] == session["name"]
            await one.type("echo from-tab-one-$((1+1))\r")
            await two.until_output("from-tab-one-2")
            # Raw text is typed as is; a lone surrogate (a JSON escape) as "?".
            await two.send("echo raw-$((5+5))\r")
            await one.until_output("raw-10")
            await two.send('{"type": "input", "data": "echo sur-\\ud800-$((1+2))\\r"}')
            await one.until_output("sur-?-3")
            await two.type("echo from-tab-two-$((2+2))\r")
            await one.until_output("from-tab-two-4")
            await two.until_output("from-tab-two-4")
        # Where both received output, they received the same bytes.
        assert one.same_bytes_as(two) > 0
        assert b"from-tab-two-4" in stream_of(one.chunks)


async def test_a_dropped_socket_reattaches_from_its_offset_with_nothing_lost(
    server: SandlotServer, grant: Grant
) -> None:
    lines = 3000
    async with app(server, grant) as (browser, _):
        async with browser.socket() as first:
            session = await opened(first)
            await first.type(
                f"for i in $(seq 1 {lines}); do echo line-$i; done; sleep 1; echo all-$((1000+1))\r"
            )
            await first.until_output("line-1\r\n")
            # The network goes: no close frame, no goodbye.
            first.ws.transport.abort()
        chunks = list(first.chunks)
        async with browser.socket(
            session_id=session["session_id"], resume=1, offset=first.end()
        ) as second:
            again = await opened(second)
            await second.until_output("all-1001")
            assert not [f for f in second.frames if f["type"] in ("history", "gap")]
            # Resuming from the offset: what the first socket had, then exactly what followed.
            out = stream_of(chunks + second.chunks).decode()
            numbers = [int(n) for n in re.findall(r"line-(\d+)\r\n", out)]
            assert numbers == list(range(1, lines + 1))
        # Without an offset, a reattach gets the history, as boring-ui's page expects.
        async with browser.socket(session_id=again["session_id"], resume=1) as third:
            await opened(third)
            history = await third.until(lambda f: f["type"] == "history")
            assert "all-1001" in history["data"]


async def test_a_reattach_beyond_the_replay_buffer_gets_an_explicit_gap(
    server: SandlotServer, grant: Grant
) -> None:
    async with app(server, grant) as (browser, _):
        async with browser.socket() as first:
            session = await opened(first)
            await first.type("echo ready-$((5*5))\r")
            await first.until_output("ready-25")
            seen = first.end()
            await first.type("head -c 3000000 /dev/zero | tr '\\0' z; echo; echo end-$((2+3))\r")
            first.ws.transport.abort()
        # Wait until the shell has written far more than its replay buffer (1 MiB) holds.
        async with asyncio.timeout(60):
            while True:
                listed = (await browser.request("GET", "/api/sessions")).json()["sessions"]
                (ours,) = [s for s in listed if s.get("name") == session["name"]]
                if ours["history_count"] > seen + 2_500_000:
                    break
                await asyncio.sleep(0.1)
        async with browser.socket(
            session_id=session["session_id"], resume=1, offset=seen
        ) as second:
            await opened(second)
            await second.until_output("end-5")
            gaps = [f for f in second.frames if f["type"] == "gap"]
            assert len(gaps) == 1 and gaps[0]["from"] == seen and gaps[0]["to"] > seen + 1_000_000
            # After the gap, every byte once and in order, to the end.
            assert second.chunks[0][0] == gaps[0]["to"]
            assert b"end-5" in stream_of(second.chunks)


async def test_a_shell_that_ended_is_not_found_and_its_exit_is_told(
    server: SandlotServer, grant: Grant
) -> None:
    async with app(server, grant) as (browser, _):
        async with browser.socket() as sock:
            session = await opened(sock)
            await sock.type("exit 3\r")
            code, frames = await sock.closed()
        assert code == 1000
        assert {"type": "exit", "code": 3, "session_id": session["session_id"]} in frames
        async with browser.socket(session_id=session["session_id"], resume=1) as again:
            code, frames = await again.closed()
        assert code == 4404 and frames == [{"type": "session_not_found"}]


async def test_a_token_the_dataplane_refuses_is_renewed_once(
    server: SandlotServer, grant: Grant
) -> None:
    header, payload, _ = grant.token.split(".")
    workspace = GrantWorkspace(THREAD, grant, stale=f"{header}.{payload}.bm90LXRoZS1zaWduYXR1cmU")
    async with app(server, grant, workspace=workspace) as (browser, _), browser.socket() as sock:
        await opened(sock)
        await sock.type("echo renewed-$((8*8))\r")
        await sock.until_output("renewed-64")
    assert workspace.renewals == 1


async def test_the_routes_plugged_into_the_web_app_use_its_gateway_auth_and_workspaces(
    server: SandlotServer, alice_key: str, tmp_path: Path
) -> None:
    """As ``sandlot serve`` wires them: ``create_web_app(extra_routes=...)`` in sandbox mode,
    the workspace named by ``?thread=`` and negotiated with the broker for the user."""
    settings = WebSettings(data_dir=tmp_path)
    web = create_web_app(
        settings,
        broker_url=server.url,
        authenticator=None,
        extra_routes=[*terminal_routes(), *chat_routes()],
    )
    auth = web.state.web.auth
    async with web.router.lifespan_context(web), serving(web) as base:
        cookie, csrf = await sign_in(base, auth, "alice", credential=alice_key)
        browser = Browser(base, auth, cookie, csrf)
        features = (await browser.request("GET", "/api/capabilities")).json()["features"]
        assert features["pty"] is True and features["chat_claude_code"] is True
        async with browser.socket(thread=THREAD, shell="main") as sock:
            assert (await opened(sock))["name"] == "main"
            await sock.type("echo wired-$((9*9))\r")
            await sock.until_output("wired-81")
        listed = await browser.request("GET", "/api/sessions", params={"thread": THREAD})
        assert "main" in [s.get("name") for s in listed.json()["sessions"]]
        # The built-in template: Claude Code, where the image has it.
        async with browser.socket("/ws/claude-stream", thread=THREAD) as sock:
            first = await sock.frame()
        if shutil.which("claude") is None:
            assert first["subtype"] == "error" and "not installed" in first["message"]
        else:
            assert first["subtype"] == "connected"
        # A thread with no sandbox has no shell: none is made for a socket.
        async with browser.socket(thread="thr_other") as sock:
            refused = await sock.frame()
        assert refused["type"] == "error" and refused["error"]["code"] == "NOT_FOUND", refused
        made = await browser.request("POST", "/api/v1/workspace", params={"thread": "thr_other"})
        assert made.status_code == 200, made.text
        # Another thread's id does not open this one's shell.
        async with browser.socket(thread="thr_other") as sock:
            other = await opened(sock)
        async with browser.socket(thread=THREAD, session_id=other["session_id"], resume=1) as sock:
            assert (await sock.closed())[1] == [{"type": "session_not_found"}]


# --- session ids, providers, origins --------------------------------------------------


async def test_expired_forged_and_foreign_session_ids_are_not_found(
    server: SandlotServer, grant: Grant
) -> None:
    clock = Clock()
    async with app(server, grant, clock=clock) as (browser, tokens):
        async with browser.socket() as sock:
            session = await opened(sock)
        good = session["session_id"]
        header, _, signature = good.split(".")
        claims = jwt.decode(good, options={"verify_signature": False})
        edited = jwt.utils.base64url_encode(json.dumps({**claims, "sub": "bob"}).encode())
        shell = claims["exec"]
        forged = [
            # Signed with another key.
            jwt.encode(claims, "k" * 32, algorithm="HS256"),
            # Another user's claims under the original signature.
            f"{header}.{edited.decode()}.{signature}",
            # Real ids, of another user, workspace, kind.
            tokens.issue(provider="shell", exec_id=shell, kind="pty", user="bob", workspace=THREAD),
            tokens.issue(provider="shell", exec_id=shell, kind="pty", user="alice", workspace="t"),
            tokens.issue(
                provider="shell", exec_id=shell, kind="stream", user="alice", workspace=THREAD
            ),
            # No signature at all.
            "eyJhbGciOiJub25lIn0.eyJzdWIiOiJhbGljZSJ9.",
        ]
        for session_id in forged:
            for resume in (1, None):
                async with browser.socket(session_id=session_id, resume=resume) as sock:
                    code, frames = await sock.closed()
                assert code == 4404 and frames == [{"type": "session_not_found"}], session_id
        clock.advance(tokens.ttl_seconds + 1)
        async with browser.socket(session_id=good, resume=1) as sock:
            code, frames = await sock.closed()
        assert code == 4404 and frames == [{"type": "session_not_found"}]
        # An id boring-ui's page made up is a new terminal, unless it asks to resume it.
        async with browser.socket(session_id="0b6f3c1e-made-up-by-the-page") as sock:
            assert (await opened(sock))["name"].startswith("web-")
        async with browser.socket(session_id="0b6f3c1e-made-up-by-the-page", resume=1) as sock:
            assert (await sock.closed())[1] == [{"type": "session_not_found"}]


async def test_an_unknown_provider_is_closed_with_4003(server: SandlotServer, grant: Grant) -> None:
    async with app(server, grant) as (browser, _), browser.socket(provider="codex") as sock:
        code, frames = await sock.closed()
    assert code == 4003
    assert frames[0]["type"] == "error" and "shell" in frames[0]["data"]


async def test_a_foreign_origin_or_no_session_is_refused(
    server: SandlotServer, grant: Grant
) -> None:
    async with app(server, grant) as (browser, _):
        with pytest.raises(InvalidStatus) as refused:
            async with browser.socket(origin="http://evil.example"):
                pass
        assert refused.value.response.status_code == 403
        browser.cookie = "not-a-session"
        with pytest.raises(InvalidStatus) as refused:
            async with browser.socket():
                pass
        assert refused.value.response.status_code == 401


# --- /api/sessions --------------------------------------------------------------------


async def test_api_sessions_creates_and_lists_shells(server: SandlotServer, grant: Grant) -> None:
    async with app(server, grant) as (browser, _):
        created = await browser.request("POST", "/api/sessions", json={"shell": "listed"})
        assert created.status_code == 201, created.text
        session_id = created.json()["session_id"]
        async with browser.socket(session_id=session_id, resume=1) as sock:
            assert (await opened(sock))["name"] == "listed"
            listed = await browser.request("GET", "/api/sessions")
        assert listed.status_code == 200
        sessions = listed.json()["sessions"]
        ours = [s for s in sessions if s.get("name") == "listed"]
        assert len(ours) == 1 and ours[0]["type"] == "pty" and ours[0]["alive"] is True
        assert ours[0]["clients"] == 1 and set(ours[0]) >= {"id", "history_count"}
        # A listed id opens the same shell.
        async with browser.socket(session_id=ours[0]["id"], resume=1) as sock:
            assert (await opened(sock))["name"] == "listed"
        refused = await browser.request(
            "POST", "/api/sessions", json={"shell": "bad name; rm -rf /"}
        )
        assert refused.status_code == 400
        # No CSRF token: refused by the middleware before the route.
        r = await browser.request("POST", "/api/sessions", headers={"X-CSRF-Token": "wrong"})
        assert r.status_code == 403


# --- limits ---------------------------------------------------------------------------


async def test_connects_beyond_the_user_budget_are_refused(
    server: SandlotServer, grant: Grant
) -> None:
    limits = SocketLimits(user_connect_burst=2, user_connects_per_second=1e-6)
    async with app(server, grant, limits=limits) as (browser, _):
        for _ in range(2):
            async with browser.socket() as sock:
                await opened(sock)
        async with browser.socket() as sock:
            code, frames = await sock.closed()
    assert code == 4429
    assert frames[0]["type"] == "error" and frames[0]["error"]["code"] == "RATE_LIMITED"


async def test_connects_beyond_the_address_budget_are_refused(
    server: SandlotServer, grant: Grant
) -> None:
    limits = SocketLimits(ip_connect_burst=1, ip_connects_per_second=1e-6)
    async with app(server, grant, limits=limits) as (browser, _):
        async with browser.socket() as sock:
            await opened(sock)
        async with browser.socket() as sock:
            code, frames = await sock.closed()
    assert code == 4429 and "address" in frames[0]["data"]


async def test_input_beyond_the_session_budget_is_dropped_and_said(
    server: SandlotServer, grant: Grant
) -> None:
    limits = SocketLimits(input_burst_bytes=2000, input_bytes_per_second=1)
    async with app(server, grant, limits=limits) as (browser, _), browser.socket() as sock:
        await opened(sock)
        await sock.type("echo first-$((1+1))\r")
        await sock.type("echo DROPPED-" + "x" * 3000 + "\r")
        refused = await sock.until(lambda f: f["type"] == "error")
        assert refused["error"]["code"] == "RATE_LIMITED" and "dropped" in refused["data"]
        await sock.type("echo second-$((2+2))\r")
        out = await sock.until_output("second-4")
        assert "first-2" in out and "DROPPED" not in out


async def test_a_browser_that_stops_reading_is_closed_with_an_error(
    server: SandlotServer, grant: Grant
) -> None:
    gate = SocketGate(SocketLimits(output_queue_frames=4))
    gateway = dataplane_gateway(server)
    async with (
        app(server, grant, limits=gate, gateway=gateway) as (browser, _),
        browser.socket() as sock,
    ):
        await opened(sock)
        await sock.type("head -c 60000000 /dev/zero | tr '\\0' y; echo\r")
        # Not reading: the browser's buffers fill, then the server's queue.
        async with asyncio.timeout(60):
            while gate.overflows == 0:
                await asyncio.sleep(0.05)
        code, frames = await sock.closed()
    assert code == 1013
    assert frames[-1]["type"] == "error" and frames[-1]["error"]["code"] == "RATE_LIMITED"
    assert "reconnect" in frames[-1]["data"]
    ended = {"channel": "pty", "side": "limit"}
    async with asyncio.timeout(30):  # counted as the server closes its side
        while not gateway.registry.get_sample_value("sandlot_web_socket_disconnects_total", ended):
            await asyncio.sleep(0.02)


async def test_sockets_are_counted_by_who_ended_them_and_why(
    server: SandlotServer, grant: Grant
) -> None:
    gateway = dataplane_gateway(server)

    def count(name: str, **labels: str) -> float:
        return gateway.registry.get_sample_value(name, {"channel": "pty", **labels}) or 0.0

    async def until(name: str, value: float, **labels: str) -> None:
        async with asyncio.timeout(30):  # the server may close its side after the browser
            while count(name, **labels) != value:
                await asyncio.sleep(0.02)

    async with app(server, grant, gateway=gateway) as (browser, _):
        async with browser.socket() as sock:
            await opened(sock)
            assert count("sandlot_web_sockets_open") == 1
        await until("sandlot_web_socket_disconnects_total", 1, side="browser")
        async with browser.socket() as sock:
            await opened(sock)
            await sock.type("exit 3\r")
            code, frames = await sock.closed()
        assert code == 1000 and frames[-1]["type"] == "exit"
        await until("sandlot_web_socket_disconnects_total", 1, side="upstream")
        async with browser.socket(session_id="not-a-session", resume=1) as sock:
            assert (await sock.closed())[0] == 4404
        async with browser.socket(provider="nope") as sock:
            assert (await sock.closed())[0] == 4003
        async with browser.socket(role="king") as sock:
            assert (await sock.closed())[0] == 1008
        await until("sandlot_web_socket_disconnects_total", 3, side="server")
        assert count("sandlot_web_sockets_open") == 0
    reasons = ("session_not_found", "unknown_provider", "refused", "rate_limited", "upstream")
    failures = {r: count("sandlot_web_attach_failures_total", reason=r) for r in reasons}
    assert failures == {
        "session_not_found": 1,
        "unknown_provider": 1,
        "refused": 1,
        "rate_limited": 0,
        "upstream": 0,
    }
    # Attached sockets are no attach failures, however they ended.
    assert count("sandlot_web_socket_disconnects_total", side="limit") == 0


def test_a_full_queue_drops_repeated_resizes_before_overflowing() -> None:
    queue = FrameQueue(max_frames=3, max_bytes=1000)
    queue.put('{"type":"resize","cols":80,"rows":24}', kind="resize")
    queue.put('{"type":"stdin","data":"a"}')
    queue.put('{"type":"resize","cols":90,"rows":30}', kind="resize")
    # Full: the older resize goes, the newer one stays.
    queue.put('{"type":"stdin","data":"b"}')
    assert queue.dropped_resizes == 1 and len(queue) == 3
    # A new resize replaces the one left.
    queue.put('{"type":"resize","cols":100,"rows":40}', kind="resize")
    assert queue.dropped_resizes == 2
    with pytest.raises(QueueOverflow):
        queue.put('{"type":"stdin","data":"c"}')
    frames = [json.loads(queue._frames[i][1]) for i in range(len(queue))]
    assert frames == [
        {"type": "stdin", "data": "a"},
        {"type": "stdin", "data": "b"},
        {"type": "resize", "cols": 100, "rows": 40},
    ]


def test_output_chunks_side_by_side_become_one_frame_and_bulk_output_waits() -> None:
    now = [100.0]
    frames = OutputFrames(binary=True, session_id="sid", window=0.008, clock=lambda: now[0])
    queue: FrameQueue[str | Output] = FrameQueue(max_frames=10, max_bytes=1 << 20)
    queue.put(Output(10, b"abc"), kind="output")
    queue.put(Output(13, "é".encode()), kind="output")
    queue.put('{"type":"gap","from":15,"to":20}')
    queue.put(Output(20, b"z"), kind="output")
    parts: list[Output] = []
    while (more := queue.take("output")) is not None:
        assert isinstance(more, Output)
        parts.append(more)
    # The gap stops the merge: what follows it is another frame.
    assert [p.offset for p in parts] == [10, 13] and len(queue) == 2
    frame = frames.frame(parts)
    assert frame == (10).to_bytes(8, "big") + "abcé".encode()
    # Small output never waits; after a bulk frame, the next waits out the window.
    assert frames.delay() == 0.0
    frames.frame([Output(15, b"x" * BULK)])
    now[0] += 0.003
    assert frames.delay() == pytest.approx(0.005)
    now[0] += 0.01
    assert frames.delay() == 0.0
    text = OutputFrames(binary=False, session_id="sid").frame([Output(7, b"a"), Output(8, b"b")])
    assert json.loads(text) == {"type": "output", "data": "ab", "session_id": "sid", "offset": 7}


def test_shell_output_sends_each_byte_once_in_order() -> None:
    output = ShellOutput(5)
    assert output.chunk(b"abc", 0) is None  # already sent
    assert output.chunk(b"abcdefg", 2) == Output(5, b"defg")
    assert output.chunk(b"later", 12) is None  # before an attach took effect: comes again
    assert output.chunk(b"hi", 9) == Output(9, b"hi")
    assert output.gap(10, 20) == (11, 20) and output.delivered == 20


# --- nothing leaks --------------------------------------------------------------------


async def test_no_credential_in_any_frame_body_or_log_line(
    server: SandlotServer,
    grant: Grant,
    renewed: Grant,
    alice_key: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    async with app(server, grant, refresh_seconds=0.05, others=(renewed,)) as (browser, _):
        async with browser.socket() as sock:
            session = await opened(sock)
            await sock.type("echo hello-$((3*3))\r")
            await sock.until_output("hello-9")
            # The socket's dataplane token is renewed in place while it lives (an
            # ``auth`` frame upstream, answered and not shown): the terminal goes on.
            renewals = 0
            async with asyncio.timeout(30):
                while renewals < 2:
                    await asyncio.sleep(0.05)
                    renewals = len([r for r in caplog.records if "auth_ok" in r.getMessage()])
            await sock.type("echo still-$((4*4))\r")
            await sock.until_output("still-16")
            assert not [f for f in sock.frames if f["type"] in ("error", "auth_ok")]
        async with browser.socket(session_id=session["session_id"], resume=1, offset=0) as sock:
            await sock.until_output("hello-9")
        await browser.request("GET", "/api/sessions")
        await browser.request("POST", "/api/sessions")
        async with browser.socket(provider="nope") as sock:
            await sock.closed()
    assert_not_leaked(
        caplog.records,
        browser.received,
        credentials=[grant.token, renewed.token, alice_key],
        session_values=[browser.cookie, browser.csrf],
    )
