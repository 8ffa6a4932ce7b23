"""Both sides of a terminal or chat socket, each sending through a bounded queue.

A :class:`BrowserChannel` wraps an accepted Starlette ``WebSocket``. Frames for the
browser are queued (:class:`~sandlot.web.limits.FrameQueue`, bounded in frames and
bytes) and sent by :meth:`BrowserChannel.run_sender`; a terminal's output waits there as
chunks, which the sender merges into frames (:mod:`sandlot.web.ptyoutput`). A browser
that stops reading
never holds up the dataplane side; if the queue overflows, :meth:`send` raises
:class:`~sandlot.web.limits.QueueOverflow` and the route ends the socket with
:meth:`BrowserChannel.abort`: what is queued is dropped (the browser reattaches and the
dataplane replays it), an ``error`` frame is sent, then the close.

:func:`serve_browser_socket` is how ``/ws/pty`` and ``/ws/claude-stream`` take a socket:
the handshake checked, the socket accepted and held against the
:class:`~sandlot.web.limits.SocketGate`'s limits while the route serves it, then closed;
it counts every socket in :class:`~sandlot.web.metrics.WebMetrics` (open, who ended it,
why one that was never attached failed: the close code says).

A :class:`DataplaneChannel` is the other side: the dataplane WebSocket the gateway
opened for it, with its own bounded queue of frames and a token kept fresh.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import json
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from starlette.websockets import WebSocket, WebSocketState
from websockets.asyncio.client import ClientConnection
from websockets.exceptions import ConnectionClosed

from sandlot.protocol.errors import RateLimited, SandlotError
from sandlot.web.auth import WebAuth
from sandlot.web.gateway import Gateway
from sandlot.web.limits import FrameQueue, SocketGate, SocketLimits
from sandlot.web.metrics import WebMetrics
from sandlot.web.ptyoutput import Output, OutputFrames
from sandlot.web.workspace import Workspace

log = logging.getLogger(__name__)

#: Close codes used on the browser's sockets.
CLOSE_NORMAL = 1000
CLOSE_POLICY = 1008
CLOSE_INTERNAL = 1011
CLOSE_TRY_AGAIN = 1013
#: boring-ui's: the provider named is not one this server runs.
CLOSE_UNKNOWN_PROVIDER = 4003
CLOSE_SESSION_NOT_FOUND = 4404
CLOSE_RATE_LIMITED = 4429
#: The dataplane's: the token was refused.
CLOSE_UNAUTHENTICATED = 4401


#: Why a socket closed before it was attached failed, by its close code.
ATTACH_FAILURES = {
    CLOSE_RATE_LIMITED: "rate_limited",
    CLOSE_UNKNOWN_PROVIDER: "unknown_provider",
    CLOSE_SESSION_NOT_FOUND: "session_not_found",
    CLOSE_TRY_AGAIN: "upstream",
    CLOSE_POLICY: "refused",
    CLOSE_INTERNAL: "internal",
}


class Disconnected(Exception):
    """The browser went away."""


class Side(enum.StrEnum):
    """Who ended a browser's socket."""

    BROWSER = "browser"
    #: The shell or agent exited, or the dataplane went.
    UPSTREAM = "upstream"
    SERVER = "server"
    #: A limit: a connect refused, a queue that overflowed.
    LIMIT = "limit"


class BrowserChannel:
    """An accepted browser WebSocket; frames to it leave through a bounded queue.

    The route sets :attr:`attached` once the socket is attached to its shell or agent.
    """

    def __init__(self, ws: WebSocket, limits: SocketLimits) -> None:
        self.ws = ws
        self.limits = limits
        self.queue: FrameQueue[str | Output] = FrameQueue(
            limits.output_queue_frames, limits.output_queue_bytes
        )
        #: How a terminal's output chunks become frames (set by the terminal's route).
        self.output: OutputFrames | None = None
        self.attached = False
        #: Who ended the socket, once known (the first to).
        self.ended_by: Side | None = None
        #: The code the server closed it with.
        self.close_code: int | None = None
        self._closed = False

    def ended(self, side: Side) -> None:
        if self.ended_by is None:
            self.ended_by = side

    def send(self, frame: dict[str, Any]) -> None:
        """Queue ``frame`` for the browser (``QueueOverflow`` if the queue is full)."""
        self.queue.put(json.dumps(frame, ensure_ascii=False, separators=(",", ":")))

    def send_text(self, text: str) -> None:
        """Queue a frame already serialised (a line of the agent's stream-JSON)."""
        self.queue.put(text)

    def send_output(self, chunk: Output) -> None:
        """Queue a chunk of a terminal's output (merged with its neighbours when sent)."""
        self.queue.put(chunk, kind="output")

    async def _next(self) -> str | bytes:
        """The next frame to send: a queued one, or the output chunks at the queue's
        head made into one frame (after :meth:`OutputFrames.delay`)."""
        item = await self.queue.get()
        if not isinstance(item, Output):
            return item
        frames = self.output
        assert frames is not None, "output queued on a socket without OutputFrames"
        wait = frames.delay()
        if wait > 0:
            await asyncio.sleep(wait)
        parts, size = [item], len(item)
        while size < frames.max_frame and (more := self.queue.take("output")) is not None:
            assert isinstance(more, Output)
            parts.append(more)
            size += len(more)
        return frames.frame(parts)

    async def _send(self, frame: str | bytes) -> None:
        if isinstance(frame, bytes):
            await self.ws.send_bytes(frame)
        else:
            await self.ws.send_text(frame)

    async def run_sender(self) -> None:
        """Send queued frames until cancelled or the browser goes away (then returns)."""
        while True:
            frame = await self._next()
            try:
                await self._send(frame)
            except Exception:
                self.ended(Side.BROWSER)
                return

    async def receive(self) -> str:
        """The next frame's text (a binary frame decoded as UTF-8); ``Disconnected`` once
        the browser has gone."""
        message = await self.ws.receive()
        if message["type"] == "websocket.disconnect":
            self.ended(Side.BROWSER)
            raise Disconnected()
        text = message.get("text")
        if text is not None:
            return str(text)
        return bytes(message.get("bytes") or b"").decode("utf-8", errors="replace")

    async def finish(self, frames: list[dict[str, Any]], code: int = CLOSE_NORMAL) -> None:
        """The upstream ended: send what is queued, then ``frames``, then close with
        ``code`` (within the close timeout: a browser that does not read is not waited
        for longer)."""
        self.ended(Side.UPSTREAM)
        with contextlib.suppress(TimeoutError, Exception):
            async with asyncio.timeout(self.limits.close_timeout):
                while len(self.queue):
                    await self._send(await self._next())
                for frame in frames:
                    await self.ws.send_text(json.dumps(frame, ensure_ascii=False))
        await self.close(code)

    async def abort(self, frame: dict[str, Any], code: int, *, side: Side = Side.SERVER) -> None:
        """``side`` ends the socket: drop what is queued, send ``frame`` and close with
        ``code``."""
        self.ended(side)
        self.queue.clear()
        with contextlib.suppress(TimeoutError, Exception):
            async with asyncio.timeout(self.limits.close_timeout):
                await self.ws.send_text(json.dumps(frame, ensure_ascii=False))
        await self.close(code)

    async def close(self, code: int = CLOSE_NORMAL, reason: str = "") -> None:
        if self._closed:
            return
        self._closed = True
        self.close_code = code
        if self.ws.application_state is WebSocketState.CONNECTED:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(self.limits.close_timeout):
                    await self.ws.close(code, reason[:120])


class SocketKind(enum.StrEnum):
    """The browser's live sockets."""

    PTY = "pty"
    CHAT = "chat"


_NAMES = {SocketKind.PTY: "terminal", SocketKind.CHAT: "chat"}

#: Serves an admitted socket: the WebSocket, its channel, the signed-in user.
Serve = Callable[[WebSocket, BrowserChannel, str], Awaitable[None]]


async def serve_browser_socket(
    ws: WebSocket,
    kind: SocketKind,
    *,
    auth: WebAuth,
    gate: SocketGate,
    metrics: WebMetrics,
    error_frame: Callable[[SandlotError], dict[str, Any]],
    serve: Serve,
) -> None:
    """Admit a terminal or chat socket and serve it.

    The handshake is checked (origin, sign-in: refused before it is accepted), then the
    socket is accepted and held against ``gate`` while ``serve`` runs; a limit refusing
    it sends ``error_frame`` of the :class:`~sandlot.protocol.errors.RateLimited` and
    closes with 4429. The socket is closed when ``serve`` returns, whatever happened,
    and counted in ``metrics``.
    """
    browser = await auth.admit_websocket(ws)
    if browser is None:
        return
    await ws.accept()
    channel = BrowserChannel(ws, gate.limits)
    metrics.socket_opened(kind)
    try:
        with gate.admit(browser.user_id, client_address(ws)):
            await serve(ws, channel, browser.user_id)
    except RateLimited as exc:
        log.info("%s of %s refused: %s", _NAMES[kind], browser.user_id, exc.message)
        await channel.abort(error_frame(exc), CLOSE_RATE_LIMITED, side=Side.LIMIT)
    finally:
        try:
            await channel.close()
        finally:
            side = channel.ended_by or Side.SERVER
            failure = None
            if not channel.attached and side is not Side.BROWSER:
                failure = ATTACH_FAILURES.get(channel.close_code or CLOSE_NORMAL, "other")
            metrics.socket_closed(kind, side, failure)


def client_address(ws: WebSocket) -> str | None:
    """The browser's address as the server saw it (behind a proxy, what the ASGI server
    was told to trust)."""
    return ws.client.host if ws.client else None


async def cancel_all(tasks: list[asyncio.Task[Any]]) -> None:
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(BaseException):
            await task


class DataplaneChannel:
    """A dataplane WebSocket opened by the gateway, with a bounded queue of frames to it.

    Frames to the dataplane wait in a :class:`~sandlot.web.limits.FrameQueue` (a
    ``resize`` is dropped before anything else when it is full). The token the socket
    was opened with is renewed in place (an ``auth`` frame) every ``refresh_seconds``
    while it lives, so a long session outlives one token.
    """

    def __init__(
        self,
        conn: ClientConnection,
        workspace: Workspace,
        token: str,
        limits: SocketLimits,
        *,
        refresh_seconds: float = 60.0,
    ) -> None:
        self.conn = conn
        self.workspace = workspace
        self._token = token
        self.refresh_seconds = refresh_seconds
        self.queue: FrameQueue[str] = FrameQueue(
            limits.input_queue_frames, limits.input_queue_bytes
        )

    @classmethod
    async def open(
        cls,
        gateway: Gateway,
        workspace: Workspace,
        path: str,
        *,
        headers: Mapping[str, str],
        limits: SocketLimits,
        refresh_seconds: float = 60.0,
        first: dict[str, Any] | None = None,
    ) -> tuple[DataplaneChannel, dict[str, Any] | None]:
        """Open ``path`` (under the workspace's ``ws_base_url``) through the gateway, send
        ``first`` if given, and read the dataplane's first frame (``None``: it closed).

        If the dataplane refuses the token (it expired, or was revoked early), the socket
        is opened once more with a renewed one (``first`` was not acted on: the dataplane
        checks the token before it reads a frame)."""
        dp = await workspace.dataplane()
        for attempt in (1, 2):
            conn = await gateway.websocket(
                f"{dp.ws_base_url}{path}", token=dp.token, headers=headers
            )
            channel = cls(conn, workspace, dp.token, limits, refresh_seconds=refresh_seconds)
            try:
                if first is not None:
                    await channel.send_now(first)
                reply = await channel.recv()
            except BaseException:
                await channel.close()
                raise
            if attempt == 1 and channel.refused_token(reply):
                await channel.close()
                dp = await workspace.renewed()
                continue
            return channel, reply
        raise AssertionError("unreachable")

    def refused_token(self, reply: dict[str, Any] | None) -> bool:
        """Whether the dataplane closed the socket over its token."""
        if reply is not None and reply.get("type") == "error":
            return reply.get("code") in ("UNAUTHENTICATED", "TOKEN_EXPIRED")
        return reply is None and self.close_code == CLOSE_UNAUTHENTICATED

    def send(self, frame: dict[str, Any], *, kind: str = "") -> None:
        """Queue ``frame`` for the dataplane (``QueueOverflow`` if the queue is full)."""
        self.queue.put(json.dumps(frame, separators=(",", ":")), kind=kind)

    async def send_now(self, frame: dict[str, Any]) -> None:
        await self.conn.send(json.dumps(frame, separators=(",", ":")))

    async def run_sender(self) -> None:
        """Send queued frames until cancelled or the socket fails (then returns)."""
        while True:
            text = await self.queue.get()
            try:
                await self.conn.send(text)
            except Exception:
                return

    async def recv(self) -> dict[str, Any] | None:
        """The next frame (``auth_ok`` answers to renewals are not shown); ``None`` once
        the socket has closed (:attr:`close_code` says how)."""
        while True:
            try:
                raw = await self.conn.recv()
            except ConnectionClosed:
                return None
            try:
                frame = json.loads(raw)
            except ValueError:
                continue
            if isinstance(frame, dict) and frame.get("type") != "auth_ok":
                return frame

    @property
    def close_code(self) -> int | None:
        return self.conn.close_code

    async def keep_token_fresh(self) -> None:
        """Renew the socket's token every ``refresh_seconds`` (runs until cancelled)."""
        while True:
            await asyncio.sleep(self.refresh_seconds)
            try:
                fresh = (await self.workspace.dataplane()).token
            except Exception as exc:  # the next round tries again; the socket lives on
                log.info("could not renew a dataplane socket's token: %s", type(exc).__name__)
                continue
            if fresh != self._token:
                self._token = fresh
                with contextlib.suppress(Exception):
                    await self.send_now({"type": "auth", "token": fresh})

    async def close(self) -> None:
        """Close the socket (its closing handshake); if that fails or is cancelled (the
        server shutting down), drop the connection rather than leave it open."""
        try:
            await self.conn.close()
        except Exception:
            self.conn.transport.abort()
        except BaseException:
            self.conn.transport.abort()
            raise
