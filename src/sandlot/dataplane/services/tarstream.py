"""A streaming reader of tar archives, for archive uploads.

``tarfile``'s stream mode builds a ``TarInfo`` per member, decodes every header
field and copies member data through two buffers: extracting 10,000 small
files spent more time there than in creating them. This reader decodes only
what an extraction uses (name, type, mode, size, link target; PAX and GNU long
names) and hands member data out as views of the chunks it received.

It reads ustar, GNU and PAX archives, plain or compressed with gzip, bzip2 or
xz (recognised by their magic bytes), as ``tar x`` does. Unlike ``tarfile``,
which stops silently at the first header that does not check out, a corrupt
header or a truncated member is an error: a sync cut short must not look like
a complete one.
"""

from __future__ import annotations

import bz2
import lzma
import zlib
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from itertools import chain
from typing import Any

BLOCK = 512
#: Decompressed output is produced in pieces of at most this size (bounded memory).
CHUNK = 1 << 20

ZERO_BLOCK = bytes(BLOCK)
_FILE_TYPES = frozenset((b"0", b"\0", b"7"))


class TarError(Exception):
    """The body is not a tar archive, or a damaged one."""


@dataclass(slots=True)
class Member:
    name: str
    #: ``file``, ``dir``, ``symlink``, ``hardlink`` or ``other`` (devices, FIFOs, sparse files…).
    kind: str
    size: int
    mode: int
    linkname: str


def text_of(raw: bytes) -> str:
    return raw.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")


def number(field: bytes) -> int:
    """An octal header field, or GNU's base-256 form for values octal cannot hold."""
    if field[:1] == b"\x80":
        return int.from_bytes(field[1:], "big")
    if field[:1] == b"\xff":
        raise TarError("negative number in tar header")
    digits = field.split(b"\0", 1)[0].strip(b" ")
    if not digits:
        return 0
    try:
        return int(digits, 8)
    except ValueError:
        raise TarError("invalid number in tar header") from None


def _byte_sum(block: bytes) -> int:
    """The sum of a block's bytes, in C: Adler-32's low half is 1 + the byte sum modulo
    65521, exact for 256 bytes (at most 65280)."""
    view = memoryview(block)
    return (zlib.adler32(view[:256]) & 0xFFFF) + (zlib.adler32(view[256:]) & 0xFFFF) - 2


def checksum_ok(block: bytes) -> bool:
    try:
        stored = number(block[148:156])
    except TarError:
        return False
    # The checksum is computed with its own field read as spaces (8 spaces sum to 256);
    # some old writers summed signed bytes.
    unsigned = _byte_sum(block) - sum(block[148:156]) + 256
    if stored == unsigned:
        return True
    signed = unsigned - 256 * sum(1 for b in block[:148] + block[156:] if b > 127)
    return stored == signed


def pax_records(data: bytes) -> dict[str, str]:
    """``"%d key=value\\n"`` records of a PAX extended header."""
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
            raise TarError("corrupt PAX header")
        key, eq, value = data[space + 1 : end - 1].partition(b"=")
        if not eq:
            raise TarError("corrupt PAX header")
        out[key.decode("utf-8", "surrogateescape")] = value.decode("utf-8", "surrogateescape")
        pos = end
    return out


def member_of(
    block: bytes,
    size: int,
    pax: Mapping[str, str],
    long_name: str | None,
    long_link: str | None,
) -> Member:
    """The member a header ``block`` (of data ``size``) describes, with the PAX records
    and GNU long names that came before it."""
    kind = block[156:157]
    name = pax.get("path") or long_name
    if name is None:
        name = text_of(block[0:100])
        if block[257:263] == b"ustar\0":  # POSIX ustar: a prefix field
            prefix = text_of(block[345:500])
            if prefix:
                name = f"{prefix}/{name}"
    link = ""
    if kind in (b"1", b"2"):  # only links carry a target
        link = pax.get("linkpath") or long_link or text_of(block[157:257])
    if "size" in pax:
        try:
            size = int(pax["size"])
        except ValueError:
            size = -1
        if size < 0:  # a negative size would also pass the server's size cap
            raise TarError("corrupt PAX header")
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
    return Member(name, what, size, number(block[100:108]), link)


def _sniff(head: bytes) -> Any:
    """A decompressor for the stream starting with ``head``, or ``None`` for a plain tar."""
    if head.startswith(b"\x1f\x8b"):
        return zlib.decompressobj(16 + zlib.MAX_WBITS)
    if head.startswith(b"BZh"):
        return bz2.BZ2Decompressor()
    if head.startswith(b"\xfd7zXZ\x00"):
        return lzma.LZMADecompressor()
    return None


def _inflated(chunks: Iterator[bytes], d: Any) -> Iterator[bytes]:
    """Decompress ``chunks``, ``CHUNK`` bytes of output at most at a time."""
    is_zlib = not hasattr(d, "needs_input")
    try:
        for data in chunks:
            while data and not d.eof:
                if is_zlib:
                    out = d.decompress(data, CHUNK)
                    data = d.unconsumed_tail
                    yield out
                else:
                    yield d.decompress(data, CHUNK)
                    data = b""
                    while not d.eof and not d.needs_input:
                        yield d.decompress(b"", CHUNK)
            if d.eof:
                return  # what follows the compressed stream is not part of the archive
    except (zlib.error, OSError, lzma.LZMAError, EOFError) as exc:
        raise TarError(f"corrupt compressed archive: {exc}") from None
    raise TarError("truncated compressed archive")


class TarStream:
    """The members of a tar archive arriving as ``chunks``, in order.

    Iterate for the members; after each, :meth:`data` yields that member's
    bytes (only a ``file`` has some). What a caller does not read of a member
    is skipped when the next one is asked for.
    """

    def __init__(self, chunks: Iterable[bytes]) -> None:
        it = iter(chunks)
        head = b""
        for chunk in it:
            head += chunk
            if len(head) >= 6:
                break
        if not head:
            raise TarError("empty body")
        d = _sniff(head)
        source = chain((head,), it)
        self._chunks: Iterator[bytes] = _inflated(source, d) if d is not None else source
        self._buf = b""
        self._pos = 0
        self._left = 0  # data bytes of the current member not handed out yet
        self._pad = 0  # then the padding to the next block
        #: The archive's end-of-archive marker was read (a stream may also end without
        #: one, at a member boundary: whole members, but perhaps not all of them).
        self.marked_end = False

    # --- buffer ---

    def _more(self) -> bool:
        for chunk in self._chunks:
            if chunk:
                rest = len(self._buf) - self._pos
                self._buf = self._buf[self._pos :] + chunk if rest else chunk
                self._pos = 0
                return True
        return False

    def _available(self, n: int) -> int:
        while len(self._buf) - self._pos < n and self._more():
            pass
        return min(n, len(self._buf) - self._pos)

    def _take(self, n: int) -> bytes:
        if self._available(n) < n:
            raise TarError("truncated tar archive")
        out = self._buf[self._pos : self._pos + n]
        self._pos += n
        return out

    def _skip(self, n: int) -> None:
        while n > 0:
            if self._pos >= len(self._buf) and not self._more():
                raise TarError("truncated tar archive")
            step = min(n, len(self._buf) - self._pos)
            self._pos += step
            n -= step

    def _body(self, size: int) -> bytes:
        """The whole data of a header member (PAX records, GNU long names)."""
        if size > 1 << 20:
            raise TarError("extended tar header too large")
        out = self._take(size)
        self._skip(-size % BLOCK)
        return out

    # --- members ---

    def data(self) -> Iterator[memoryview]:
        """The current member's bytes, as views of the received chunks."""
        while self._left > 0:
            if self._pos >= len(self._buf) and not self._more():
                raise TarError("truncated tar archive")
            step = min(self._left, len(self._buf) - self._pos)
            view = memoryview(self._buf)[self._pos : self._pos + step]
            self._pos += step
            self._left -= step
            yield view

    def __iter__(self) -> Iterator[Member]:
        pax: dict[str, str] = {}
        long_name: str | None = None
        long_link: str | None = None
        first = True
        while True:
            self._skip(self._left + self._pad)
            self._left = self._pad = 0
            got = self._available(BLOCK)
            if got == 0 and not first:
                return  # the stream ended at a member boundary, without the zero blocks
            if got < BLOCK:
                raise TarError("not a tar archive" if first else "truncated tar archive")
            block = self._take(BLOCK)
            if block == ZERO_BLOCK:
                self.marked_end = True
                return  # the end-of-archive marker
            if not checksum_ok(block):
                raise TarError("not a tar archive" if first else "corrupt tar header")
            first = False
            kind = block[156:157]
            size = number(block[124:136])
            if kind in (b"x", b"X"):
                pax = pax_records(self._body(size))
                continue
            if kind == b"g":
                self._skip(size + (-size % BLOCK))  # global defaults: nothing used here
                continue
            if kind == b"L":
                long_name = text_of(self._body(size))
                continue
            if kind == b"K":
                long_link = text_of(self._body(size))
                continue
            member = member_of(block, size, pax, long_name, long_link)
            pax = {}
            long_name = long_link = None
            # Data follows regular files and types this reader does not know
            # (as in tarfile); a directory or link header carries none.
            if member.kind in ("file", "other"):
                self._left, self._pad = member.size, -member.size % BLOCK
            yield member
