"""The tar a sandbox sends back, read as it arrives, for ``sandlot pull``.

The archive is written from what an agent left in the sandbox, and passes
through a dataplane running there: its bytes are input, not a format to trust.
``tarfile`` does not fit: it wants a file object (the download is an async
stream), and it stops silently at a missing end marker or at the first header
that does not check out, so a download cut short (the dataplane stops the
stream when a file cannot be read mid-walk) reads as a complete, smaller tree.
Here every header is checked and the archive must end with its two zero blocks;
anything else is an :class:`ArchiveError`.

Only what a pull uses is decoded: name, type, mode, size, link target, with
ustar prefixes, PAX records and GNU long names.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

BLOCK = 512
#: The most a PAX header or a GNU long name may hold.
MAX_HEADER_DATA = 1 << 20

_ZERO_BLOCK = bytes(BLOCK)
_FILE_TYPES = frozenset((b"0", b"\0", b"7"))


class ArchiveError(Exception):
    """The archive is damaged, or ended before its end-of-archive marker."""


@dataclass(slots=True)
class Member:
    name: str
    #: ``file``, ``dir``, ``symlink``, ``hardlink`` or ``other`` (devices, FIFOs, sparse files…).
    kind: str
    size: int
    mode: int
    linkname: str


def _text(raw: bytes) -> str:
    return raw.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")


def _number(field: bytes) -> int:
    """An octal header field, or GNU's base-256 form for values octal cannot hold."""
    if field[:1] == b"\x80":
        return int.from_bytes(field[1:], "big")
    if field[:1] == b"\xff":
        raise ArchiveError("corrupt archive: a negative number in a header")
    digits = field.split(b"\0", 1)[0].strip(b" ")
    try:
        return int(digits, 8) if digits else 0
    except ValueError:
        raise ArchiveError("corrupt archive: a header field is not a number") from None


def _checksum_ok(block: bytes) -> bool:
    try:
        stored = _number(block[148:156])
    except ArchiveError:
        return False
    # Computed with the checksum field read as 8 spaces; some old writers summed signed bytes.
    unsigned = sum(block[:148]) + sum(block[156:]) + 256
    signed = unsigned - 256 * sum(1 for b in block[:148] + block[156:] if b > 127)
    return stored in (unsigned, signed)


def _pax_records(data: bytes) -> dict[str, str]:
    """The ``"%d key=value\\n"`` records of a PAX extended header."""
    out: dict[str, str] = {}
    pos = 0
    while pos < len(data) and data[pos] != 0:
        space = data.find(b" ", pos)
        try:
            length = int(data[pos:space]) if space > pos else 0
        except ValueError:
            length = 0
        end = pos + length
        if length <= 0 or end > len(data) or data[end - 1 : end] != b"\n":
            raise ArchiveError("corrupt archive: a bad PAX header")
        key, eq, value = data[space + 1 : end - 1].partition(b"=")
        if not eq:
            raise ArchiveError("corrupt archive: a bad PAX header")
        out[key.decode("utf-8", "surrogateescape")] = value.decode("utf-8", "surrogateescape")
        pos = end
    return out


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
            if block == _ZERO_BLOCK:
                if await self._take(BLOCK) != _ZERO_BLOCK:
                    raise ArchiveError("corrupt archive: a lone zero block")
                return
            if not _checksum_ok(block):
                raise ArchiveError("corrupt archive: a header's checksum does not match")
            kind = block[156:157]
            size = _number(block[124:136])
            if kind in (b"x", b"X"):
                pax = _pax_records(await self._header_data(size))
                continue
            if kind == b"g":
                await self._skip(size + (-size % BLOCK))  # global defaults: nothing used here
                continue
            if kind == b"L":
                long_name = _text(await self._header_data(size))
                continue
            if kind == b"K":
                long_link = _text(await self._header_data(size))
                continue
            name = pax.get("path") or long_name
            if name is None:
                name = _text(block[0:100])
                if block[257:263] == b"ustar\0":  # POSIX ustar: a prefix field
                    prefix = _text(block[345:500])
                    if prefix:
                        name = f"{prefix}/{name}"
            link = ""
            if kind in (b"1", b"2"):
                link = pax.get("linkpath") or long_link or _text(block[157:257])
            if "size" in pax:
                try:
                    size = int(pax["size"])
                except ValueError:
                    size = -1
                if size < 0:
                    raise ArchiveError("corrupt archive: a bad PAX size")
            if kind in _FILE_TYPES:
                what = "dir" if kind == b"\0" and name.endswith("/") else "file"
            elif kind == b"5":
                what = "dir"
            elif kind == b"2":
                what = "symlink"
            elif kind == b"1":
                what = "hardlink"
            else:
                what = "other"
            if any(k.startswith("GNU.sparse.") for k in pax):
                what = "other"
            pax, long_name, long_link = {}, None, None
            # Data follows regular files and types not known here (as in tarfile);
            # a directory or link header carries none.
            if what in ("file", "other"):
                self._left, self._pad = size, -size % BLOCK
            yield Member(name, what, size, _number(block[100:108]), link)
