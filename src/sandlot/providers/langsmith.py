"""The ``langsmith`` provider: a sandbox is a box of a hosted sandbox service (LangSmith
sandboxes, or any server with the same surface), served to clients through the broker's
relay.

Boxes are created and deleted through the service's control plane
(``POST/GET/DELETE {url}/boxes``, ``GET {url}/boxes/{name}/status``, ``X-Api-Key``).
The service cannot verify sandlot's tokens, so clients never reach a box: a sandbox's
dataplane is ``{public_url}/dp/{sandbox_id}/v1``, served by the relay
(:class:`~sandlot.providers.hostedrelay.HostedRelay`), which verifies each call's
token and calls the box's dataplane with the provider's key. The key is read from the
environment or a file, held by this process alone, and never logged, sent to a client
or put in a box.

Boxes are named ``sandlot-{instance}-{sandbox id}`` (``instance``: a hash of this
server's data directory): a restarted broker re-adopts its boxes by name, and the
reaper removes boxes of this instance that no live sandbox owns, never another's.

Config keys (``[providers.NAME]`` with ``kind = "langsmith"``, or ``[provider]`` with
``name = "langsmith"``):

- ``url``: the control plane, e.g. ``https://api.smith.langchain.com/v2/sandboxes``
  (required).
- ``api_key_env``: the environment variable holding the key (default
  ``LANGSMITH_API_KEY``); ``api_key_file``: a file holding it instead (wins).
- ``snapshots``: a table template name → the service's snapshot a box starts from;
  ``snapshot``: the snapshot of templates not in the table (default: none, the
  service's default).
- ``workspace``: the box's directory relative paths resolve from (default ``/workspace``).
- ``start_timeout_seconds``: how long a box may take to be ready (default 300).
- ``poll_seconds``: how often a starting box's status is read (default 0.5).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

from sandlot.dataplane.services.auth import TokenVerifier
from sandlot.protocol.errors import InvalidRequest, ProviderUnavailable, SandboxNotFound
from sandlot.protocol.sessions import DataplaneCoordinates, SandboxActivity
from sandlot.protocol.states import SandboxState
from sandlot.protocol.tokens import RevokedToken
from sandlot.providers.base import (
    AdoptionRecord,
    Provider,
    ProviderStatus,
    SandboxSpec,
    StatusListener,
)
from sandlot.providers.hostedbox import STREAM_TIMEOUT, Box, box_error
from sandlot.providers.hostedrelay import HostedRelay
from sandlot.providers.hostedstate import Hosted
from sandlot.sdk._async._wire import AsyncWire

log = logging.getLogger("sandlot.providers.langsmith")


def read_api_key(config: Mapping[str, Any]) -> str:
    """The service's key: ``api_key_file`` if set, else the variable ``api_key_env`` names."""
    path = config.get("api_key_file")
    if path:
        try:
            key = Path(str(path)).expanduser().read_text().strip()
        except OSError as exc:
            raise InvalidRequest(
                f"cannot read the langsmith api_key_file: {exc.strerror}"
            ) from None
    else:
        var = str(config.get("api_key_env", "LANGSMITH_API_KEY"))
        key = os.environ.get(var, "").strip()
        if not key:
            raise InvalidRequest(f"the langsmith provider's key is not set (environment {var})")
    if not key or any(c.isspace() for c in key):
        raise InvalidRequest("the langsmith provider's key is empty or malformed")
    return key


class LangSmithProvider(Provider):
    name = "langsmith"
    host_bound = False

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        super().__init__(config)
        cfg = self.config
        url = cfg.get("url")
        if not url:
            raise InvalidRequest("the langsmith provider needs its control plane's url")
        self.url = str(url).rstrip("/")
        self._key = read_api_key(cfg)
        self.snapshots: dict[str, str] = {
            str(k): str(v) for k, v in cfg.get("snapshots", {}).items()
        }
        self.snapshot: str | None = cfg.get("snapshot")
        self.workspace = str(cfg.get("workspace", "/workspace"))
        self.start_timeout = float(cfg.get("start_timeout_seconds", 300.0))
        self.poll = float(cfg.get("poll_seconds", 0.5))
        data_dir = Path(cfg.get("data_dir", ".sandlot")).absolute()
        self.instance = hashlib.sha256(str(data_dir).encode()).hexdigest()[:8]
        self.public_url = str(cfg.get("public_url", "http://127.0.0.1:8765")).rstrip("/")
        issuer, jwks = str(cfg.get("issuer", "")), cfg.get("jwks")
        if jwks is None or not issuer:
            raise InvalidRequest("the langsmith provider needs the broker's issuer and JWKS source")
        self.verifier = TokenVerifier(jwks, issuer=issuer)
        self._sandboxes: dict[str, Hosted] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._listener: StatusListener | None = None
        self._client: httpx.AsyncClient | None = None
        self._transfers: httpx.AsyncClient | None = None
        self._wire: AsyncWire | None = None
        #: The ASGI app the embedded server mounts at ``/dp``.
        self.app = HostedRelay(self._hosted, self.verifier)

    def __repr__(self) -> str:  # never the key
        return f"LangSmithProvider({self.url!r})"

    # --- lifecycle ------------------------------------------------------------------------

    async def start(self, listener: StatusListener | None = None) -> None:
        self._listener = listener
        # httpx notes every request at INFO: one line per relayed call is noise and time.
        logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().level))
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(60.0, connect=10.0, pool=10.0),
            limits=httpx.Limits(max_connections=200, max_keepalive_connections=50),
        )
        # Streamed uploads and downloads last as long as their clients take: a pool of
        # their own, so that however many are held they never starve the control plane
        # and the boxes' other calls (each sandbox holds at most MAX_TRANSFERS of them).
        self._transfers = httpx.AsyncClient(
            timeout=STREAM_TIMEOUT,
            limits=httpx.Limits(max_connections=200, max_keepalive_connections=20),
        )
        self._wire = AsyncWire()

    async def close(self) -> None:
        for task in list(self._tasks.values()):
            task.cancel()
        for task in list(self._tasks.values()):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self._client is not None:
            await self._client.aclose()
            self._client = None
        if self._transfers is not None:
            await self._transfers.aclose()
            self._transfers = None
        if self._wire is not None:
            await self._wire.aclose()
            self._wire = None

    def readiness(self) -> dict[str, Any]:
        return {"ok": self._client is not None, "sandboxes": len(self._sandboxes)}

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            raise ProviderUnavailable("the langsmith provider is not started")
        return self._client

    def _box(self, url: str) -> Box:
        return Box(
            url,
            self._key,
            self.client,
            workspace=self.workspace,
            wire=self._wire,
            transfers=self._transfers,
        )

    async def _control(
        self, method: str, route: str, json_body: Any = None, *, missing_ok: bool = False
    ) -> httpx.Response | None:
        """One control-plane call with the key; errors without the service's body."""
        try:
            resp = await self.client.request(
                method, f"{self.url}{route}", json=json_body, headers={"X-Api-Key": self._key}
            )
        except httpx.TransportError as exc:
            raise ProviderUnavailable("the hosted sandbox service is unreachable") from exc
        if resp.status_code == 404 and missing_ok:
            return None
        if resp.status_code >= 400:
            raise box_error(resp.status_code, resp.content)
        return resp

    # --- names ------------------------------------------------------------------------------

    def box_name(self, sandbox_id: str) -> str:
        return f"sandlot-{self.instance}-{sandbox_id.replace('_', '-')}".lower()

    def _sandbox_of(self, box_name: str) -> str | None:
        prefix = f"sandlot-{self.instance}-"
        if not box_name.startswith(prefix):
            return None
        rest = box_name[len(prefix) :]
        kind, _, ident = rest.partition("-")
        return f"{kind}_{ident}" if ident else None

    def _hosted(self, sandbox_id: str) -> Hosted:
        hosted = self._sandboxes.get(sandbox_id)
        if hosted is None:
            raise SandboxNotFound(f"no sandbox {sandbox_id}")
        return hosted

    # --- the contract -----------------------------------------------------------------------

    async def create(self, spec: SandboxSpec) -> ProviderStatus:
        sid = spec.sandbox_id
        hosted = self._sandboxes.get(sid)
        if hosted is not None and hosted.generation == spec.generation:
            return await self.status(sid)
        if hosted is not None:
            await self.delete(sid)
        self._sandboxes[sid] = Hosted(sid, spec.generation, spec.template)
        task = asyncio.get_running_loop().create_task(self._create(spec))
        self._tasks[sid] = task
        task.add_done_callback(lambda _t: self._tasks.pop(sid, None))
        return await self.status(sid)

    async def _create(self, spec: SandboxSpec) -> None:
        sid = spec.sandbox_id
        hosted = self._sandboxes[sid]
        name = self.box_name(sid)
        try:
            body: dict[str, Any] = {"name": name, "wait_for_ready": False}
            snapshot = self.snapshots.get(spec.template.name, self.snapshot)
            if snapshot:
                body["snapshot"] = snapshot
            resp = await self._control("POST", "/boxes", body)
            assert resp is not None
            doc = resp.json()
            hosted.box_name = name
            await self._wait_ready(name, doc)
            url = await self._dataplane_url(name, doc)
            hosted.box = self._box(url)
            hosted.state, hosted.reason = SandboxState.ACTIVE, "box ready"
            hosted.events.append(
                "sandbox.ready",
                "phase",
                {"from": "provisioning", "to": "active", "reason": "box ready"},
            )
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            reason = exc.message if hasattr(exc, "message") else type(exc).__name__
            log.warning("creating the box of %s failed: %s", sid, reason)
            hosted.state, hosted.reason = SandboxState.FAILED, str(reason)
        finally:
            hosted.settled.set()
        await self.report_status(self._listener, sid)

    async def _wait_ready(self, name: str, doc: Mapping[str, Any]) -> None:
        deadline = time.monotonic() + self.start_timeout
        status = str(doc.get("status", "provisioning"))
        while status != "ready":
            if status == "failed":
                raise ProviderUnavailable(f"the hosted service failed box {name}")
            if time.monotonic() > deadline:
                raise ProviderUnavailable(f"box {name} was not ready in {self.start_timeout:g} s")
            await asyncio.sleep(self.poll)
            resp = await self._control("GET", f"/boxes/{name}/status")
            assert resp is not None
            status = str(resp.json().get("status", ""))

    async def _dataplane_url(self, name: str, doc: Mapping[str, Any]) -> str:
        url = doc.get("dataplane_url")
        if not url:
            resp = await self._control("GET", f"/boxes/{name}")
            assert resp is not None
            url = resp.json().get("dataplane_url")
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ProviderUnavailable(f"box {name} has no dataplane url")
        return url

    async def status(self, sandbox_id: str) -> ProviderStatus:
        hosted = self._hosted(sandbox_id)
        return ProviderStatus(hosted.state, hosted.events.last_sequence, hosted.reason)

    async def delete(self, sandbox_id: str) -> None:
        hosted = self._sandboxes.pop(sandbox_id, None)
        task = self._tasks.pop(sandbox_id, None)
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if hosted is not None:
            hosted.state = SandboxState.TERMINATED
            hosted.settled.set()
            hosted.close()
            for shell in list(hosted.shells.values()):
                await shell.kill()
        await self._control("DELETE", f"/boxes/{self.box_name(sandbox_id)}", missing_ok=True)

    def dataplane(self, sandbox_id: str) -> DataplaneCoordinates:
        http = f"{self.public_url}/dp/{sandbox_id}/v1"
        ws = "ws" + http[4:] if http.startswith("http") else http
        return DataplaneCoordinates(http_base_url=http, ws_base_url=ws)

    async def revoke(self, sandbox_id: str, tokens: Sequence[RevokedToken]) -> None:
        self.verifier.revoke(tokens)
        await self.app.revoked([t.jti for t in tokens])

    async def activity(self, sandbox_id: str) -> SandboxActivity:
        hosted = self._hosted(sandbox_id)
        return SandboxActivity(
            running_execs=hosted.running,
            attached_clients=hosted.clients,
            last_active_at=hosted.last_active_at,
        )

    async def load_state(self, records: Sequence[AdoptionRecord]) -> list[str]:
        lost: list[str] = []
        for rec in records:
            name = self.box_name(rec.sandbox_id)
            try:
                resp = await self._control("GET", f"/boxes/{name}", missing_ok=True)
            except ProviderUnavailable:
                resp = None
            doc = resp.json() if resp is not None else {}
            if rec.state is SandboxState.PROVISIONING or doc.get("status") != "ready":
                lost.append(rec.sandbox_id)
                continue
            hosted = Hosted(rec.sandbox_id, rec.generation, rec.template)
            try:
                url = await self._dataplane_url(name, doc)
            except ProviderUnavailable:
                lost.append(rec.sandbox_id)
                continue
            hosted.box_name = name
            hosted.box = self._box(url)
            hosted.state, hosted.reason = SandboxState.ACTIVE, "re-adopted after restart"
            hosted.settled.set()
            self._sandboxes[rec.sandbox_id] = hosted
        return lost

    async def list_sandboxes(self) -> set[str]:
        resp = await self._control("GET", "/boxes")
        assert resp is not None
        doc = resp.json()
        boxes = doc.get("sandboxes") or doc.get("boxes") or [] if isinstance(doc, dict) else doc
        found = {self._sandbox_of(str(b.get("name", ""))) for b in boxes if isinstance(b, dict)}
        return set(self._sandboxes) | {s for s in found if s}


__all__ = ["LangSmithProvider", "read_api_key"]
