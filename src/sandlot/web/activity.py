"""The workspace's event log (PROTOCOL.md 3.7) as JSON pages, with who did what.

The dataplane serves its log as a Server-Sent Events stream that goes on live once it
has sent what it holds. A page reads that stream from the cursor (``after``, exclusive)
and stops when it has ``limit`` events, when the stream has nothing more for
:data:`SETTLE_SECONDS` (what was held is sent at once, in one piece), or after
:data:`PAGE_SECONDS`. Each event keeps the dataplane's fields (``sequence``,
``event_type``, ``timestamp``, ``actor`` — ``{"type": "human"|"agent", "id"}``, or
``null`` for a change seen by the workspace watcher — and ``details``) and, for a file
event inside the workspace, the browser's ``path`` (and ``from`` for a move). The git
commands this server runs for its own routes are left out (``next_after`` still moves
past them).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from sandlot.protocol.errors import InvalidRequest, SandlotError, SequenceExpired
from sandlot.web import paths
from sandlot.web.calls import DataplaneCalls

log = logging.getLogger("sandlot.web.activity")

#: The most events of the backlog a stream opened with ``tail`` sends.
MAX_TAIL = 10_000
#: How long a quiet stream is waited on before the page is complete (or, for a stream, the
#: backlog through, when the dataplane does not say so itself with a ``: live`` comment).
SETTLE_SECONDS = 0.15
#: The dataplane's comment once a stream has sent what the log held.
LIVE = "live"
#: The longest a page is read.
PAGE_SECONDS = 5.0
MAX_PAGE = 1000
#: The ``command_id`` prefix of the commands this server runs itself (left out of pages).
OWN_COMMANDS = "web-git-"
#: Most bytes of events read for one page.
MAX_PAGE_BYTES = 8 << 20


def browser_event(event: dict[str, Any]) -> dict[str, Any]:
    """An event as the browser gets it (see the module's docstring)."""
    out = {
        "sequence": event.get("sequence"),
        "event_type": event.get("event_type"),
        "timestamp": event.get("timestamp"),
        "actor": event.get("actor"),
        "details": event.get("details") or {},
    }
    fs = out["details"].get("fs") if isinstance(out["details"], dict) else None
    if isinstance(fs, dict):
        rel = paths.to_browser(str(fs.get("path", "")))
        if rel is not None:
            out["path"] = rel
        moved_from = fs.get("from")
        if isinstance(moved_from, str) and (src := paths.to_browser(moved_from)) is not None:
            out["from"] = src
    return out


def own_command(event: dict[str, Any]) -> bool:
    """Whether an event is of a command this server ran itself (git, for its routes)."""
    exec_ = (event.get("details") or {}).get("exec")
    return isinstance(exec_, dict) and str(exec_.get("command_id") or "").startswith(OWN_COMMANDS)


def _frame(raw: bytes) -> tuple[str, str]:
    """``(event, data)`` of one SSE frame (a comment as ``("comment", text)``)."""
    name, data = "message", []
    for line in raw.decode("utf-8", "replace").split("\n"):
        if line.startswith(":"):
            name = "comment"
            data.append(line[1:].strip())
        elif line.startswith("event:"):
            name = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].lstrip(" "))
    return name, "\n".join(data)


class _FrameSplitter:
    """SSE frames out of a byte stream's chunks: every frame a chunk completes, at once."""

    def __init__(self) -> None:
        self._rest = b""

    def feed(self, chunk: bytes) -> list[tuple[str, str]]:
        *complete, self._rest = (self._rest + chunk).split(b"\n\n")
        return [_frame(raw) for raw in complete]


async def _frames(chunks: AsyncIterator[bytes]) -> AsyncGenerator[tuple[str, str]]:
    """``(event, data)`` of each SSE frame (comments as ``("comment", text)``)."""
    splitter = _FrameSplitter()
    async for chunk in chunks:
        for frame in splitter.feed(chunk):
            yield frame


class WorkspaceActivity:
    """The event log of one workspace, for one browser request."""

    def __init__(self, calls: DataplaneCalls) -> None:
        self.calls = calls

    async def events(self, after: int, limit: int) -> tuple[list[dict[str, Any]], bool]:
        """Up to ``limit`` raw events after ``after``, and whether ``limit`` stopped it."""
        events: list[dict[str, Any]] = []
        deadline = time.monotonic() + PAGE_SECONDS
        async with self.calls.stream(
            "/events", params={"after": after}, accept="text/event-stream",
            max_bytes=MAX_PAGE_BYTES,
        ) as answer:  # fmt: skip
            frames = _frames(answer.aiter_bytes())
            try:
                while len(events) < limit:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    try:
                        async with asyncio.timeout(min(SETTLE_SECONDS, left)):
                            name, data = await anext(frames)
                    except (TimeoutError, StopAsyncIteration):
                        break
                    if name == "error":
                        raise SequenceExpired("events before this cursor are no longer kept")
                    if name == "comment" or not data:
                        continue
                    try:
                        events.append(json.loads(data))
                    except ValueError:
                        continue
            finally:
                await frames.aclose()
        return events, len(events) >= limit

    async def page(self, after: int, limit: int = 100) -> dict[str, Any]:
        """``GET /api/v1/activity``: ``{"events", "after", "next_after", "has_more"}``."""
        if after < 0:
            raise InvalidRequest("after must be 0 or more")
        if not 1 <= limit <= MAX_PAGE:
            raise InvalidRequest(f"limit must be between 1 and {MAX_PAGE}")
        events, full = await self.events(after, limit)
        page = [browser_event(e) for e in events if not own_command(e)]
        last = int(events[-1].get("sequence") or after) if events else after
        return {"events": page, "after": after, "next_after": last, "has_more": full}

    async def last_agent_change(self, path: str) -> dict[str, Any] | None:
        """The latest file event of an ``agent`` actor on ``path`` that the log still holds."""
        sandbox_path = paths.to_sandbox(path)
        found: dict[str, Any] | None = None
        after = 0
        for _ in range(20):  # at most 20 pages: the log keeps 10,000 events by default
            events, full = await self.events(after, MAX_PAGE)
            for event in events:
                fs = (event.get("details") or {}).get("fs")
                actor = event.get("actor") or {}
                mine = isinstance(fs, dict) and fs.get("path") == sandbox_path
                if mine and actor.get("type") == "agent":
                    found = browser_event(event)
            if not full or not events:
                break
            after = int(events[-1].get("sequence") or after)
        return found


#: The most bytes one live stream relays before it ends (the browser then reconnects
#: from its last event id).
STREAM_BYTES = 256 << 20
#: Upstream chunks read ahead of the browser's writes.
READ_AHEAD = 16


def sse_frame(event: str, data: str, event_id: int | None = None) -> bytes:
    """One Server-Sent Events frame (``data`` is one line of escaped JSON)."""
    head = f"id: {event_id}\n" if event_id is not None else ""
    return f"{head}event: {event}\ndata: {data}\n\n".encode()


class ActivityStream:
    """``GET /api/v1/activity/stream``: the event log after ``after``, then live, as
    Server-Sent Events (each event a ``message`` with its sequence as ``id``; one
    ``ready`` once what the log held has been sent; ``expired`` then the end when the
    cursor is older than the log keeps). The dataplane's keep-alive comments pass
    through, so a quiet stream stays open.

    The upstream stream is long-lived: it has a connection of its own, outside the pool
    the short calls share (:meth:`~sandlot.web.gateway.Gateway.stream`), closed by
    :meth:`aclose` however the stream ends (:class:`ActivityResponse` calls it)."""

    def __init__(self, calls: DataplaneCalls, after: int, tail: int | None = None) -> None:
        if after < 0:
            raise InvalidRequest("after must be 0 or more")
        if tail is not None and not 0 <= tail <= MAX_TAIL:
            raise InvalidRequest(f"tail must be between 0 and {MAX_TAIL}")
        self.calls = calls
        self.after = after
        #: Of the log's backlog, only its latest ``tail`` events (``None``: all); the
        #: dataplane skips the rest, so a long log costs nothing to a page opening.
        self.tail = tail
        self._stack = contextlib.AsyncExitStack()
        self._chunks: AsyncGenerator[bytes] | None = None
        self._expired = False
        #: Set to end the stream from elsewhere (its user opened one too many).
        self.closing = asyncio.Event()

    async def open(self) -> None:
        """Opens the upstream stream (its failures are the request's errors).

        A log keeps its latest events only. A page opening the stream from the start
        (``after=0``) gets what the log still holds, from its oldest event: refusing it
        left a workspace with more changes than the log keeps without a live page. A
        later cursor older than the log gets ``expired`` as the stream's first frame,
        as when a reader falls behind, and the page starts again from the start."""
        try:
            await self._open(self.after)
        except SequenceExpired as exc:
            oldest = exc.metadata.get("oldest_sequence")
            if self.after == 0 and isinstance(oldest, int) and oldest > 0:
                await self._open(oldest - 1)
            else:
                self._expired = True
        except BaseException:
            await self.aclose()
            raise

    async def _open(self, after: int) -> None:
        params = {"after": after} if self.tail is None else {"after": after, "tail": self.tail}
        answer = await self._stack.enter_async_context(
            self.calls.stream(
                "/events",
                params=params,
                accept="text/event-stream",
                max_bytes=STREAM_BYTES,
                long_lived=True,
            )
        )
        self._chunks = answer.aiter_bytes()

    async def aclose(self) -> None:
        """Closes the upstream stream and drops its connection (shielded: it runs while
        the request whose browser left is being cancelled)."""
        with anyio.CancelScope(shield=True):
            try:
                if self._chunks is not None:
                    await self._chunks.aclose()
            finally:
                await self._stack.aclose()

    async def read_upstream(self, sink: MemoryObjectSendStream[bytes]) -> None:
        """Passes the upstream's chunks to ``sink`` until it ends (or ends badly: over
        its byte cap, the sandbox gone; the browser then reconnects from its last event
        id)."""
        async with sink:
            if self._chunks is None:
                return
            with contextlib.suppress(SandlotError):
                async for chunk in self._chunks:
                    await sink.send(chunk)

    @staticmethod
    def _message(data: str, encode: Callable[[Any], str]) -> bytes:
        """The browser's frame of one dataplane event (``b""`` for none of its business)."""
        try:
            event = json.loads(data)
        except ValueError:
            return b""
        if not isinstance(event, dict) or own_command(event):
            return b""
        return sse_frame("message", encode(browser_event(event)), event.get("sequence"))

    async def frames(
        self, chunks: MemoryObjectReceiveStream[bytes], encode: Callable[[Any], str]
    ) -> AsyncGenerator[bytes]:
        """The browser's frames of the upstream's ``chunks`` (``encode`` writes an event
        as escaped JSON), those of one chunk in one piece: the log's backlog, which the
        dataplane sends at once, reaches the browser in a few writes rather than one
        per event."""
        if self._expired:
            yield sse_frame("expired", "{}")
            return
        splitter = _FrameSplitter()
        ready = False
        while True:
            try:
                if ready:
                    chunk = await chunks.receive()
                else:
                    # The dataplane says when its backlog is through (``: live``); one
                    # that does not is taken as through after a pause.
                    with anyio.move_on_after(SETTLE_SECONDS) as settle:
                        chunk = await chunks.receive()
                    if settle.cancelled_caught:
                        ready = True
                        yield sse_frame("ready", "{}")
                        continue
            except anyio.EndOfStream:
                return
            out: list[bytes] = []
            for name, data in splitter.feed(chunk):
                if name == "error":
                    out.append(sse_frame("expired", "{}"))
                    yield b"".join(out)
                    return
                if name == "comment":
                    if data == LIVE:
                        # The dataplane caught up with its log: what follows is live.
                        if not ready:
                            ready = True
                            out.append(sse_frame("ready", "{}"))
                        continue
                    out.append(b": keep-alive\n\n")
                    continue
                frame = self._message(data, encode)
                if frame:
                    out.append(frame)
            if out:
                yield b"".join(out)


class ActivityResponse(Response):
    """The answer of ``GET /api/v1/activity/stream``: ``stream``'s frames as Server-Sent
    Events until the upstream ends, the browser leaves, or the stream is closed
    (``stream.closing``: its user opened too many); then its upstream connection is
    dropped at once. One task reads the upstream, one listens for the browser leaving,
    and this one writes, in one task group: the cleanup runs in this request's own
    task, not in a generator's ``finally`` that a cancelled response never gets past."""

    media_type = "text/event-stream"

    def __init__(
        self,
        stream: ActivityStream,
        encode: Callable[[Any], str],
        *,
        streams: UserStreams,
        user: str,
        headers: dict[str, str] | None = None,
    ) -> None:
        self.stream = stream
        self.encode = encode
        self.streams = streams
        self.user = user
        self.status_code = 200
        self.background = None
        self.init_headers(headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.streams.admit(self.user, self.stream)
        left = False
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            sink, source = anyio.create_memory_object_stream[bytes](READ_AHEAD)
            async with anyio.create_task_group() as tasks, source:

                async def until_left() -> None:
                    nonlocal left
                    while (await receive())["type"] != "http.disconnect":
                        pass
                    left = True
                    tasks.cancel_scope.cancel()

                async def until_closed() -> None:
                    await self.stream.closing.wait()
                    tasks.cancel_scope.cancel()

                tasks.start_soon(until_left)
                tasks.start_soon(until_closed)
                tasks.start_soon(self.stream.read_upstream, sink)
                async for frame in self.stream.frames(source, self.encode):
                    await send({"type": "http.response.body", "body": frame, "more_body": True})
                tasks.cancel_scope.cancel()
            if not left:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            self.streams.leave(self.user, self.stream)
            await self.stream.aclose()


class UserStreams:
    """The activity streams each user has open, at most ``per_user``: one more closes
    the user's oldest (its page reconnects a moment later; the page in front of the
    user is the one that gets its stream)."""

    def __init__(self, per_user: int) -> None:
        self.per_user = per_user
        self._open: dict[str, list[ActivityStream]] = {}

    def admit(self, user: str, stream: ActivityStream) -> None:
        streams = self._open.setdefault(user, [])
        streams.append(stream)
        while len(streams) > self.per_user:
            oldest = streams.pop(0)
            oldest.closing.set()
            log.info("closed the oldest activity stream of %s (%d open)", user, self.per_user)

    def leave(self, user: str, stream: ActivityStream) -> None:
        streams = self._open.get(user, [])
        with contextlib.suppress(ValueError):
            streams.remove(stream)
        if not streams:
            self._open.pop(user, None)

    def count(self, user: str) -> int:
        return len(self._open.get(user, ()))
