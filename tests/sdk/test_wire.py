"""The SDK's HTTP/1.1 client (``sandlot.sdk._async._wire`` and its sync twin).

The real servers are covered by every other SDK test; here a scripted HTTP
server on loopback plays the network's and servers' misbehaviour that those
cannot provoke on demand: an idle connection closed by the server, a request
swallowed by a closing connection, an answer that never comes, a server that
is not there, and TLS.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import ipaddress
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from sandlot.sdk import ConnectError, ConnectionLost, RequestTimeout, SandlotError
from sandlot.sdk._async._wire import AsyncWire
from sandlot.sdk._sync._wire import Wire
from sandlot.sdk.transport import Deadline

# A handler gets the connection's number, the request's head and body, and the
# socket; it answers (or not) and says whether to keep the connection open.
Handler = Callable[[int, bytes, bytes, socket.socket], bool]


def answer(sock: socket.socket, body: bytes, *, status: str = "200 OK", extra: str = "") -> None:
    sock.sendall(f"HTTP/1.1 {status}\r\nContent-Length: {len(body)}\r\n{extra}\r\n".encode() + body)


class ScriptedServer:
    """HTTP/1.1 on 127.0.0.1: parses requests (Content-Length or chunked) and hands them
    to ``handler``; counts connections and requests."""

    def __init__(self, handler: Handler, tls: ssl.SSLContext | None = None) -> None:
        self.handler = handler
        self.tls = tls
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.connections = 0
        self.requests: list[tuple[int, bytes, bytes]] = []
        self._threads: list[threading.Thread] = []
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except OSError:
                return
            self.connections += 1
            t = threading.Thread(target=self._serve, args=(sock, self.connections), daemon=True)
            t.start()
            self._threads.append(t)

    def _serve(self, sock: socket.socket, number: int) -> None:
        if self.tls is not None:
            try:
                sock = self.tls.wrap_socket(sock, server_side=True)
            except (OSError, ssl.SSLError):
                sock.close()
                return
        with sock, contextlib.suppress(ConnectionResetError):
            # A client may end a connection with a reset (closing with bytes unread, such
            # as TLS session tickets): that ends the connection, like a close.
            self._serve_requests(sock, number)

    def _serve_requests(self, sock: socket.socket, number: int) -> None:
        buf = b""
        while True:
            while b"\r\n\r\n" not in buf:
                data = sock.recv(65536)
                if not data:
                    return
                buf += data
            head, _, buf = buf.partition(b"\r\n\r\n")
            lower = head.lower()
            body = b""
            if b"transfer-encoding: chunked" in lower:
                while True:
                    while b"\r\n" not in buf:
                        buf += sock.recv(65536)
                    size_line, _, buf = buf.partition(b"\r\n")
                    size = int(size_line, 16)
                    while len(buf) < size + 2:
                        buf += sock.recv(65536)
                    body += buf[:size]
                    buf = buf[size + 2 :]
                    if size == 0:
                        break
            else:
                for line in lower.split(b"\r\n"):
                    if line.startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                        while len(buf) < length:
                            buf += sock.recv(65536)
                        body, buf = buf[:length], buf[length:]
            self.requests.append((number, head, body))
            if not self.handler(number, head, body, sock):
                return

    def close(self) -> None:
        self.listener.close()


@pytest.fixture
def scripted() -> Iterator[Callable[..., ScriptedServer]]:
    servers: list[ScriptedServer] = []

    def make(handler: Handler, tls: ssl.SSLContext | None = None) -> ScriptedServer:
        servers.append(ScriptedServer(handler, tls))
        return servers[-1]

    yield make
    for srv in servers:
        srv.close()


def echo(number: int, head: bytes, body: bytes, sock: socket.socket) -> bool:
    answer(sock, f"{number}:".encode() + body)
    return True


def run(
    wire: AsyncWire | Wire,
    method: str,
    url: str,
    body: object = None,
    *,
    timeout: float = 5.0,
    keep: bool = False,
):
    """One request through either twin, whole answer returned; the pool is closed
    after it unless ``keep`` (an async pool always is: its loop ends)."""
    kw = {"headers": [("X-Test", "1")], "body": body, "deadline": Deadline(timeout)}
    if isinstance(wire, AsyncWire):

        async def once():
            try:
                return await wire.request(method, url, **kw)  # type: ignore[arg-type]
            finally:
                await wire.aclose()

        return asyncio.run(once())
    try:
        return wire.request(method, url, **kw)  # type: ignore[arg-type]
    finally:
        if not keep:
            wire.close()


def twins() -> list[object]:
    return [pytest.param(Wire, id="sync"), pytest.param(AsyncWire, id="async")]


@pytest.mark.parametrize("kind", twins())
def test_requests_reuse_one_connection(scripted, kind) -> None:
    srv = scripted(echo)
    wire = kind()
    if kind is AsyncWire:

        async def many() -> list[bytes]:
            out = []
            for i in range(20):
                r = await wire.request(
                    "PUT", f"{srv.url}/x?i={i}", headers=[], body=b"abc", deadline=Deadline(5)
                )
                out.append(r.content)
            await wire.aclose()
            return out

        bodies = asyncio.run(many())
    else:
        bodies = [
            run(wire, "PUT", f"{srv.url}/x?i={i}", b"abc", keep=True).content for i in range(20)
        ]
        wire.close()
    assert bodies == [b"1:abc"] * 20
    assert srv.connections == 1
    heads = [h for _, h, _ in srv.requests]
    assert heads[3].startswith(b"PUT /x?i=3 HTTP/1.1\r\n")
    assert b"\r\nhost: 127.0.0.1:" in heads[0].lower()
    assert b"\r\ncontent-length: 3" in heads[0].lower()


def test_idle_connection_closed_by_the_server_is_not_reused(scripted) -> None:
    def once(number: int, head: bytes, body: bytes, sock: socket.socket) -> bool:
        answer(sock, b"ok")
        return False  # closes after answering, without saying so

    srv = scripted(once)
    wire = Wire()
    for _ in range(3):
        assert run(wire, "GET", srv.url + "/", keep=True).content == b"ok"
        time.sleep(0.05)  # the close reaches the client while its connection is idle
    assert srv.connections == 3
    wire.close()


def swallow(path: bytes) -> Handler:
    """Answers every request, except that the second request of the first connection,
    if it is for ``path``, is read and then the connection closed without an answer."""

    def handler(number: int, head: bytes, body: bytes, sock: socket.socket) -> bool:
        if number == 1 and head.split(b" ")[1] == path:
            sock.shutdown(socket.SHUT_RDWR)
            return False
        answer(sock, head.split(b" ")[1] + b"|" + body)
        return True

    return handler


@pytest.mark.parametrize("kind", twins())
def test_idempotent_request_swallowed_by_a_closing_connection_is_sent_again(scripted, kind) -> None:
    # The keep-alive race: the server closes an idle connection just as a request
    # goes out on it. No byte of an answer came back and the request is idempotent
    # with a body that can be sent again: it goes once more on a new connection.
    srv = scripted(swallow(b"/second"))
    wire = kind()

    async def go() -> tuple[bytes, bytes]:
        first = await wire.request(
            "PUT", srv.url + "/first", headers=[], body=b"1", deadline=Deadline(5)
        )
        second = await wire.request(
            "PUT", srv.url + "/second", headers=[], body=b"2", deadline=Deadline(5)
        )
        await wire.aclose()
        return first.content, second.content

    if kind is AsyncWire:
        got = asyncio.run(go())
    else:
        got = (
            run(wire, "PUT", srv.url + "/first", b"1", keep=True).content,
            run(wire, "PUT", srv.url + "/second", b"2").content,
        )
    assert got == (b"/first|1", b"/second|2")
    assert srv.connections == 2
    assert [(n, h.split(b" ")[1]) for n, h, _ in srv.requests] == [
        (1, b"/first"),
        (1, b"/second"),
        (2, b"/second"),
    ]


@pytest.mark.parametrize(
    ("method", "body"),
    [
        pytest.param("POST", b"edit", id="not idempotent"),
        pytest.param("PUT", iter([b"a" * 10, b"b" * 5]), id="streamed body"),
    ],
)
def test_request_that_cannot_be_replayed_is_never_sent_twice(scripted, method, body) -> None:
    srv = scripted(swallow(b"/once"))
    wire = Wire()
    run(wire, "GET", srv.url + "/warm", keep=True)
    with pytest.raises(ConnectionError):
        run(wire, method, srv.url + "/once", body)
    assert [h.split(b" ")[1] for _, h, _ in srv.requests] == [b"/warm", b"/once"]
    assert srv.requests[1][2] in (b"edit", b"a" * 10 + b"b" * 5)
    assert srv.connections == 1


def test_connection_idle_too_long_is_not_reused(scripted, monkeypatch) -> None:
    from sandlot.sdk._sync import _wire

    monkeypatch.setattr(_wire, "KEEPALIVE_EXPIRY", 0.2)
    srv = scripted(echo)
    wire = Wire()
    assert run(wire, "GET", srv.url + "/", keep=True).content == b"1:"
    assert run(wire, "GET", srv.url + "/", keep=True).content == b"1:"
    time.sleep(0.3)
    assert run(wire, "GET", srv.url + "/").content == b"2:"
    assert srv.connections == 2


@pytest.mark.parametrize("kind", twins())
def test_an_answer_that_never_comes_ends_at_the_deadline(scripted, kind) -> None:
    srv = scripted(lambda n, h, b, s: True)  # reads the request, never answers
    t0 = time.monotonic()
    with pytest.raises(TimeoutError) as info:
        run(kind(), "GET", srv.url + "/", timeout=0.3)
    assert time.monotonic() - t0 < 3
    # One except SandlotError catches it too (and it says it may be retried).
    assert isinstance(info.value, RequestTimeout) and info.value.retryable


@pytest.mark.parametrize("kind", twins())
def test_unreachable_server_is_a_connect_error(kind) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there once closed
    with pytest.raises(ConnectError, match=f"127.0.0.1:{port}") as info:
        run(kind(), "GET", f"http://127.0.0.1:{port}/")
    assert isinstance(info.value, SandlotError) and isinstance(info.value, ConnectionError)
    assert info.value.wire_code == "CONNECT_FAILED"


def test_answer_cut_short_is_a_connection_error(scripted) -> None:
    def short(number: int, head: bytes, body: bytes, sock: socket.socket) -> bool:
        sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly this")
        return False

    srv = scripted(short)
    with pytest.raises(ConnectionLost) as info:
        run(Wire(), "GET", srv.url + "/")
    assert isinstance(info.value, SandlotError) and isinstance(info.value, ConnectionError)


def test_chunked_upload_and_streamed_chunked_answer(scripted) -> None:
    def chunked(number: int, head: bytes, body: bytes, sock: socket.socket) -> bool:
        parts = [body[i : i + 7] for i in range(0, len(body), 7)]
        wire_body = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"
        sock.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + wire_body)
        return True

    srv = scripted(chunked)
    wire = Wire()
    sent = [b"line one\n", b"line two\r\n", b"", b"partial", b" line\nlast"]
    with wire.stream(
        "POST", srv.url + "/up", headers=[], body=iter(sent), deadline=Deadline(5)
    ) as resp:
        lines = list(resp.iter_lines())
    assert lines == ["line one", "line two", "partial line", "last"]
    assert srv.requests[0][2] == b"".join(sent)
    assert b"transfer-encoding: chunked" in srv.requests[0][1].lower()
    # The connection went back to the pool: the next request reuses it.
    assert run(wire, "POST", srv.url + "/again", b"x").content == b"x"  # closes the pool
    assert srv.connections == 1


def test_answer_left_unread_closes_its_connection(scripted) -> None:
    srv = scripted(lambda n, h, b, s: answer(s, b"z" * 100_000) or True)
    wire = Wire()
    with wire.stream("GET", srv.url + "/", headers=[], deadline=Deadline(5)) as resp:
        assert resp.status_code == 200
    assert len(run(wire, "GET", srv.url + "/").content) == 100_000  # closes the pool
    assert srv.connections == 2


def _self_signed(tmp: Path) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = tmp / "cert.pem", tmp / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


def test_https(scripted, tmp_path: Path) -> None:
    cert, key = _self_signed(tmp_path)
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(cert, key)
    srv = scripted(echo, tls=server_ctx)
    trusted = ssl.create_default_context(cafile=str(cert))
    assert run(Wire(tls=trusted), "PUT", srv.url + "/", b"sync").content == b"1:sync"
    # Without trusting that certificate, nothing is sent.
    with pytest.raises(ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        run(Wire(), "PUT", srv.url + "/", b"secret")

    async def go() -> bytes:
        wire = AsyncWire(tls=trusted)
        resp = await wire.request(
            "PUT", srv.url + "/", headers=[], body=b"async", deadline=Deadline(5)
        )
        await wire.aclose()
        with pytest.raises(ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            await AsyncWire().request(
                "PUT", srv.url + "/", headers=[], body=b"secret", deadline=Deadline(5)
            )
        # asyncio ends a failed TLS connection on a later turn of the loop: let it.
        await asyncio.sleep(0.2)
        return resp.content

    assert asyncio.run(go()) == b"3:async"
    assert [b for _, _, b in srv.requests] == [b"sync", b"async"]


def test_not_an_http_url() -> None:
    with pytest.raises(ValueError, match="not an http"):
        run(Wire(), "GET", "ftp://127.0.0.1/x")


def test_call_past_its_deadline_names_the_request(scripted) -> None:
    from sandlot.sdk._sync._http import HTTP

    srv = scripted(lambda n, h, b, s: True)  # never answers
    http = HTTP(srv.url + "/v1", dict, timeout=0.3)
    with pytest.raises(TimeoutError, match=r"^GET /fs/stat: deadline exceeded$"):
        http.json("GET", "/fs/stat", deadline=http.deadline(None), params={"path": "/"})
    http.close()
    assert srv.requests[0][1].startswith(b"GET /v1/fs/stat?path=%2F HTTP/1.1")


def raw(payload: bytes, *, close: bool = True) -> Handler:
    """Answers every request with ``payload`` as is (closing the connection after it)."""

    def handler(number: int, head: bytes, body: bytes, sock: socket.socket) -> bool:
        sock.sendall(payload)
        if close:
            sock.shutdown(socket.SHUT_WR)
        return not close

    return handler


@pytest.mark.parametrize("kind", twins())
@pytest.mark.parametrize(
    ("payload", "content", "reused"),
    [
        pytest.param(
            b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok",
            b"ok",
            True,
            id="informational answer skipped",
        ),
        pytest.param(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"3;ext=1\r\nabc\r\n1\r\nd\r\n0\r\nX-Trailer: t\r\n\r\n",
            b"abcd",
            True,
            id="chunk extensions and trailers",
        ),
        pytest.param(
            b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok",
            b"ok",
            False,
            id="connection close",
        ),
        pytest.param(
            b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok", b"ok", False, id="HTTP/1.0"
        ),
        pytest.param(b"HTTP/1.1 200 OK\r\n\r\nuntil the end", b"until the end", False, id="eof"),
        pytest.param(b"HTTP/1.1 204 No Content\r\n\r\n", b"", True, id="no content"),
        pytest.param(
            b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nokEXTRA", b"ok", False, id="extra bytes"
        ),
    ],
)
def test_answers_framed_every_way(scripted, kind, payload, content, reused) -> None:
    srv = scripted(raw(payload, close=not reused))
    wire = kind()

    async def twice() -> list[bytes]:
        out = []
        for _ in range(2):
            r = await wire.request("GET", srv.url + "/", headers=[], deadline=Deadline(5))
            out.append(r.content)
        await wire.aclose()
        return out

    if kind is AsyncWire:
        got = asyncio.run(twice())
    else:
        got = [run(wire, "GET", srv.url + "/", keep=True).content for _ in range(2)]
        wire.close()
    assert got == [content, content]
    assert srv.connections == (1 if reused else 2)


@pytest.mark.parametrize("kind", twins())
@pytest.mark.parametrize(
    "payload",
    [
        pytest.param(b"SSH-2.0-OpenSSH\r\n\r\n", id="not HTTP"),
        pytest.param(b"HTTP/1.1 20 OK\r\n\r\n", id="short status"),
        pytest.param(b"HTTP/1.1 200 OK\r\nbad header line\r\n\r\n", id="header without colon"),
        pytest.param(b"HTTP/1.1 200 OK\r\n folded: x\r\n\r\n", id="obsolete line folding"),
        pytest.param(b"HTTP/1.1 200 OK\r\nContent-Length: 1, 2\r\n\r\nx", id="two lengths"),
        pytest.param(b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n", id="negative length"),
        pytest.param(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n", id="gzip"),
        pytest.param(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", id="bad chunk size"
        ),
        pytest.param(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nabXX", id="chunk overrun"
        ),
        pytest.param(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nab", id="chunk cut short"
        ),
        pytest.param(b"HTTP/1.1 200 OK\r\nX: " + b"y" * (70 << 10), id="head too large"),
        pytest.param(b"HTTP/1.1 101 Switching Protocols\r\n\r\n", id="upgrade"),
        pytest.param(b"", id="closed before an answer"),
    ],
)
def test_broken_answers_are_connection_errors(scripted, kind, payload) -> None:
    srv = scripted(raw(payload))
    with pytest.raises(ConnectionError):
        run(kind(), "GET", srv.url + "/")


def test_duplicate_headers_are_joined_and_names_lowered(scripted) -> None:
    srv = scripted(raw(b"HTTP/1.1 200 OK\r\nX-A: 1\r\nx-a:  2 \r\nContent-Length: 0\r\n\r\n"))
    resp = run(Wire(), "GET", srv.url + "/")
    assert resp.headers["x-a"] == "1, 2"


def test_a_head_answer_has_no_body(scripted) -> None:
    srv = scripted(raw(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n", close=False))
    wire = Wire()
    assert run(wire, "HEAD", srv.url + "/", keep=True).content == b""
    assert run(wire, "HEAD", srv.url + "/").content == b""
    assert srv.connections == 1


@pytest.mark.parametrize(
    ("method", "url", "headers"),
    [
        ("GET", "/x", [("X-Token", "a\r\nInjected: 1")]),
        ("GET", "/x", [("Bad Name", "v")]),
        ("GET", "/x y", []),
        ("G ET", "/x", []),
    ],
)
def test_a_request_that_would_break_the_framing_is_not_sent(
    scripted, method: str, url: str, headers: list[tuple[str, str]]
) -> None:
    srv = scripted(echo)
    wire = Wire()
    with pytest.raises(ValueError):
        wire.request(method, srv.url + url, headers=headers, deadline=Deadline(5))
    wire.close()
    assert srv.requests == []
