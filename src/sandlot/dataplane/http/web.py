"""HTTP plumbing shared by the dataplane routes: errors, request ids, auth, JSON.

Routes are thin: they parse, authorise, call a service, serialise. Every
failure leaves as the error envelope of PROTOCOL.md section 1 with an
``X-Request-Id``; nothing a client sends can produce a traceback or a 500.

An endpoint finds its :class:`Host` in its app's state (``app.state.dataplane``),
as Starlette's own examples do, and declares what it takes and answers with
:func:`endpoint`; the OpenAPI document is drawn from those declarations
(:mod:`sandlot.dataplane.http.openapi`).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import re
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException
from starlette.formparsers import MultiPartException
from starlette.requests import HTTPConnection, Request
from starlette.responses import Response

from sandlot.dataplane.services.auth import AuthContext, bearer_from_header
from sandlot.dataplane.services.paths import os_error
from sandlot.protocol.common import Capability, json_bytes, new_id
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
    from sandlot.dataplane.http.metrics import DataplaneMetrics
    from sandlot.dataplane.services.auth import Authenticator
    from sandlot.dataplane.services.sandbox import Connection, SandboxEntry
    from sandlot.dataplane.services.socketlimits import SocketLimits
    from sandlot.dataplane.settings import DataplaneSettings

log = logging.getLogger("sandlot.dataplane")

M = TypeVar("M", bound=BaseModel)
_REQUEST_ID = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")

Handler = Callable[[Request], Awaitable[Response]]


def request_id_of(headers: Any) -> str:
    rid = headers.get("x-request-id")
    return rid if rid and _REQUEST_ID.match(rid) else new_id("req", 8)


dumps = json_bytes

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
    """``obj`` (a wire model, or plain JSON data) as an ``application/json`` response."""
    body = (
        obj.__pydantic_serializer__.to_json(obj, by_alias=True)
        if isinstance(obj, BaseModel)
        else dumps(obj)
    )
    return Response(body, status, headers=headers, media_type="application/json")


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


@dataclass(frozen=True)
class Param:
    """A query parameter or header an endpoint reads (for the OpenAPI document)."""

    name: str
    schema: dict[str, Any]
    required: bool = False
    where: str = "query"


#: An answer: a wire model, or an OpenAPI response object for anything else.
Answer = type[BaseModel] | dict[str, Any]


@dataclass(frozen=True)
class Operation:
    """What an endpoint takes and answers, declared with :func:`endpoint`."""

    summary: str
    responses: dict[int, Answer]
    body: type[BaseModel] | dict[str, Any] | None = None
    params: tuple[Param, ...] = ()
    #: Answered without a credential (no error responses of the auth path).
    public: bool = False
    #: ``HEAD`` is part of the contract (Starlette answers it for every ``GET``).
    head: bool = False


def endpoint(
    *,
    ok: Answer | None = None,
    responses: Mapping[int, Answer] | None = None,
    body: type[BaseModel] | dict[str, Any] | None = None,
    params: tuple[Param, ...] = (),
    public: bool = False,
    head: bool = False,
) -> Callable[[Handler], Handler]:
    """Make ``fn`` an endpoint: request id in and out, every exception as the error
    envelope, and an :class:`Operation` (summary: the docstring's first line; ``ok``:
    the 200 answer) for the OpenAPI document."""

    def wrap(fn: Handler) -> Handler:
        summary = (fn.__doc__ or fn.__name__).strip().splitlines()[0].rstrip(".")
        answers = dict(responses or {})
        if ok is not None:
            answers[200] = ok
        operation = Operation(summary, answers, body, params, public, head)

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

        wrapper.operation = operation  # type: ignore[attr-defined]
        return wrapper

    return wrap


def operation_of(fn: Any) -> Operation | None:
    """The :class:`Operation` an endpoint declared, if it is one."""
    found = getattr(fn, "operation", None)
    return found if isinstance(found, Operation) else None


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
    """What the routes use of their host (:class:`~sandlot.dataplane.http.host.DataplaneHost`)."""

    authenticator: Authenticator
    settings: DataplaneSettings
    sockets: SocketLimits
    metrics: DataplaneMetrics
    #: The sandbox of routes without a ``{sandbox_id}`` (a standalone dataplane's one).
    default_sandbox: str | None

    def entry(self, sandbox_id: str) -> SandboxEntry: ...

    def track(
        self, entry: SandboxEntry, ctx: AuthContext, closed: asyncio.Event, sock: Any = None
    ) -> Connection: ...

    def untrack(self, entry: SandboxEntry, conn: Connection) -> None: ...


def host_of(conn: HTTPConnection) -> Host:
    """The host serving this request or socket."""
    host: Host = conn.app.state.dataplane
    return host


def sandbox_of(conn: HTTPConnection) -> SandboxEntry:
    """The sandbox a request or socket addresses (404 SANDBOX_NOT_FOUND if none)."""
    host = host_of(conn)
    sid = conn.path_params.get("sandbox_id") or host.default_sandbox
    if not sid:
        raise SandboxNotFound("no such sandbox")
    return host.entry(str(sid))


async def authorize(
    request: Request, capability: Capability | None
) -> tuple[SandboxEntry, AuthContext]:
    """The sandbox addressed and who is calling, if they hold ``capability`` on it."""
    entry = sandbox_of(request)
    ctx = await host_of(request).authenticator.authenticate(
        bearer=bearer_from_header(request.headers.get("authorization")),
        api_key=request.headers.get("x-api-key"),
        sandbox_id=entry.sandbox_id,
        generation=entry.generation,
        capability=capability,
    )
    entry.touch()
    request.state.sandbox_entry = entry  # for the error path (a full disk)
    return entry, ctx
