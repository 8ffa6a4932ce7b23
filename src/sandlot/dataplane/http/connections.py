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
  connection waiting for a head is.
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


def guarded_http(deadline: float | None = None) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol (``httptools`` when installed, else ``h11``, as its
    ``auto``), closing a connection that has sent no whole request head within
    ``deadline`` seconds (default :func:`head_seconds`) of its start or of its last
    response's end."""
    from uvicorn.config import HTTP_PROTOCOLS
    from uvicorn.importer import import_from_string

    try:
        import httptools  # noqa: F401

        base: type[Any] = import_from_string(HTTP_PROTOCOLS["httptools"])
    except ImportError:
        base = import_from_string(HTTP_PROTOCOLS["h11"])

    seconds = head_seconds() if deadline is None else deadline

    class HeadDeadline(base):  # type: ignore[misc]
        """The protocol, with a timer armed while no request is being answered."""

        _head_timer: asyncio.TimerHandle | None = None
        #: The request the timer was armed after (``None``: none yet on the connection).
        _armed_after: Any = None

        def connection_made(self, transport: asyncio.Transport) -> None:
            super().connection_made(transport)
            self._arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._armed_after = self.cycle
            self._head_timer = self.loop.call_later(seconds, self._head_late)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_late(self) -> None:
            self._head_timer = None
            transport = self.transport
            if transport.is_closing() or transport.get_protocol() is not self:
                return  # closed already, or a WebSocket now
            cycle = self.cycle
            if cycle is not self._armed_after:
                return  # a head came: its request is being answered (its end re-arms)
            if cycle is not None and not cycle.response_complete:
                return  # a request pipelined behind the last one is being answered
            transport.close()

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


__all__ = ["HEAD_ENV", "HEAD_SECONDS", "guarded_http", "head_seconds", "raise_open_files_limit"]
