"""Errors on the wire: every failure becomes the protocol's envelope."""

from __future__ import annotations

import secrets
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from sandlot.protocol.errors import SandlotError


def request_id(request: Request) -> str:
    rid = getattr(request.state, "request_id", None)
    if not rid:
        rid = f"req_{secrets.token_hex(8)}"
        request.state.request_id = rid
    return str(rid)


def envelope_for(request: Request, exc: SandlotError) -> dict[str, Any]:
    return exc.to_wire(request_id(request))


def error_response(request: Request, exc: SandlotError) -> JSONResponse:
    """The one place the broker answers an error (every exception handler comes here)."""
    metrics = getattr(request.app.state, "metrics", None)
    if metrics is not None:
        metrics.error(exc.code)
    headers = {}
    if exc.retry_after is not None:
        headers["Retry-After"] = str(max(1, round(exc.retry_after)))
    elif exc.retryable and exc.status in (423, 429, 503):
        headers["Retry-After"] = "1"
    return JSONResponse(envelope_for(request, exc), status_code=exc.status, headers=headers)
