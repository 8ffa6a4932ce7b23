"""A provider served over HTTP, and the client that uses it.

``sandlot serve --workers N`` runs the broker in N worker processes and the
sandboxes (with their dataplane) in one *sandbox host* process: sandboxes,
shared shells and reattach buffers must live in exactly one place. The host
exposes its provider with :func:`provider_router` on a private Unix socket
(guarded by a secret, mode 0600) and the workers reach it through
:class:`RemoteProvider`. The same pair puts sandboxes on other machines than the
brokers: ``sandlot host`` serves the router over TCP next to its dataplane, guarded
by its credential, and brokers reach it through :class:`RemoteProvider` too
(:class:`sandlot.broker.fleet.FleetProvider` keeps one per registered host).
"""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Mapping, Sequence
from typing import Any

import httpx
from fastapi import APIRouter, Request

from sandlot.protocol.errors import (
    InvalidRequest,
    ProviderUnavailable,
    SandlotError,
    error_from_wire,
)
from sandlot.protocol.sessions import DataplaneCoordinates, SandboxActivity, Template
from sandlot.protocol.states import SandboxState
from sandlot.protocol.tokens import RevokedToken
from sandlot.providers.base import (
    AdoptionRecord,
    Provider,
    ProviderStatus,
    SandboxSpec,
    StatusListener,
)
from sandlot.providers.multi import choose_provider

SECRET_HEADER = "x-sandlot-provider-secret"


def _status(data: Mapping[str, Any]) -> ProviderStatus:
    return ProviderStatus(
        SandboxState(data["state"]), int(data["last_event_sequence"]), data.get("reason")
    )


def _status_json(status: ProviderStatus) -> dict[str, Any]:
    return {
        "state": status.state.value,
        "last_event_sequence": status.last_event_sequence,
        "reason": status.reason,
    }


def dataplane_coordinates(dataplane_url: str, sandbox_id: str) -> DataplaneCoordinates:
    """Where the dataplane of a host whose public URL is ``dataplane_url`` serves a sandbox."""
    http = f"{dataplane_url.rstrip('/')}/dp/{sandbox_id}/v1"
    ws = "ws" + http[4:] if http.startswith("http") else http
    return DataplaneCoordinates(http_base_url=http, ws_base_url=ws)


def members_json(provider: Provider) -> dict[str, Any]:
    """The configured providers a host runs (several behind a :class:`MultiProvider`):
    name → kind and whether it keeps sandboxes across a suspend, and the default."""
    found = getattr(provider, "members", None)
    members: Mapping[str, Provider] = found if isinstance(found, dict) else {}
    default = str(getattr(provider, "default", provider.name))
    if not members:
        members = {provider.name: provider}
    return {
        "default": default,
        "members": {
            name: {"kind": m.name, "supports_suspend": m.supports_suspend}
            for name, m in members.items()
        },
    }


def provider_router(provider: Provider, secret: str) -> APIRouter:
    """Expose ``provider`` over HTTP to callers that present ``secret`` (a private Unix
    socket, or a host's port where brokers hold the credential)."""
    from sandlot.protocol.errors import Unauthenticated

    router = APIRouter(prefix="/internal/provider")

    def check(request: Request) -> None:
        given = request.headers.get(SECRET_HEADER, "")
        if not hmac.compare_digest(given.encode(), secret.encode()):
            raise Unauthenticated("bad provider secret")

    @router.post("/sandboxes")
    async def create(request: Request) -> Any:
        check(request)
        body = await _body(request)
        try:
            spec = SandboxSpec(
                sandbox_id=str(body["sandbox_id"]),
                generation=int(body["generation"]),
                template=Template.model_validate(body["template"]),
                owner_user_id=_optional_str(body.get("owner_user_id")),
                name=_optional_str(body.get("name")),
                provider=_optional_str(body.get("provider")),
            )
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            raise InvalidRequest(f"not a sandbox to create: {_what(exc)}") from None
        return _status_json(await provider.create(spec))

    @router.get("/members")
    async def members(request: Request) -> Any:
        check(request)
        return members_json(provider)

    @router.get("/sandboxes")
    async def list_all(request: Request) -> Any:
        check(request)
        return {"ids": sorted(await provider.list_sandboxes())}

    @router.get("/sandboxes/{sandbox_id}")
    async def status(request: Request, sandbox_id: str) -> Any:
        check(request)
        return _status_json(await provider.status(sandbox_id))

    @router.post("/sandboxes/{sandbox_id}/{action}")
    async def act(request: Request, sandbox_id: str, action: str) -> Any:
        check(request)
        if action == "suspend":
            return _status_json(await provider.suspend(sandbox_id))
        if action == "resume":
            return _status_json(await provider.resume(sandbox_id))
        if action == "revoke":
            body = await _body(request)
            try:
                given = body["tokens"]
                tokens = [RevokedToken(str(t["jti"]), float(t["expires_at"])) for t in given]
            except (KeyError, TypeError, ValueError, OverflowError) as exc:
                raise InvalidRequest(f"not a list of revoked tokens: {_what(exc)}") from None
            await provider.revoke(sandbox_id, tokens)
            return {}
        if action == "activity":
            a = await provider.activity(sandbox_id)
            return {
                "running_execs": a.running_execs,
                "attached_clients": a.attached_clients,
                "last_active_at": a.last_active_at,
            }
        from sandlot.protocol.errors import ResourceNotFound

        raise ResourceNotFound(f"no action {action}")

    @router.delete("/sandboxes/{sandbox_id}")
    async def delete(request: Request, sandbox_id: str) -> Any:
        check(request)
        await provider.delete(sandbox_id)
        return {}

    return router


async def _body(request: Request) -> dict[str, Any]:
    """The request's JSON object, or 400."""
    try:
        body = await request.json()
    except ValueError:
        raise InvalidRequest("the body is not JSON") from None
    if not isinstance(body, dict):
        raise InvalidRequest("the body is not a JSON object")
    return body


def _optional_str(value: Any) -> str | None:
    if value is not None and not isinstance(value, str):
        raise TypeError(f"{value!r} is not a string")
    return value


def _what(exc: BaseException) -> str:
    return f"{exc.args[0]!r} is missing" if isinstance(exc, KeyError) else str(exc)[:200]


#: ``metadata.reason`` of a call that never reached its host (nothing was done there).
HOST_UNREACHABLE = "host_unreachable"
#: Seconds a call to a host may take in all (its answer included, however it trickles).
CALL_SECONDS = 30.0
#: What a host says of the broker's own credential, never of the user's: a broker's
#: caller is told the host is unavailable, not that its own key is wrong.
_ABOUT_THE_BROKER = frozenset({"UNAUTHENTICATED", "FORBIDDEN"})


class RemoteProvider(Provider):
    """A provider reached over HTTP (config: ``url``, ``uds``, ``secret``, ``dataplane_url``).

    With ``members`` (the names of several configured providers the host runs behind a
    :class:`~sandlot.providers.multi.MultiProvider`) and ``default``, it chooses among
    them as that provider does, tells the host which one makes each sandbox, and learns
    from the host, when started, which of them keep a sandbox across a suspend.
    """

    name = "local"

    def __init__(self, config: Mapping[str, Any]) -> None:
        self.name = str(config.get("name", "local"))  # type: ignore[misc]
        self.supports_suspend = bool(config.get("supports_suspend", True))
        self.dataplane_url = str(config["dataplane_url"]).rstrip("/")
        #: The host's configured providers (empty: one, this provider's ``name``).
        self.members: tuple[str, ...] = tuple(config.get("members", ()))
        self.default = str(config.get("default", self.name))
        #: Member name → whether it suspends (from the host; until then, ``supports_suspend``).
        self._suspends: dict[str, bool] = {}
        #: Sandbox id → the member that runs it (as the broker's rows say).
        self._owner: dict[str, str] = {}
        transport = httpx.AsyncHTTPTransport(uds=config["uds"]) if config.get("uds") else None
        self.call_seconds = float(config.get("call_timeout_seconds", CALL_SECONDS))
        self._client = httpx.AsyncClient(
            base_url=str(config.get("url", "http://sandbox-host")),
            transport=transport,
            headers={SECRET_HEADER: str(config["secret"])},
            timeout=httpx.Timeout(self.call_seconds, connect=min(5.0, self.call_seconds)),
        )

    async def start(self, listener: StatusListener | None = None) -> None:
        if not self.members:
            return
        # The host is up before its workers; a restarted one may take a moment.
        for attempt in range(100):
            try:
                doc = await self._call("GET", "/members")
                break
            except ProviderUnavailable:
                if attempt == 99:
                    raise
                await asyncio.sleep(0.1)
        self._suspends = {
            str(name): bool(m.get("supports_suspend")) for name, m in doc["members"].items()
        }

    async def close(self) -> None:
        await self._client.aclose()

    # --- several configured providers on the host -------------------------------------

    def choose(self, template: Template, preference: str = "auto") -> str:
        if not self.members:
            return super().choose(template, preference)
        return choose_provider(self.members, self.default, template, preference)

    def member(self, name: str) -> Provider:
        if not self.members:
            return super().member(name)
        if name not in self.members:
            raise InvalidRequest(f"provider {name!r} is not configured")
        return self

    def assign(self, sandbox_id: str, provider: str | None) -> Provider:
        if self.members:
            self._owner[sandbox_id] = provider if provider in self.members else self.default
        return self

    def can_suspend(self, sandbox_id: str) -> bool:
        if not self.members:
            return self.supports_suspend
        owner = self._owner.get(sandbox_id, self.default)
        return self._suspends.get(owner, self.supports_suspend)

    async def _call(self, method: str, path: str, body: Any = None) -> Any:
        try:
            # The client's timeout bounds each read; this, the whole answer (a host that
            # sends a byte now and then held the broker's request for good).
            async with asyncio.timeout(self.call_seconds):
                resp = await self._client.request(method, f"/internal/provider{path}", json=body)
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            # Never sent: the host did nothing (a creation may be tried elsewhere).
            raise ProviderUnavailable(
                "the sandbox host is unreachable", metadata={"reason": HOST_UNREACHABLE}
            ) from exc
        except httpx.HTTPError as exc:
            raise ProviderUnavailable("the sandbox host is unreachable") from exc
        except TimeoutError:
            raise ProviderUnavailable(
                f"the sandbox host did not answer within {self.call_seconds:g} s"
            ) from None
        try:
            payload = resp.json()
        except ValueError:
            payload = None
        if resp.status_code >= 400:
            error = error_from_wire(payload, resp.status_code)
            if error.wire_code in _ABOUT_THE_BROKER:
                raise ProviderUnavailable(
                    "the sandbox host refused this broker's credential",
                    metadata={"host_said": error.message[:200]},
                )
            raise error
        if payload is None:
            raise ProviderUnavailable("the sandbox host's answer is not JSON")
        return payload

    async def create(self, spec: SandboxSpec) -> ProviderStatus:
        body = {
            "sandbox_id": spec.sandbox_id,
            "generation": spec.generation,
            "template": spec.template.model_dump(mode="json"),
            "owner_user_id": spec.owner_user_id,
            "name": spec.name,
            "provider": spec.provider,
        }
        self.assign(spec.sandbox_id, spec.provider)
        return _status(await self._call("POST", "/sandboxes", body))

    async def status(self, sandbox_id: str) -> ProviderStatus:
        return _status(await self._call("GET", f"/sandboxes/{sandbox_id}"))

    async def suspend(self, sandbox_id: str) -> ProviderStatus:
        return _status(await self._call("POST", f"/sandboxes/{sandbox_id}/suspend"))

    async def resume(self, sandbox_id: str) -> ProviderStatus:
        return _status(await self._call("POST", f"/sandboxes/{sandbox_id}/resume"))

    async def delete(self, sandbox_id: str) -> None:
        await self._call("DELETE", f"/sandboxes/{sandbox_id}")
        self._owner.pop(sandbox_id, None)

    def dataplane(self, sandbox_id: str) -> DataplaneCoordinates:
        return dataplane_coordinates(self.dataplane_url, sandbox_id)

    async def revoke(self, sandbox_id: str, tokens: Sequence[RevokedToken]) -> None:
        body = {"tokens": [{"jti": t.jti, "expires_at": t.expires_at} for t in tokens]}
        await self._call("POST", f"/sandboxes/{sandbox_id}/revoke", body)

    async def activity(self, sandbox_id: str) -> SandboxActivity:
        data = await self._call("POST", f"/sandboxes/{sandbox_id}/activity")
        return SandboxActivity(**data)

    async def load_state(self, records: Sequence[AdoptionRecord]) -> list[str]:
        # The sandbox host re-adopts its own sandboxes; workers adopt nothing.
        return []

    async def list_sandboxes(self) -> set[str]:
        return set((await self._call("GET", "/sandboxes"))["ids"])


__all__ = ["RemoteProvider", "SandlotError", "provider_router"]
