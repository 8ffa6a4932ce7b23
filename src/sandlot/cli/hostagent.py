"""``sandlot host --broker URL --key KEY``: a sandbox host that reaches the store through
the brokers' API (:mod:`sandlot.broker.hostapi`), for machines without the database.

It runs the same provider, dataplane (``/dp``) and provider API (``/internal/provider``)
as a host with the store (:mod:`sandlot.cli.host`); what that one reads and writes in
the store, this one asks a broker for, authenticated by its host key:

- before it serves, it reads the sandboxes the store holds for it and re-adopts them in
  its provider (a restart with the same data directory keeps them);
- then it registers (its provider API, the secret brokers present there, its public
  dataplane URL, its capacity), has a broker re-drive or fail what it lost, and is
  ready (``/readyz`` 200);
- every ``hosts.heartbeat_seconds`` (the brokers' setting) a heartbeat that reports its
  capacity; every ``policy.reaper_interval_seconds`` a reaper pass over its sandboxes
  run by a broker; every 0.2 s the revocations, pushed to its dataplane; and each state
  its provider reports, retried until a broker took it;
- its dataplane verifies tokens with the brokers' public keys and checks API keys
  (``X-Api-Key``) with a broker.

A host cut from every broker keeps running its sandboxes; its heartbeats lapse and,
after ``hosts.lost_after_seconds``, the brokers declare it lost and fail its sandboxes
(``host_lost``), as for any host.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from sandlot.broker.revocations import Revocations, RevocationWatcher
from sandlot.dataplane.services.auth import AuthContext
from sandlot.protocol.common import Actor, Capability
from sandlot.protocol.errors import (
    InternalError,
    NotSupported,
    SandlotError,
    Unauthenticated,
    error_from_wire,
)
from sandlot.protocol.sessions import Template
from sandlot.protocol.states import SandboxState
from sandlot.providers.base import AdoptionRecord, Provider, ProviderStatus

log = logging.getLogger("sandlot.host")

#: Retryable answers: the brokers are restarting, overloaded, or behind a balancer.
_RETRY_STATUS = frozenset({502, 503, 504})


class BrokerUnreachable(Exception):
    """No broker answered (connection refused, timed out, 502/503/504)."""


class HostKeyRefused(Exception):
    """The brokers refuse this host's key (unknown, revoked, or mistyped)."""


@dataclass(frozen=True)
class BrokerConfig:
    """What the brokers say a host needs (``GET /v1/hosts/self``)."""

    host_id: str
    issuer: str
    heartbeat_seconds: float
    lost_after_seconds: float
    reaper_interval_seconds: float

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> BrokerConfig:
        return cls(
            host_id=str(data["host_id"]),
            issuer=str(data["issuer"]),
            heartbeat_seconds=float(data["heartbeat_seconds"]),
            lost_after_seconds=float(data["lost_after_seconds"]),
            reaper_interval_seconds=float(data["reaper_interval_seconds"]),
        )


def _raise_for(resp: httpx.Response) -> None:
    if resp.status_code < 400:
        return
    if resp.status_code in _RETRY_STATUS:
        raise BrokerUnreachable(f"the broker answered {resp.status_code}")
    try:
        payload = resp.json()
    except ValueError:
        payload = None
    err = error_from_wire(payload, resp.status_code)
    if isinstance(err, Unauthenticated):
        raise HostKeyRefused(err.message)
    raise err


def hello(url: str, key: str, *, wait: float = 30.0) -> BrokerConfig:
    """Check the key with the brokers and read their settings, before anything starts.

    Unreachable brokers are retried for ``wait`` seconds; a refused key is not.
    """
    deadline = time.monotonic() + wait
    headers = {"Authorization": f"Bearer {key}"}
    while True:
        try:
            resp = httpx.get(f"{url.rstrip('/')}/v1/hosts/self", headers=headers, timeout=10)
            if resp.status_code == 404:
                raise NotSupported(f"{url} serves no host registration (not a sandlot broker?)")
            _raise_for(resp)
            return BrokerConfig.from_json(resp.json())
        except (httpx.HTTPError, BrokerUnreachable) as exc:
            if time.monotonic() >= deadline:
                raise BrokerUnreachable(f"no broker answered at {url}: {exc}") from None
            time.sleep(0.5)


class BrokerLink:
    """The host's authenticated calls to the brokers."""

    def __init__(self, url: str, key: str) -> None:
        self.url = url.rstrip("/")
        self._client = httpx.AsyncClient(
            base_url=self.url,
            headers={"Authorization": f"Bearer {key}"},
            timeout=httpx.Timeout(30.0, connect=5.0),
        )

    async def call(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        params: Mapping[str, Any] | None = None,
        timeout: float | None = None,
    ) -> Any:
        kw: dict[str, Any] = {"json": body, "params": params}
        if timeout is not None:
            kw["timeout"] = httpx.Timeout(timeout, connect=5.0)
        try:
            resp = await self._client.request(method, path, **kw)
        except httpx.HTTPError as exc:
            raise BrokerUnreachable(f"{type(exc).__name__}: {exc}") from None
        _raise_for(resp)
        return resp.json() if resp.content else None

    async def jwks(self) -> Mapping[str, Any]:
        data: Mapping[str, Any] = await self.call("GET", "/.well-known/jwks.json")
        return data

    async def close(self) -> None:
        await self._client.aclose()


class BrokerRevocations(RevocationWatcher):
    """Revocations read from the brokers (this host's sandboxes' tokens, revoked keys)."""

    def __init__(self, link: BrokerLink, provider: Provider, clock: Callable[[], float]) -> None:
        super().__init__(None, provider, clock)
        self.link = link

    async def fetch(self) -> Revocations:
        try:
            data = await self.link.call(
                "GET",
                "/v1/hosts/revocations",
                params={"since": self._since, "keys_since": max(self._keys_since, 0.0)},
            )
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            # Read again at the next look (the agent's heartbeats log the outage).
            log.debug("revocations not read: %s", exc)
            return Revocations([], [], [])
        return Revocations(
            tokens=[SimpleNamespace(**t) for t in data["tokens"]],
            keys=[SimpleNamespace(**k) for k in data["keys"]],
            live=list(data["live"]),
        )


class HostAgent:
    """The host's side of the brokers' API: adoption, registration, heartbeats, reaper
    passes, state reports, revocations."""

    #: How long a failed call waits before it is tried again.
    RETRY_SECONDS = 0.5

    def __init__(
        self,
        link: BrokerLink,
        config: BrokerConfig,
        provider: Provider,
        registration: Mapping[str, Any],
    ) -> None:
        self.link = link
        self.config = config
        self.provider = provider
        self.registration = dict(registration)
        self.ready = False
        self.revocations = BrokerRevocations(link, provider, time.time)
        self._lost: list[str] = []
        self._outbox: asyncio.Queue[tuple[str, ProviderStatus]] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        self._warned: dict[str, float] = {}

    # --- start ------------------------------------------------------------------------

    async def adopt(self) -> None:
        """Re-adopt the sandboxes the store holds for this host (before serving)."""
        data = await self._until_done(lambda: self.link.call("GET", "/v1/hosts/adoption"))
        records = []
        lost = []
        for r in data["records"]:
            if r["template"] is None:
                lost.append(r["sandbox_id"])
                continue
            records.append(
                AdoptionRecord(
                    r["sandbox_id"],
                    int(r["generation"]),
                    Template.model_validate(r["template"]),
                    SandboxState(r["state"]),
                    provider=r.get("provider"),
                )
            )
        lost += await self.provider.load_state(records)
        self._lost = lost
        log.info("re-adopted %d sandboxes, %d lost", len(records) - len(lost), len(lost))

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks.append(loop.create_task(self._run()))

    async def stop(self) -> None:
        await self.revocations.stop()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()

    async def _run(self) -> None:
        await self.register()
        lost = self._lost
        await self._until_done(lambda: self.link.call("POST", "/v1/hosts/recover", {"lost": lost}))
        await self.revocations.run_once()
        self.revocations.start()
        loop = asyncio.get_running_loop()
        self._tasks += [
            loop.create_task(self._heartbeats()),
            loop.create_task(self._reaper()),
            loop.create_task(self._reports()),
        ]
        self.ready = True

    async def register(self) -> None:
        data = await self._until_done(
            lambda: self.link.call("POST", "/v1/hosts/register", self.registration)
        )
        if data.get("was_lost"):
            log.warning(
                "this sandbox host (%s) had been declared lost: its sandboxes failed and are "
                "removed by the reaper",
                self.config.host_id,
            )

    async def _until_done(self, call: Callable[[], Any]) -> Any:
        """A call to the brokers, retried until one answers it (unreachable brokers, a
        refused key, a broker's own failure: each logged, at most every 10 s)."""
        while True:
            try:
                return await call()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._warn(exc)
            await asyncio.sleep(self.RETRY_SECONDS)

    def _warn(self, exc: Exception) -> None:
        """Log a failed call at most every 10 s per kind."""
        kind = type(exc).__name__
        now = time.monotonic()
        if now - self._warned.get(kind, -1e9) < 10:
            return
        self._warned[kind] = now
        if isinstance(exc, HostKeyRefused):
            log.error("the brokers refuse this host's key (%s): revoked or replaced?", exc)
        elif isinstance(exc, BrokerUnreachable):
            log.warning("the brokers are unreachable: %s", exc)
        elif isinstance(exc, SandlotError):
            log.warning("a broker refused a call: %s %s", exc.code, exc.message)
        else:
            log.exception("a call to the brokers failed", exc_info=exc)

    # --- loops ------------------------------------------------------------------------

    async def _heartbeats(self) -> None:
        body = {"capacity": self.registration["capacity"]}
        while True:
            await asyncio.sleep(self.config.heartbeat_seconds)
            sent = time.monotonic()
            try:
                data = await self.link.call("POST", "/v1/hosts/heartbeat", body)
                took = time.monotonic() - sent
                if took > self.config.lost_after_seconds / 4:
                    log.warning(
                        "a heartbeat took %.1f s (the brokers declare this host lost after "
                        "%.0f s without one)",
                        took,
                        self.config.lost_after_seconds,
                    )
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._warn(exc)
                continue
            if data["was"] is None:
                await self.register()
            elif data["was"] == "lost":
                log.warning(
                    "this sandbox host (%s) was declared lost meanwhile: its sandboxes "
                    "failed and are removed by the reaper",
                    self.config.host_id,
                )

    async def _reaper(self) -> None:
        while True:
            try:
                data = await self.link.call("POST", "/v1/hosts/reap", timeout=300.0)
                if data["report"]:
                    log.debug("reaper pass: %s", data["report"])
            except asyncio.CancelledError:
                raise
            except SandlotError as exc:
                if (exc.metadata or {}).get("reason") == "not_registered":
                    await self.register()
                else:
                    self._warn(exc)
            except Exception as exc:
                self._warn(exc)
            await asyncio.sleep(self.config.reaper_interval_seconds)

    def on_status(self, sandbox_id: str, status: ProviderStatus) -> None:
        """The provider's listener: the state goes to the brokers, in order, retried."""
        self._outbox.put_nowait((sandbox_id, status))

    async def _reports(self) -> None:
        while True:
            sandbox_id, status = await self._outbox.get()
            body = {
                "state": status.state.value,
                "last_event_sequence": status.last_event_sequence,
                "reason": status.reason,
            }
            path = f"/v1/hosts/sandboxes/{sandbox_id}/status"
            while True:
                try:
                    await self.link.call("POST", path, body)
                    break
                except asyncio.CancelledError:
                    raise
                except (BrokerUnreachable, HostKeyRefused) as exc:
                    self._warn(exc)
                except SandlotError as exc:
                    if (exc.metadata or {}).get("reason") == "not_registered":
                        await self.register()
                        continue
                    if exc.status < 500:
                        # Not (or no longer) a sandbox of this host: nothing to record.
                        log.info("state of %s not recorded: %s", sandbox_id, exc.message)
                        break
                    self._warn(exc)
                except Exception as exc:
                    self._warn(exc)
                await asyncio.sleep(self.RETRY_SECONDS)

    # --- the dataplane's questions ----------------------------------------------------

    async def check_api_key(self, api_key: str, sandbox_id: str) -> AuthContext | None:
        try:
            data = await self.link.call(
                "POST", "/v1/hosts/api-keys/check", {"api_key": api_key, "sandbox_id": sandbox_id}
            )
        except (BrokerUnreachable, HostKeyRefused, SandlotError):
            return None
        ctx = data.get("context")
        if ctx is None:
            return None
        return AuthContext(
            principal_id=ctx["principal_id"],
            actor=Actor.model_validate(ctx["actor"]),
            caps=frozenset(Capability(c) for c in ctx["caps"]),
            sandbox_id=ctx["sandbox_id"],
            generation=ctx["generation"],
            jti=ctx["jti"],
        )


def agent_app(
    settings: Any, link: BrokerLink, config: BrokerConfig, provider_url: str, credential: str
) -> Any:
    """The ASGI app of a host without the store: provider API, health, dataplane at ``/dp``."""
    from sandlot.broker.assembly import build_provider

    holder: list[HostAgent] = []
    # One line per call to the brokers (several a second) is noise, not news.
    logging.getLogger("httpx").setLevel(logging.WARNING)

    async def key_resolver(api_key: str, sandbox_id: str) -> AuthContext | None:
        return await holder[0].check_api_key(api_key, sandbox_id)

    provider = build_provider(
        settings,
        [],
        dataplane_url=settings.dataplane_url,
        jwks_source=link.jwks,
        key_resolver=key_resolver,
    )
    agent = HostAgent(
        link,
        config,
        provider,
        {
            "provider": provider.name,
            "provider_url": provider_url,
            "provider_secret": credential,
            "dataplane_url": settings.dataplane_url,
            "capacity": settings.host_capacity,
        },
    )
    holder.append(agent)

    async def readiness() -> tuple[bool, dict[str, Any]]:
        ready = agent.ready and bool(provider.readiness().get("ok"))
        return ready, {
            "ready": ready,
            "host": config.host_id,
            "brokers": {"registered": agent.ready},
            "provider": {"name": provider.name},
        }

    @contextlib.asynccontextmanager
    async def lifespan(_app: Any) -> AsyncIterator[None]:
        await provider.start(agent.on_status)
        await agent.adopt()
        agent.start()
        try:
            yield
        finally:
            await agent.stop()
            await provider.close()
            await link.close()

    return host_frame(provider, credential, readiness, lifespan)


def host_frame(
    provider: Provider,
    credential: str,
    readiness: Callable[[], Awaitable[tuple[bool, dict[str, Any]]]],
    lifespan: Callable[[Any], contextlib.AbstractAsyncContextManager[None]],
) -> Any:
    """A sandbox host's app, with or without the store: the provider API for the brokers,
    ``/healthz``, ``/readyz`` (``readiness``: ready, and the body), error envelopes, and
    the provider's dataplane at ``/dp``."""
    from fastapi.responses import JSONResponse

    from sandlot.broker.app import MountDispatch, RequestIdMiddleware
    from sandlot.broker.routes.errors import error_response
    from sandlot.providers.remote import provider_router

    app = FastAPI(title="sandlot host", openapi_url=None, docs_url=None, redoc_url=None)

    @app.exception_handler(SandlotError)
    async def _sandlot_error(request: Request, exc: SandlotError) -> JSONResponse:
        return error_response(request, exc)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        return error_response(request, InternalError("internal error"))

    @app.get("/healthz")
    async def healthz() -> Any:
        return {"ok": True}

    @app.get("/readyz")
    async def readyz() -> Any:
        ready, body = await readiness()
        return JSONResponse(body, status_code=200 if ready else 503)

    app.include_router(provider_router(provider, credential))
    app.add_middleware(RequestIdMiddleware)
    app.router.lifespan_context = lifespan
    dataplane = getattr(provider, "app", None)
    return MountDispatch(app, {"/dp": dataplane}) if dataplane else app
