"""Moving bytes between a process's non-blocking fds and the event loop."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
from collections.abc import Callable

from sandlot.dataplane.services.streams import OutputStream

READ_SIZE = 65536
#: What a paced stream keeps free ahead of its leading client: one read, plus a default
#: (64 KiB) pipe full of output drained at once when the process exits.
PACING_HEADROOM = 2 * READ_SIZE


class FdReader:
    """Feeds everything read from ``fd`` into ``stream``; closes both at EOF.

    When the stream is paced and becomes :attr:`~OutputStream.full`, the reader stops
    watching the fd until the stream has room again: the writer then blocks on a full pipe
    (back-pressure) instead of its output being trimmed before a client could get it.
    """

    def __init__(
        self, fd: int, stream: OutputStream, *, on_eof: Callable[[], None] | None = None
    ) -> None:
        self.fd = fd
        self.stream = stream
        self._on_eof = on_eof
        self._loop = asyncio.get_running_loop()
        self.closed = False
        self.paused = False
        self._loop.add_reader(fd, self._readable)

    def _read(self) -> bytes:
        """The next chunk, ``b""`` at EOF; ``BlockingIOError`` when there is none yet."""
        try:
            return os.read(self.fd, READ_SIZE)
        except BlockingIOError:
            raise
        except OSError as exc:
            # A PTY master reports EIO once the last slave fd is closed: that is EOF.
            if exc.errno not in (errno.EIO, errno.EBADF):
                raise
            return b""

    def _readable(self) -> None:
        try:
            data = self._read()
        except BlockingIOError:
            return
        if data:
            self.stream.feed(data)
            if self.stream.full:
                self._pause()
        else:
            self.close()

    def _pause(self) -> None:
        self.paused = True
        self._loop.remove_reader(self.fd)
        self.stream.when_room(self._resume)

    def _resume(self) -> None:
        # Closed meanwhile (exit, or given up): the fd may be closed, its number reused.
        if self.closed or not self.paused:
            return
        self.paused = False
        self._loop.add_reader(self.fd, self._readable)

    def close(self) -> None:
        """Stop reading (EOF, or giving up on grandchildren that keep the pipe open)."""
        if self.closed:
            return
        self.closed = True
        self.paused = False
        self._loop.remove_reader(self.fd)
        self.stream.close()
        if self._on_eof is not None:
            self._on_eof()


async def write_all(fd: int, data: bytes) -> None:
    """Write ``data`` to a non-blocking fd, waiting for room when the pipe is full."""
    view = memoryview(data)
    loop = asyncio.get_running_loop()
    while view:
        try:
            written = os.write(fd, view)
        except BlockingIOError:
            ready = loop.create_future()
            loop.add_writer(fd, ready.set_result, None)
            try:
                await ready
            finally:
                loop.remove_writer(fd)
            continue
        view = view[written:]


def close_fd(fd: int | None) -> None:
    if fd is not None:
        with contextlib.suppress(OSError):
            os.close(fd)
