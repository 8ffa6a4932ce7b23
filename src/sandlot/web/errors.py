"""What a browser gets when an upstream call fails: the project's error envelope.

An upstream's 4xx that carries the dataplane's own envelope passes with its code, its
message and its scalar metadata only (:func:`upstream_error`); anything else becomes
the error class of its status with a message of the gateway's own. No upstream body,
URL or token ever reaches the browser. :func:`error_answer` draws the envelope of
PROTOCOL.md section 1 (status, body, ``X-Request-Id`` and ``Retry-After``).
"""

from __future__ import annotations

import email.utils
import json
import math
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sandlot.protocol.common import new_id
from sandlot.protocol.errors import (
    ERROR_TABLE,
    InternalError,
    InvalidRequest,
    SandlotError,
    exception_for,
)

#: Longest message and metadata string kept from an upstream's envelope.
MAX_TEXT = 500
#: Most metadata entries kept from an upstream's envelope.
MAX_METADATA = 20


def retry_after_seconds(value: str | None) -> float | None:
    """A ``Retry-After`` header in seconds (delay or HTTP date); ``None`` if unreadable."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return max((when - datetime.now(UTC)).total_seconds(), 0.0)


def own_envelope(body: bytes | None) -> dict[str, Any] | None:
    """The ``error`` object of the dataplane's own envelope in ``body`` (a code of the
    error table, domain ``sandlot``), if that is what ``body`` is."""
    if not body:
        return None
    try:
        data = json.loads(body)
    except ValueError:
        return None
    err = data.get("error") if isinstance(data, dict) else None
    if not isinstance(err, dict) or err.get("domain", "sandlot") != "sandlot":
        return None
    code = err.get("code")
    return err if isinstance(code, str) and code in ERROR_TABLE else None


def _kept(value: Any) -> bool:
    if isinstance(value, str):
        return len(value) <= MAX_TEXT
    return value is None or isinstance(value, bool | int | float)


def upstream_error(status: int, body: bytes | None, retry_after: float | None) -> SandlotError:
    """The browser's error for an upstream's 4xx answer."""
    err = own_envelope(body)
    if err is not None and 400 <= ERROR_TABLE[err["code"]].status < 500:
        message = err.get("message")
        raw = err.get("metadata")
        metadata: dict[str, Any] = {}
        if isinstance(raw, dict):
            kept = [(k, v) for k, v in raw.items() if isinstance(k, str) and _kept(v)]
            metadata = dict(kept[:MAX_METADATA])
        return ERROR_TABLE[err["code"]].exception(
            message if isinstance(message, str) and len(message) <= MAX_TEXT else err["code"],
            metadata=metadata,
            retry_after=retry_after,
            code=err["code"],
        )
    cls = exception_for("", status)
    if cls is InternalError:
        cls = InvalidRequest
    return cls(f"the sandbox host answered {status}", retry_after=retry_after)


@dataclass(frozen=True)
class ErrorAnswer:
    """The browser's answer for an error: HTTP status, the envelope, headers."""

    status: int
    body: dict[str, Any]
    headers: dict[str, str]


def error_answer(exc: BaseException, request_id: str | None = None) -> ErrorAnswer:
    """The envelope for ``exc``; anything but a server-side sandlot error becomes a bare
    ``INTERNAL`` (no message of it reaches the browser)."""
    if not isinstance(exc, SandlotError) or exc.status < 400:
        exc = InternalError("internal error")
    rid = request_id or exc.request_id or new_id("req", 8)
    headers = {"X-Request-Id": rid}
    if exc.retry_after is not None:
        headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after)))
    return ErrorAnswer(exc.status, exc.to_wire(rid), headers)
