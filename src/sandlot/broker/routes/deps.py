"""What every route needs: the broker, the caller, an audit context, a JSON body."""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Annotated, Any, TypeVar

import anyio
import pydantic_core
from fastapi import Depends, Request
from pydantic import BaseModel, ValidationError

from sandlot.broker.audit import AuditContext
from sandlot.broker.core import Broker
from sandlot.broker.principals import Principal
from sandlot.protocol.common import PrincipalType
from sandlot.protocol.errors import Forbidden, InvalidRequest, PayloadTooLarge

M = TypeVar("M", bound=BaseModel)

#: Every request body is read through :func:`read_body` (413 beyond this) and every JSON
#: body parsed by :func:`parse_json` (400 when malformed or nested deeper than this).
MAX_BODY_BYTES = 1 << 20
MAX_JSON_DEPTH = 32
_USER_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.@-]{0,199}$")


def broker_of(request: Request) -> Broker:
    broker: Broker = request.app.state.broker
    return broker


async def get_broker(request: Request) -> Broker:
    # A coroutine, so FastAPI calls it inline instead of hopping to a worker thread.
    return broker_of(request)


def api_key_of(request: Request) -> str | None:
    auth = request.headers.get("authorization")
    if auth:
        scheme, _, value = auth.partition(" ")
        if scheme.lower() != "bearer":
            return None
        return value.strip()
    return request.headers.get("x-api-key")


#: Who a request comes from when the platform hosting the broker authenticated it, or
#: ``None`` to authenticate its API key (``app.state.principal_of``; see
#: :mod:`sandlot.integrations.langgraph`).
PrincipalOf = Callable[[Request], Awaitable[Principal | None]]


async def get_principal(request: Request) -> Principal:
    broker = broker_of(request)
    cached = getattr(request.state, "principal", None)
    if cached is not None:
        return cached  # type: ignore[no-any-return]
    hosted: PrincipalOf | None = getattr(request.app.state, "principal_of", None)
    principal = await hosted(request) if hosted is not None else None
    if principal is not None:
        request.state.principal = principal
        return principal
    raw = api_key_of(request)
    # A key not cached is read from the store in a thread: keys nobody has (anyone can
    # send some) never are, and a slow store or one out of reach held the event loop.
    principal = broker.keys.from_cache(raw)
    if principal is None:
        principal = await anyio.to_thread.run_sync(broker.keys.authenticate, raw)
    on_behalf = request.headers.get("x-sandlot-on-behalf-of")
    if on_behalf:
        if principal.type is not PrincipalType.SERVICE:
            raise Forbidden("only service principals may act on behalf of a user")
        if not _USER_RE.match(on_behalf):
            raise InvalidRequest("X-Sandlot-On-Behalf-Of is not a valid user id")
        principal = replace(principal, on_behalf_of=on_behalf, is_admin=False)
    request.state.principal = principal
    return principal


def require_admin(principal: Principal) -> None:
    if not principal.is_admin:
        raise Forbidden("this requires an admin")


def audit_context(request: Request, principal: Principal) -> AuditContext:
    return AuditContext(request_id=getattr(request.state, "request_id", None), principal=principal)


async def read_body(request: Request) -> bytes:
    length = request.headers.get("content-length")
    if length and length.isdigit() and int(length) > MAX_BODY_BYTES:
        raise PayloadTooLarge(f"request body over {MAX_BODY_BYTES} bytes")
    chunks = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise PayloadTooLarge(f"request body over {MAX_BODY_BYTES} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def _deeper_than(value: Any, limit: int) -> bool:
    """Whether arrays and objects nest more than ``limit`` levels (iterative: no recursion)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item
        for child in children:
            if isinstance(child, (dict, list)):
                if depth >= limit:
                    return True
                stack.append((child, depth + 1))
    return False


def _holds_nul(value: Any) -> bool:
    """Whether a key or a string anywhere in ``value`` holds a NUL (iterative)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if "\x00" in item:
                return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


def parse_json(body: bytes, *, empty_ok: bool = False) -> dict[str, Any]:
    """The one way a request body becomes data: a JSON object, bounded in size and depth.

    The parser (pydantic-core's, in Rust) never recurses in Python, refuses invalid
    UTF-8, lone surrogates, ``NaN`` and ``Infinity``, and stops at its own nesting
    limit (200) before :data:`MAX_JSON_DEPTH` is checked on what it returns. A key
    given twice counts once, with its last value (as in the dataplane). No string the
    broker takes holds a NUL (PostgreSQL's text cannot hold one): a body with one is
    refused (looked for only in a body that spells ``\\u0000``).
    """
    if not body.strip():
        if empty_ok:
            return {}
        raise InvalidRequest("a JSON body is required")
    try:
        data: Any = pydantic_core.from_json(body, allow_inf_nan=False)
    except ValueError as exc:
        raise InvalidRequest(f"body is not valid JSON: {exc}"[:300]) from exc
    if not isinstance(data, dict):
        raise InvalidRequest("body must be a JSON object")
    if b"\\u0000" in body and _holds_nul(data):
        raise InvalidRequest("a string in the body holds a NUL byte")
    if _deeper_than(data, MAX_JSON_DEPTH):
        raise InvalidRequest(
            f"body nests arrays and objects deeper than {MAX_JSON_DEPTH} levels",
            metadata={"max_depth": MAX_JSON_DEPTH},
        )
    return data


def parse_model(model: type[M], body: bytes, *, empty_ok: bool = False) -> M:
    data = parse_json(body, empty_ok=empty_ok)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        parts = []
        for err in exc.errors()[:5]:
            loc = ".".join(str(p) for p in err.get("loc", ()))
            parts.append(f"{loc or 'body'}: {err.get('msg', 'invalid')}")
        raise InvalidRequest("; ".join(parts)) from exc


BrokerDep = Annotated[Broker, Depends(get_broker)]
PrincipalDep = Annotated[Principal, Depends(get_principal)]


async def audited(request: Request, principal: Principal, action: str, **kw: Any) -> None:
    """Record an admin or resource action in the audit log (off the event loop)."""
    ctx = audit_context(request, principal)
    broker = broker_of(request)
    await anyio.to_thread.run_sync(lambda: broker.audit.write(ctx, action, **kw))
