"""Health, readiness, metrics, JWKS and the audit log."""

from __future__ import annotations

from typing import Annotated, Any

import anyio
from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST

from sandlot import __version__
from sandlot.broker.routes.deps import BrokerDep, PrincipalDep, require_admin
from sandlot.protocol.common import API_VERSION, Scope, rfc3339
from sandlot.protocol.errors import InvalidRequest
from sandlot.protocol.events import MAX_SEQUENCE
from sandlot.protocol.sessions import AuditPage, Health, Jwks

router = APIRouter()


@router.get("/.well-known/jwks.json", response_model=Jwks)
async def jwks(broker: BrokerDep) -> Any:
    return JSONResponse(
        await anyio.to_thread.run_sync(broker.keyring.jwks),
        headers={"Cache-Control": "public, max-age=30"},
    )


@router.get("/healthz", response_model=Health)
async def healthz() -> Any:
    return {"status": "ok", "server": f"sandlot/{__version__}", "api_version": API_VERSION}


@router.get("/readyz")
async def readyz(broker: BrokerDep) -> Any:
    store_ok = await anyio.to_thread.run_sync(broker.store.ping)
    provider = broker.provider.readiness()
    ready = store_ok and bool(provider.get("ok")) and broker.started
    body = {
        "ready": ready,
        "store": {"ok": store_ok, "dialect": broker.store.dialect},
        "provider": {"name": broker.provider.name, **provider},
        "dataplane": provider.get("dataplane", {"ok": bool(provider.get("ok"))}),
    }
    return JSONResponse(body, status_code=200 if ready else 503)


@router.get("/metrics", response_class=PlainTextResponse)
async def metrics(request: Request) -> Response:
    data = await anyio.to_thread.run_sync(request.app.state.metrics.render)
    return Response(data, media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/audit", response_model=AuditPage)
async def audit(
    broker: BrokerDep,
    principal: PrincipalDep,
    scope: str | None = None,
    actor: str | None = None,
    after: Annotated[int, Query(ge=0, le=MAX_SEQUENCE)] = 0,
    limit: Annotated[int, Query(ge=1, le=5000)] = 500,
) -> Any:
    require_admin(principal)
    if scope is not None:
        try:
            Scope.parse(scope)
        except ValueError as exc:
            raise InvalidRequest("scope must read TYPE:ID, e.g. thread:thr_1") from exc
    items = await anyio.to_thread.run_sync(
        lambda: broker.audit.query(scope_key=scope, actor_id=actor, after=after, limit=limit)
    )
    for item in items:
        item["timestamp"] = rfc3339(item["timestamp"])
    return {"items": items, "next_after": items[-1]["id"] if items else after}
