"""``/api/v1/activity/stream`` against a real ``sandlot serve``: a browser that leaves
ends its upstream event stream and frees its connection at once.

Each stream of the workspace's event log is relayed from the sandbox's dataplane over a
connection of the server's gateway. A browser closing its tab used to leave that
connection open for good (the dataplane's keep-alives kept it alive): after 64 page
loads the user's next stream was refused (the dataplane's limit of streams per token),
after 100 the gateway's one pool of connections was full and every user's workspace
calls failed. Here one user opens and abruptly leaves 150 streams, each time the
server's connections to its dataplane go back to what they were, and then another
user's tree and the first user's new stream still open. A user opening more streams than
``SANDLOT_WEB_MAX_ACTIVITY_STREAMS`` has the oldest closed.
"""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Callable, Iterator

import psutil
import pytest

from sandlot.sdk import Sandlot
from tests.servers import SandlotServer
from tests.web.conftest import login_with_key

#: Streams one user may have open in this server (its oldest closed beyond).
PER_USER = 3


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SandlotServer]:
    env = {"SANDLOT_WEB_MAX_ACTIVITY_STREAMS": str(PER_USER)}
    server = SandlotServer(tmp_path_factory.mktemp("activity") / "d", env=env).start()
    try:
        yield server
    finally:
        server.stop()
        server.cleanup()


class Browser:
    """A signed-in user whose thread's sandbox exists."""

    def __init__(self, server: SandlotServer, user: str, thread: str) -> None:
        key = server.key(user)
        with Sandlot(server.url, key, auto_refresh=False) as sdk:
            sdk.ensure(thread)
        self.server = server
        self.thread = thread
        self.http, _, _ = login_with_key(server.url, key, [])
        self.cookie = "; ".join(f"{k}={v}" for k, v in self.http.cookies.items())

    def open_stream(self) -> tuple[socket.socket, bytes]:
        """A stream on a raw socket (as a browser's, closed without a word): the socket,
        and what it got up to the ``ready`` frame."""
        sock = socket.create_connection(("127.0.0.1", self.server.port), timeout=30)
        sock.sendall(
            f"GET /api/v1/activity/stream?thread={self.thread}&after=0&tail=0 HTTP/1.1\r\n"
            f"Host: 127.0.0.1:{self.server.port}\r\nCookie: {self.cookie}\r\n"
            "Accept: text/event-stream\r\n\r\n".encode()
        )
        got = b""
        while b"event: ready" not in got:
            chunk = sock.recv(65536)
            assert chunk, f"the stream ended before it was ready: {got!r}"
            got += chunk
        assert got.startswith(b"HTTP/1.1 200 "), got
        return sock, got


@pytest.fixture
def browser(server: SandlotServer) -> Iterator[Callable[[str, str], Browser]]:
    """Signs a user in (their thread's sandbox made first)."""
    made: list[Browser] = []

    def sign_in(user: str, thread: str) -> Browser:
        made.append(Browser(server, user, thread))
        return made[-1]

    try:
        yield sign_in
    finally:
        for b in made:
            b.http.close()


def upstream_connections(server: SandlotServer) -> int:
    """The server's open connections to its own port: its gateway's to the dataplane
    under ``/dp`` (and any keep-alive one of its own clients, which close within
    seconds when idle)."""
    assert server.proc is not None
    proc = psutil.Process(server.proc.pid)
    return sum(
        1
        for c in proc.net_connections("tcp")
        if c.raddr and c.raddr.port == server.port and c.status == psutil.CONN_ESTABLISHED
    )


def wait_for_at_most(server: SandlotServer, count: int, deadline: float = 20.0) -> int:
    end = time.monotonic() + deadline
    while (now := upstream_connections(server)) > count and time.monotonic() < end:
        time.sleep(0.02)
    return now


def leave(sock: socket.socket, *, reset: bool) -> None:
    """Closes a browser's connection as a closed tab does (a FIN), or as a lost one (RST)."""
    if reset:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


@pytest.mark.timeout(300)
def test_a_browser_that_leaves_frees_its_upstream_connection_at_once(
    server: SandlotServer, browser: Callable[[str, str], Browser]
) -> None:
    ada = browser("ada", "thr_activity_ada")
    bob = browser("bob", "thr_activity_bob")
    before = wait_for_at_most(server, 0, deadline=10)
    for i in range(150):
        sock, _ = ada.open_stream()
        leave(sock, reset=i % 2 == 1)
        now = wait_for_at_most(server, before)
        assert now <= before, f"stream {i}: {now} connections upstream, {before} before"
    r = bob.http.get("/api/tree", params={"thread": bob.thread})
    assert r.status_code == 200, r.text
    sock, got = ada.open_stream()
    try:
        assert b"event: ready" in got
    finally:
        leave(sock, reset=False)
    assert wait_for_at_most(server, before) <= before


def test_a_user_over_the_cap_has_the_oldest_stream_closed(
    server: SandlotServer, browser: Callable[[str, str], Browser]
) -> None:
    ada = browser("ada", "thr_activity_cap")
    before = wait_for_at_most(server, 0, deadline=10)
    opened = [ada.open_stream()[0] for _ in range(PER_USER + 1)]
    try:
        # The oldest one ends (a whole chunked answer: its page reconnects), the others
        # stay open.
        oldest = opened[0]
        rest = b""
        while not rest.endswith(b"0\r\n\r\n"):
            chunk = oldest.recv(65536)
            assert chunk, f"cut rather than ended: {rest!r}"
            rest += chunk
        assert wait_for_at_most(server, before + PER_USER) <= before + PER_USER
        r = ada.http.get("/api/tree", params={"thread": ada.thread})
        assert r.status_code == 200, r.text
    finally:
        for sock in opened:
            leave(sock, reset=False)
    assert wait_for_at_most(server, before) <= before
