"""Output streams with byte offsets, a bounded replay buffer, and cursors.

A stream keeps the last ``capacity`` bytes a process wrote. Clients never get
a queue of their own: each one holds a *cursor* (the next offset it needs)
and copies from the shared buffer when it can send. So a slow client costs
no memory, never slows the others, and when it falls behind the buffer it
gets a ``gap`` frame saying exactly which bytes it lost, then continues.

Exec streams are also *paced* (``headroom`` set): while a client is attached,
the stream is :attr:`~OutputStream.full` once ``headroom`` more bytes could
trim bytes that the most advanced client has not been sent, and the reader of
the process's fd stops reading until that client advances or leaves. The
process then blocks on a full pipe, so a client that keeps up loses nothing
however fast the producer is. Only the leading client paces: the others fall
behind and get gaps as before, and with no client attached the command runs
at full speed (the buffer keeps the tail). Pacing stops when the process
exits, so exit is never delayed and what is left in the pipe is read at once.
Shells are not paced.

Only complete UTF-8 sequences enter the buffer (an incomplete tail waits for
the next read), so chunks decode on their own and offsets stay byte offsets;
an invalid byte is sent as one ``?`` (see :mod:`sandlot.protocol.frames`).
"""

from __future__ import annotations

import asyncio
import codecs
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from sandlot.protocol.errors import InvalidRequest
from sandlot.protocol.frames import gap_frame, output_frame


def _qmark(exc: UnicodeError) -> tuple[str, int]:
    assert isinstance(exc, UnicodeDecodeError)
    return "?" * (exc.end - exc.start), exc.end


codecs.register_error("sandlot-qmark", _qmark)


def decode(data: bytes) -> tuple[str, int]:
    """Text of ``data`` with one ``?`` per invalid byte, and how many were replaced."""
    try:
        return data.decode("utf-8"), 0
    except UnicodeDecodeError:
        text = data.decode("utf-8", "sandlot-qmark")
        # Every byte is either inside a valid character or became one "?".
        return text, text.count("?") - data.count(b"?")


def complete_utf8(data: bytes | bytearray) -> int:
    """Length of the prefix of ``data`` that does not end inside a UTF-8 sequence."""
    n = len(data)
    i = n - 1
    floor = max(0, n - 4)
    while i >= floor and (data[i] & 0xC0) == 0x80:
        i -= 1
    if i < floor or i < 0:
        return n
    lead = data[i]
    need = 1 if lead < 0xC0 else 2 if lead < 0xE0 else 3 if lead < 0xF0 else 4 if lead < 0xF8 else 1
    return i if n - i < need else n


def _boundary_forward(buf: bytearray, pos: int) -> int:
    """First character boundary at or after ``pos`` (skips at most 3 continuation bytes)."""
    end = min(len(buf), pos + 3)
    while pos < end and (buf[pos] & 0xC0) == 0x80:
        pos += 1
    return pos


class ByteBudget:
    """Bytes several streams may keep between them: the one-shot copies (``POST /exec``)
    of one sandbox's running commands. A stream takes what it keeps and gives it all back
    when it ends; what it would keep beyond its share is cut (``truncated``)."""

    def __init__(self, total: int) -> None:
        self.available = total


class OutputStream:
    """One output stream (stdout, stderr, or a PTY) of a command or shell."""

    def __init__(
        self,
        name: str,
        capacity: int,
        *,
        collect_limit: int | None = None,
        headroom: int | None = None,
        budget: ByteBudget | None = None,
    ) -> None:
        self.name = name
        self.capacity = capacity
        #: Room kept free ahead of the leading client for what one more read and, at exit,
        #: the pipe's leftovers may add (see :attr:`full`); ``None``: never paced.
        self.headroom = headroom
        #: Attached cursors, with the index of this stream in each one's offsets.
        self._cursors: dict[Cursor, int] = {}
        self._on_room: Callable[[], None] | None = None
        self._buf = bytearray()
        self._start = 0
        self._pending = b""
        self.eof = False
        self._listeners: set[asyncio.Event] = set()
        #: Everything written, up to ``collect_limit`` bytes (one-shot ``POST /exec``).
        self.collected: bytearray | None = bytearray() if collect_limit is not None else None
        self._collect_limit = collect_limit or 0
        self.truncated = False
        #: Where the collected bytes are taken from while the stream runs, and how many.
        self._budget = budget
        self._charged = 0

    @property
    def start(self) -> int:
        return self._start

    @property
    def end(self) -> int:
        return self._start + len(self._buf)

    def listen(self, event: asyncio.Event) -> None:
        self._listeners.add(event)

    def unlisten(self, event: asyncio.Event) -> None:
        self._listeners.discard(event)

    def _notify(self) -> None:
        for event in self._listeners:
            event.set()

    # --- pacing -------------------------------------------------------------------------

    @property
    def full(self) -> bool:
        """Whether reading on could trim bytes the most advanced attached client still needs.

        A client that has everything never holds the reader back, whatever the capacity.
        """
        if self.headroom is None or self.eof or not self._cursors:
            return False
        lead = max(c.offsets[i] for c, i in self._cursors.items())
        unsent = self.end - lead
        # Bytes held back as an incomplete character are already out of the pipe, and a
        # trim cuts up to 3 bytes more than asked to land on a character boundary.
        return unsent > 0 and unsent + len(self._pending) + 3 + self.headroom > self.capacity

    def when_room(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once, when the stream stops being :attr:`full`."""
        self._on_room = callback
        self.check_room()

    def stop_pacing(self) -> None:
        """Never hold the reader back again (the process exited: drain its pipes now)."""
        self.headroom = None
        self.check_room()

    def check_room(self) -> None:
        """Wake the waiting reader if a cursor moved (or left) far enough for it to go on."""
        if self._on_room is not None and not self.full:
            callback, self._on_room = self._on_room, None
            callback()

    def add_cursor(self, cursor: Cursor, index: int) -> None:
        """``cursor`` reads this stream as its ``index``-th; from now on it may pace it."""
        self._cursors[cursor] = index

    def remove_cursor(self, cursor: Cursor) -> None:
        """The client left: the reader it held back goes on (free if it was the last)."""
        self._cursors.pop(cursor, None)
        self.check_room()

    def feed(self, data: bytes) -> None:
        if self._pending:
            data = self._pending + data
        cut = complete_utf8(data)
        self._pending = data[cut:]
        if cut:
            self._append(data[:cut] if cut < len(data) else data)

    def _append(self, data: bytes) -> None:
        if self.collected is not None:
            self._collect(data)
        self._buf += data
        # Trim in steps (not on every write) so the memmove is amortised.
        excess = len(self._buf) - self.capacity
        if excess > 0 and excess >= min(65536, self.capacity // 8 or 1):
            cut = _boundary_forward(self._buf, excess)
            del self._buf[:cut]
            self._start += cut
        self._notify()

    def _collect(self, data: bytes) -> None:
        assert self.collected is not None
        room = self._collect_limit - len(self.collected)
        if self._budget is not None and not self.eof:
            room = min(room, self._budget.available)
        kept = data if room >= len(data) else data[: complete_utf8(data[: max(room, 0)])]
        if len(kept) < len(data):
            self.truncated = True
        self.collected += kept
        if self._budget is not None and not self.eof:
            self._budget.available -= len(kept)
            self._charged += len(kept)

    def _give_back(self) -> None:
        if self._budget is not None:
            self._budget.available += self._charged
            self._charged = 0

    def resume(self, start: int, data: bytes, head: bytes, size: int) -> None:
        """Continue a stream of ``size`` bytes whose last ones, from ``start``, are ``data``.

        ``head`` is its beginning, for the one-shot copy (what a restarted server finds
        in the spool file of a command another server started).
        """
        skip = 0
        while start and skip < min(3, len(data)) and (data[skip] & 0xC0) == 0x80:
            skip += 1
        self._buf = bytearray()
        self._start = start + skip
        self._pending = b""
        collected, self.collected = self.collected, None
        self.feed(data[skip:])
        if collected is not None:
            self._give_back()
            self.collected = bytearray()
            kept = head[: self._collect_limit]
            self._collect(kept[: complete_utf8(kept)])
            self.truncated = self.truncated or size > self._collect_limit

    def close(self) -> None:
        if self.eof:
            return
        if self._pending:
            pending, self._pending = self._pending, b""
            self._append(pending)
        self.eof = True
        # Ended: what it keeps counts among the sandbox's finished commands from now on.
        self._give_back()
        self._on_room = None  # nothing left to read: no reader to wake
        self._notify()

    def read(self, offset: int, max_bytes: int) -> tuple[int, bytes]:
        """``(offset, bytes)`` from ``offset`` on; the offset moves forward past lost bytes."""
        if offset < self._start:
            offset = self._start
        rel = offset - self._start
        if rel >= len(self._buf):
            return offset, b""
        chunk = bytes(self._buf[rel : rel + max_bytes])
        if len(chunk) == max_bytes and rel + max_bytes < len(self._buf):
            cut = complete_utf8(chunk)
            if cut:
                chunk = chunk[:cut]
        return offset, chunk

    def tail(self, max_bytes: int) -> tuple[int, bytes]:
        start = max(self._start, self.end - max_bytes)
        start = self._start + _boundary_forward(self._buf, start - self._start)
        return start, bytes(self._buf[start - self._start :])


Send = Callable[[dict[str, Any]], Awaitable[None]]


def check_offsets(streams: Sequence[OutputStream], offsets: Sequence[int]) -> None:
    """An offset past what was written is a client bug: say so rather than skip bytes."""
    for s, off in zip(streams, offsets, strict=False):
        if off > s.end:
            raise InvalidRequest(
                f"{s.name} offset {off} is beyond the {s.end} bytes written",
                metadata={"stream": s.name, "end": s.end},
            )


class Cursor:
    """One client's position in a set of streams."""

    def __init__(self, streams: Sequence[OutputStream], offsets: Sequence[int]) -> None:
        self.streams = list(streams)
        self.offsets = list(offsets)
        self.event = asyncio.Event()
        for i, s in enumerate(self.streams):
            s.listen(self.event)
            s.add_cursor(self, i)
        self.event.set()

    def close(self) -> None:
        for s in self.streams:
            s.unlisten(self.event)
            s.remove_cursor(self)

    def seek(self, offsets: Sequence[int]) -> None:
        check_offsets(self.streams, offsets)
        self.offsets = list(offsets)
        for s in self.streams:
            s.check_room()
        self.event.set()

    @property
    def drained(self) -> bool:
        return all(
            s.eof and off >= s.end for s, off in zip(self.streams, self.offsets, strict=True)
        )

    async def flush(self, send: Send, max_frame: int) -> None:
        """Send everything available from the cursor on (gaps first where bytes are gone)."""
        self.event.clear()
        for i, s in enumerate(self.streams):
            while self.offsets[i] < s.end:
                want = self.offsets[i]
                got, chunk = s.read(want, max_frame)
                if got > want:
                    await send(gap_frame(s.name, want, got))
                if not chunk:
                    self.offsets[i] = got
                    s.check_room()
                    break
                text, replaced = decode(chunk)
                await send(output_frame(s.name, text, got, replaced))
                # The stream may have been trimmed while we were sending: only our
                # own bookkeeping moves the cursor, and a later read reports the gap.
                self.offsets[i] = got + len(chunk)
                s.check_room()
