"""The relay's bounds: what a client sends or asks for is never held whole in the
broker, a client that stops reading costs it nothing, and what a request cannot do is
an error envelope, never a 500 or a command left "running".

Two settings: the dataplane suite's server as the box (:mod:`tests.providers.relayharness`),
and, where a box's misbehaviour or a count of the bytes it sent or received is needed, a
fake hosted box (a small Starlette app: the hosted service is outside the system) with
the relay in front of it (:func:`front`)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
import websockets
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from sandlot.dataplane.services.auth import TokenVerifier
from sandlot.protocol.errors import ProviderUnavailable
from sandlot.protocol.sessions import Template
from sandlot.protocol.states import SandboxState
from sandlot.protocol.tokens import RevokedToken
from sandlot.providers import hostedstate
from sandlot.providers.hostedbox import Box
from sandlot.providers.hostedrelay import MAX_FILE_BYTES, HostedRelay
from sandlot.providers.hostedstate import Hosted
from tests.dataplane.conftest import ISSUER, Keys, Server
from tests.providers.relayharness import relayed
from tests.servers import free_port

pytestmark = [pytest.mark.timeout(240)]

MiB = 1 << 20
#: Output kept per stream of a one-shot command (PROTOCOL.md 3.1's default).
MAX_OUTPUT_BYTES = 10 * MiB


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    yield from relayed(tmp_path)


# --- a fake hosted box, and the relay in front of it ---------------------------------------


@dataclass
class FakeBox:
    """Counts what it sent and received; ``/download`` streams ``download_bytes`` of
    ``a`` with no length given (a file growing as it is read, or a very large one)."""

    url: str = ""
    download_bytes: int = 64 * MiB
    sent: int = 0
    received: int = 0
    uploads: list[bytes] = field(default_factory=list)

    def app(self) -> Starlette:
        async def download(request: Request) -> Response:
            if request.method == "HEAD":
                return Response(status_code=404)

            async def body() -> AsyncIterator[bytes]:
                chunk = b"a" * (256 << 10)
                while self.sent < self.download_bytes:
                    if await request.is_disconnected():
                        return  # (uvicorn would take, and drop, the rest)
                    self.sent += len(chunk)
                    yield chunk

            return StreamingResponse(body(), media_type="application/octet-stream")

        async def upload(request: Request) -> Response:
            head = bytearray()
            async for chunk in request.stream():
                self.received += len(chunk)
                if len(head) < 4096:
                    head += chunk[:4096]
            self.uploads.append(bytes(head))
            return JSONResponse({})

        async def execute(request: Request) -> Response:
            return JSONResponse({"stdout": "ok\n", "stderr": "", "exit_code": 0})

        return Starlette(
            routes=[
                Route("/v1/download", download, methods=["GET", "HEAD"]),
                Route("/v1/upload", upload, methods=["POST"]),
                Route("/v1/execute", execute, methods=["POST"]),
            ]
        )


@dataclass
class Front:
    base: str
    keys: Keys
    hosted: Hosted
    relay: HostedRelay
    loop: asyncio.AbstractEventLoop

    def url(self, path: str) -> str:
        return f"{self.base}/{self.hosted.sandbox_id}/v1{path}"

    def headers(self, **over: Any) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.keys.token(self.hosted.sandbox_id, **over)}"}

    async def call(self, fn: Any) -> Any:
        """Run ``fn()`` (maybe a coroutine) on the relay's loop."""

        async def run() -> Any:
            out = fn()
            return await out if asyncio.iscoroutine(out) else out

        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(run(), self.loop))


@contextlib.contextmanager
def _serving(app: Any, setup: Any = None) -> Iterator[tuple[int, asyncio.AbstractEventLoop]]:
    """``app`` on a port of its own, in a thread (``setup``: awaited first, in its loop)."""
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off")
    )
    loops: list[asyncio.AbstractEventLoop] = []

    def run() -> None:
        async def main() -> None:
            loops.append(asyncio.get_running_loop())
            async with contextlib.AsyncExitStack() as stack:
                if setup is not None:
                    await setup(stack)
                await server.serve()

        asyncio.run(main())

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    deadline = time.time() + 10
    while not server.started:
        assert time.time() < deadline, "the server did not start"
        time.sleep(0.01)
    try:
        yield port, loops[0]
    finally:
        server.should_exit = True
        thread.join(10)


@contextlib.contextmanager
def front(fake: FakeBox) -> Iterator[Front]:
    """The fake box, and the relay in front of it."""
    keys = Keys()

    async def jwks() -> dict[str, Any]:
        return keys.jwks()

    hosted = Hosted("sb_bounds", 1, Template(name="default", image="host"))
    relay = HostedRelay(lambda _sid: hosted, TokenVerifier(jwks, issuer=ISSUER))
    with _serving(fake.app()) as (box_port, _):
        fake.url = f"http://127.0.0.1:{box_port}/v1"

        async def setup(stack: contextlib.AsyncExitStack) -> None:
            client = await stack.enter_async_context(httpx.AsyncClient(timeout=60))
            hosted.box = Box(fake.url, "box-key", client, workspace="/workspace")
            hosted.state = SandboxState.ACTIVE

        with _serving(relay, setup) as (port, loop):
            yield Front(f"http://127.0.0.1:{port}", keys, hosted, relay, loop)


# --- 400s, not 500s; failed commands end ---------------------------------------------------


async def test_a_signal_body_that_is_not_an_object_is_a_400(server: Server) -> None:
    async with httpx.AsyncClient(headers=server.headers(), timeout=30) as http:
        r = await http.post(server.url("/exec"), json={"command": "true"})
        exec_id = r.json()["exec_id"]
        for body in (b"[]", b"null", b"3", b'"INT"', b"{bad", b'{"signal": 5}'):
            r = await http.post(server.url(f"/execs/{exec_id}/signal"), content=body)
            assert r.status_code == 400, (body, r.text)
            assert r.json()["error"]["code"] == "INVALID_REQUEST"


async def test_a_command_that_fails_to_start_is_not_left_running(server: Server) -> None:
    hosted: Hosted = server.extra["hosted"]
    async with httpx.AsyncClient(headers=server.headers(), timeout=30) as http:
        for body in (
            {"command": "cat", "stdin": "x", "cwd": "no/such/dir"},
            {"command": "pwd", "cwd": "no/such/dir"},
        ):
            r = await http.post(server.url("/exec"), json=body)
            assert r.status_code == 400, r.text
        execs = (await http.get(server.url("/execs"))).json()["execs"]
    assert [e["state"] for e in execs] == ["failed", "failed"]
    assert all(e["ended_at"] for e in execs)
    # What the idle reaper reads: no command runs.
    assert hosted.running == 0


# --- output caps ---------------------------------------------------------------------------

#: A command writing 11 MiB of ``a`` (past the 10 MiB kept).
FLOOD = "head -c 11534336 /dev/zero | tr '\\0' a"


async def test_exec_with_stdin_keeps_at_most_the_cap_and_says_so(server: Server) -> None:
    async with httpx.AsyncClient(headers=server.headers(), timeout=120) as http:
        r = await http.post(
            server.url("/exec"),
            json={"command": f"cat >/dev/null; {FLOOD}; echo done >&2", "stdin": "x"},
        )
    assert r.status_code == 200
    doc = r.json()
    assert len(doc["stdout"]) == MAX_OUTPUT_BYTES
    assert doc["truncated"] is True
    assert (doc["stderr"], doc["exit_code"]) == ("done\n", 0)  # the command ran to its end


async def test_exec_reports_the_box_cutting_its_output(server: Server) -> None:
    async with httpx.AsyncClient(headers=server.headers(), timeout=120) as http:
        r = await http.post(server.url("/exec"), json={"command": FLOOD})
        assert r.status_code == 200
        doc = r.json()
        assert len(doc["stdout"]) <= MAX_OUTPUT_BYTES
        assert doc["truncated"] is True
        r = await http.post(server.url("/exec"), json={"command": "echo small"})
        assert r.json()["truncated"] is False


# --- revocation ends an event stream -------------------------------------------------------


async def test_revoking_a_token_ends_its_event_stream() -> None:
    with front(FakeBox()) as f:
        jti = "tok_events_revoked"
        headers = f.headers(jti=jti)
        lines: list[str] = []
        async with (
            httpx.AsyncClient(timeout=30) as http,
            http.stream("GET", f.url("/events"), headers=headers) as resp,
        ):
            assert resp.status_code == 200
            it = resp.aiter_lines()
            async with asyncio.timeout(20):
                while (await anext(it)) != ": live":
                    pass

                def revoke() -> Any:
                    f.relay.verifier.revoke([RevokedToken(jti, time.time() + 900)])
                    return f.relay.revoked([jti])

                await f.call(revoke)
                await f.call(lambda: f.hosted.changed("/workspace/after", "created", None))
                # The stream ends (a client would wait forever otherwise).
                lines = [line async for line in it]
        assert not any("/workspace/after" in line for line in lines)
        assert any("UNAUTHENTICATED" in line for line in lines)


# --- redirects of the box's WebSocket are not followed --------------------------------------


async def test_the_box_websocket_follows_no_redirect() -> None:
    received: list[bytes] = []

    async def elsewhere(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        received.append(await reader.readuntil(b"\r\n\r\n"))
        writer.close()

    async def redirecting(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(
            b"HTTP/1.1 302 Found\r\nLocation: ws://localhost:%d/steal\r\n"
            b"Content-Length: 0\r\n\r\n" % other_port
        )
        await writer.drain()
        writer.close()

    other = await asyncio.start_server(elsewhere, "127.0.0.1", 0)
    other_port = other.sockets[0].getsockname()[1]
    box_server = await asyncio.start_server(redirecting, "127.0.0.1", 0)
    port = box_server.sockets[0].getsockname()[1]
    async with other, box_server, httpx.AsyncClient() as client:
        box = Box(f"http://127.0.0.1:{port}/v1", "THE-PROVIDER-KEY", client)
        with pytest.raises(ProviderUnavailable) as failed:
            await box.execute_ws()
    assert "redirect" in failed.value.message
    assert received == []


# --- a shell client that stops reading ------------------------------------------------------


class _StalledClient:
    """A WebSocket client on a plain socket, which reads nothing until asked to (a
    library's client would read ahead into buffers of its own)."""

    def __init__(self, port: int, target: str, token: str) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.sendall(
            f"GET {target} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\n"
            "Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
            f"Sec-WebSocket-Version: 13\r\nAuthorization: Bearer {token}\r\n\r\n".encode()
        )
        self.buf = b""
        while b"\r\n\r\n" not in self.buf:
            self.buf += self.sock.recv(4096)
        head, _, self.buf = self.buf.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 101"), head

    def _take(self, n: int) -> bytes:
        while len(self.buf) < n:
            data = self.sock.recv(1 << 20)
            assert data, "connection closed"
            self.buf += data
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def frame(self) -> dict[str, Any]:
        """The next text frame (the server's frames are unmasked and unfragmented here)."""
        b0, b1 = self._take(2)
        size = b1 & 0x7F
        if size == 126:
            size = int.from_bytes(self._take(2), "big")
        elif size == 127:
            size = int.from_bytes(self._take(8), "big")
        payload = self._take(size)
        assert b0 & 0x0F == 1, b0
        return dict(json.loads(payload))

    def send(self, frame: dict[str, Any]) -> None:
        data = json.dumps(frame).encode()
        mask = b"\x01\x02\x03\x04"
        head = bytes([0x81, 0x80 | len(data)]) if len(data) < 126 else None
        assert head is not None
        self.sock.sendall(head + mask + bytes(c ^ mask[i % 4] for i, c in enumerate(data)))


async def test_a_shell_client_that_stops_reading_gets_a_gap(server: Server) -> None:
    """Its output is dropped for it alone (told by a ``gap``), instead of piling up."""
    total = 24 * MiB
    token = server.token()
    port = int(server.base.rsplit(":", 1)[1])
    target = f"/{server.sandbox_id}/v1/shell/ws?session=flood&role=driver"
    slow = await asyncio.to_thread(_StalledClient, port, target, token)
    try:
        async with (
            websockets.connect(
                server.ws_url("/shell/ws?session=flood&role=observer"),
                additional_headers={"Authorization": f"Bearer {token}"},
                max_size=None,
            ) as fast,
            httpx.AsyncClient(headers=server.headers(), timeout=30) as http,
        ):
            assert (await asyncio.to_thread(slow.frame))["type"] == "session"
            assert (await asyncio.to_thread(slow.frame))["type"] == "history"
            for _ in range(2):
                await fast.recv()
            typed = f"head -c {total} /dev/zero | tr '\\0' a; echo; echo END-$((6*7))\n"
            slow.send({"type": "stdin", "data": typed})
            seen = ""
            async with asyncio.timeout(180):
                # The other client is not held back by the stalled one.
                while "END-42" not in seen:
                    frame = json.loads(await fast.recv())
                    seen = (seen + str(frame.get("data", "")))[-4096:]
                while True:  # everything has passed through the relay
                    shells = (await http.get(server.url("/shells"))).json()["shells"]
                    if shells and shells[0]["offset"] >= total:
                        break
                    await asyncio.sleep(0.2)

            def read_slow() -> list[dict[str, Any]]:
                gaps: list[dict[str, Any]] = []
                offset = None
                seen = ""
                while "END-42" not in seen:
                    frame = slow.frame()
                    if frame["type"] == "gap":
                        gaps.append(frame)
                        assert offset is None or frame["from"] == offset
                        offset = frame["to"]
                    elif frame["type"] == "stdout":
                        assert offset is None or frame["offset"] == offset
                        offset = frame["offset"] + len(frame["data"].encode())
                        seen = (seen + frame["data"])[-4096:]
                return gaps

            gaps = await asyncio.wait_for(asyncio.to_thread(read_slow), 120)
    finally:
        slow.sock.close()
    assert gaps, "a client that stopped reading was sent everything"
    assert gaps[0]["stream"] == "stdout" and gaps[0]["to"] > gaps[0]["from"]


# --- whole-file reads stop at the limit -----------------------------------------------------


async def test_reading_a_huge_file_whole_stops_at_the_limit() -> None:
    fake = FakeBox()
    with front(fake) as f:
        async with httpx.AsyncClient(headers=f.headers(), timeout=120) as http:
            for method, route, kw in (
                ("GET", "/fs/read", {"params": {"path": "huge.bin"}}),
                ("POST", "/fs/edit", {"json": {"path": "huge.bin", "old_string": "a",
                                                "new_string": "b"}}),
            ):  # fmt: skip
                fake.sent = 0
                r = await http.request(method, f.url(route), **kw)
                assert r.status_code == 413, r.text
                assert r.json()["error"]["code"] == "PAYLOAD_TOO_LARGE"
                # What the box sent: the limit, and what the sockets held meanwhile.
                assert fake.sent <= MAX_FILE_BYTES + 8 * MiB, fake.sent


# --- uploads are passed on as they arrive ---------------------------------------------------


async def test_an_upload_reaches_the_box_before_it_has_all_arrived() -> None:
    fake = FakeBox()
    with front(fake) as f:
        first, rest = 16, 4

        async def body() -> AsyncIterator[bytes]:
            chunk = b"u" * MiB
            for _ in range(first):
                yield chunk
            # The relay holding the whole upload would never pass these on.
            async with asyncio.timeout(30):
                while fake.received < 8 * MiB:
                    await asyncio.sleep(0.05)
            for _ in range(rest):
                yield chunk

        async with httpx.AsyncClient(headers=f.headers(), timeout=120) as http:
            r = await http.post(f.url("/files/upload"), params={"path": "big.bin"}, content=body())
            assert r.status_code == 201, r.text
            assert r.json()["size"] == (first + rest) * MiB
            assert fake.received > (first + rest) * MiB  # and the multipart framing
            # A multipart body's file too, as it is parsed (never kept whole in between).
            boundary = "b-0"
            before = fake.received

            async def multipart() -> AsyncIterator[bytes]:
                yield (
                    f'--{boundary}\r\nContent-Disposition: form-data; name="file"; '
                    'filename="x"\r\n\r\n'
                ).encode()
                chunk = b"m" * MiB
                for _ in range(first):
                    yield chunk
                async with asyncio.timeout(30):
                    while fake.received < before + 8 * MiB:
                        await asyncio.sleep(0.05)
                for _ in range(rest):
                    yield chunk
                yield f"\r\n--{boundary}--\r\n".encode()

            r = await http.post(
                f.url("/files/upload"),
                params={"path": "big-multipart.bin"},
                content=multipart(),
                headers={"Content-Type": f"multipart/form-data; boundary={boundary}"},
            )
            assert r.status_code == 201, r.text
            assert r.json()["size"] == (first + rest) * MiB
            # A multipart upload goes the same way.
            r = await http.post(
                f.url("/files/upload"),
                params={"path": 'dir/odd "name".txt'},
                files={"file": ("x", b"hello multipart", "text/plain")},
            )
            assert r.status_code == 201 and r.json()["size"] == len(b"hello multipart")
            assert b"hello multipart" in fake.uploads[-1]


async def test_uploads_in_both_shapes_arrive_whole_at_a_real_box(server: Server) -> None:
    blob = bytes(range(256)) * 12_000  # 3 MB, every byte value
    async with httpx.AsyncClient(headers=server.headers(), timeout=60) as http:
        r = await http.post(server.url("/files/upload"), params={"path": "raw.bin"}, content=blob)
        assert r.status_code == 201 and r.json()["size"] == len(blob)
        r = await http.post(
            server.url("/files/upload"),
            params={"path": 'sub/a "q".bin'},
            files={"file": ("ignored", blob, "application/octet-stream")},
        )
        assert r.status_code == 201 and r.json()["size"] == len(blob)
        for path in ("raw.bin", 'sub/a "q".bin'):
            r = await http.get(server.url("/files/download"), params={"path": path})
            assert r.status_code == 200 and r.content == blob
        # A multipart body cut before its closing boundary: refused, nothing kept at the box.
        whole = httpx.Request(
            "POST", "http://x/", files={"file": ("f", blob, "application/octet-stream")}
        )
        body = whole.read()
        for path in ("raw.bin", "cut.bin"):
            r = await http.post(
                server.url("/files/upload"),
                params={"path": path},
                content=body[: -len(b"--\r\n") - 1],
                headers={"Content-Type": whole.headers["content-type"]},
            )
            assert r.status_code == 400, r.text
            assert r.json()["error"]["code"] == "INVALID_REQUEST"
        r = await http.get(server.url("/files/download"), params={"path": "raw.bin"})
        assert r.status_code == 200 and r.content == blob
        r = await http.get(server.url("/files/download"), params={"path": "cut.bin"})
        assert r.status_code == 404, r.text


# --- streamed transfers cannot starve the rest ----------------------------------------------


async def test_a_sandbox_holds_a_bounded_number_of_transfers() -> None:
    fake = FakeBox(download_bytes=1 << 40)
    limit = hostedstate.MAX_TRANSFERS
    with front(fake) as f:
        async with contextlib.AsyncExitStack() as stack:
            http = await stack.enter_async_context(
                httpx.AsyncClient(headers=f.headers(), timeout=30)
            )
            held = []
            for _ in range(limit):  # downloads whose client reads nothing
                resp = await stack.enter_async_context(
                    http.stream("GET", f.url("/files/download"), params={"path": "big"})
                )
                assert resp.status_code == 200
                held.append(resp)
            async with http.stream(
                "GET", f.url("/files/download"), params={"path": "big"}
            ) as refused:
                assert refused.status_code == 429
                doc = json.loads(await refused.aread())
                assert doc["error"]["code"] == "RATE_LIMITED" and refused.headers["retry-after"]
            r = await http.post(f.url("/files/upload"), params={"path": "x"}, content=b"x")
            assert r.status_code == 429
            # Other calls of the same sandbox go on.
            r = await http.post(f.url("/exec"), json={"command": "echo ok"})
            assert r.status_code == 200 and r.json()["stdout"] == "ok\n"
            # A transfer given up gives its slot back.
            await held.pop().aclose()
            async with asyncio.timeout(20):
                while True:
                    r = await http.post(f.url("/files/upload"), params={"path": "y"}, content=b"y")
                    if r.status_code == 201:
                        break
                    await asyncio.sleep(0.1)
        # Every client gone: every slot is free again.
        async with asyncio.timeout(20):
            while f.hosted.transfers:
                await asyncio.sleep(0.05)


async def test_streamed_transfers_have_a_pool_of_their_own() -> None:
    fake = FakeBox(download_bytes=1 << 40)
    with _serving(fake.app()) as (port, _):
        url = f"http://127.0.0.1:{port}/v1"
        async with (
            httpx.AsyncClient(timeout=30) as client,
            httpx.AsyncClient(limits=httpx.Limits(max_connections=1)) as transfers,
        ):
            box = Box(url, "box-key", client, transfers=transfers)
            held = await box.stream("GET", "/download", params={"path": "big"}, headers={})
            try:
                # The other calls' pool is not the transfers': they go on.
                assert (await box.execute("echo ok"))["stdout"] == "ok\n"
                # A full pool answers a retryable 503 after a bounded wait, no hang.
                with pytest.raises(ProviderUnavailable) as busy:
                    await box.stream("GET", "/download", params={"path": "big"}, headers={})
                assert busy.value.retryable and busy.value.retry_after
            finally:
                await held.aclose()
