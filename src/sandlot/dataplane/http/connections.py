"""What sandlot's servers do about connections that hold a file descriptor and ask
nothing: uvicorn keeps a connection open until its client sends a whole request head,
however long that takes (its keep-alive timeout starts only once a response ends), so
a thousand connections that send nothing, or a byte a minute, from one machine and
without a key, took every descriptor a server may open and it answered nobody.

- :func:`guarded_http` is uvicorn's HTTP protocol with a deadline for each request
  head (:data:`HEAD_SECONDS`, or ``SANDLOT_HEAD_TIMEOUT_SECONDS``; as nginx's
  ``client_header_timeout`` or Apache's ``RequestReadTimeout``): counted from the
  connection, then from each response's end; a connection still short of a head by
  then is closed. A request in flight, a stream, a WebSocket are never cut: only a
  connection waiting for a head is. A body its handler reads may pause three times
  that at most between two reads (:data:`BODY_IDLE_HEADS`, ``client_body_timeout``).
  A head larger than :data:`MAX_HEAD_BYTES` is answered 431 and its connection closed.
- :func:`raise_open_files_limit` takes the soft limit of open files up to the hard one
  (the soft one is often 1024, which is nothing for a server; Go's runtime does the same
  for every program).
"""

from __future__ import annotations

import asyncio
import logging
import os
import resource
from collections.abc import Mapping
from typing import Any

log = logging.getLogger("sandlot.connections")

#: Seconds a connection may take to send a request's head (from its start, or from the
#: end of the response before); an HTTP client sends one in one go.
HEAD_SECONDS = 20.0
#: The environment variable that sets it for a server.
HEAD_ENV = "SANDLOT_HEAD_TIMEOUT_SECONDS"
#: Bytes a request head (its line and headers) may take, as nginx's
#: ``large_client_header_buffers`` bounds it: httptools and uvicorn build a header's
#: value and the URL by appending each piece to what came before, so one head of 80 MB
#: sent in small pieces held the event loop for seconds at a time, without any key.
MAX_HEAD_BYTES = 64 << 10
#: How long a connection refused for its head's size must have been quiet (what came
#: was read and dropped) before it is closed, for its answer to reach the client.
LINGER_SECONDS = 2.0
#: The longest such a connection is read for (nginx's ``lingering_time``).
LINGER_MAX_SECONDS = 30.0
#: How many head deadlines a request's body may go without a byte while its handler
#: reads it (60 s by default, nginx's ``client_body_timeout``): a head that announces
#: a body, then nothing, held its connection for good, and a route that reads a body
#: takes no key (the sign-in).
BODY_IDLE_HEADS = 3


def head_seconds(environ: Mapping[str, str] = os.environ) -> float:
    """:data:`HEAD_SECONDS`, or ``SANDLOT_HEAD_TIMEOUT_SECONDS`` when it is a positive
    number."""
    given = environ.get(HEAD_ENV)
    if given is None:
        return HEAD_SECONDS
    try:
        seconds = float(given)
    except ValueError:
        seconds = 0.0
    if not 0 < seconds < float("inf"):
        log.warning("%s=%r is not a positive number: %s s", HEAD_ENV, given, HEAD_SECONDS)
        return HEAD_SECONDS
    return seconds


def guarded_http(
    deadline: float | None = None, body_idle: float | None = None
) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol (``httptools`` when installed, else ``h11``, as its
    ``auto``), closing a connection that has sent no whole request head within
    ``deadline`` seconds (default :func:`head_seconds`) of its start or of its last
    response's end, or that sends nothing for ``body_idle`` seconds (default
    :data:`BODY_IDLE_HEADS` deadlines) of a body its request's handler is reading."""
    from uvicorn.config import HTTP_PROTOCOLS
    from uvicorn.importer import import_from_string

    try:
        import httptools  # noqa: F401

        base: type[Any] = import_from_string(HTTP_PROTOCOLS["httptools"])
    except ImportError:
        base = import_from_string(HTTP_PROTOCOLS["h11"])

    head = head_seconds() if deadline is None else deadline
    idle = BODY_IDLE_HEADS * head if body_idle is None else body_idle
    # httptools tells the protocol when a head is whole; h11 bounds a head itself
    # (uvicorn's ``h11_max_incomplete_event_size``).
    sized = hasattr(base, "on_headers_complete")

    class HeadDeadline(base):  # type: ignore[misc]
        """The protocol, with a timer while it waits for a client: for a request head
        (from the connection, or the last response's end), or for the next bytes of a
        request body that its handler is reading."""

        _timer: asyncio.TimerHandle | None = None
        #: The request the head deadline was set after (``None``: none yet).
        _armed_after: Any = None
        _head_due = 0.0
        _last_data = 0.0
        #: Whether a head is awaited (not whole yet), and how many bytes came for it.
        _in_head = True
        _head_bytes = 0
        _refused = False
        _refused_at = 0.0
        _linger_last = 0.0

        def connection_made(self, transport: asyncio.Transport) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            self._last_data = self.loop.time()
            if self._refused:
                self._linger_last = self._last_data
                return  # what the client sends after its refusal is dropped unread
            if sized and self._in_head:
                room = MAX_HEAD_BYTES - self._head_bytes
                if len(data) > room:
                    # Its head is whole within the bound, or it is refused; what follows
                    # the head (a body) is not the head's.
                    first, data = data[: max(room, 0)], data[max(room, 0) :]
                    self._head_bytes += len(first)
                    if first:
                        super().data_received(first)
                    if self._in_head and not self.transport.is_closing():
                        # What follows is dropped: the parser must not go on to a whole
                        # head, and the app answer after the refusal.
                        self._refuse_head()
                        return
                    if self.transport.is_closing() or not data:
                        return
                    if self.transport.get_protocol() is not self:
                        self.transport.get_protocol().data_received(data)
                        return
                else:
                    self._head_bytes += len(data)
            super().data_received(data)

        def on_message_begin(self) -> None:
            # A new request: its head is counted from the next bytes on. (Not from the end
            # of the answer before: the rest of a body its handler never read comes after
            # that, and it is no head.)
            self._in_head, self._head_bytes = True, 0
            super().on_message_begin()

        def on_headers_complete(self) -> None:
            self._in_head = False
            super().on_headers_complete()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()

        def _refuse_head(self) -> None:
            body = (
                b'{"error":{"code":"INVALID_REQUEST","message":"the request head is larger '
                b'than %d bytes","retryable":false,"domain":"sandlot","metadata":{}}}'
                % MAX_HEAD_BYTES
            )
            self.transport.write(
                b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
                b"content-type: application/json\r\nconnection: close\r\n"
                b"content-length: %d\r\n\r\n%s" % (len(body), body)
            )
            # Closed at once with the client's bytes unread, the connection would be reset
            # and the answer lost: the sending side ends now, what still comes is dropped
            # (nginx's lingering close), and the connection closes once the client has
            # sent nothing for LINGER_SECONDS (LINGER_MAX_SECONDS at most).
            self._refused = True
            self._refused_at = self._linger_last = self.loop.time()
            self._disarm()
            if self.transport.can_write_eof():
                self.transport.write_eof()
            self.loop.call_later(LINGER_SECONDS, self._linger)

        def _linger(self) -> None:
            now = self.loop.time()
            quiet = now - self._linger_last
            if quiet >= LINGER_SECONDS or now - self._refused_at >= LINGER_MAX_SECONDS:
                self.transport.close()
            else:
                self.loop.call_later(LINGER_SECONDS - quiet, self._linger)

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._armed_after = self.cycle
            now = self.loop.time()
            self._head_due = now + head
            self._last_data = now
            self._schedule(head)

        def _schedule(self, delay: float) -> None:
            self._disarm()
            self._timer = self.loop.call_later(max(delay, 0.01), self._check)

        def _disarm(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

        def _check(self) -> None:
            self._timer = None
            transport = self.transport
            if transport.is_closing() or transport.get_protocol() is not self:
                return  # closed already, or a WebSocket now
            now = self.loop.time()
            cycle = self.cycle
            if cycle is self._armed_after and (cycle is None or cycle.response_complete):
                # No head since: the deadline is the head's.
                if now >= self._head_due:
                    transport.close()
                else:
                    self._schedule(self._head_due - now)
                return
            if cycle is None or cycle.response_complete or not cycle.more_body:
                # A request being answered, its body read (its end arms the deadline of
                # the next head); or a pipelined one about to be.
                self._schedule(idle)
                return
            if self.flow.read_paused:
                # The handler is slow to take the body, not the client to send it.
                self._last_data = now
            if now - self._last_data >= idle:
                transport.close()
            else:
                self._schedule(self._last_data + idle - now)

    HeadDeadline.__name__ = HeadDeadline.__qualname__ = f"HeadDeadline{base.__name__}"
    return HeadDeadline


def raise_open_files_limit() -> int:
    """The soft limit of open files raised to the hard one; the limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    # Linux refuses more than fs.nr_open (1 Mi by default) whatever the hard limit says.
    want = 1 << 20 if hard == resource.RLIM_INFINITY else hard
    if soft == resource.RLIM_INFINITY or soft >= want:
        return soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    except (OSError, ValueError):
        log.warning("the open files limit stays %d (raising it to %d failed)", soft, want)
        return soft
    return want


__all__ = [
    "BODY_IDLE_HEADS",
    "HEAD_ENV",
    "HEAD_SECONDS",
    "MAX_HEAD_BYTES",
    "guarded_http",
    "head_seconds",
    "raise_open_files_limit",
]
