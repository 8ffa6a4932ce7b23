"""Output that outlives the server: each stream of a kept process spooled to a file.

A command's output must not depend on the server process staying alive. So for
a process the runtime keeps (:class:`~sandlot.runtime.base.Keep`), the sandbox's
init holds the server's ends of the pipes, and the server moves every chunk
from the pipe into the stream's spool file with ``splice`` *before* it reads
it back for clients. A byte is therefore either still in the pipe (held by the
init while the server is gone, the command blocked behind it) or in the file:
a server killed at any instant loses nothing, and the file's size is the
stream's offset. A PTY master cannot be spliced into a file directly: its
output goes through a pipe the init holds too, drained first on adoption.

Spool files live in the runtime's :attr:`~sandlot.runtime.base.SandboxRuntime.spool_dir`
(outside the sandbox; removed with it). Their disk use is bounded like the
memory of the streams: everything before the last ``keep_tail`` bytes is
punched out of the file (``FALLOC_FL_PUNCH_HOLE``: offsets stay, the blocks go),
except the first ``keep_head`` bytes a one-shot ``POST /exec`` answers with.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
from pathlib import Path

from sandlot.dataplane.services.procio import READ_SIZE, FdReader
from sandlot.dataplane.services.streams import OutputStream

_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02
#: Holes are punched in steps of this many bytes (not on every read).
PUNCH_STEP = 1 << 20

_libc = ctypes.CDLL(None, use_errno=True)
_fallocate = _libc.fallocate
_fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
_fallocate.restype = ctypes.c_int


class SpoolFile:
    """One stream's spool: an append-only file whose size is the stream's length."""

    def __init__(self, path: Path, *, keep_head: int, keep_tail: int, create: bool) -> None:
        flags = os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW | (os.O_CREAT | os.O_EXCL if create else 0)
        self.path = path
        self.fd = os.open(path, flags, 0o600)
        self.size = os.fstat(self.fd).st_size
        self.keep_head = keep_head
        self.keep_tail = keep_tail
        self._punched = keep_head

    def append_from(self, src: int, count: int = READ_SIZE) -> int:
        """Move up to ``count`` bytes from the pipe ``src`` to the end; 0 at EOF.

        Raises ``BlockingIOError`` when the pipe is empty.
        """
        moved = os.splice(src, self.fd, count, offset_dst=self.size, flags=os.SPLICE_F_NONBLOCK)
        self.size += moved
        return moved

    def read(self, offset: int, count: int) -> bytes:
        return os.pread(self.fd, count, offset)

    def trim(self) -> None:
        """Give back the blocks of everything older than the kept head and tail."""
        end = self.size - self.keep_tail
        if end - self._punched < PUNCH_STEP:
            return
        end -= end % PUNCH_STEP
        if (
            _fallocate(
                self.fd,
                _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE,
                self._punched,
                end - self._punched,
            )
            == 0
        ):
            self._punched = end
        else:
            # A filesystem without holes: keep the bytes (bounded by the sandbox's limits).
            self._punched = self.size

    def restore(self, stream: OutputStream) -> None:
        """Refill ``stream`` from the file, as it was when the server that wrote it died."""
        head = self.read(0, min(self.keep_head, self.size)) if self.keep_head else b""
        start = max(0, self.size - stream.capacity)
        stream.resume(start, self.read(start, self.size - start), head, self.size)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def remove(self) -> None:
        self.close()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()


class SpoolReader(FdReader):
    """An :class:`FdReader` that moves each chunk through the spool file first.

    ``fd`` is the pipe of the stream; under a PTY, ``master`` is the terminal,
    moved into ``fd``'s write end ``pipe_in`` (both held by the init) before.
    """

    def __init__(
        self,
        fd: int,
        stream: OutputStream,
        spool: SpoolFile,
        *,
        master: int | None = None,
        pipe_in: int | None = None,
    ) -> None:
        self.spool = spool
        self.master = master
        self.pipe_in = pipe_in
        self._master_eof = False
        super().__init__(master if master is not None else fd, stream)
        self.pipe = fd

    def _read(self) -> bytes:
        if self.master is not None and not self._master_eof:
            # Whatever an earlier server left in the pipe goes first, then the terminal.
            leftover = self._drain_pipe()
            if leftover:
                return leftover
            try:
                assert self.pipe_in is not None
                moved = os.splice(self.master, self.pipe_in, READ_SIZE, flags=os.SPLICE_F_NONBLOCK)
            except BlockingIOError:
                raise
            except OSError as exc:
                # A PTY master reports EIO once the last slave fd is closed: that is EOF.
                if exc.errno not in (errno.EIO, errno.EBADF):
                    raise
                moved = 0
            self._master_eof = moved == 0
            return self._drain_pipe()
        if self.master is not None:
            return self._drain_pipe()
        offset = self.spool.size
        if self.spool.append_from(self.pipe) == 0:
            return b""
        return self._read_back(offset)

    def _drain_pipe(self) -> bytes:
        offset = self.spool.size
        try:
            while self.spool.append_from(self.pipe):
                pass
        except BlockingIOError:
            pass
        return self._read_back(offset) if self.spool.size > offset else b""

    def _read_back(self, offset: int) -> bytes:
        data = self.spool.read(offset, self.spool.size - offset)
        self.spool.trim()
        return data
