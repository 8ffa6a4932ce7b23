"""Behavioural fakes of *providers* (outside the broker): slow, never ready, crashing.

They stand in for infrastructure the broker does not own, to test how the
broker handles its faults. The broker itself is always the real one.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Mapping, Sequence
from typing import Any

from sandlot.protocol.errors import ProviderUnavailable, SandboxNotFound
from sandlot.protocol.sessions import DataplaneCoordinates
from sandlot.protocol.states import SandboxState
from sandlot.providers.base import (
    AdoptionRecord,
    Provider,
    ProviderStatus,
    RevokedToken,
    SandboxActivity,
    SandboxSpec,
    StatusListener,
)


class FakeProvider(Provider):
    name = "fake"
    supports_suspend = True

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        config = config or {}
        self.ready_after: float = config.get("ready_after", 0.0)
        self.never_ready: bool = config.get("never_ready", False)
        self.crash_on_create: bool = config.get("crash_on_create", False)
        self.fail_async: bool = config.get("fail_async", False)
        self.states: dict[str, SandboxState] = {}
        self.seq: dict[str, int] = {}
        self.revoked: list[RevokedToken] = []
        self.busy: set[str] = set()
        self.deleted: list[str] = []
        self.created: list[str] = []
        self.listener: StatusListener | None = None

    async def start(self, listener: StatusListener | None = None) -> None:
        self.listener = listener

    def _set(self, sid: str, state: SandboxState) -> None:
        self.states[sid] = state
        self.seq[sid] = self.seq.get(sid, 0) + 1

    async def _emit(self, sid: str) -> None:
        if self.listener is not None:
            res = self.listener(sid, await self.status(sid))
            if inspect.isawaitable(res):
                await res

    async def create(self, spec: SandboxSpec) -> ProviderStatus:
        if self.crash_on_create:
            raise RuntimeError("provider crashed")
        sid = spec.sandbox_id
        self.created.append(sid)
        self._set(sid, SandboxState.PROVISIONING)
        if not self.never_ready:
            asyncio.get_running_loop().create_task(self._finish(sid))
        return await self.status(sid)

    async def _finish(self, sid: str) -> None:
        await asyncio.sleep(self.ready_after)
        if sid not in self.states:
            return
        self._set(sid, SandboxState.FAILED if self.fail_async else SandboxState.ACTIVE)
        await self._emit(sid)

    async def status(self, sandbox_id: str) -> ProviderStatus:
        if sandbox_id not in self.states:
            raise SandboxNotFound(sandbox_id)
        return ProviderStatus(self.states[sandbox_id], self.seq[sandbox_id])

    async def suspend(self, sandbox_id: str) -> ProviderStatus:
        self._set(sandbox_id, SandboxState.SUSPENDED)
        return await self.status(sandbox_id)

    async def resume(self, sandbox_id: str) -> ProviderStatus:
        self._set(sandbox_id, SandboxState.ACTIVE)
        return await self.status(sandbox_id)

    async def delete(self, sandbox_id: str) -> None:
        self.states.pop(sandbox_id, None)
        self.deleted.append(sandbox_id)

    def dataplane(self, sandbox_id: str) -> DataplaneCoordinates:
        return DataplaneCoordinates(
            http_base_url=f"http://fake/dp/{sandbox_id}/v1",
            ws_base_url=f"ws://fake/dp/{sandbox_id}/v1",
        )

    async def revoke(self, sandbox_id: str, tokens: Sequence[RevokedToken]) -> None:
        self.revoked.extend(tokens)

    async def activity(self, sandbox_id: str) -> SandboxActivity:
        return SandboxActivity(running_execs=1 if sandbox_id in self.busy else 0)

    async def load_state(self, records: Sequence[AdoptionRecord]) -> list[str]:
        return [r.sandbox_id for r in records if r.sandbox_id not in self.states]

    async def list_sandboxes(self) -> set[str]:
        return set(self.states)


class DownProvider(FakeProvider):
    async def create(self, spec: SandboxSpec) -> ProviderStatus:
        raise ProviderUnavailable("provider is down")


class ClaimingProvider(FakeProvider):
    """A provider that records pool claims on its sandboxes, as a shared engine's labels
    do: a sandbox is claimed once; ``taken_elsewhere`` are claimed by another broker."""

    claims_pooled = True

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        super().__init__(config)
        self.claimed: dict[str, int] = {}
        self.released: list[str] = []
        self.taken_elsewhere: set[str] = set()

    async def claim_pooled(self, sandbox_id: str) -> bool:
        await asyncio.sleep(0)  # a round trip: other claimers run meanwhile
        if sandbox_id in self.taken_elsewhere or self.claimed.get(sandbox_id):
            return False
        self.claimed[sandbox_id] = 1
        return True

    async def release_pooled(self, sandbox_id: str, pool: str) -> None:
        assert self.claimed.get(sandbox_id) == 1, f"{sandbox_id} released unclaimed"
        self.claimed[sandbox_id] = 0
        self.released.append(sandbox_id)


class SlowListingProvider(FakeProvider):
    """A provider whose listing is answered late: what it returns was true when it began,
    and :attr:`meanwhile` runs before it returns (work of a busy server, say)."""

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        super().__init__(config)
        self.meanwhile: Any = None

    async def list_sandboxes(self) -> set[str]:
        listed = set(self.states)
        if self.meanwhile is not None:
            await self.meanwhile()
        return listed
