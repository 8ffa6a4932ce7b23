"""HTTP plumbing shared by the dataplane routes: errors, request ids, auth, JSON.

Routes are thin: they parse, authorise, call a service, serialise. Every
failure leaves as the error envelope of PROTOCOL.md section 1 with an
``X-Request-Id``; nothing a client sends can produce a traceback or a 500.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import re
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException
from starlette.formparsers import MultiPartException
from starlette.requests import Request
from starlette.responses import Response

from sandlot.dataplane.auth import AuthContext, bearer_from_header
from sandlot.dataplane.paths import os_error
from sandlot.protocol.common import Capability, new_id
from sandlot.protocol.errors import (
    InternalError,
    InvalidRequest,
    PayloadTooLarge,
    QuotaExceeded,
    SandboxNotFound,
    SandlotError,
    exception_for,
)

if TYPE_CHECKING:
    from sandlot.dataplane.auth import Authenticator
    from sandlot.dataplane.metrics import DataplaneMetrics
    from sandlot.dataplane.sandbox import Connection, SandboxEntry
    from sandlot.dataplane.settings import DataplaneSettings
    from sandlot.dataplane.socketlimits import SocketLimits

log = logging.getLogger("sandlot.dataplane")

M = TypeVar("M", bound=BaseModel)
_REQUEST_ID = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")

Handler = Callable[[Request], Awaitable[Response]]


def request_id_of(headers: Any) -> str:
    rid = headers.get("x-request-id")
    return rid if rid and _REQUEST_ID.match(rid) else new_id("req", 8)


def dumps(obj: Any) -> bytes:
    try:
        return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()
    except UnicodeEncodeError:
        # A file name that is not valid UTF-8 (lone surrogates): escape instead of failing.
        return json.dumps(obj, separators=(",", ":")).encode()


_OUTPUT_FRAMES = frozenset({"stdout", "stderr", "history"})


def dumps_text(frame: dict[str, Any]) -> str:
    """JSON text for a WebSocket frame (the hot path of every byte a command prints).

    Output frames hold text decoded by the server (always valid UTF-8) and go out
    unescaped; other frames may echo client input, so they are ASCII-escaped.
    """
    return json.dumps(
        frame, separators=(",", ":"), ensure_ascii=frame.get("type") not in _OUTPUT_FRAMES
    )


def json_response(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(dumps(obj), status, headers=headers, media_type="application/json")


def error_response(exc: SandlotError, request_id: str) -> Response:
    headers = {"X-Request-Id": request_id}
    if exc.retry_after is not None:
        headers["Retry-After"] = str(max(1, round(exc.retry_after)))
    return json_response(exc.to_wire(request_id), exc.status, headers)


def as_sandlot_error(exc: BaseException) -> SandlotError:
    if isinstance(exc, SandlotError):
        return exc
    if isinstance(exc, ValidationError):
        errors = exc.errors()
        if not errors:
            return InvalidRequest("invalid request")
        where = ".".join(str(p) for p in errors[0]["loc"])
        msg = errors[0]["msg"]
        return InvalidRequest(f"{where}: {msg}" if where else msg)
    if isinstance(exc, HTTPException) and exc.status_code < 500:
        # Raised by Starlette itself (a malformed multipart body, for instance).
        return exception_for("", exc.status_code)(str(exc.detail)[:200])
    if isinstance(exc, MultiPartException):
        return InvalidRequest(exc.message[:200])
    if isinstance(exc, OSError):
        return os_error(exc)
    if isinstance(exc, (UnicodeError, ValueError)):
        return InvalidRequest("invalid request")
    log.exception("unexpected error in the dataplane", exc_info=exc)
    return InternalError("internal error")


def endpoint(fn: Handler) -> Handler:
    """Wrap a route: request id in and out, every exception as the error envelope."""

    @functools.wraps(fn)
    async def wrapper(request: Request) -> Response:
        rid = request_id_of(request.headers)
        request.state.request_id = rid
        try:
            response = await fn(request)
        except Exception as exc:
            error = as_sandlot_error(exc)
            if isinstance(error, QuotaExceeded) and error.metadata.get("resource") == "disk":
                entry = getattr(request.state, "sandbox_entry", None)
                if entry is not None and entry.disk is not None:
                    entry.disk.write_failed()
            return error_response(error, rid)
        response.headers["X-Request-Id"] = rid
        return response

    return wrapper


async def read_body(request: Request, limit: int) -> bytes:
    length = request.headers.get("content-length")
    if length is not None:
        if not length.isdigit():
            raise InvalidRequest("bad Content-Length")
        if int(length) > limit:
            raise PayloadTooLarge(f"body larger than {limit} bytes")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"body larger than {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


async def parse_json(request: Request, model: type[M], limit: int = 1 << 20) -> M:
    body = await read_body(request, limit)
    if not body:
        raise InvalidRequest("a JSON body is required")
    return model.model_validate_json(body)


def query_int(request: Request, name: str, default: int, lo: int = 0, hi: int = 1 << 40) -> int:
    raw = request.query_params.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise InvalidRequest(f"{name} must be an integer") from None
    if not lo <= value <= hi:
        raise InvalidRequest(f"{name} out of range")
    return value


def query_bool(request: Request, name: str, default: bool) -> bool:
    raw = request.query_params.get(name)
    if raw is None or raw == "":
        return default
    if raw.lower() in ("1", "true", "yes", "on"):
        return True
    if raw.lower() in ("0", "false", "no", "off"):
        return False
    raise InvalidRequest(f"{name} must be a boolean")


def query_path(request: Request, name: str = "path", default: str | None = None) -> str:
    raw = request.query_params.get(name, default)
    if raw is None or raw == "":
        if default is not None:
            return default
        raise InvalidRequest(f"{name} is required")
    return raw


class Host(Protocol):
    """What the routes use of their host (:class:`~sandlot.dataplane.host.DataplaneHost`)."""

    authenticator: Authenticator
    settings: DataplaneSettings
    sockets: SocketLimits
    metrics: DataplaneMetrics

    def entry(self, sandbox_id: str) -> SandboxEntry: ...

    def track(
        self, entry: SandboxEntry, ctx: AuthContext, closed: asyncio.Event, sock: Any = None
    ) -> Connection: ...

    def untrack(self, entry: SandboxEntry, conn: Connection) -> None: ...


class Api:
    """What routes need from the host: the sandbox addressed, and who is calling."""

    def __init__(self, host: Host, default_sandbox: str | None = None) -> None:
        self.host = host
        self.default_sandbox = default_sandbox

    def sandbox_id(self, scope_params: dict[str, Any]) -> str:
        sid = scope_params.get("sandbox_id") or self.default_sandbox
        if not sid:
            raise SandboxNotFound("no such sandbox")
        return str(sid)

    def entry(self, request: Request) -> SandboxEntry:
        return self.host.entry(self.sandbox_id(request.path_params))

    async def auth(
        self, request: Request, capability: Capability | None
    ) -> tuple[SandboxEntry, AuthContext]:
        entry = self.entry(request)
        ctx = await self.host.authenticator.authenticate(
            bearer=bearer_from_header(request.headers.get("authorization")),
            api_key=request.headers.get("x-api-key"),
            sandbox_id=entry.sandbox_id,
            generation=entry.generation,
            capability=capability,
        )
        entry.touch()
        request.state.sandbox_entry = entry  # for the error path (a full disk)
        return entry, ctx
