"""Moving bytes between a process's non-blocking fds and the event loop."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
from collections.abc import Callable

from sandlot.dataplane.streams import OutputStream

READ_SIZE = 65536


class FdReader:
    """Feeds everything read from ``fd`` into ``stream``; closes both at EOF."""

    def __init__(
        self, fd: int, stream: OutputStream, *, on_eof: Callable[[], None] | None = None
    ) -> None:
        self.fd = fd
        self.stream = stream
        self._on_eof = on_eof
        self._loop = asyncio.get_running_loop()
        self.closed = False
        self._loop.add_reader(fd, self._readable)

    def _readable(self) -> None:
        try:
            data = os.read(self.fd, READ_SIZE)
        except BlockingIOError:
            return
        except OSError as exc:
            # A PTY master reports EIO once the last slave fd is closed: that is EOF.
            if exc.errno not in (errno.EIO, errno.EBADF):
                raise
            data = b""
        if data:
            self.stream.feed(data)
        else:
            self.close()

    def close(self) -> None:
        """Stop reading (EOF, or giving up on grandchildren that keep the pipe open)."""
        if self.closed:
            return
        self.closed = True
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
