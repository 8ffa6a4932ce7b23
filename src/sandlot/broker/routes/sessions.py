"""Sessions (PROTOCOL.md 2.1-2.6) and scope sharing."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Hashable
from functools import partial
from typing import Annotated, Any

import anyio
from fastapi import APIRouter, Header, Query, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.types import Receive, Send
from starlette.types import Scope as Scope_

from sandlot.broker.events import EventHub
from sandlot.broker.idempotency import MAX_KEY_LENGTH, Claim, fingerprint
from sandlot.broker.keys import KeyService
from sandlot.broker.principals import Principal
from sandlot.broker.ratelimit import Charge, SharedRateLimiter
from sandlot.broker.routes.deps import (
    BrokerDep,
    PrincipalDep,
    audit_context,
    broker_of,
    parse_model,
    read_body,
)
from sandlot.broker.routes.errors import envelope_for
from sandlot.protocol.common import Scope, ScopeType
from sandlot.protocol.errors import InvalidRequest, SandlotError, Unauthenticated
from sandlot.protocol.events import MAX_SEQUENCE
from sandlot.protocol.openapi import event_stream, json_body
from sandlot.protocol.sessions import (
    HeartbeatResponse,
    MemberRequest,
    MembersResponse,
    RefreshResponse,
    SessionGrant,
    SessionRequest,
    SessionSnapshot,
)
from sandlot.protocol.states import SandboxState

router = APIRouter()

KEEPALIVE_SECONDS = 15.0


class EventStream(StreamingResponse):
    media_type = "text/event-stream"

    #: Whether the API key that opened the stream still works (``None``: no key to
    #: lose); set from the request when the response is sent, for :func:`sse_response`.
    key_live: Callable[[], Awaitable[bool]] | None = None

    async def __call__(self, scope: Scope_, receive: Receive, send: Send) -> None:
        request = Request(scope)
        principal = getattr(request.state, "principal", None)
        if isinstance(principal, Principal) and principal.key_id is not None:
            broker = broker_of(request)
            self.key_live = partial(_key_live, broker.keys, broker.hub, principal.key_id)
        await super().__call__(scope, receive, send)


async def _key_live(keys: KeyService, hub: EventHub, key_id: str) -> bool:
    """Whether the key still works: from the keys' cache or, once a second, the store
    (one read for every stream of the key that asks meanwhile)."""
    live = keys.key_live_cached(key_id)
    if live is None:
        live = await hub.shared(("key_live", key_id), partial(keys.key_live, key_id))
    return live


#: How often an open event stream checks that the key that opened it still works.
KEY_CHECK_SECONDS = 1.0


def _error_event(exc: SandlotError) -> bytes:
    """An in-band error that ends a stream already under way (the SDK raises it)."""
    error = json.dumps(exc.to_wire()["error"], separators=(",", ":"))
    return b"event: error\ndata: " + error.encode() + b"\n\n"


#: What ends a stream whose key was revoked (the SDK raises it as ``Unauthenticated``).
_KEY_REVOKED = _error_event(Unauthenticated("the API key that opened this stream was revoked"))


#: Where an event stream starts: after this sequence number (exclusive).
Cursor = Annotated[int | None, Query(ge=0, le=MAX_SEQUENCE)]
#: Where an event stream resumes (SSE reconnection); it takes precedence over ``after``.
LastEventId = Annotated[str | None, Header(description="Resume after this sequence number")]
#: ``wait=false`` on a teardown: answer once it is accepted (202), not once it is done.
WaitParam = Annotated[
    bool,
    Query(description="false: answer 202 with the snapshot once the teardown is accepted"),
]
ACCEPTED_DELETE = (
    "Teardown accepted, not finished (wait=false, or the provider is still deleting): "
    "the snapshot in state terminating; wait on the events after its last_event_sequence"
)


async def idempotent(
    request: Request,
    broker: Any,
    principal: Principal,
    body: bytes,
    run: Callable[[Claim | None], Awaitable[tuple[int, Any]]],
    key: str | None,
) -> JSONResponse:
    """Run a creating request under its ``Idempotency-Key`` (if any).

    ``run`` gets the key's :class:`Claim` and settles it in the transaction that does
    the work (see :mod:`sandlot.broker.idempotency`); what it leaves unsettled is
    settled here, in a transaction of its own.
    """
    if key is None:
        status, payload = await run(None)
        return JSONResponse(payload, status_code=status)
    store = broker.idempotency
    who = principal.lease_holder
    claim = store.claim(who, key, fingerprint(request.method, request.url.path, body))
    try:
        status, payload = await run(claim)
    except SandlotError as exc:
        if claim.owned:
            if exc.retryable or exc.status == 429:
                # A transient failure is not an outcome: let the retry run again. Nor is
                # a quota's refusal (not retryable as such: something must be freed
                # first), or the same request would stay refused once it was.
                await anyio.to_thread.run_sync(store.abandon, who, key)
            else:
                outcome = envelope_for(request, exc)
                await anyio.to_thread.run_sync(
                    store.record, who, key, claim.fingerprint, exc.status, outcome
                )
        raise
    except BaseException:
        if claim.owned:
            await anyio.to_thread.run_sync(store.abandon, who, key)
        raise
    if claim.replay is not None:
        return JSONResponse(
            claim.replay.body,
            status_code=claim.replay.status,
            headers={"Idempotent-Replayed": "true"},
        )
    if claim.status is None:
        await anyio.to_thread.run_sync(store.finish, who, key, status, payload)
    return JSONResponse(payload, status_code=status)


@router.post(
    "/v1/sandbox/sessions", response_model=SessionGrant, openapi_extra=json_body(SessionRequest)
)
async def negotiate(
    request: Request,
    broker: BrokerDep,
    principal: PrincipalDep,
    idempotency_key: Annotated[
        str | None,
        Header(
            min_length=1,
            max_length=MAX_KEY_LENGTH,
            description="A retry with the same key (printable characters) replays the answer",
        ),
    ] = None,
) -> Response:
    body = await read_body(request)
    req = parse_model(SessionRequest, body)
    limiter, charge = broker.ratelimit, None
    if isinstance(limiter, SharedRateLimiter):
        # Taken in the negotiation's own transaction: no transaction of its own.
        charge = Charge(limiter, principal.lease_holder)
    else:
        await limiter.check(principal.lease_holder)
    ctx = audit_context(request, principal)

    async def run(claim: Claim | None) -> tuple[int, Any]:
        started = time.perf_counter()
        grant = await broker.sessions.negotiate(ctx, principal, req, claim=claim, charge=charge)
        if grant is None:  # the claim holds an earlier identical request's answer
            return 0, None
        request.app.state.metrics.negotiation(req.mode.value, time.perf_counter() - started)
        if claim is not None and claim.status is not None:
            return claim.status, claim.body  # recorded with the work, already serialized
        return 200, grant.model_dump(mode="json")

    return await idempotent(request, broker, principal, body, run, idempotency_key)


@router.get("/v1/sandbox/sessions/{session_id}", response_model=SessionSnapshot)
async def get_session(session_id: str, broker: BrokerDep, principal: PrincipalDep) -> Any:
    return await anyio.to_thread.run_sync(broker.leases.snapshot, principal, session_id)


async def _refresh(request: Request, session_id: str, broker: Any, principal: Principal) -> Any:
    await read_body(request)
    ctx = audit_context(request, principal)
    return await anyio.to_thread.run_sync(broker.leases.refresh, ctx, principal, session_id)


@router.post("/v1/sandbox/sessions/{session_id}/refresh", response_model=RefreshResponse)
async def refresh(
    request: Request, session_id: str, broker: BrokerDep, principal: PrincipalDep
) -> Any:
    return await _refresh(request, session_id, broker, principal)


@router.post("/v1/sandbox/sessions/{session_id}/refresh-token", response_model=RefreshResponse)
async def refresh_token(
    request: Request, session_id: str, broker: BrokerDep, principal: PrincipalDep
) -> Any:
    return await _refresh(request, session_id, broker, principal)


@router.post("/v1/sandbox/sessions/{session_id}/heartbeat", response_model=HeartbeatResponse)
async def heartbeat(
    request: Request, session_id: str, broker: BrokerDep, principal: PrincipalDep
) -> Any:
    return await broker.leases.heartbeat(audit_context(request, principal), principal, session_id)


@router.delete(
    "/v1/sandbox/sessions/{session_id}",
    status_code=204,
    responses={202: {"model": SessionSnapshot, "description": ACCEPTED_DELETE}},
)
async def release(
    request: Request,
    session_id: str,
    broker: BrokerDep,
    principal: PrincipalDep,
    terminate: bool = False,
    wait: WaitParam = True,
) -> Response:
    snap = await broker.leases.release(
        audit_context(request, principal), principal, session_id, terminate=terminate, wait=wait
    )
    if snap is None or snap.binding.state == SandboxState.TERMINATED.value:
        return Response(status_code=204)
    return JSONResponse(snap.model_dump(mode="json"), status_code=202)


def parse_cursor(last: str | None, after: int | None) -> int:
    if last is not None:
        last = last.strip()
        # isdigit() alone admits "²", which int() refuses.
        if not (last.isascii() and last.isdigit()) or int(last) > MAX_SEQUENCE:
            raise InvalidRequest("Last-Event-ID must be a sequence number")
        return int(last)
    return after or 0


def sse_response(
    fetch: Callable[[int], list[dict[str, Any]]],
    cursor: int,
    *,
    hub: EventHub,
    stream_id: str,
    ended: Callable[[], bool],
    share: Hashable,
) -> EventStream:
    """An SSE stream: events after ``cursor``, then live, keep-alive every 15 s.

    Streams with the same ``share`` read the same (the same principal's, for a session's
    events, whose reads check its access; anyone's for a sandbox's): their concurrent
    reads at one cursor are one read (:meth:`EventHub.shared`).
    """

    async def key_revoked() -> bool:
        # Read when the stream is sent: the response is made first.
        return response.key_live is not None and not await response.key_live()

    async def stream() -> AsyncIterator[bytes]:
        nonlocal cursor
        last_sent = time.monotonic()
        yield b": stream open\n\n"
        try:
            while True:
                seen = hub.version(stream_id)
                try:
                    items = await hub.shared((share, stream_id, cursor), partial(fetch, cursor))
                    finished = False
                    if not items:
                        finished = await hub.shared((share, stream_id, "ended"), ended)
                        if finished:
                            # The last events may have been committed (with the final
                            # state) between the read above and this one: send them.
                            items = await anyio.to_thread.run_sync(fetch, cursor)
                except SandlotError as exc:
                    # Access lost meanwhile (the scope no longer shared with the caller):
                    # said in the stream, which has started.
                    yield _error_event(exc)
                    return
                if await key_revoked():
                    yield _KEY_REVOKED
                    return
                for ev in items:
                    cursor = int(ev["sequence"])
                    data = json.dumps(ev, separators=(",", ":"))
                    yield f"id: {cursor}\nevent: {ev['event_type']}\ndata: {data}\n\n".encode()
                    last_sent = time.monotonic()
                if finished and not items:
                    return
                if not items:
                    # Woken by this process's events, other processes' notifications
                    # and the process's reconciling read (events.EventReconciler); and
                    # every second to see that the key was not revoked (from its cache:
                    # the store is read at most once a second per key).
                    until = time.monotonic() + KEEPALIVE_SECONDS
                    while hub.version(stream_id) == seen and (left := until - time.monotonic()) > 0:
                        wait = left if response.key_live is None else min(left, KEY_CHECK_SECONDS)
                        await hub.wait(stream_id, wait, seen)
                        if await key_revoked():
                            yield _KEY_REVOKED
                            return
                    if time.monotonic() - last_sent >= KEEPALIVE_SECONDS:
                        yield b": keep-alive\n\n"
                        last_sent = time.monotonic()
        finally:
            hub.forget(stream_id)

    response = EventStream(
        stream(), headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )
    return response


@router.get(
    "/v1/sandbox/sessions/{session_id}/events",
    response_class=EventStream,
    responses=event_stream("The binding's events after the cursor, then live"),
)
async def session_events(
    session_id: str,
    broker: BrokerDep,
    principal: PrincipalDep,
    after: Cursor = None,
    last_event_id: LastEventId = None,
) -> EventStream:
    cursor = parse_cursor(last_event_id, after)
    # Checks access and retention before the stream starts, so errors get a status.
    await anyio.to_thread.run_sync(broker.leases.events_after, principal, session_id, cursor)

    def ended() -> bool:
        snap = broker.leases.snapshot(principal, session_id)
        return SandboxState(snap.binding.state).settled

    return sse_response(
        lambda c: broker.leases.events_after(principal, session_id, c),
        cursor,
        hub=broker.hub,
        stream_id=session_id,
        ended=ended,
        share=principal,
    )


def _scope(scope_type: ScopeType, scope_id: str) -> Scope:
    try:
        return Scope(type=scope_type, id=scope_id)
    except ValueError as exc:
        raise InvalidRequest(f"invalid scope id {scope_id!r}") from exc


@router.get("/v1/sandbox/scopes/{scope_type}/{scope_id}/members", response_model=MembersResponse)
async def list_members(
    scope_type: ScopeType, scope_id: str, broker: BrokerDep, principal: PrincipalDep
) -> Any:
    return await anyio.to_thread.run_sync(
        broker.members.members, principal, _scope(scope_type, scope_id)
    )


@router.post(
    "/v1/sandbox/scopes/{scope_type}/{scope_id}/members",
    response_model=MembersResponse,
    openapi_extra=json_body(MemberRequest),
)
async def add_member(
    request: Request,
    scope_type: ScopeType,
    scope_id: str,
    broker: BrokerDep,
    principal: PrincipalDep,
) -> Any:
    req = parse_model(MemberRequest, await read_body(request))
    ctx = audit_context(request, principal)
    return await anyio.to_thread.run_sync(
        broker.members.add_member, ctx, principal, _scope(scope_type, scope_id), req.user_id
    )


@router.delete("/v1/sandbox/scopes/{scope_type}/{scope_id}/members/{user_id}", status_code=204)
async def remove_member(
    request: Request,
    scope_type: ScopeType,
    scope_id: str,
    user_id: str,
    broker: BrokerDep,
    principal: PrincipalDep,
) -> Response:
    ctx = audit_context(request, principal)
    await anyio.to_thread.run_sync(
        broker.members.remove_member, ctx, principal, _scope(scope_type, scope_id), user_id
    )
    return Response(status_code=204)
