"""Surfaces kept for existing clients: the 2.9 aliases and LangSmith's ``/v2/sandboxes/boxes``."""

from __future__ import annotations

import secrets
import time
from typing import Any

import anyio
from fastapi import APIRouter, Request, Response

from sandlot.broker.audit import record
from sandlot.broker.core import Broker
from sandlot.broker.principals import Principal
from sandlot.broker.routes.deps import (
    BrokerDep,
    PrincipalDep,
    audit_context,
    parse_model,
    read_body,
)
from sandlot.broker.sandboxes import SandboxRow
from sandlot.broker.store.schema import sandboxes
from sandlot.protocol.common import rfc3339
from sandlot.protocol.errors import (
    Forbidden,
    InvalidRequest,
    ProviderUnavailable,
    SandboxNotFound,
)
from sandlot.protocol.openapi import json_body
from sandlot.protocol.sessions import (
    AcquireRequest,
    AcquireResponse,
    AliasRefreshRequest,
    AliasRefreshResponse,
    AliasReleaseRequest,
    Box,
    BoxCreate,
    BoxList,
    BoxState,
    BoxStatus,
    SessionMode,
    SessionRequest,
)
from sandlot.protocol.states import SandboxState

router = APIRouter()


# --- 2.9 aliases -----------------------------------------------------------------------


@router.post(
    "/sandbox/acquire", response_model=AcquireResponse, openapi_extra=json_body(AcquireRequest)
)
async def acquire(request: Request, broker: BrokerDep, principal: PrincipalDep) -> Any:
    req = parse_model(AcquireRequest, await read_body(request))
    await broker.ratelimit.check(principal.lease_holder)
    grant = await broker.sessions.negotiate(
        audit_context(request, principal),
        principal,
        SessionRequest(
            thread_id=req.thread_id, mode=SessionMode.ENSURE, assistant_id=req.assistant_id
        ),
    )
    return AcquireResponse(
        sandbox_id=grant.sandbox.id,
        session_id=grant.session_id,
        token=grant.token,
        ws_url=grant.dataplane.ws_base_url,
        http_url=grant.dataplane.http_base_url,
        expires_at=grant.expires_at,
        scopes=grant.credentials.granted_capabilities,
        refresh_url=grant.refresh_url,
    )


@router.post(
    "/sandbox/refresh",
    response_model=AliasRefreshResponse,
    openapi_extra=json_body(AliasRefreshRequest),
)
async def alias_refresh(request: Request, broker: BrokerDep, principal: PrincipalDep) -> Any:
    req = parse_model(AliasRefreshRequest, await read_body(request))
    claims = broker.keyring.verify(req.token)
    if claims.get("sub") != principal.id:
        raise Forbidden("this token belongs to another principal")
    session_id = await anyio.to_thread.run_sync(broker.leases.session_for_token, claims)
    resp = await anyio.to_thread.run_sync(
        broker.leases.refresh, audit_context(request, principal), principal, session_id
    )
    return {
        **resp.model_dump(mode="json"),
        "sandbox_id": claims.get("sandbox_id"),
        "session_id": session_id,
        "scopes": [c.value for c in resp.credentials.granted_capabilities],
    }


@router.post("/sandbox/release", status_code=204, openapi_extra=json_body(AliasReleaseRequest))
async def alias_release(request: Request, broker: BrokerDep, principal: PrincipalDep) -> Response:
    req = parse_model(AliasReleaseRequest, await read_body(request))
    await broker.leases.release(
        audit_context(request, principal), principal, req.session_id, terminate=False
    )
    return Response(status_code=204)


# --- LangSmith boxes -------------------------------------------------------------------

_BOX_STATUS: dict[SandboxState, BoxState] = {
    SandboxState.PROVISIONING: "provisioning",
    SandboxState.ACTIVE: "ready",
    SandboxState.IDLE: "ready",
    SandboxState.SUSPENDED: "stopped",
    SandboxState.TERMINATING: "stopped",
    SandboxState.TERMINATED: "stopped",
    SandboxState.FAILED: "failed",
}


def _box(broker: Broker, row: SandboxRow, updated_at: float | None = None) -> dict[str, Any]:
    return Box(
        name=row.name or row.id,
        id=row.id,
        status=_BOX_STATUS[row.state],
        template_name=row.template,
        dataplane_url=broker.sandboxes.coordinates(row).http_base_url,
        created_at=rfc3339(row.created_at) or "",
        updated_at=rfc3339(updated_at or row.created_at) or "",
    ).model_dump(mode="json")


def _find_box(broker: Broker, principal: Principal, name: str) -> SandboxRow:
    from sqlalchemy import select

    with broker.store.read() as conn:
        row = conn.execute(
            select(sandboxes).where(
                sandboxes.c.owner_user_id == principal.effective_user,
                sandboxes.c.pool.is_(None),
                (sandboxes.c.live_name == f"{principal.effective_user}:{name}")
                | (sandboxes.c.id == name),
            )
        ).first()
    if row is None:
        raise SandboxNotFound(f"no box {name!r}")
    found = SandboxRow.from_row(row)
    if not found.state.live:
        raise SandboxNotFound(f"no box {name!r}")
    return found


async def _wait_ready(broker: Broker, sandbox_id: str, timeout: float) -> SandboxRow:
    deadline = time.monotonic() + timeout
    while True:
        seen = broker.hub.version(sandbox_id)
        row = await anyio.to_thread.run_sync(broker.sandboxes.get, sandbox_id)
        if row.state is not SandboxState.PROVISIONING:
            return row
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise ProviderUnavailable(f"box {sandbox_id} was not ready within {timeout:g} s")
        await broker.hub.wait(sandbox_id, remaining, seen)


@router.post(
    "/v2/sandboxes/boxes", response_model=Box, openapi_extra=json_body(BoxCreate, required=False)
)
async def create_box(request: Request, broker: BrokerDep, principal: PrincipalDep) -> Any:
    req = parse_model(BoxCreate, await read_body(request), empty_ok=True)
    await broker.ratelimit.check(principal.lease_holder)
    named = {n for n in (req.template_name, req.snapshot, req.snapshot_name, req.snapshot_id) if n}
    if len(named) > 1:
        raise InvalidRequest(
            "template_name, snapshot, snapshot_name and snapshot_id name different templates"
        )
    # An unknown template is 404 NOT_FOUND, never the default in its place.
    template = await anyio.to_thread.run_sync(
        broker.templates.get, named.pop() if named else broker.settings.default_template
    )
    name = req.name or f"box-{secrets.token_hex(4)}"
    ctx = audit_context(request, principal)

    def tx() -> SandboxRow:
        with broker.store.write() as conn:
            row = broker.sandboxes.insert(
                conn, template=template, owner_user_id=principal.effective_user, name=name
            )
            record(conn, ctx, "sandbox.create", sandbox_id=row.id, details={"box": name})
        return row

    row = await anyio.to_thread.run_sync(tx)
    broker.sandboxes.spawn(broker.sandboxes.provision(row, template))
    if req.wait_for_ready:
        row = await _wait_ready(broker, row.id, req.timeout)
        if row.state is SandboxState.FAILED:
            raise ProviderUnavailable(f"box {name!r} failed: {row.reason or 'unknown'}")
    return _box(broker, row)


@router.get("/v2/sandboxes/boxes", response_model=BoxList)
async def list_boxes(broker: BrokerDep, principal: PrincipalDep) -> Any:
    rows = await anyio.to_thread.run_sync(broker.sandboxes.list_for, principal.effective_user)
    # Boxes are the user's own sandboxes, not those serving a scope.
    return {"sandboxes": [_box(broker, r) for r in rows if r.scope_key is None]}


@router.get("/v2/sandboxes/boxes/{name}", response_model=Box)
async def get_box(name: str, broker: BrokerDep, principal: PrincipalDep) -> Any:
    row = await anyio.to_thread.run_sync(_find_box, broker, principal, name)
    return _box(broker, row)


@router.get("/v2/sandboxes/boxes/{name}/status", response_model=BoxStatus)
async def box_status(name: str, broker: BrokerDep, principal: PrincipalDep) -> Any:
    row = await anyio.to_thread.run_sync(_find_box, broker, principal, name)
    return {"status": _BOX_STATUS[row.state]}


@router.delete("/v2/sandboxes/boxes/{name}", status_code=204)
async def delete_box(
    request: Request, name: str, broker: BrokerDep, principal: PrincipalDep
) -> Response:
    row = await anyio.to_thread.run_sync(_find_box, broker, principal, name)
    await broker.sandboxes.terminate(
        row.id, reason="box deleted", ctx=audit_context(request, principal)
    )
    return Response(status_code=204)


@router.post("/v2/sandboxes/boxes/{name}/stop", response_model=Box)
async def stop_box(name: str, broker: BrokerDep, principal: PrincipalDep) -> Any:
    row = await anyio.to_thread.run_sync(_find_box, broker, principal, name)
    await broker.sandboxes.suspend(row.id, reason="box stopped")
    return _box(broker, await anyio.to_thread.run_sync(broker.sandboxes.get, row.id))


@router.post("/v2/sandboxes/boxes/{name}/start", response_model=Box)
async def start_box(name: str, broker: BrokerDep, principal: PrincipalDep) -> Any:
    row = await anyio.to_thread.run_sync(_find_box, broker, principal, name)
    if row.state is SandboxState.SUSPENDED:
        await broker.sandboxes.resume(row.id, reason="box started")
    return _box(broker, await anyio.to_thread.run_sync(broker.sandboxes.get, row.id))


__all__ = ["router"]
