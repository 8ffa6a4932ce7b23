"""Templates, volumes, pools and sandboxes (PROTOCOL.md 2.8)."""

from __future__ import annotations

from typing import Any

import anyio
from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from sandlot.broker.core import Broker
from sandlot.broker.events import read_events
from sandlot.broker.principals import Principal
from sandlot.broker.routes.deps import (
    BrokerDep,
    PrincipalDep,
    audit_context,
    audited,
    parse_model,
    read_body,
    require_admin,
)
from sandlot.broker.routes.sessions import (
    ACCEPTED_DELETE,
    Cursor,
    EventStream,
    LastEventId,
    WaitParam,
    parse_cursor,
    sse_response,
)
from sandlot.broker.sandboxes import SandboxRow
from sandlot.protocol.errors import InvalidRequest, SandboxNotFound, SequenceExpired
from sandlot.protocol.openapi import event_stream, json_body
from sandlot.protocol.sessions import (
    ListResponse,
    Pool,
    PoolSnapshot,
    SandboxCreate,
    SandboxSnapshot,
    Template,
    Volume,
    VolumeCreate,
)
from sandlot.protocol.states import SandboxState

router = APIRouter()


# --- templates -------------------------------------------------------------------------


@router.get("/v1/templates", response_model=ListResponse[Template])
async def list_templates(broker: BrokerDep, principal: PrincipalDep) -> dict[str, Any]:
    items = await anyio.to_thread.run_sync(broker.templates.list)
    return {"items": [t.model_dump(mode="json") for t in items]}


@router.get("/v1/templates/{name}", response_model=Template)
async def get_template(name: str, broker: BrokerDep, principal: PrincipalDep) -> Any:
    return await anyio.to_thread.run_sync(broker.templates.get, name)


@router.post(
    "/v1/templates", response_model=Template, status_code=201, openapi_extra=json_body(Template)
)
async def create_template(request: Request, broker: BrokerDep, principal: PrincipalDep) -> Any:
    require_admin(principal)
    tpl = parse_model(Template, await read_body(request))
    created = await anyio.to_thread.run_sync(broker.templates.create, tpl)
    await audited(request, principal, "template.create", details={"name": tpl.name})
    return created


@router.delete("/v1/templates/{name}", status_code=204)
async def delete_template(
    request: Request, name: str, broker: BrokerDep, principal: PrincipalDep
) -> Response:
    require_admin(principal)
    await anyio.to_thread.run_sync(broker.templates.delete, name)
    await audited(request, principal, "template.delete", details={"name": name})
    return Response(status_code=204)


# --- volumes ---------------------------------------------------------------------------


def _owner_filter(principal: Principal) -> str | None:
    return None if principal.is_admin else principal.effective_user


@router.get("/v1/volumes", response_model=ListResponse[Volume])
async def list_volumes(broker: BrokerDep, principal: PrincipalDep) -> dict[str, Any]:
    items = await anyio.to_thread.run_sync(broker.volumes.list, _owner_filter(principal))
    return {"items": [v.model_dump(mode="json") for v in items]}


@router.get("/v1/volumes/{name}", response_model=Volume)
async def get_volume(name: str, broker: BrokerDep, principal: PrincipalDep) -> Any:
    return await anyio.to_thread.run_sync(broker.volumes.get, name, _owner_filter(principal))


@router.post(
    "/v1/volumes", response_model=Volume, status_code=201, openapi_extra=json_body(VolumeCreate)
)
async def create_volume(request: Request, broker: BrokerDep, principal: PrincipalDep) -> Any:
    req = parse_model(VolumeCreate, await read_body(request))
    vol = await anyio.to_thread.run_sync(broker.volumes.create, req.name, principal.effective_user)
    await audited(request, principal, "volume.create", details={"name": req.name})
    return vol


@router.delete("/v1/volumes/{name}", status_code=204)
async def delete_volume(
    request: Request, name: str, broker: BrokerDep, principal: PrincipalDep
) -> Response:
    await anyio.to_thread.run_sync(broker.volumes.delete, name, _owner_filter(principal))
    await audited(request, principal, "volume.delete", details={"name": name})
    return Response(status_code=204)


# --- pools -----------------------------------------------------------------------------


@router.get("/v1/pools", response_model=ListResponse[PoolSnapshot])
async def list_pools(broker: BrokerDep, principal: PrincipalDep) -> dict[str, Any]:
    items = await anyio.to_thread.run_sync(broker.pools.list)
    return {"items": [p.model_dump(mode="json") for p in items]}


@router.get("/v1/pools/{name}", response_model=PoolSnapshot)
async def get_pool(name: str, broker: BrokerDep, principal: PrincipalDep) -> Any:
    return await anyio.to_thread.run_sync(broker.pools.get, name)


@router.post(
    "/v1/pools", response_model=PoolSnapshot, status_code=201, openapi_extra=json_body(Pool)
)
async def create_pool(request: Request, broker: BrokerDep, principal: PrincipalDep) -> Any:
    require_admin(principal)
    pool = parse_model(Pool, await read_body(request))
    snap = await anyio.to_thread.run_sync(broker.pools.create, pool)
    await audited(request, principal, "pool.create", details=pool.model_dump())
    await broker.reaper.run_once()
    return snap


@router.delete("/v1/pools/{name}", status_code=204)
async def delete_pool(
    request: Request, name: str, broker: BrokerDep, principal: PrincipalDep
) -> Response:
    require_admin(principal)
    ids = await anyio.to_thread.run_sync(broker.pools.delete, name)
    ctx = audit_context(request, principal)
    for sandbox_id in ids:
        await broker.sandboxes.terminate(sandbox_id, reason="pool deleted", ctx=ctx)
    await anyio.to_thread.run_sync(
        lambda: broker.audit.write(ctx, "pool.delete", details={"name": name})
    )
    return Response(status_code=204)


# --- sandboxes -------------------------------------------------------------------------


def visible_sandbox(broker: Broker, principal: Principal, sandbox_id: str) -> SandboxRow:
    row = broker.sandboxes.get(sandbox_id)
    if row.pool is not None or (
        row.owner_user_id != principal.effective_user and not principal.is_admin
    ):
        raise SandboxNotFound(f"no sandbox {sandbox_id}")
    return row


@router.get("/v1/sandboxes", response_model=ListResponse[SandboxSnapshot])
async def list_sandboxes(
    broker: BrokerDep, principal: PrincipalDep, all_users: bool = False, include_ended: bool = False
) -> dict[str, Any]:
    if all_users:
        require_admin(principal)
    rows = await anyio.to_thread.run_sync(
        lambda: broker.sandboxes.list_for(
            None if all_users else principal.effective_user, include_ended=include_ended
        )
    )
    return {"items": [broker.sandboxes.snapshot(r).model_dump(mode="json") for r in rows]}


@router.post(
    "/v1/sandboxes",
    response_model=SandboxSnapshot,
    status_code=201,
    openapi_extra=json_body(SandboxCreate, required=False),
)
async def create_sandbox(request: Request, broker: BrokerDep, principal: PrincipalDep) -> Any:
    req = parse_model(SandboxCreate, await read_body(request), empty_ok=True)
    await broker.ratelimit.check(principal.lease_holder)
    template = await anyio.to_thread.run_sync(broker.templates.get, req.template)
    ctx = audit_context(request, principal)

    def tx() -> SandboxRow:
        from sandlot.broker.audit import record

        with broker.store.write() as conn:
            row = broker.sandboxes.insert(
                conn, template=template, owner_user_id=principal.effective_user, name=req.name
            )
            record(
                conn, ctx, "sandbox.create", sandbox_id=row.id, details={"template": req.template}
            )
        return row

    row = await anyio.to_thread.run_sync(tx)
    broker.sandboxes.spawn(broker.sandboxes.provision(row, template))
    return broker.sandboxes.snapshot(row)


@router.get("/v1/sandboxes/{sandbox_id}", response_model=SandboxSnapshot)
async def get_sandbox(sandbox_id: str, broker: BrokerDep, principal: PrincipalDep) -> Any:
    row = await anyio.to_thread.run_sync(visible_sandbox, broker, principal, sandbox_id)
    return broker.sandboxes.snapshot(row)


@router.delete(
    "/v1/sandboxes/{sandbox_id}",
    status_code=204,
    responses={202: {"model": SandboxSnapshot, "description": ACCEPTED_DELETE}},
)
async def delete_sandbox(
    request: Request,
    sandbox_id: str,
    broker: BrokerDep,
    principal: PrincipalDep,
    wait: WaitParam = True,
) -> Response:
    await anyio.to_thread.run_sync(visible_sandbox, broker, principal, sandbox_id)
    row = await broker.sandboxes.terminate(
        sandbox_id, reason="deleted by request", ctx=audit_context(request, principal), wait=wait
    )
    if row.state is SandboxState.TERMINATED:
        return Response(status_code=204)
    return JSONResponse(broker.sandboxes.snapshot(row).model_dump(mode="json"), status_code=202)


@router.post("/v1/sandboxes/{sandbox_id}/suspend", response_model=SandboxSnapshot)
async def suspend_sandbox(
    request: Request, sandbox_id: str, broker: BrokerDep, principal: PrincipalDep
) -> Any:
    row = await anyio.to_thread.run_sync(visible_sandbox, broker, principal, sandbox_id)
    if row.state not in (SandboxState.ACTIVE, SandboxState.IDLE, SandboxState.SUSPENDED):
        raise InvalidRequest(f"a {row.state} sandbox cannot be suspended")
    if not broker.provider.assign(row.id, row.provider).can_suspend(sandbox_id):
        raise InvalidRequest(f"provider {row.provider} cannot suspend sandboxes")
    await broker.sandboxes.suspend(sandbox_id, reason="suspended by request")
    await audited(request, principal, "sandbox.suspend", sandbox_id=sandbox_id)
    return broker.sandboxes.snapshot(broker.sandboxes.get(sandbox_id))


@router.post("/v1/sandboxes/{sandbox_id}/resume", response_model=SandboxSnapshot)
async def resume_sandbox(
    request: Request, sandbox_id: str, broker: BrokerDep, principal: PrincipalDep
) -> Any:
    row = await anyio.to_thread.run_sync(visible_sandbox, broker, principal, sandbox_id)
    if row.state is SandboxState.SUSPENDED:
        await broker.sandboxes.resume(sandbox_id, reason="resumed by request")
    elif not row.state.live:
        raise InvalidRequest(f"a {row.state} sandbox cannot be resumed")
    await audited(request, principal, "sandbox.resume", sandbox_id=sandbox_id)
    return broker.sandboxes.snapshot(broker.sandboxes.get(sandbox_id))


@router.get(
    "/v1/sandboxes/{sandbox_id}/events",
    response_class=EventStream,
    responses=event_stream("The sandbox's phase events after the cursor, then live"),
)
async def sandbox_events(
    sandbox_id: str,
    broker: BrokerDep,
    principal: PrincipalDep,
    after: Cursor = None,
    last_event_id: LastEventId = None,
) -> EventStream:
    cursor = parse_cursor(last_event_id, after)
    await anyio.to_thread.run_sync(visible_sandbox, broker, principal, sandbox_id)

    def fetch(c: int) -> list[dict[str, Any]]:
        with broker.store.read() as conn:
            items, oldest = read_events(conn, sandbox_id, c)
        if oldest is not None and c < oldest - 1:
            raise SequenceExpired(f"events after {c} are no longer retained")
        return items

    await anyio.to_thread.run_sync(fetch, cursor)
    return sse_response(
        fetch,
        cursor,
        hub=broker.hub,
        stream_id=sandbox_id,
        ended=lambda: broker.sandboxes.get(sandbox_id).state.settled,
        share="sandbox",
    )
