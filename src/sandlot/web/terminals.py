"""boring-ui's terminals: ``/ws/pty`` and ``/api/sessions``, each terminal one of the
workspace's shared shells.

A ``/ws/pty`` session *is* a shared shell of the sandbox's dataplane (PROTOCOL.md 3.4),
the same one ``sandlot shell THREAD --session NAME`` attaches to: every browser tab and
terminal attached to it sees the same bytes, drivers type, observers watch. The web
server reaches it only through its :class:`~sandlot.web.gateway.Gateway`, with the token
it holds; the browser holds a ``session_id``, the signed id of
:mod:`sandlot.web.session_tokens` naming the shell (its dataplane id and name), the
provider, the user and the workspace.

Query parameters (boring-ui's, then sandlot's):

- ``session_id``: reattach to that session. An id that does not verify (forged, expired,
  another user's or workspace's) is answered ``session_not_found``, never why; so is one
  whose shell has ended. boring-ui's page makes up ids of its own for new terminals: an
  id that is not one of ours is taken as a request for a new session, unless
  ``resume=1`` asks to resume it (then ``session_not_found``).
- ``provider`` (default ``shell``): which shell profile of the template runs; an unknown
  one is closed with 4003.
- ``force_new=1``: a new shell, whatever ``session_id`` says.
- ``shell=NAME``: open (or create) the shared shell of that name instead of a new one:
  ``shell=main`` is the terminal ``sandlot shell THREAD`` opens.
- ``role=observer``: watch without typing (default ``driver``).
- ``session_name``: boring-ui's label for the tab; not used.
- ``offset=N``: on a reattach, the byte offset of the output the page already has:
  it gets exactly what follows (replayed by the dataplane), not the whole history.
- ``cols``, ``rows``: the terminal's size when it opens.
- ``binary=1``: output comes in binary frames (sandlot's page asks for them): each the
  offset of its first byte as 8 bytes (unsigned, big-endian), then the output's bytes as
  the shell wrote them (UTF-8). Every other frame stays JSON text.

Frames: the browser sends ``{"type":"input","data"}``, ``{"type":"resize","rows","cols"}``,
``{"type":"ping"}``, or any text that is not a JSON object (raw input). The server sends
``{"type":"session","session_id","name","role"}`` first (the id to keep, renewed at every
attach), then ``{"type":"history","data","offset"}`` when there is history (or, with
``offset``, the missing output as ``output`` frames), then ``{"type":"output","data",
"session_id","offset"}`` (``offset``: where the chunk's first byte lies in the shell's
output; a binary frame instead with ``binary=1``; the chunks the dataplane sends back to
back are merged into larger frames, see :mod:`sandlot.web.ptyoutput`),
``{"type":"gap","from","to","session_id"}`` when bytes were lost to a slow reader,
``{"type":"exit","code","session_id"}``, ``{"type":"pong"}``, ``{"type":"error","data",
"error":{"code","message"}}`` and ``{"type":"session_not_found"}``.

Close codes: 1000 the shell exited, 1013 the dataplane was lost or a queue overflowed
(reattach), 4003 unknown provider, 4404 session not found, 4429 too many connections.

``GET /api/sessions`` lists the workspace's shells and the user's chats as
``{"sessions":[{"id","type":"pty"|"stream","alive","clients","history_count"}]}``
(``history_count``: bytes of output so far); ``POST /api/sessions`` (optional JSON
``{"provider", "shell"}``) creates a shell and answers ``{"session_id"}``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route, WebSocketRoute
from starlette.websockets import WebSocket

from sandlot.protocol.errors import InvalidRequest, PayloadTooLarge, RateLimited, SandlotError
from sandlot.web.auth import WebAuth, current_user, error_response
from sandlot.web.channels import (
    CLOSE_INTERNAL,
    CLOSE_NORMAL,
    CLOSE_POLICY,
    CLOSE_SESSION_NOT_FOUND,
    CLOSE_TRY_AGAIN,
    CLOSE_UNKNOWN_PROVIDER,
    BrowserChannel,
    DataplaneChannel,
    Disconnected,
    Side,
    SocketKind,
    cancel_all,
    serve_browser_socket,
)
from sandlot.web.chat_templates import chat_of
from sandlot.web.gateway import Gateway
from sandlot.web.limits import QueueOverflow, SocketGate, SocketLimits
from sandlot.web.ptyoutput import OutputFrames, ShellOutput
from sandlot.web.session_tokens import InvalidSessionId, SessionKind, SessionTokens
from sandlot.web.wiring import Deps, UsesDeps, WorkspaceOf
from sandlot.web.workspace import Workspace

log = logging.getLogger(__name__)

#: boring-ui's provider → the template's shell profile it runs.
DEFAULT_PROVIDERS: Mapping[str, str] = {"shell": "default"}
#: Names the browser may give a shell (``sandlot shell`` accepts more; those are listed
#: and reattached by id, not created from here).
SHELL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
MAX_BODY_BYTES = 16 * 1024


def error_frame(exc: SandlotError) -> dict[str, Any]:
    """boring-ui's ``error`` frame (it shows ``data``) with the envelope's code."""
    return {
        "type": "error",
        "data": exc.message,
        "error": {"code": exc.wire_code, "message": exc.message, "retryable": exc.retryable},
    }


def looks_like_session_id(value: str) -> bool:
    """Whether ``value`` has the form of our ids (a JWT), as opposed to one a page made up."""
    return value.count(".") == 2 and value.startswith("ey")


def truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes")


def shell_exec_id(shell_id: str, name: str) -> str:
    """The ``exec`` claim of a terminal: the shell's dataplane id and its name."""
    return f"{shell_id}/{name}"


@dataclass(frozen=True)
class ShellTarget:
    """The shell a ``/ws/pty`` connection opens."""

    name: str
    #: The dataplane id it must have (a reattach), or ``None`` (whatever runs under the name).
    shell_id: str | None
    create: bool


class Terminals(UsesDeps):
    """The terminal routes over one gateway (see the module's docstring)."""

    def __init__(
        self,
        *,
        deps: Deps,
        gate: SocketGate,
        providers: Mapping[str, str],
        refresh_seconds: float,
    ) -> None:
        self.deps = deps
        self.gate = gate
        self.providers = dict(providers)
        self.refresh_seconds = refresh_seconds

    # --- /ws/pty ------------------------------------------------------------------------

    async def pty(self, ws: WebSocket) -> None:
        self.deps.bind(ws)
        await serve_browser_socket(
            ws,
            SocketKind.PTY,
            auth=self.auth,
            gate=self.gate,
            metrics=self.metrics,
            error_frame=error_frame,
            serve=self._pty,
        )

    async def _pty(self, ws: WebSocket, channel: BrowserChannel, user: str) -> None:
        q = ws.query_params
        provider = q.get("provider") or "shell"
        profile = self.providers.get(provider)
        if profile is None:
            exc = InvalidRequest(f"unknown provider; this server runs {sorted(self.providers)}")
            await channel.abort(error_frame(exc), CLOSE_UNKNOWN_PROVIDER)
            return
        role = q.get("role") or "driver"
        try:
            if role not in ("driver", "observer"):
                raise InvalidRequest("role must be driver or observer")
            workspace = await self.workspace_of(ws)
            target = self._target(q, user, workspace.id, provider)
            params = {
                "session": target.name,
                "role": role,
                "profile": profile,
                "create": "true" if target.create else "false",
            }
            for size in ("cols", "rows"):
                if (value := q.get(size)) and value.isdigit():
                    params[size] = value
            upstream, greeting = await DataplaneChannel.open(
                self.gateway,
                workspace,
                f"/shell/ws?{urlencode(params)}",
                headers=ws.headers,
                limits=self.gate.limits,
                refresh_seconds=self.refresh_seconds,
            )
        except InvalidSessionId:
            await channel.abort({"type": "session_not_found"}, CLOSE_SESSION_NOT_FOUND)
            return
        except SandlotError as exc:
            await channel.abort(
                error_frame(exc), CLOSE_TRY_AGAIN if exc.retryable else CLOSE_POLICY
            )
            return
        try:
            await self._attached(
                ws, channel, upstream, greeting, target, user, workspace, provider, role
            )
        finally:
            await upstream.close()

    def _target(
        self, q: Mapping[str, str], user: str, workspace: str, provider: str
    ) -> ShellTarget:
        """Which shell to open; ``InvalidSessionId`` for an id that cannot be resumed."""
        session_id = q.get("session_id") or ""
        named = q.get("shell")
        if named is not None and not SHELL_NAME.fullmatch(named):
            raise InvalidRequest("shell names are letters, digits, '.', '_' and '-' (64 at most)")
        fresh = ShellTarget(named or f"web-{secrets.token_hex(6)}", None, True)
        if truthy(q.get("force_new")):
            return fresh
        if session_id:
            try:
                claims = self.tokens.verify(
                    session_id,
                    user=user,
                    workspace=workspace,
                    kind=SessionKind.PTY,
                    provider=provider,
                )
            except InvalidSessionId:
                if truthy(q.get("resume")) or looks_like_session_id(session_id):
                    raise
                return fresh  # an id boring-ui's page made up for a new terminal
            shell_id, _, name = claims.exec_id.partition("/")
            if not name:
                raise InvalidSessionId()
            return ShellTarget(name, shell_id, False)
        if truthy(q.get("resume")):
            raise InvalidSessionId()
        return fresh

    async def _attached(
        self,
        ws: WebSocket,
        channel: BrowserChannel,
        upstream: DataplaneChannel,
        greeting: dict[str, Any] | None,
        target: ShellTarget,
        user: str,
        workspace: Workspace,
        provider: str,
        role: str,
    ) -> None:
        if greeting is None or greeting.get("type") != "session":
            await self._not_opened(channel, upstream, target, greeting)
            return
        shell_id, name = str(greeting.get("session_id")), str(greeting.get("name"))
        if target.shell_id is not None and shell_id != target.shell_id:
            # The shell of that id ended and another took its name: not this session.
            await channel.abort({"type": "session_not_found"}, CLOSE_SESSION_NOT_FOUND)
            return
        history = await upstream.recv()
        if history is None or history.get("type") != "history":
            await self._not_opened(channel, upstream, target, history)
            return
        token = self.tokens.issue(
            provider=provider,
            exec_id=shell_exec_id(shell_id, name),
            kind=SessionKind.PTY,
            user=user,
            workspace=workspace.id,
        )
        channel.attached = True
        log.info("terminal of %s attached to shell %s (%s) as %s", user, name, shell_id, role)
        binary = truthy(ws.query_params.get("binary"))
        channel.output = OutputFrames(binary=binary, session_id=token)
        output = self._greet(channel, upstream, token, name, role, history, ws.query_params)
        await self._relay(channel, upstream, output, token, (workspace.id, shell_id))

    def _greet(
        self,
        channel: BrowserChannel,
        upstream: DataplaneChannel,
        token: str,
        name: str,
        role: str,
        history: dict[str, Any],
        q: Mapping[str, str],
    ) -> ShellOutput:
        channel.send({"type": "session", "session_id": token, "name": name, "role": role})
        text = str(history.get("data") or "")
        start = int(history.get("offset") or 0)
        end = start + len(text.encode("utf-8"))
        raw_offset = q.get("offset")
        offset = int(raw_offset) if raw_offset and raw_offset.isdigit() else None
        if offset is not None and offset <= end:
            if offset < end:
                # The dataplane replays from there (from its buffer, further back than
                # the history); a ``gap`` says what it no longer holds.
                upstream.send({"type": "attach", "offset": offset})
            return ShellOutput(offset)
        if text:
            channel.send({"type": "history", "data": text, "offset": start})
        return ShellOutput(end)

    async def _not_opened(
        self,
        channel: BrowserChannel,
        upstream: DataplaneChannel,
        target: ShellTarget,
        frame: dict[str, Any] | None,
    ) -> None:
        code = str((frame or {}).get("code") or "")
        if not target.create and (upstream.close_code == 4404 or code == "NOT_FOUND"):
            await channel.abort({"type": "session_not_found"}, CLOSE_SESSION_NOT_FOUND)
            return
        message = str((frame or {}).get("message") or "the shell could not be opened")
        exc = SandlotError(message)
        await channel.abort(
            {"type": "error", "data": message, "error": {"code": code or exc.wire_code}},
            CLOSE_TRY_AGAIN,
        )

    async def _relay(
        self,
        channel: BrowserChannel,
        upstream: DataplaneChannel,
        output: ShellOutput,
        token: str,
        session: tuple[str, str],
    ) -> None:
        async def from_upstream() -> tuple[str, int | None]:
            while True:
                frame = await upstream.recv()
                if frame is None:
                    return "lost", upstream.close_code
                kind = frame.get("type")
                if kind == "stdout":
                    raw = str(frame.get("data", "")).encode("utf-8")
                    part = output.chunk(raw, int(frame.get("offset", 0)))
                    if part is not None:
                        channel.send_output(part)
                elif kind == "gap":
                    lost = output.gap(int(frame.get("from", 0)), int(frame.get("to", 0)))
                    if lost is not None:
                        channel.send(
                            {"type": "gap", "from": lost[0], "to": lost[1], "session_id": token}
                        )
                elif kind == "exit":
                    code = frame.get("exit_code")
                    return "exit", code if isinstance(code, int) else None
                elif kind == "error":
                    message = str(frame.get("message") or "error")
                    channel.send(
                        {
                            "type": "error",
                            "data": message,
                            "error": {"code": frame.get("code"), "message": message},
                        }
                    )

        async def from_browser() -> tuple[str, int | None]:
            throttled = False
            max_frame = self.gate.limits.max_input_frame_bytes
            while True:
                text = await channel.receive()
                size = len(text.encode("utf-8"))
                if size > max_frame:
                    channel.send(
                        error_frame(PayloadTooLarge(f"frames are {max_frame} bytes at most"))
                    )
                    continue
                if not self.gate.input_allowed(session, size):
                    if not throttled:
                        throttled = True
                        channel.send(
                            error_frame(RateLimited("input rate limit reached: input dropped"))
                        )
                    continue
                throttled = False
                self._from_browser(text, channel, upstream)

        tasks = {
            "upstream": asyncio.create_task(from_upstream()),
            "browser": asyncio.create_task(from_browser()),
            "to_browser": asyncio.create_task(channel.run_sender()),
            "to_upstream": asyncio.create_task(upstream.run_sender()),
            "token": asyncio.create_task(upstream.keep_token_fresh()),
        }
        try:
            done, _ = await asyncio.wait(tasks.values(), return_when=asyncio.FIRST_COMPLETED)
        finally:
            await cancel_all(list(tasks.values()))
        first = next(name for name, task in tasks.items() if task in done)
        task = tasks[first]
        error = task.exception() if not task.cancelled() else None
        outcome = task.result() if error is None and not task.cancelled() else None
        exc: SandlotError
        if isinstance(error, QueueOverflow):
            self.gate.overflows += 1
            log.info(
                "terminal closed: its %s queue overflowed",
                "output" if first == "upstream" else "input",
            )
            exc = RateLimited("the terminal fell too far behind: reconnect to resume")
            await channel.abort(error_frame(exc), CLOSE_TRY_AGAIN, side=Side.LIMIT)
        elif isinstance(error, Disconnected) or first == "to_browser":
            return  # the browser left: the shell keeps running
        elif error is not None:
            log.error("terminal relay failed", exc_info=error)
            await channel.abort(error_frame(SandlotError("internal error")), CLOSE_INTERNAL)
        elif isinstance(outcome, tuple) and outcome[0] == "exit":
            code = outcome[1]
            await channel.finish(
                [{"type": "exit", "code": code, "session_id": token}], CLOSE_NORMAL
            )
        else:
            exc = SandlotError("the connection to the workspace was lost: reconnect to resume")
            await channel.finish([error_frame(exc)], CLOSE_TRY_AGAIN)

    def _from_browser(self, text: str, channel: BrowserChannel, upstream: DataplaneChannel) -> None:
        try:
            message = json.loads(text)
        except ValueError:
            message = None
        if not isinstance(message, dict):
            data: object = text  # boring-ui: text that is not a JSON object is typed as is
        else:
            kind = message.get("type")
            if kind == "ping":
                channel.send({"type": "pong"})
                return
            if kind == "resize":
                rows, cols = message.get("rows"), message.get("cols")
                if not all(isinstance(v, int) and 1 <= v <= 1000 for v in (rows, cols)):
                    channel.send(error_frame(InvalidRequest("rows and cols are 1-1000")))
                    return
                upstream.send({"type": "resize", "cols": cols, "rows": rows}, kind="resize")
                return
            if kind != "input":
                return  # boring-ui ignores what it does not know
            data = message.get("data")
            if not isinstance(data, str):
                channel.send(error_frame(InvalidRequest("input data must be text")))
                return
        if data:
            # A lone surrogate (a JSON escape) is not text the terminal can take.
            text = str(data).encode("utf-8", "replace").decode("utf-8")
            upstream.send({"type": "stdin", "data": text})

    # --- /api/sessions ------------------------------------------------------------------

    async def sessions(self, request: Request) -> Response:
        self.deps.bind(request)
        try:
            if request.method == "POST":
                return await self._create(request)
            return await self._list(request)
        except SandlotError as exc:
            return error_response(exc)

    async def _list(self, request: Request) -> Response:
        user = current_user(request).user_id
        workspace = await self.workspace_of(request)
        dp = await workspace.dataplane()
        base = dp.http_base_url
        shells = await self.gateway.request(
            "GET", f"{base}/shells", token=dp.token, headers=request.headers
        )
        execs = await self.gateway.request(
            "GET", f"{base}/execs", token=dp.token, headers=request.headers
        )
        by_profile = {profile: provider for provider, profile in self.providers.items()}
        sessions: list[dict[str, Any]] = []
        for shell in shells.json().get("shells", []):
            provider = by_profile.get(shell.get("profile"))
            if provider is None:
                continue
            exec_id = shell_exec_id(shell["session_id"], shell["name"])
            sessions.append(
                {
                    "id": self.tokens.issue(
                        provider=provider,
                        exec_id=exec_id,
                        kind=SessionKind.PTY,
                        user=user,
                        workspace=workspace.id,
                    ),
                    "type": "pty",
                    "alive": shell.get("state") == "running",
                    "clients": int(shell.get("clients") or 0),
                    "history_count": int(shell.get("offset") or 0),
                    "name": shell["name"],
                }
            )
        for ex in execs.json().get("execs", []):
            template = chat_of(ex.get("command_id"), user)
            if template is None:
                continue
            sessions.append(
                {
                    "id": self.tokens.issue(
                        provider=template,
                        exec_id=ex["exec_id"],
                        kind=SessionKind.STREAM,
                        user=user,
                        workspace=workspace.id,
                    ),
                    "type": "stream",
                    "alive": ex.get("state") == "running",
                    "clients": int(ex.get("clients") or 0),
                    "history_count": int(ex.get("stdout_offset") or 0),
                }
            )
        return JSONResponse({"sessions": sessions}, headers={"Cache-Control": "no-store"})

    async def _create(self, request: Request) -> Response:
        user = current_user(request).user_id
        body = bytearray()
        async for piece in request.stream():
            body += piece
            if len(body) > MAX_BODY_BYTES:
                raise PayloadTooLarge(f"at most {MAX_BODY_BYTES} bytes")
        options: Any = {}
        if body.strip():
            try:
                options = json.loads(body)
            except ValueError:
                raise InvalidRequest("the body is not valid JSON") from None
        if not isinstance(options, dict):
            raise InvalidRequest("the body must be a JSON object")
        provider = options.get("provider") or "shell"
        profile = self.providers.get(provider) if isinstance(provider, str) else None
        if profile is None:
            raise InvalidRequest(f"unknown provider; this server runs {sorted(self.providers)}")
        name = options.get("shell") or f"web-{secrets.token_hex(6)}"
        if not isinstance(name, str) or not SHELL_NAME.fullmatch(name):
            raise InvalidRequest("shell names are letters, digits, '.', '_' and '-' (64 at most)")
        workspace = await self.workspace_of(request)
        params = urlencode({"session": name, "role": "driver", "profile": profile})
        upstream, greeting = await DataplaneChannel.open(
            self.gateway,
            workspace,
            f"/shell/ws?{params}",
            headers=request.headers,
            limits=self.gate.limits,
        )
        await upstream.close()
        if greeting is None or greeting.get("type") != "session":
            message = str((greeting or {}).get("message") or "the shell could not be started")
            raise SandlotError(message)
        token = self.tokens.issue(
            provider=provider,
            exec_id=shell_exec_id(str(greeting["session_id"]), str(greeting["name"])),
            kind=SessionKind.PTY,
            user=user,
            workspace=workspace.id,
        )
        log.info("shell %s created for %s", greeting["name"], user)
        return JSONResponse(
            {"session_id": token}, status_code=201, headers={"Cache-Control": "no-store"}
        )


def terminal_routes(
    *,
    gateway: Gateway | None = None,
    tokens: SessionTokens | None = None,
    auth: WebAuth | None = None,
    workspace_of: WorkspaceOf | None = None,
    limits: SocketLimits | SocketGate | None = None,
    providers: Mapping[str, str] = DEFAULT_PROVIDERS,
    refresh_seconds: float = 60.0,
) -> list[BaseRoute]:
    """``/ws/pty`` and ``/api/sessions``, for ``create_web_app(extra_routes=...)``.

    ``gateway``, ``auth``, ``tokens`` and ``workspace_of`` (which gives the workspace a
    request or WebSocket works on) default to the app's own (:class:`Deps`); ``limits``
    (a :class:`SocketGate` to share one with :func:`~sandlot.web.chat.chat_routes`, so
    connects are counted across both) bounds connects, input and queues; ``providers``
    maps boring-ui's provider names to the template's shell profiles;
    ``refresh_seconds`` is how often a long-lived socket's dataplane token is renewed.
    The app must be wrapped in :class:`~sandlot.web.auth.BrowserAuthMiddleware`.
    """
    gate = limits if isinstance(limits, SocketGate) else SocketGate(limits)
    deps = Deps(gateway=gateway, auth=auth, tokens=tokens, workspace_of=workspace_of)
    terminals = Terminals(
        deps=deps, gate=gate, providers=providers, refresh_seconds=refresh_seconds
    )
    return [
        WebSocketRoute("/ws/pty", terminals.pty),
        Route("/api/sessions", terminals.sessions, methods=["GET", "POST"]),
    ]
