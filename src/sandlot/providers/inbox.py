"""What the providers whose dataplane runs inside the sandbox share (``docker``,
``kubernetes``).

Such a sandbox's dataplane verifies the broker's tokens itself, from a trust directory
the provider keeps up to date (the broker's keys, the revoked tokens), and clients reach
it through the server's relay at ``/dp`` (:class:`~sandlot.providers.socketrelay.SocketRelay`).
:class:`InboxProvider` holds the per-sandbox records (:class:`InboxSandbox`), creation in
the background, the relay's lookups, the status and activity read from the dataplane's
``/__control/status``, the refresh of the broker's keys and the bookkeeping of
revocations; each provider brings how its sandboxes are made, watched and removed, and
how their trust directory is written.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import json
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, ClassVar, Generic, TypeVar

import httpx

from sandlot.protocol.errors import ProviderUnavailable, SandboxNotFound, SandboxStarting
from sandlot.protocol.sessions import DataplaneCoordinates, SandboxActivity
from sandlot.protocol.states import SandboxState
from sandlot.protocol.tokens import RevokedToken
from sandlot.providers.base import Provider, ProviderStatus, SandboxSpec, StatusListener
from sandlot.providers.socketrelay import SocketRelay, TcpUpstream, Upstream

JwksSource = Callable[[], Awaitable[Mapping[str, Any]]]

STATUS = "/__control/status"
#: Seconds a status read may take in all, where the provider sets no ``status_timeout``.
STATUS_SECONDS = 10.0
#: Seconds an activity read may take in all (the reaper waits for it).
ACTIVITY_SECONDS = 5.0


class InboxSandbox:
    """What the provider knows of one sandbox."""

    def __init__(self, spec: SandboxSpec, state: SandboxState) -> None:
        self.spec = spec
        self.state = state
        self.reason: str | None = None
        #: A failed sandbox's typed reason (``OOM``…), given as the relay's error's
        #: ``metadata.reason``.
        self.failure: str | None = None
        self.upstream: Upstream | TcpUpstream | None = None
        self.last_event_sequence = 0
        self.revoked: dict[str, float] = {}
        #: Set once creation ended (ready or failed) or the sandbox was deleted.
        self.settled = asyncio.Event()

    def note_revoked(self, tokens: Sequence[RevokedToken]) -> dict[str, Any]:
        """Add ``tokens`` to its revocations (dropping those expired over a minute ago);
        the document of the trust directory's ``revoked.json``."""
        now = time.time()
        self.revoked = {j: e for j, e in self.revoked.items() if e > now - 60}
        self.revoked.update({t.jti: t.expires_at for t in tokens})
        return {"revoked": [{"jti": j, "expires_at": e} for j, e in self.revoked.items()]}


BoxT = TypeVar("BoxT", bound=InboxSandbox)


class InboxProvider(Provider, Generic[BoxT]):
    """A provider of sandboxes whose dataplane runs inside them (see the module)."""

    #: How long :meth:`status` waits for the dataplane (None: the upstream's own limits).
    status_timeout: ClassVar[float | None] = None
    #: What a failed status read passes over (then :meth:`_unanswered` is called).
    status_errors: ClassVar[tuple[type[Exception], ...]] = (httpx.TransportError,)

    start_timeout: float
    jwks_refresh: float
    public_url: str
    _jwks: JwksSource

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        super().__init__(config)
        self._jwks_text = ""
        self._listener: StatusListener | None = None
        self._sandboxes: dict[str, BoxT] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._refresher: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closing = threading.Event()
        #: The ASGI app the embedded server mounts at ``/dp``.
        self.app = SocketRelay(self._upstream, until_started=self._until_started)

    @property
    def _log(self) -> logging.Logger:
        return logging.getLogger(f"sandlot.providers.{self.name}")

    # --- what each provider brings --------------------------------------------------------

    @abc.abstractmethod
    def _new_box(self, spec: SandboxSpec, state: SandboxState) -> BoxT:
        """A fresh record of a sandbox."""

    @abc.abstractmethod
    async def _create(self, spec: SandboxSpec) -> None:
        """Make the sandbox (in the background); its record tells how it went."""

    @abc.abstractmethod
    async def _remove(self, sandbox_id: str) -> None:
        """Everything the sandbox had (idempotent)."""

    @abc.abstractmethod
    async def _write_keys(self, sandbox_id: str, doc: Mapping[str, Any]) -> None:
        """Give the sandbox's trust directory the broker's new keys (failures passed over)."""

    def _check_serving(self, box: BoxT) -> None:
        """Raise what the relay should answer for a sandbox that has an upstream but
        should not be reached (the provider's own states)."""

    async def _unanswered(self, sandbox_id: str, box: BoxT) -> None:
        """The dataplane of an active sandbox did not answer a status read."""

    def _forget(self, box: BoxT) -> None:
        """The sandbox is deleted or the provider closes: its own pending work ends."""

    async def _control_headers(self, box: BoxT) -> Mapping[str, str]:
        """What a call to the dataplane's control routes carries (its control key)."""
        return {}

    # --- shared -----------------------------------------------------------------------------

    async def _notify(self, sandbox_id: str) -> None:
        await self.report_status(self._listener, sandbox_id)

    async def _close_sandboxes(self) -> None:
        """Stop refreshing keys and creating sandboxes; close every upstream."""
        if self._refresher is not None:
            self._refresher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._refresher
        for task in list(self._tasks.values()):
            task.cancel()
        for box in self._sandboxes.values():
            self._forget(box)
            if box.upstream is not None:
                await box.upstream.close()
                box.upstream = None

    async def _refresh_keys(self) -> bool:
        """Fetch the broker's keys; rewrite every sandbox's copy if they changed."""
        doc = await self._jwks()
        text = json.dumps(doc, sort_keys=True)
        if text == self._jwks_text:
            return False
        self._jwks_text = text
        for sandbox_id in list(self._sandboxes):
            await self._write_keys(sandbox_id, doc)
        return True

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(self.jwks_refresh)
            try:
                await self._refresh_keys()
            except Exception:
                self._log.exception("refreshing the broker's keys failed")

    def _box(self, sandbox_id: str) -> BoxT:
        box = self._sandboxes.get(sandbox_id)
        if box is None:
            raise SandboxNotFound(f"no sandbox {sandbox_id}")
        return box

    async def _until_started(self, sandbox_id: str) -> None:
        """Wait while the sandbox is being created (bounded by the start timeout)."""
        box = self._sandboxes.get(sandbox_id)
        if box is None or box.state is not SandboxState.PROVISIONING:
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(box.settled.wait(), self.start_timeout)

    def _upstream(self, sandbox_id: str) -> Upstream | TcpUpstream:
        box = self._box(sandbox_id)
        if box.state is SandboxState.PROVISIONING or box.upstream is None:
            if box.state is SandboxState.FAILED:
                metadata = {"reason": box.failure} if box.failure else None
                raise ProviderUnavailable(box.reason or "the sandbox failed", metadata=metadata)
            raise SandboxStarting("sandbox is starting", retry_after=1.0)
        self._check_serving(box)
        if not box.state.live:
            raise SandboxNotFound("sandbox is no longer running")
        return box.upstream

    # --- the contract -----------------------------------------------------------------------

    async def create(self, spec: SandboxSpec) -> ProviderStatus:
        sid = spec.sandbox_id
        box = self._sandboxes.get(sid)
        if box is not None and box.spec.generation == spec.generation:
            return await self.status(sid)
        if box is not None:
            await self.delete(sid)
        self._sandboxes[sid] = self._new_box(spec, SandboxState.PROVISIONING)
        task = asyncio.get_running_loop().create_task(self._create(spec))
        self._tasks[sid] = task
        task.add_done_callback(lambda _t: self._tasks.pop(sid, None))
        return await self.status(sid)

    async def status(self, sandbox_id: str) -> ProviderStatus:
        box = self._box(sandbox_id)
        if box.state is SandboxState.ACTIVE and box.upstream is not None:
            timeout = (
                httpx.USE_CLIENT_DEFAULT if self.status_timeout is None else self.status_timeout
            )
            try:
                # The whole answer within the deadline, not each read: a dataplane that
                # answered a byte at a time held the caller (the reaper, a resume).
                async with asyncio.timeout(self.status_timeout or STATUS_SECONDS):
                    headers = await self._control_headers(box)
                    resp = await box.upstream.client.get(STATUS, headers=headers, timeout=timeout)
                    if resp.status_code == 200:
                        box.last_event_sequence = _sequence(resp.json())
            except self.status_errors:
                await self._unanswered(sandbox_id, box)
            except (TimeoutError, ValueError):
                await self._unanswered(sandbox_id, box)
        return ProviderStatus(box.state, box.last_event_sequence, box.reason)

    async def delete(self, sandbox_id: str) -> None:
        box = self._sandboxes.pop(sandbox_id, None)
        task = self._tasks.pop(sandbox_id, None)
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if box is not None:
            box.settled.set()
            self._forget(box)
            if box.upstream is not None:
                await box.upstream.close()
        await self._remove(sandbox_id)

    def dataplane(self, sandbox_id: str) -> DataplaneCoordinates:
        http = f"{self.public_url}/dp/{sandbox_id}/v1"
        ws = "ws" + http[4:] if http.startswith("http") else http
        return DataplaneCoordinates(http_base_url=http, ws_base_url=ws)

    async def activity(self, sandbox_id: str) -> SandboxActivity:
        """What the dataplane in the sandbox reports (nothing unless it is active)."""
        box = self._box(sandbox_id)
        if box.state is not SandboxState.ACTIVE or box.upstream is None:
            return SandboxActivity()
        try:
            async with asyncio.timeout(ACTIVITY_SECONDS):
                headers = await self._control_headers(box)
                resp = await box.upstream.client.get(
                    STATUS, headers=headers, timeout=ACTIVITY_SECONDS
                )
                doc = resp.json() if resp.status_code == 200 else {}
            if not isinstance(doc, dict):
                raise ValueError("the status is not an object")
            last = doc.get("last_active_at")
            return SandboxActivity(
                running_execs=int(doc.get("running_execs", 0)),
                attached_clients=int(doc.get("attached_clients", 0)),
                last_active_at=float(last) if last is not None else None,
            )
        except (httpx.TransportError, TimeoutError, ValueError, TypeError):
            # Nothing the dataplane says (in time, or at all) is no activity.
            return SandboxActivity()


def _sequence(doc: Any) -> int:
    """The status's ``last_event_sequence`` (ValueError: not one)."""
    value = doc.get("last_event_sequence") if isinstance(doc, dict) else None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"not an event sequence: {value!r}")
    return value


__all__ = ["InboxProvider", "InboxSandbox", "JwksSource"]
