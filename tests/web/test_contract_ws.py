"""The terminals' WebSocket contract, the same in both modes: ``/ws/pty``'s frames and
``/api/sessions``, in ``local`` mode (the web app in this process over a temporary folder,
its shells plain processes of this machine served by the loopback dataplane) and in
``sandbox`` mode (a real ``sandlot serve``, the shells the sandbox's). Either way the
browser signs in through ``/api/auth/login`` with a real API key, as in
``test_contract.py``, and its sockets carry its cookie and its own ``Origin``.

Checked in both: the frame sequence (``session`` first, typed input echoed as ``output``
with contiguous offsets, ``resize`` reaching the shell, ``ping`` answered ``pong``), two
sockets on one session seeing the same bytes, a dropped socket reattached from its offset
losing nothing (and, without an offset, getting the history), forged ids answered
``session_not_found``, an unknown provider closed with 4003, a foreign origin refused,
and the shapes of ``GET``/``POST /api/sessions``.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jwt
import pytest
from websockets.exceptions import InvalidStatus

from sandlot.broker.keys import KeyService
from sandlot.broker.store import Store
from sandlot.protocol.common import PrincipalType
from sandlot.sdk import Sandlot
from sandlot.web.app import create_web_app
from sandlot.web.live import live_routes
from sandlot.web.settings import WebSettings, WorkspaceMode
from tests.servers import SandlotServer
from tests.web.browser import Browser, Socket
from tests.web.conftest import ThreadedServer, login_with_key

THREAD = "thr_contract_ws"
#: The chat's agent program, a stand-in for an agent CLI in stream-JSON mode: says it
#: started, then answers every user message with a result. Run by ``python -c`` in both
#: modes (the host's interpreter in ``local`` mode, the image's in ``sandbox`` mode); no
#: braces, which a template's argv keeps for its placeholders.
ECHO_AGENT = """
import json, sys
print(json.dumps(dict(type="system", subtype="init")), flush=True)
for line in sys.stdin:
    message = json.loads(line)
    if message.get("type") != "user":
        continue
    content = message["message"]["content"]
    text = content if isinstance(content, str) else " ".join(b["text"] for b in content)
    print(json.dumps(dict(type="result", subtype="success", result="echo: " + text)), flush=True)
"""


def _templates(tmp: Path, python: str) -> Path:
    """A chat templates file holding the one template ``echo``."""
    path = tmp / "chat.toml"
    argv = json.dumps([python, "-c", ECHO_AGENT])
    path.write_text(f'default = "echo"\n\n[templates.echo]\nargv = {argv}\n')
    return path


class Workspace:
    """A signed-in browser of one mode; its sockets and requests name :data:`THREAD`."""

    def __init__(self, mode: str, base: str, cookie: str, csrf: str) -> None:
        self.mode = mode
        self.browser = Browser(base, None, cookie, csrf)

    def socket(self, path: str = "/ws/pty", **query: Any) -> Any:
        return self.browser.socket(path, thread=THREAD, **query)

    async def request(self, method: str, path: str, **kw: Any) -> Any:
        return await self.browser.request(method, path, params={"thread": THREAD}, **kw)


def _local(tmp: Path) -> Iterator[Workspace]:
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
        chat_templates_file=_templates(tmp, sys.executable),
    )
    # As ``sandlot web`` serves it: the live routes beside the workspace routes.
    app = create_web_app(
        settings, broker_url=None, authenticator=keys, extra_routes=live_routes(settings)
    )
    server = ThreadedServer(app).start()
    key, _ = keys.create(user_id="ada", principal_type=PrincipalType.HUMAN)
    client, csrf, cookie = login_with_key(server.url, key, [])
    try:
        yield Workspace("local", server.url, cookie, csrf)
    finally:
        client.close()
        server.stop()
        store.dispose()


def _sandbox(tmp: Path) -> Iterator[Workspace]:
    templates = _templates(tmp, "python3")
    server = SandlotServer(tmp / "d", env={"SANDLOT_WEB_CHAT_TEMPLATES": str(templates)}).start()
    human = Sandlot(server.url, server.key("ada"), auto_refresh=False)
    try:
        human.ensure(THREAD)
        client, csrf, cookie = login_with_key(server.url, server.key("ada"), [])
        try:
            yield Workspace("sandbox", server.url, cookie, csrf)
        finally:
            client.close()
    finally:
        human.close()
        server.stop()
        server.cleanup()


@pytest.fixture(scope="module", params=["local", "sandbox"])
def workspace(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Workspace]:
    tmp = tmp_path_factory.mktemp(f"contract-ws-{request.param}")
    yield from (_local if request.param == "local" else _sandbox)(tmp)


async def opened(sock: Socket) -> dict[str, Any]:
    """The ``session`` frame: the first frame of every socket that opens a shell."""
    first = await sock.frame()
    assert first["type"] == "session", first
    assert set(first) >= {"session_id", "name", "role"}, first
    assert isinstance(first["session_id"], str) and first["session_id"]
    return first


def stream_of(chunks: list[tuple[int, str]]) -> bytes:
    """The output pieced together by offset: every chunk starts where the previous ended."""
    out = b""
    start = chunks[0][0] if chunks else 0
    for offset, data in chunks:
        assert offset == start + len(out), f"chunk at {offset}, expected {start + len(out)}"
        out += data.encode()
    return out


# --- frames ---------------------------------------------------------------------------


async def test_the_frame_sequence_of_a_new_terminal(workspace: Workspace) -> None:
    async with workspace.socket() as sock:
        session = await opened(sock)
        assert session["role"] == "driver" and session["name"].startswith("web-")
        await sock.type("echo typed-$((6*7))\r")
        await sock.until_output("typed-42")
        outputs = [f for f in sock.frames if f["type"] == "output"]
        assert outputs
        for frame in outputs:
            assert set(frame) == {"type", "data", "session_id", "offset"}, frame
            assert isinstance(frame["offset"], int) and isinstance(frame["data"], str)
        assert b"typed-42" in stream_of(sock.chunks)
        # A resize reaches the shell's terminal.
        await sock.send({"type": "resize", "cols": 101, "rows": 37})
        await sock.type("stty size; echo sized-$((2+3))\r")
        assert re.search(r"37 101\r\n(.*\r\n)*?sized-5", await sock.until_output("sized-5"))
        await sock.send({"type": "ping"})
        assert await sock.until(lambda f: f["type"] in ("pong", "error")) == {"type": "pong"}
        assert not [f for f in sock.frames if f["type"] in ("error", "gap", "exit")]


async def test_two_sockets_on_one_session_see_the_same_bytes(workspace: Workspace) -> None:
    async with workspace.socket() as one:
        session = await opened(one)
        async with workspace.socket(session_id=session["session_id"], resume=1) as two:
            again = await opened(two)
            assert again["name"] == session["name"]
            await one.type("echo from-one-$((1+1))\r")
            await two.until_output("from-one-2")
            await two.type("echo from-two-$((2+2))\r")
            await one.until_output("from-two-4")
            await two.until_output("from-two-4")
    assert one.same_bytes_as(two) > 0
    assert b"from-two-4" in stream_of(one.chunks)
    assert b"from-two-4" in stream_of(two.chunks)


async def test_a_dropped_socket_reattaches_from_its_offset_with_nothing_lost(
    workspace: Workspace,
) -> None:
    lines = 2000
    async with workspace.socket() as first:
        session = await opened(first)
        loop = f"for i in $(seq 1 {lines}); do echo line-$i; done"
        # The last line a second later: the socket dropped after the first line has not
        # had it (the server merges the output queued for a socket into one frame).
        await first.type(f"{loop}; sleep 1; echo all-$((1000+1))\r")
        await first.until_output("line-1\r\n")
        # The network goes: no close frame.
        first.ws.transport.abort()
    chunks = list(first.chunks)
    async with workspace.socket(
        session_id=session["session_id"], resume=1, offset=first.end()
    ) as second:
        again = await opened(second)
        assert again["name"] == session["name"]
        await second.until_output("all-1001")
        assert not [f for f in second.frames if f["type"] in ("history", "gap")]
        out = stream_of(chunks + second.chunks).decode()
        numbers = [int(n) for n in re.findall(r"line-(\d+)\r\n", out)]
        assert numbers == list(range(1, lines + 1))
    # Without an offset, a reattach gets the history.
    async with workspace.socket(session_id=again["session_id"], resume=1) as third:
        await opened(third)
        history = await third.until(lambda f: f["type"] == "history")
        assert "all-1001" in history["data"] and isinstance(history["offset"], int)


async def test_binary_output_frames_hold_the_shells_bytes_from_their_offset(
    workspace: Workspace,
) -> None:
    lines = 3000
    async with workspace.socket(binary=1) as first:
        session = await opened(first)
        # Multi-byte characters, and more output than one read of the terminal, merged
        # into frames as it comes.
        loop = f"for i in $(seq 1 {lines}); do echo é€-$i; done"
        await first.type(f"{loop}; echo all-$((1000+2))\r")
        await first.until_output("all-1002")
        outputs = [f for f in first.frames if f["type"] == "output"]
        assert outputs and all(f.get("binary") for f in outputs)
        out = stream_of(first.chunks).decode()
        numbers = [int(n) for n in re.findall(r"é€-(\d+)\r\n", out)]
        assert numbers == list(range(1, lines + 1))
        # Every other frame is still JSON text: ``ping`` is answered ``pong``.
        await first.send({"type": "ping"})
        assert await first.until(lambda f: f["type"] in ("pong", "error")) == {"type": "pong"}
        await first.type(f"{loop}; sleep 1; echo again-$((1000+3))\r")
        await first.until_output("é€-1\r\n")
        first.ws.transport.abort()
    chunks = list(first.chunks)
    async with workspace.socket(
        binary=1, session_id=session["session_id"], resume=1, offset=first.end()
    ) as second:
        await opened(second)
        await second.until_output("again-1003")
        assert not [f for f in second.frames if f["type"] in ("history", "gap")]
        out = stream_of(chunks + second.chunks).decode()
        numbers = [int(n) for n in re.findall(r"é€-(\d+)\r\n", out)]
        assert numbers == list(range(1, lines + 1)) * 2


# --- ids, providers, origins ----------------------------------------------------------


async def test_forged_session_ids_are_not_found(workspace: Workspace) -> None:
    async with workspace.socket() as sock:
        good = (await opened(sock))["session_id"]
    header, _, signature = good.split(".")
    claims = jwt.decode(good, options={"verify_signature": False})
    edited = jwt.utils.base64url_encode(json.dumps({**claims, "sub": "bob"}).encode())
    forged = [
        jwt.encode(claims, "k" * 32, algorithm="HS256"),
        f"{header}.{edited.decode()}.{signature}",
        "eyJhbGciOiJub25lIn0.eyJzdWIiOiJhZGEifQ.",
    ]
    for session_id in forged:
        for resume in (1, None):
            async with workspace.socket(session_id=session_id, resume=resume) as sock:
                code, frames = await sock.closed()
            assert code == 4404 and frames == [{"type": "session_not_found"}], session_id
    # The genuine one still opens its shell.
    async with workspace.socket(session_id=good, resume=1) as sock:
        await opened(sock)


async def test_an_unknown_provider_is_closed_with_4003(workspace: Workspace) -> None:
    async with workspace.socket(provider="codex") as sock:
        code, frames = await sock.closed()
    assert code == 4003
    assert frames[0]["type"] == "error" and "shell" in frames[0]["data"]


async def test_a_foreign_origin_is_refused(workspace: Workspace) -> None:
    with pytest.raises(InvalidStatus) as refused:
        async with workspace.socket(origin="http://evil.example"):
            pass
    assert refused.value.response.status_code == 403


# --- /api/sessions --------------------------------------------------------------------


async def test_api_sessions_creates_and_lists_shells(workspace: Workspace) -> None:
    created = await workspace.request("POST", "/api/sessions", json={"shell": "listed"})
    assert created.status_code == 201, created.text
    assert set(created.json()) == {"session_id"}
    session_id = created.json()["session_id"]
    async with workspace.socket(session_id=session_id, resume=1) as sock:
        assert (await opened(sock))["name"] == "listed"
        listed = await workspace.request("GET", "/api/sessions")
    assert listed.status_code == 200, listed.text
    assert listed.headers["content-type"] == "application/json"
    sessions = listed.json()["sessions"]
    for entry in sessions:
        assert set(entry) >= {"id", "type", "alive", "clients", "history_count"}, entry
        assert entry["type"] in ("pty", "stream")
    ours = [s for s in sessions if s.get("name") == "listed"]
    assert len(ours) == 1 and ours[0]["type"] == "pty" and ours[0]["alive"] is True
    assert ours[0]["clients"] == 1 and isinstance(ours[0]["history_count"], int)
    async with workspace.socket(session_id=ours[0]["id"], resume=1) as sock:
        assert (await opened(sock))["name"] == "listed"
    bare = await workspace.request("POST", "/api/sessions")
    assert bare.status_code == 201 and set(bare.json()) == {"session_id"}
    refused = await workspace.request("POST", "/api/sessions", json={"shell": "bad name; rm"})
    assert refused.status_code == 400
    assert refused.json()["error"]["code"] == "INVALID_REQUEST"
    r = await workspace.request("POST", "/api/sessions", headers={"X-CSRF-Token": "wrong"})
    assert r.status_code == 403


# --- chat -----------------------------------------------------------------------------


async def test_a_chat_runs_the_template_program_as_stream_json(workspace: Workspace) -> None:
    async with workspace.socket("/ws/claude-stream", provider="echo") as sock:
        hello = await sock.frame()
        assert hello["type"] == "system" and hello["subtype"] == "connected", hello
        assert hello["resumed"] is False and isinstance(hello["session_id"], str)
        assert hello["settings"]["template"] == "echo"
        await sock.until(lambda f: f.get("subtype") in ("init", "error"))
        assert sock.frames[-1]["subtype"] == "init", sock.frames[-1]
        await sock.send({"type": "user", "message": "hello there"})
        result = await sock.until(lambda f: f["type"] in ("result", "error"))
        assert result["result"] == "echo: hello there", result
        await sock.send("plain text")
        result = await sock.until(lambda f: f["type"] in ("result", "error"))
        assert result["result"] == "echo: plain text", result
        await sock.send({"type": "ping"})
        await sock.until(lambda f: f["type"] == "pong")
    async with workspace.socket("/ws/claude-stream", provider="codex") as sock:
        code, frames = await sock.closed()
    assert code == 4003 and frames[0]["subtype"] == "error", frames
