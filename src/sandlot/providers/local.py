"""The ``local`` provider: sandboxes on this machine, served by an in-process dataplane.

Config keys (``[provider]`` in the server's configuration, plus what the
embedded server wires in):

- ``mode``: ``isolated`` (namespaces, cgroups, seccomp; the default) or
  ``unisolated`` (plain processes in a workspace directory; warns on every start).
- ``data_dir``: where run directories, workspaces and named volumes live.
- ``public_url``: the base URL clients reach this server at (dataplane URLs
  are ``{public_url}/dp/{sandbox_id}/v1``).
- ``issuer`` and ``jwks``: the broker's issuer and an async callable returning
  its JWKS (tokens are verified exactly as a remote dataplane would).
- ``api_key_resolver``: lets the LangSmith-compatible surface accept API keys.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from sandlot.dataplane.http.host import DataplaneHost
from sandlot.dataplane.services.auth import TokenVerifier
from sandlot.dataplane.settings import DataplaneSettings
from sandlot.protocol.errors import InvalidRequest, ProviderUnavailable, SandboxNotFound
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
from sandlot.runtime.base import SandboxRuntime
from sandlot.runtime.local import LocalRuntimeManager, RuntimeSettings, RuntimeUnavailable

log = logging.getLogger("sandlot.providers.local")


class LocalProvider(Provider):
    name = "local"

    def __init__(self, config: Mapping[str, Any]) -> None:
        self.mode = str(config.get("mode", "isolated"))
        if self.mode not in ("isolated", "unisolated"):
            raise InvalidRequest("local provider mode must be 'isolated' or 'unisolated'")
        self.supports_suspend = True
        data_dir = Path(config.get("data_dir", ".sandlot")).absolute()
        self.public_url = str(config.get("public_url", "http://127.0.0.1:8765")).rstrip("/")
        self.manager = LocalRuntimeManager(
            RuntimeSettings(
                run_dir=data_dir / "run",
                workspaces_dir=data_dir / "workspaces",
                volumes_dir=data_dir / "volumes",
                mode=self.mode,  # type: ignore[arg-type]
            )
        )
        self.volumes_dir = data_dir / "volumes"
        jwks = config.get("jwks")
        if jwks is None:
            raise InvalidRequest("the local provider needs the broker's JWKS source")
        self.verifier = TokenVerifier(jwks, issuer=str(config["issuer"]))
        self.host = DataplaneHost(
            verifier=self.verifier,
            settings=config.get("dataplane_settings") or DataplaneSettings.from_env(),
            api_key_resolver=config.get("api_key_resolver"),
        )
        self._listener: StatusListener | None = None
        self._runtimes: dict[str, SandboxRuntime] = {}
        self._specs: dict[str, SandboxSpec] = {}
        self._creating: dict[str, asyncio.Task[None]] = {}
        self._failed: dict[str, str] = {}
        self._lock = asyncio.Lock()

    # --- lifecycle of the provider --------------------------------------------------

    async def start(self, listener: StatusListener | None = None) -> None:
        self._listener = listener
        try:
            await asyncio.to_thread(self.manager.preflight)
        except RuntimeUnavailable as exc:
            raise ProviderUnavailable(str(exc)) from exc
        if self.mode == "unisolated":
            log.warning(
                "UNISOLATED MODE: sandboxes are plain processes with the server's rights "
                "and see the whole host, with no disk limit (templates' disk_mb is ignored: "
                "a sandbox can fill the host's filesystem). Use it only on a machine without "
                "namespaces."
            )

    async def close(self) -> None:
        for task in list(self._creating.values()):
            task.cancel()
        await self.host.close()

    @property
    def app(self) -> Any:
        """The dataplane ASGI app; the embedded server mounts it at ``/dp``."""
        return self.host.app

    def readiness(self) -> dict[str, Any]:
        return {"ok": True, "mode": self.mode, "sandboxes": len(self._runtimes)}

    async def _notify(self, sandbox_id: str) -> None:
        await self.report_status(self._listener, sandbox_id)

    # --- the contract -----------------------------------------------------------------

    def _volume_paths(self, template: Template) -> dict[str, Path]:
        paths = {}
        for vm in template.volume_mounts:
            path = self.volumes_dir / vm.volume
            path.mkdir(parents=True, exist_ok=True)
            paths[vm.volume] = path
        return paths

    async def create(self, spec: SandboxSpec) -> ProviderStatus:
        sid = spec.sandbox_id
        if sid in self._runtimes or sid in self._creating:
            return await self.status(sid)
        self._specs[sid] = spec
        self.host.register(sid, spec.generation, SandboxState.PROVISIONING)
        task = asyncio.get_running_loop().create_task(self._create(spec))
        self._creating[sid] = task
        task.add_done_callback(lambda _t: self._creating.pop(sid, None))
        return await self.status(sid)

    async def _create(self, spec: SandboxSpec) -> None:
        sid = spec.sandbox_id
        try:
            runtime = await self.manager.create(
                sid, spec.generation, spec.template, self._volume_paths(spec.template)
            )
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.error("creating sandbox %s failed: %s", sid, exc)
            self._failed[sid] = str(exc)
            with contextlib.suppress(SandboxNotFound):
                self.host.set_state(sid, SandboxState.FAILED, reason=str(exc)[:500])
            await self._notify(sid)
            return
        if sid not in self._specs:  # deleted while it was being created
            await self.manager.destroy(sid)
            return
        self._runtimes[sid] = runtime
        self.host.set_runtime(sid, runtime)
        self.host.set_state(sid, SandboxState.ACTIVE, reason="ready")
        await self._notify(sid)

    async def status(self, sandbox_id: str) -> ProviderStatus:
        try:
            state, seq = self.host.status(sandbox_id)
        except KeyError as exc:
            raise SandboxNotFound(f"no sandbox {sandbox_id}") from exc
        return ProviderStatus(state, seq, self._failed.get(sandbox_id))

    def _runtime(self, sandbox_id: str) -> SandboxRuntime:
        rt = self._runtimes.get(sandbox_id)
        if rt is None:
            raise SandboxNotFound(f"no running sandbox {sandbox_id}")
        return rt

    async def suspend(self, sandbox_id: str) -> ProviderStatus:
        rt = self._runtime(sandbox_id)
        await self.manager.suspend(rt)
        self.host.set_state(sandbox_id, SandboxState.SUSPENDED, reason="suspended")
        return await self.status(sandbox_id)

    async def resume(self, sandbox_id: str) -> ProviderStatus:
        rt = self._runtime(sandbox_id)
        await self.manager.resume(rt)
        self.host.set_state(sandbox_id, SandboxState.ACTIVE, reason="resumed")
        await self.host.readopt(sandbox_id)
        return await self.status(sandbox_id)

    async def delete(self, sandbox_id: str) -> None:
        self._specs.pop(sandbox_id, None)
        task = self._creating.pop(sandbox_id, None)
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        with contextlib.suppress(SandboxNotFound):
            self.host.set_state(sandbox_id, SandboxState.TERMINATED, reason="deleted")
        await self.host.unregister(sandbox_id)
        self._runtimes.pop(sandbox_id, None)
        self._failed.pop(sandbox_id, None)
        # Named volumes are separate mounts; the workspace always belongs to the sandbox.
        await self.manager.destroy(sandbox_id)

    def dataplane(self, sandbox_id: str) -> DataplaneCoordinates:
        http = f"{self.public_url}/dp/{sandbox_id}/v1"
        ws = "ws" + http[4:] if http.startswith("http") else http
        return DataplaneCoordinates(http_base_url=http, ws_base_url=ws)

    async def revoke(self, sandbox_id: str, tokens: Sequence[RevokedToken]) -> None:
        self.host.revoke(tokens)

    async def activity(self, sandbox_id: str) -> SandboxActivity:
        try:
            return self.host.activity(sandbox_id)
        except KeyError as exc:
            raise SandboxNotFound(f"no sandbox {sandbox_id}") from exc

    async def load_state(self, records: Sequence[AdoptionRecord]) -> list[str]:
        lost: list[str] = []
        adopted: set[str] = set()
        for rec in records:
            if rec.state is SandboxState.PROVISIONING:
                lost.append(rec.sandbox_id)
                continue
            try:
                runtime = await self.manager.adopt(rec.sandbox_id, rec.generation, rec.template)
            except Exception:
                log.exception("could not re-adopt %s", rec.sandbox_id)
                runtime = None
            if runtime is None:
                lost.append(rec.sandbox_id)
                continue
            spec = SandboxSpec(rec.sandbox_id, rec.generation, rec.template)
            self._specs[rec.sandbox_id] = spec
            self._runtimes[rec.sandbox_id] = runtime
            state = runtime.state if runtime.state.live else SandboxState.ACTIVE
            self.host.register(rec.sandbox_id, rec.generation, SandboxState.PROVISIONING, runtime)
            self.host.set_state(rec.sandbox_id, state, reason="re-adopted after restart")
            if state is SandboxState.ACTIVE:
                # A frozen init answers nothing: a suspended sandbox's commands on resume.
                try:
                    await self.host.readopt(rec.sandbox_id)
                except Exception:
                    # Its files and shells are still served; the others' commands too.
                    log.exception("could not take over the commands of %s", rec.sandbox_id)
            adopted.add(rec.sandbox_id)
        await self.manager.cleanup_leftovers(keep=adopted)
        return lost

    async def list_sandboxes(self) -> set[str]:
        return set(self._specs) | self.manager.list_existing()
