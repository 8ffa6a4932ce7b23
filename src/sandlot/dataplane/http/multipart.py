"""An upload's file read from a ``multipart/form-data`` body as it arrives.

Starlette's ``request.form()`` writes each file part to a temporary file of the server
(in memory up to 1 MiB, then on the server's disk) and checks nothing of its size
until the body has ended: an upload of any size, sent chunked, would fill the disk of
the host serving the sandbox before the sandbox's own limits were looked at. Here the
bytes of the one file part are handed on as they are parsed, so that whatever writes
them (into the sandbox, or on to a hosted box) counts them against its limit at once
and nothing of the upload is ever kept outside it.

The body carries one part named ``file`` (the file's bytes, with or without a
``filename``) and at most :data:`MAX_PARTS` parts in all; the others are read and
dropped, each at most :data:`MAX_FIELD_BYTES`. A second ``file`` part, a body without
one, one that ends before its closing boundary (Starlette would keep the file cut
short) or one the parser cannot read is 400 INVALID_REQUEST — found once the body has
been read to its end, so whatever consumes the bytes must keep nothing of them before
the iteration ends without an error.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from sandlot.protocol.errors import InvalidRequest

if TYPE_CHECKING:
    from starlette.requests import Request

FILE_FIELD = b"file"
#: Parts of one upload body, the file's included.
MAX_PARTS = 16
#: Bytes of a part other than the file's (its value is dropped).
MAX_FIELD_BYTES = 1 << 20
#: Bytes of a part's headers.
MAX_HEADER_BYTES = 16 << 10


class _Parts:
    """The parser's callbacks: the file part's bytes, queued until handed on."""

    def __init__(self) -> None:
        self.pending: list[bytes] = []
        self.parts = 0
        self.seen_file = False
        self.ended = False
        self._in_file = False
        self._other = 0
        self._header_name = b""
        self._header_value = b""
        self._header_bytes = 0
        self._disposition = b""

    def on_part_begin(self) -> None:
        self.parts += 1
        if self.parts > MAX_PARTS:
            raise InvalidRequest(f"a multipart upload has at most {MAX_PARTS} parts")
        self._in_file = False
        self._other = 0
        self._header_bytes = 0
        self._disposition = b""

    def on_header_field(self, data: bytes, start: int, end: int) -> None:
        self._header_name += data[start:end]
        self._count_header(end - start)

    def on_header_value(self, data: bytes, start: int, end: int) -> None:
        self._header_value += data[start:end]
        self._count_header(end - start)

    def _count_header(self, n: int) -> None:
        self._header_bytes += n
        if self._header_bytes > MAX_HEADER_BYTES:
            raise InvalidRequest("a multipart part's headers are too long")

    def on_header_end(self) -> None:
        if self._header_name.lower() == b"content-disposition":
            self._disposition = self._header_value
        self._header_name = self._header_value = b""

    def on_headers_finished(self) -> None:
        from python_multipart.multipart import parse_options_header

        _, options = parse_options_header(self._disposition)
        if options.get(b"name") == FILE_FIELD:
            if self.seen_file:
                raise InvalidRequest("a multipart upload has one field 'file'")
            self.seen_file = self._in_file = True

    def on_part_data(self, data: bytes, start: int, end: int) -> None:
        if start == end:
            return
        if self._in_file:
            self.pending.append(data[start:end])
            return
        self._other += end - start
        if self._other > MAX_FIELD_BYTES:
            raise InvalidRequest(f"a multipart field is over {MAX_FIELD_BYTES} bytes")

    def on_part_end(self) -> None:
        self._in_file = False

    def on_end(self) -> None:
        self.ended = True


async def file_chunks(request: Request) -> AsyncIterator[bytes]:
    """The bytes of the body's ``file`` part, as they arrive (see the module's doc)."""
    from python_multipart.exceptions import FormParserError
    from python_multipart.multipart import MultipartParser, parse_options_header

    _, params = parse_options_header(request.headers.get("content-type", ""))
    boundary = params.get(b"boundary")
    if not boundary:
        raise InvalidRequest("a multipart body needs a boundary")
    parts = _Parts()
    parser = MultipartParser(
        boundary,
        {
            "on_part_begin": parts.on_part_begin,
            "on_header_field": parts.on_header_field,
            "on_header_value": parts.on_header_value,
            "on_header_end": parts.on_header_end,
            "on_headers_finished": parts.on_headers_finished,
            "on_part_data": parts.on_part_data,
            "on_part_end": parts.on_part_end,
            "on_end": parts.on_end,
        },
    )
    try:
        async for chunk in request.stream():
            parser.write(chunk)
            if parts.pending:
                data = b"".join(parts.pending)
                parts.pending.clear()
                yield data
    except FormParserError as exc:
        raise InvalidRequest("invalid multipart body") from exc
    if not parts.ended:
        # The parser itself says nothing of a body cut short: the file would be kept cut.
        raise InvalidRequest("the multipart body ends before its closing boundary")
    if not parts.seen_file:
        raise InvalidRequest("multipart field 'file' is required")


__all__ = ["MAX_FIELD_BYTES", "MAX_PARTS", "file_chunks"]
