"""Sandbox hosts without the store: registration, heartbeats, their sandboxes' states,
reaper passes and revocations, behind the host's key (:mod:`sandlot.broker.hostapi`);
and the admin's routes that issue, list and revoke host keys.

Every host route authenticates ``Authorization: Bearer slh_…`` and acts on the host the
key names, never on another's sandboxes. A bad or revoked key is ``401
UNAUTHENTICATED``; a broker on SQLite answers ``501 NOT_SUPPORTED``.
"""

from __future__ import annotations

from typing import Annotated, Any

import anyio
from fastapi import APIRouter, Depends, Query, Request
from pydantic import BaseModel, ConfigDict, Field

from sandlot.broker.assembly import resolve_api_key
from sandlot.broker.hostapi import HostApi, HostRegistrationRequest
from sandlot.broker.routes.deps import (
    PrincipalDep,
    api_key_of,
    audited,
    broker_of,
    parse_model,
    read_body,
    require_admin,
)
from sandlot.broker.settings import MAX_HOST_CAPACITY
from sandlot.protocol.errors import SandboxNotFound
from sandlot.protocol.events import MAX_SEQUENCE
from sandlot.protocol.states import SandboxState
from sandlot.providers.base import ProviderStatus

router = APIRouter()


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RegisterBody(_Body):
    provider: str = Field(min_length=1, max_length=40, pattern=r"^[a-z][a-z0-9_-]*$")
    provider_url: str = Field(min_length=8, max_length=400, pattern=r"^https?://")
    provider_secret: str = Field(min_length=16, max_length=200)
    dataplane_url: str = Field(min_length=8, max_length=400, pattern=r"^https?://")
    capacity: int = Field(ge=1, le=MAX_HOST_CAPACITY)


class HeartbeatBody(_Body):
    capacity: int | None = Field(default=None, ge=1, le=MAX_HOST_CAPACITY)


class RecoverBody(_Body):
    lost: list[str] = Field(max_length=100_000)


class StatusBody(_Body):
    state: SandboxState
    last_event_sequence: int = Field(default=0, ge=0, le=MAX_SEQUENCE)
    reason: str | None = Field(default=None, max_length=2000)


class KeyCheckBody(_Body):
    api_key: str = Field(max_length=400)
    sandbox_id: str = Field(max_length=100)


class HostKeyBody(_Body):
    name: str | None = Field(default=None, max_length=200)
    host_id: str | None = Field(default=None, max_length=80)


def _api(request: Request) -> HostApi:
    return broker_of(request).host_api


async def _host_of(request: Request) -> str:
    """The host whose key authenticates the request."""
    return await anyio.to_thread.run_sync(_api(request).keys.authenticate, api_key_of(request))


HostDep = Annotated[str, Depends(_host_of)]


@router.get("/v1/hosts/self", include_in_schema=False)
async def host_self(request: Request, host: HostDep) -> Any:
    return await anyio.to_thread.run_sync(_api(request).settings_for, host)


@router.post("/v1/hosts/register", include_in_schema=False)
async def register(request: Request, host: HostDep) -> Any:
    body = parse_model(RegisterBody, await read_body(request))
    api = _api(request)
    req = HostRegistrationRequest(**body.model_dump())
    was_lost = await anyio.to_thread.run_sync(api.register, host, req)
    return {**await anyio.to_thread.run_sync(api.settings_for, host), "was_lost": was_lost}


@router.post("/v1/hosts/heartbeat", include_in_schema=False)
async def heartbeat(request: Request, host: HostDep) -> Any:
    body = parse_model(HeartbeatBody, await read_body(request), empty_ok=True)
    was = await anyio.to_thread.run_sync(_api(request).heartbeat, host, body.capacity)
    return {"was": was}


@router.get("/v1/hosts/adoption", include_in_schema=False)
async def adoption(request: Request, host: HostDep) -> Any:
    return {"records": await anyio.to_thread.run_sync(_api(request).adoption, host)}


@router.post("/v1/hosts/recover", include_in_schema=False)
async def recover(request: Request, host: HostDep) -> Any:
    body = parse_model(RecoverBody, await read_body(request))
    return {"lost": await _api(request).recover(host, body.lost)}


@router.post("/v1/hosts/reap", include_in_schema=False)
async def reap(request: Request, host: HostDep) -> Any:
    return {"report": await _api(request).reap(host)}


@router.post("/v1/hosts/sandboxes/{sandbox_id}/status", include_in_schema=False)
async def report_status(request: Request, sandbox_id: str, host: HostDep) -> Any:
    body = parse_model(StatusBody, await read_body(request))
    status = ProviderStatus(body.state, body.last_event_sequence, body.reason)
    return {"changed": await _api(request).report_status(host, sandbox_id, status)}


@router.get("/v1/hosts/revocations", include_in_schema=False)
async def revocations(
    request: Request,
    host: HostDep,
    since: Annotated[float, Query(ge=0)] = 0.0,
    keys_since: Annotated[float, Query(ge=0)] = 0.0,
) -> Any:
    api = _api(request)
    return await anyio.to_thread.run_sync(
        lambda: api.revocations(host, since=since, keys_since=keys_since)
    )


@router.post("/v1/hosts/api-keys/check", include_in_schema=False)
async def check_api_key(request: Request, host: HostDep) -> Any:
    """Who an API key used on one of the host's sandboxes is (404: nobody it admits)."""
    body = parse_model(KeyCheckBody, await read_body(request))
    api = _api(request)
    if not await anyio.to_thread.run_sync(api.owns, host, body.sandbox_id):
        raise SandboxNotFound(f"no sandbox {body.sandbox_id} on host {host}")
    ctx = await resolve_api_key(broker_of(request), body.api_key, body.sandbox_id)
    if ctx is None:
        return {"context": None}
    return {
        "context": {
            "principal_id": ctx.principal_id,
            "actor": ctx.actor.model_dump(mode="json"),
            "caps": sorted(c.value for c in ctx.caps),
            "sandbox_id": ctx.sandbox_id,
            "generation": ctx.generation,
            "jti": ctx.jti,
        }
    }


# --- an admin's host keys ----------------------------------------------------------


@router.post("/v1/hosts/keys", status_code=201)
async def create_host_key(request: Request, principal: PrincipalDep) -> Any:
    """Issue a host key (shown once; only its hash is stored)."""
    require_admin(principal)
    body = parse_model(HostKeyBody, await read_body(request), empty_ok=True)
    api = _api(request)
    key, host_id = await anyio.to_thread.run_sync(
        lambda: api.keys.create(name=body.name, host_id=body.host_id)
    )
    await audited(
        request, principal, "host_key.create", details={"host_id": host_id, "name": body.name}
    )
    return {"key": key, "host_id": host_id, "name": body.name}


@router.get("/v1/hosts/keys")
async def list_host_keys(request: Request, principal: PrincipalDep) -> Any:
    require_admin(principal)
    keys = await anyio.to_thread.run_sync(_api(request).keys.list)
    return {
        "items": [
            {
                "host_id": k.host_id,
                "name": k.name,
                "created_at": k.created_at,
                "revoked_at": k.revoked_at,
            }
            for k in keys
        ]
    }


@router.delete("/v1/hosts/keys/{host_id}", status_code=204)
async def revoke_host_key(request: Request, host_id: str, principal: PrincipalDep) -> None:
    require_admin(principal)
    await anyio.to_thread.run_sync(_api(request).keys.revoke, host_id)
    await audited(request, principal, "host_key.revoke", details={"host_id": host_id})
