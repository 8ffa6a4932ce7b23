"""The broker's ASGI application: wiring only (routes live in ``routes/``)."""

from __future__ import annotations

import logging
import re
import secrets
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sandlot import __version__
from sandlot.broker.core import Broker
from sandlot.broker.metrics import Metrics
from sandlot.broker.routes import compat, hosts, ops, resources, sessions
from sandlot.broker.routes.errors import error_response
from sandlot.protocol.errors import (
    InternalError,
    InvalidRequest,
    ResourceNotFound,
    SandlotError,
    exception_for,
)
from sandlot.protocol.openapi import error_responses

log = logging.getLogger("sandlot.broker.app")

_REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9_.:-]{1,80}$")


class RequestIdMiddleware:
    """Echo a sane ``X-Request-Id`` or generate one; expose it as ``scope['request_id']``."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        rid = None
        for name, value in scope.get("headers", ()):
            if name == b"x-request-id":
                candidate = value.decode("latin-1")
                if _REQUEST_ID_RE.match(candidate):
                    rid = candidate
                break
        rid = rid or f"req_{secrets.token_hex(8)}"
        scope.setdefault("state", {})["request_id"] = rid
        raw_rid = rid.encode()

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", ()))
                headers.append((b"x-request-id", raw_rid))
                message["headers"] = headers
            await send(message)

        await self.app(scope, receive, send_with_id)


class RefuseNul:
    """Refuse a request whose path or query string holds a NUL byte: 400 INVALID_REQUEST.

    No id, name or value the broker takes holds one, and PostgreSQL's text cannot (it
    refuses the statement), so without this a NUL in, say, a session id would be a
    server error on PostgreSQL and a plain 404 on SQLite. Bodies are checked where they
    are parsed (``routes.deps.parse_json``). Inside :class:`RequestIdMiddleware`, so the
    refusal carries a request id."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket") and (
            "\x00" in scope["path"] or b"%00" in scope.get("query_string", b"")
        ):
            if scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 1008})
                return
            exc = InvalidRequest("a request's path or query holds no NUL byte")
            await error_response(Request(scope), exc)(scope, receive, send)
            return
        await self.app(scope, receive, send)


def _validation_message(errors: list[Any]) -> str:
    parts = []
    for err in errors[:5]:
        loc = ".".join(str(p) for p in err.get("loc", ()) if p not in ("body", "query", "path"))
        parts.append(f"{loc or 'body'}: {err.get('msg', 'invalid')}")
    return "; ".join(parts) or "invalid request"


class MountDispatch:
    """Requests under a mount prefix go straight to that app; everything else to ``app``.

    The dataplane (``/dp``) serves every agent file operation. Sent straight to it,
    a request skips the broker's middleware and route table, about a tenth of a
    millisecond. The dataplane's own endpoints echo or make the request id and
    write every error as the error envelope, as the broker does.
    """

    def __init__(self, app: ASGIApp, mounts: dict[str, ASGIApp]) -> None:
        self.app = app
        self.mounts = [(prefix.rstrip("/"), sub) for prefix, sub in mounts.items()]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            root = scope.get("root_path", "")
            path: str = scope["path"]
            route = path[len(root) :] if root and path.startswith(root) else path
            for prefix, sub in self.mounts:
                if route.startswith(prefix) and route[len(prefix) : len(prefix) + 1] == "/":
                    child = dict(scope)
                    child["root_path"] = root + prefix
                    child.setdefault("app_root_path", root)
                    await sub(child, receive, send)
                    return
        await self.app(scope, receive, send)


def create_app(broker: Broker) -> FastAPI:
    app = FastAPI(
        title="sandlot",
        version=__version__,
        description="Sandlot broker: sessions, sandboxes, tokens (PROTOCOL.md section 2).",
    )
    app.state.broker = broker
    app.state.metrics = Metrics(broker)

    @app.exception_handler(SandlotError)
    async def _sandlot_error(request: Request, exc: SandlotError) -> JSONResponse:
        return error_response(request, exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(request, InvalidRequest(_validation_message(list(exc.errors()))))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            err: SandlotError = ResourceNotFound(f"no route {request.url.path}")
        elif exc.status_code == 405:
            err = InvalidRequest(f"method {request.method} not allowed on {request.url.path}")
        else:
            cls = exception_for("", exc.status_code)
            err = cls(str(exc.detail))
        return error_response(request, err)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(request, InternalError("internal error"))

    for module in (sessions, resources, compat, ops, hosts):
        app.include_router(module.router, responses=error_responses())
    app.add_middleware(RefuseNul)
    app.add_middleware(RequestIdMiddleware)
    return app
