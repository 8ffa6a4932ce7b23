"""What the broker's relay keeps of each hosted sandbox (:class:`Hosted`: its box, the
commands and shells started through the relay, its event log) and how a request is
authorized there (:func:`authorize`): see :mod:`sandlot.providers.hostedrelay`."""

from __future__ import annotations

import asyncio
import secrets
import shlex
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request

from sandlot.dataplane.services.auth import AuthContext, TokenVerifier, bearer_from_header
from sandlot.dataplane.services.events import EventLog
from sandlot.protocol.common import Actor, Capability, rfc3339
from sandlot.protocol.errors import (
    ExecNotFound,
    RateLimited,
    SandboxNotFound,
    SandboxStarting,
    Unauthenticated,
)
from sandlot.protocol.sessions import Template
from sandlot.protocol.states import SandboxState
from sandlot.providers.hostedbox import Box


@dataclass
class RelayExec:
    """A command started through the relay (what ``/execs`` reports)."""

    exec_id: str
    command_id: str
    command: str | list[str]
    actor: Actor | None
    pty: bool = False
    pid: int | None = None
    state: str = "running"
    exit_code: int | None = None
    started_at: float = field(default_factory=time.time)
    ended_at: float | None = None
    stdout_offset: int = 0
    stderr_offset: int = 0
    result: dict[str, Any] | None = None
    kill_on_disconnect: bool = False
    #: Clients attached through the relay right now.
    clients: int = 0

    def snapshot(self, last_event_sequence: int) -> dict[str, Any]:
        return {
            "exec_id": self.exec_id,
            "command_id": self.command_id,
            "command": self.command,
            "actor": self.actor.model_dump(mode="json") if self.actor else None,
            "state": self.state,
            "exit_code": self.exit_code,
            "signal": None,
            "oom_killed": False,
            "pty": self.pty,
            "started_at": rfc3339(self.started_at),
            "ended_at": rfc3339(self.ended_at) if self.ended_at else None,
            "stdout_offset": self.stdout_offset,
            "stderr_offset": self.stderr_offset,
            "last_event_sequence": last_event_sequence,
        }


#: Finished commands a sandbox's relay remembers (for ``/execs`` and reattaches); past
#: it, the oldest finished ones without a client are forgotten, as the dataplane does.
MAX_RELAY_EXECS = 1_000
#: Streamed uploads and downloads one sandbox may have open at once: each holds a
#: connection to the service for as long as its client takes, and the pool they share
#: is every sandbox's.
MAX_TRANSFERS = 16


class Hosted:
    """What the relay knows of one sandbox (one box)."""

    def __init__(self, sandbox_id: str, generation: int, template: Template) -> None:
        self.sandbox_id = sandbox_id
        self.generation = generation
        self.template = template
        self.box: Box | None = None
        self.box_name: str | None = None
        self.state = SandboxState.PROVISIONING
        self.reason: str | None = None
        self.events = EventLog(sandbox_id, 10_000, lambda: self.state.value)
        self.execs: dict[str, RelayExec] = {}
        self.by_command: dict[str, str] = {}
        self.shells: dict[str, Any] = {}
        self.last_active_at = time.time()
        self.running = 0
        self.clients = 0
        #: Streamed transfers open now (at most :data:`MAX_TRANSFERS`).
        self.transfers = 0
        self.settled = asyncio.Event()
        #: Commands followed by the relay while no client watches them.
        self.watchers: set[asyncio.Task[None]] = set()

    def watch(self, ex: RelayExec, follow: Any) -> None:
        """Follow ``ex`` with ``follow`` (a coroutine) until it ends, unless a client does."""
        task = asyncio.get_running_loop().create_task(follow)
        self.watchers.add(task)
        task.add_done_callback(self.watchers.discard)

    def take_transfer(self) -> None:
        """Hold one of the sandbox's transfer slots (429 when all are held): give it back
        with :meth:`give_transfer` however the transfer ends."""
        if self.transfers >= MAX_TRANSFERS:
            raise RateLimited(
                f"at most {MAX_TRANSFERS} uploads and downloads at once per sandbox",
                metadata={"limit": MAX_TRANSFERS},
                retry_after=1.0,
            )
        self.transfers += 1

    def give_transfer(self) -> None:
        self.transfers -= 1

    def close(self) -> None:
        for task in list(self.watchers):
            task.cancel()

    def ready(self) -> Box:
        if self.state is SandboxState.PROVISIONING or self.box is None:
            if self.state is SandboxState.FAILED:
                raise SandboxNotFound(self.reason or "the sandbox failed")
            raise SandboxStarting("sandbox is starting", retry_after=1.0)
        if self.state is SandboxState.SUSPENDED:
            raise SandboxStarting("sandbox is suspended", retry_after=1.0)
        if not self.state.live:
            raise SandboxNotFound("sandbox is no longer running")
        self.last_active_at = time.time()
        return self.box

    def new_exec(
        self, command: str | list[str], command_id: str | None, actor: Actor | None, pty: bool
    ) -> RelayExec:
        # One draw of randomness for both ids (each draw is a system call).
        token = secrets.token_hex(18)
        ex = RelayExec(f"ex_{token[:20]}", command_id or f"cmd_{token[20:]}", command, actor, pty)
        if len(self.execs) >= MAX_RELAY_EXECS:
            self._forget_finished(len(self.execs) - MAX_RELAY_EXECS * 9 // 10)
        self.execs[ex.exec_id] = ex
        self.by_command[ex.command_id] = ex.exec_id
        self.running += 1
        self.events.append(
            "exec.started", "exec", {"exec_id": ex.exec_id, "command_id": ex.command_id}, actor
        )
        return ex

    def _forget_finished(self, count: int) -> None:
        """Forget up to ``count`` of the oldest finished commands no client watches."""
        done = [e for e in self.execs.values() if e.state != "running" and e.clients == 0]
        for e in done[:count]:
            del self.execs[e.exec_id]
            if self.by_command.get(e.command_id) == e.exec_id:
                del self.by_command[e.command_id]

    def ended(self, ex: RelayExec, exit_code: int | None, *, state: str = "exited") -> None:
        if ex.state != "running":
            return
        ex.state, ex.exit_code, ex.ended_at = state, exit_code, time.time()
        self.running -= 1
        self.events.append(
            f"exec.{state}", "exec", {"exec_id": ex.exec_id, "exit_code": exit_code}, ex.actor
        )

    def changed(self, path: str, op: str, actor: Actor) -> None:
        self.events.append(f"fs.{op}", "fs", {"path": path, "op": op}, actor)

    def find_exec(self, exec_id: str) -> RelayExec:
        ex = self.execs.get(exec_id) or self.execs.get(self.by_command.get(exec_id, ""))
        if ex is None:
            raise ExecNotFound(f"no exec {exec_id}")
        return ex


#: Sandbox id → what the relay knows of it (raises ``SandboxNotFound``).
HostedLookup = Callable[[str], Hosted]
#: Closes one socket (or ends one stream) of the relay, saying why.
SocketCloser = Callable[[str], Coroutine[Any, Any, None]]

_background: set[asyncio.Task[None]] = set()


class RelayCore:
    """What every route of the relay shares: the sandboxes, the token verifier, the
    sockets open per token (closed when it is revoked or expires)."""

    def __init__(self, lookup: HostedLookup, verifier: TokenVerifier) -> None:
        self.lookup = lookup
        self.verifier = verifier
        #: The sockets open per token id (closed when it is revoked).
        self.sockets: dict[str, set[Tracked]] = {}

    async def authenticate(
        self, hosted: Hosted, bearer: str | None, capability: Capability
    ) -> AuthContext:
        if bearer is None:
            raise Unauthenticated("a sandbox token is required")
        return await self.verifier.verify(
            bearer,
            sandbox_id=hosted.sandbox_id,
            generation=hosted.generation,
            capability=capability,
        )

    def track(self, ctx: AuthContext, closer: SocketCloser) -> Tracked:
        """Follow a socket (or stream) opened with ``ctx``: ``closer`` closes it when its
        token is revoked or expires, as the dataplane closes its own; :meth:`Tracked.end`
        once it is done."""
        tracked = Tracked(self, closer)
        tracked.switch(ctx)
        return tracked

    async def revoked(self, jtis: list[str]) -> None:
        """Close the sockets of these (just revoked) tokens."""
        for jti in jtis:
            for tracked in list(self.sockets.pop(jti, ())):
                tracked.end()
                await tracked.closer("token revoked")


class Tracked:
    """One socket (or stream) of the relay under its token: in :attr:`RelayCore.sockets`
    by the token's id, and timed to close at the token's expiry (plus the verifier's
    leeway): a socket outlives no token, whether or not anybody revokes it."""

    def __init__(self, relay: RelayCore, closer: SocketCloser) -> None:
        self.relay = relay
        self.closer = closer
        self.ctx: AuthContext | None = None
        self._jti: str | None = None
        self._timer: asyncio.TimerHandle | None = None

    def switch(self, ctx: AuthContext) -> None:
        """Follow ``ctx``'s token: the first, or a refreshed one (an ``auth`` frame)."""
        self.end()
        self.ctx = ctx
        if ctx.jti is not None:
            self._jti = ctx.jti
            self.relay.sockets.setdefault(ctx.jti, set()).add(self)
        if ctx.expires_at is not None:
            delay = max(0.0, ctx.expires_at + self.relay.verifier.leeway - time.time())
            self._timer = asyncio.get_running_loop().call_later(delay, self._expired)

    def end(self) -> None:
        """No longer followed (idempotent)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._jti is not None:
            found = self.relay.sockets.get(self._jti)
            if found is not None:
                found.discard(self)
                if not found:
                    del self.relay.sockets[self._jti]
            self._jti = None

    def _expired(self) -> None:
        self._timer = None
        self.end()
        task = asyncio.get_running_loop().create_task(self.closer("token expired"))
        _background.add(task)
        task.add_done_callback(_background.discard)


def relay_of(request: Any) -> RelayCore:
    relay: RelayCore = request.app.state.relay
    return relay


async def authorize(request: Request, capability: Capability) -> tuple[Hosted, AuthContext, Box]:
    """The sandbox addressed, the caller (holding ``capability``) and its box."""
    relay = relay_of(request)
    hosted = relay.lookup(request.path_params["sandbox_id"])
    bearer = bearer_from_header(request.headers.get("authorization"))
    if bearer is None:
        bearer = request.headers.get("x-api-key")
    ctx = await relay.authenticate(hosted, bearer, capability)
    return hosted, ctx, hosted.ready()


def command_text(command: str | list[str]) -> str:
    return command if isinstance(command, str) else shlex.join(command)


__all__ = [
    "MAX_TRANSFERS",
    "Hosted",
    "HostedLookup",
    "RelayCore",
    "RelayExec",
    "Tracked",
    "authorize",
    "command_text",
    "relay_of",
]
