"""The tar a sandbox sends back, read as it arrives, for ``sandlot pull``.

The archive is written from what an agent left in the sandbox, and passes
through a dataplane running there: its bytes are input, not a format to trust.
``tarfile`` does not fit: it wants a file object (the download is an async
stream), and it stops silently at a missing end marker or at the first header
that does not check out, so a download cut short (the dataplane stops the
stream when a file cannot be read mid-walk) reads as a complete, smaller tree.
Here every header is checked and the archive must end with its two zero blocks;
anything else is an :class:`ArchiveError`.

Headers are decoded as the dataplane's own reader of uploads decodes them
(:mod:`sandlot.dataplane.services.tarstream`); only the reading differs (async here).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from sandlot.dataplane.services.tarstream import (
    BLOCK,
    ZERO_BLOCK,
    Member,
    TarError,
    checksum_ok,
    member_of,
    number,
    pax_records,
    text_of,
)

#: The most a PAX header or a GNU long name may hold.
MAX_HEADER_DATA = 1 << 20


class ArchiveError(TarError):
    """The archive is damaged, or ended before its end-of-archive marker."""


class ArchiveReader:
    """The members of a plain tar arriving as ``chunks``, in order.

    Iterate :meth:`members`; after each, :meth:`data` yields that member's bytes
    (only a ``file`` has some). What is not read of a member is skipped when the
    next one is asked for. The iteration ends only at the end-of-archive marker.
    """

    def __init__(self, chunks: AsyncIterator[bytes]) -> None:
        self._chunks = chunks
        self._buf = b""
        self._pos = 0
        self._left = 0  # data bytes of the current member not handed out yet
        self._pad = 0  # then the padding to the next block

    async def _more(self) -> None:
        while True:
            chunk = await anext(self._chunks, None)
            if chunk is None:
                raise ArchiveError("the archive was cut short (no end-of-archive marker)")
            if chunk:
                rest = len(self._buf) - self._pos
                self._buf = self._buf[self._pos :] + chunk if rest else chunk
                self._pos = 0
                return

    async def _take(self, n: int) -> bytes:
        while len(self._buf) - self._pos < n:
            await self._more()
        out = self._buf[self._pos : self._pos + n]
        self._pos += n
        return out

    async def _skip(self, n: int) -> None:
        while n > 0:
            if self._pos >= len(self._buf):
                await self._more()
            step = min(n, len(self._buf) - self._pos)
            self._pos += step
            n -= step

    async def _header_data(self, size: int) -> bytes:
        if size > MAX_HEADER_DATA:
            raise ArchiveError("corrupt archive: an extended header too large")
        out = await self._take(size)
        await self._skip(-size % BLOCK)
        return out

    async def data(self) -> AsyncIterator[bytes]:
        """The current member's bytes, piece by piece."""
        while self._left > 0:
            if self._pos >= len(self._buf):
                await self._more()
            step = min(self._left, len(self._buf) - self._pos)
            out = self._buf[self._pos : self._pos + step]
            self._pos += step
            self._left -= step
            yield out

    async def members(self) -> AsyncIterator[Member]:
        pax: dict[str, str] = {}
        long_name: str | None = None
        long_link: str | None = None
        while True:
            await self._skip(self._left + self._pad)
            self._left = self._pad = 0
            block = await self._take(BLOCK)
            if block == ZERO_BLOCK:
                if await self._take(BLOCK) != ZERO_BLOCK:
                    raise ArchiveError("corrupt archive: a lone zero block")
                return
            if not checksum_ok(block):
                raise ArchiveError("corrupt archive: a header's checksum does not match")
            kind = block[156:157]
            size = number(block[124:136])
            if kind in (b"x", b"X"):
                pax = pax_records(await self._header_data(size))
                continue
            if kind == b"g":
                await self._skip(size + (-size % BLOCK))  # global defaults: nothing used here
                continue
            if kind == b"L":
                long_name = text_of(await self._header_data(size))
                continue
            if kind == b"K":
                long_link = text_of(await self._header_data(size))
                continue
            member = member_of(block, size, pax, long_name, long_link)
            pax, long_name, long_link = {}, None, None
            # Data follows regular files and types not known here (as in tarfile);
            # a directory or link header carries none.
            if member.kind in ("file", "other"):
                self._left, self._pad = member.size, -member.size % BLOCK
            yield member
