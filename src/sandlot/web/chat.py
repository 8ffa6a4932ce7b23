"""boring-ui's agent chat: ``/ws/claude-stream``, an agent program of a server-owned
template run in the workspace through the dataplane's streaming exec.

The program is started from a :class:`~sandlot.web.chat_templates.ChatTemplate` only:
the browser names the template (``provider``, default: the configured default) and gives
values for its parameters (``mode``, ``model``, ``allowed_tools``/``allowedTools``,
``disallowed_tools``/``disallowedTools``, ``file``…, each checked against the
template's pattern and passed as its own argument). It never gives a command: a
``command`` frame is a slash command typed to the agent (its stdin), never something
run. The template id, the user and the dataplane exec id are logged at each start.

Query parameters: ``session_id`` (reattach; the same rules as ``/ws/pty``: an id that
does not verify, or whose command is gone, is ``system/session_not_found``), ``resume``,
``force_new`` (a new agent; the previous one of that id is stopped), ``provider``, and
the template's parameters. Query names the template does not declare are ignored.

The browser sends ``{"type":"user","message"}`` (text, or content blocks), ``command``
(``{"command":"/compact"}``), ``control`` (``set_permission_mode`` with a mode the
template accepts, ``set_model``, ``interrupt``), ``control_response`` (answers to the
agent's own permission requests, passed to it), ``interrupt``, ``ping``, ``restart``;
text that is not JSON is a user message. The server forwards each line the agent writes
on stdout as one frame (a line that is not a JSON object as ``{"type":"raw","data"}``),
its stderr as ``{"type":"system","subtype":"stderr","data"}``, and adds
``{"type":"system","subtype":"connected","session_id","resumed","settings"}`` first,
``system/error``, ``system/session_not_found``, ``system/interrupted``,
``system/restarted``, ``system/exited`` (``exit_code``), ``system/gap`` (``lost_bytes``:
output a slow reader lost) and ``pong``. A reattach replays the agent's output from its
start as far as the dataplane still holds it (1 MiB by default).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from starlette.routing import BaseRoute, WebSocketRoute
from starlette.websockets import WebSocket

from sandlot.protocol.errors import InvalidRequest, PayloadTooLarge, RateLimited, SandlotError
from sandlot.web.auth import WebAuth
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
from sandlot.web.chat_templates import (
    DEFAULT_TEMPLATES,
    ChatTemplate,
    ChatTemplates,
    new_command_id,
    query_values,
)
from sandlot.web.gateway import Gateway
from sandlot.web.limits import QueueOverflow, SocketGate, SocketLimits
from sandlot.web.session_tokens import InvalidSessionId, SessionKind, SessionTokens
from sandlot.web.terminals import looks_like_session_id, truthy
from sandlot.web.wiring import Deps, UsesDeps, WorkspaceOf
from sandlot.web.workspace import Dataplane, Workspace

log = logging.getLogger(__name__)

#: A slash command typed to the agent: ``/name`` and its arguments, one line.
SLASH_COMMAND = re.compile(r"/[A-Za-z][A-Za-z0-9_:-]{0,63}( [^\x00-\x1f\x7f]{0,2000})?")
#: The longest line of the agent's output kept whole (a longer one is passed on in pieces).
MAX_LINE_CHARS = 4 * 1024 * 1024
#: Characters per ``stdin`` frame (the dataplane takes at most 1 MiB of text in one).
STDIN_PIECE_CHARS = 128 * 1024
PERMISSION_MODES = {"default": "ask", "acceptEdits": "act", "plan": "plan"}


def system(subtype: str, **fields: Any) -> dict[str, Any]:
    return {"type": "system", "subtype": subtype, **fields}


def system_error(exc: SandlotError) -> dict[str, Any]:
    return system("error", message=exc.message, code=exc.wire_code)


class Lines:
    """Splits one output stream into lines, across chunks (a gap drops the partial line:
    half a JSON document is no use)."""

    def __init__(self) -> None:
        self._partial = ""
        self._skipping = False

    def feed(self, data: str) -> list[str]:
        text = self._partial + data
        *lines, self._partial = text.split("\n")
        if self._skipping and lines:
            lines = lines[1:]
            self._skipping = False
        if len(self._partial) > MAX_LINE_CHARS:
            lines.append(self._partial)
            self._partial = ""
        return [line.rstrip("\r") for line in lines if line.strip()]

    def lost(self) -> None:
        self._partial = ""
        self._skipping = True


@dataclass
class ChatSession:
    """The agent a chat socket talks to: its exec id and the id the browser keeps."""

    exec_id: str
    token: str
    resumed: bool


class Chat(UsesDeps):
    """The chat route over one gateway (see the module's docstring)."""

    def __init__(
        self,
        *,
        deps: Deps,
        gate: SocketGate,
        templates: ChatTemplates,
        refresh_seconds: float,
    ) -> None:
        self.deps = deps
        self.gate = gate
        self.templates = templates
        self.refresh_seconds = refresh_seconds

    async def stream(self, ws: WebSocket) -> None:
        self.deps.bind(ws)
        await serve_browser_socket(
            ws,
            SocketKind.CHAT,
            auth=self.auth,
            gate=self.gate,
            metrics=self.metrics,
            error_frame=system_error,
            serve=self._stream,
        )

    async def _stream(self, ws: WebSocket, channel: BrowserChannel, user: str) -> None:
        q = ws.query_params
        template = self.templates.get(q.get("provider"))
        if template is None:
            exc = InvalidRequest(
                f"unknown provider; this server runs {sorted(self.templates.templates)}"
            )
            await channel.abort(system_error(exc), CLOSE_UNKNOWN_PROVIDER)
            return
        values = query_values(q.multi_items())
        try:
            argv = template.build(values)
            settings = template.settings(values)
            workspace = await self.workspace_of(ws)
            previous = self._previous(q, user, workspace.id, template.id)
        except InvalidSessionId:
            await channel.abort(system("session_not_found"), CLOSE_SESSION_NOT_FOUND)
            return
        except SandlotError as exc:
            log.info("chat of %s refused: %s", user, exc.message)
            await channel.abort(system_error(exc), CLOSE_POLICY)
            return
        if previous is not None and truthy(q.get("force_new")):
            await self._stop(workspace, previous, ws)
            previous = None
        try:
            upstream, session = await self._open(ws, workspace, template, argv, user, previous)
        except InvalidSessionId:
            await channel.abort(system("session_not_found"), CLOSE_SESSION_NOT_FOUND)
            return
        except SandlotError as exc:
            await channel.abort(
                system_error(exc), CLOSE_TRY_AGAIN if exc.retryable else CLOSE_POLICY
            )
            return
        channel.attached = True
        try:
            channel.send(
                system(
                    "connected",
                    session_id=session.token,
                    resumed=session.resumed,
                    settings=settings,
                )
            )
            await self._relay(ws, channel, upstream, session, workspace, template, argv, user)
        finally:
            await upstream.close()

    def _previous(
        self, q: Mapping[str, str], user: str, workspace: str, template: str
    ) -> str | None:
        """The exec id of the chat to resume, or ``None`` for a new one."""
        session_id = q.get("session_id") or ""
        if not session_id:
            if truthy(q.get("resume")) and not truthy(q.get("force_new")):
                raise InvalidSessionId()
            return None
        try:
            claims = self.tokens.verify(
                session_id,
                user=user,
                workspace=workspace,
                kind=SessionKind.STREAM,
                provider=template,
            )
        except InvalidSessionId:
            if truthy(q.get("force_new")):
                return None
            if truthy(q.get("resume")) or looks_like_session_id(session_id):
                raise
            return None  # an id boring-ui's page made up for a new chat
        return claims.exec_id

    async def _open(
        self,
        ws: WebSocket,
        workspace: Workspace,
        template: ChatTemplate,
        argv: list[str],
        user: str,
        previous: str | None,
    ) -> tuple[DataplaneChannel, ChatSession]:
        if previous is not None:
            first = {"type": "attach", "exec_id": previous, "stdout_offset": 0, "stderr_offset": 0}
        else:
            first = self._start_frame(template, argv, user)
        upstream, ready = await DataplaneChannel.open(
            self.gateway,
            workspace,
            "/exec/ws",
            headers=ws.headers,
            limits=self.gate.limits,
            refresh_seconds=self.refresh_seconds,
            first=first,
        )
        try:
            if ready is None or ready.get("type") != "ready":
                code = str((ready or {}).get("code") or "")
                if previous is not None and (
                    code.endswith("NOT_FOUND") or upstream.close_code == 4404
                ):
                    raise InvalidSessionId()
                message = str((ready or {}).get("message") or "the agent could not be started")
                if previous is None and "not found" in message:
                    message = (
                        f"the agent program of {template.id!r} is not installed in this workspace"
                    )
                raise InvalidRequest(message)
        except BaseException:
            await upstream.close()
            raise
        exec_id = str(ready["exec_id"])
        if previous is None:
            log.info("chat started for %s: template %s, exec %s", user, template.id, exec_id)
        token = self.tokens.issue(
            provider=template.id,
            exec_id=exec_id,
            kind=SessionKind.STREAM,
            user=user,
            workspace=workspace.id,
        )
        return upstream, ChatSession(exec_id, token, resumed=previous is not None)

    @staticmethod
    def _start_frame(template: ChatTemplate, argv: list[str], user: str) -> dict[str, Any]:
        frame: dict[str, Any] = {
            "type": "start",
            "command": argv,
            "env": dict(template.env),
            "command_id": new_command_id(template.id, user),
        }
        if template.cwd:
            frame["cwd"] = template.cwd
        return frame

    async def _stop(self, workspace: Workspace, exec_id: str, ws: WebSocket) -> None:
        """Stop the agent of ``exec_id`` (a ``force_new`` or a ``restart``), if it runs."""
        dp: Dataplane = await workspace.dataplane()
        try:
            await self.gateway.request(
                "POST",
                f"{dp.http_base_url}/execs/{exec_id}/signal",
                token=dp.token,
                headers={**dict(ws.headers), "Content-Type": "application/json"},
                content=json.dumps({"signal": "SIGTERM"}).encode(),
            )
        except SandlotError as exc:  # gone already, or not ours to stop: a new one starts anyway
            log.info("could not stop chat exec %s: %s", exec_id, exc.message)

    async def _relay(
        self,
        ws: WebSocket,
        channel: BrowserChannel,
        upstream: DataplaneChannel,
        session: ChatSession,
        workspace: Workspace,
        template: ChatTemplate,
        argv: list[str],
        user: str,
    ) -> None:
        try:
            while True:
                outcome = await self._pump(channel, upstream, session, workspace.id, template)
                if outcome != "restart":
                    return
                with contextlib.suppress(Exception):
                    await upstream.send_now({"type": "signal", "signal": "SIGTERM"})
                await upstream.close()
                try:
                    upstream, session = await self._open(ws, workspace, template, argv, user, None)
                except SandlotError as exc:
                    await channel.abort(system_error(exc), CLOSE_TRY_AGAIN)
                    return
                channel.send(system("restarted", session_id=session.token))
        finally:
            await upstream.close()

    async def _pump(
        self,
        channel: BrowserChannel,
        upstream: DataplaneChannel,
        session: ChatSession,
        workspace: str,
        template: ChatTemplate,
    ) -> str:
        """Relay one agent until it exits, either side goes, or a ``restart`` (returned)."""
        streams = {"stdout": Lines(), "stderr": Lines()}

        async def from_upstream() -> tuple[str, int | None]:
            while True:
                frame = await upstream.recv()
                if frame is None:
                    return "lost", upstream.close_code
                kind = frame.get("type")
                if kind in ("stdout", "stderr"):
                    for line in streams[kind].feed(str(frame.get("data", ""))):
                        self._forward(channel, kind, line)
                elif kind == "gap":
                    stream = str(frame.get("stream") or "stdout")
                    streams.get(stream, streams["stdout"]).lost()
                    lost = int(frame.get("to", 0)) - int(frame.get("from", 0))
                    channel.send(system("gap", stream=stream, lost_bytes=lost))
                elif kind == "exit":
                    code = frame.get("exit_code")
                    return "exit", code if isinstance(code, int) else None
                elif kind == "error":
                    message = str(frame.get("message") or "error")
                    channel.send(system("error", message=message, code=frame.get("code")))

        async def from_browser() -> tuple[str, int | None]:
            throttled = False
            max_frame = self.gate.limits.max_chat_frame_bytes
            while True:
                text = await channel.receive()
                size = len(text.encode("utf-8"))
                if size > max_frame:
                    channel.send(
                        system_error(PayloadTooLarge(f"frames are {max_frame} bytes at most"))
                    )
                    continue
                if not self.gate.input_allowed((workspace, session.exec_id), size):
                    if not throttled:
                        throttled = True
                        channel.send(
                            system_error(RateLimited("input rate limit reached: message dropped"))
                        )
                    continue
                throttled = False
                if self._from_browser(text, channel, upstream, session, template) == "restart":
                    return "restart", None

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
                "chat closed: its %s queue overflowed", "output" if first == "upstream" else "input"
            )
            exc = RateLimited("the chat fell too far behind: reconnect to resume")
            await channel.abort(system_error(exc), CLOSE_TRY_AGAIN, side=Side.LIMIT)
        elif isinstance(error, Disconnected) or first == "to_browser":
            pass  # the browser left: the agent keeps running for a reattach
        elif error is not None:
            log.error("chat relay failed", exc_info=error)
            await channel.abort(system_error(SandlotError("internal error")), CLOSE_INTERNAL)
        elif isinstance(outcome, tuple) and outcome[0] == "restart":
            return "restart"
        elif isinstance(outcome, tuple) and outcome[0] == "exit":
            code = outcome[1]
            if code == 127 and not session.resumed:
                exc = InvalidRequest(
                    f"the agent program of {template.id!r} is not installed in this workspace"
                )
                channel.send(system_error(exc))
            await channel.finish(
                [system("exited", exit_code=code, session_id=session.token)], CLOSE_NORMAL
            )
        else:
            exc = SandlotError("the connection to the workspace was lost: reconnect to resume")
            await channel.finish([system_error(exc)], CLOSE_TRY_AGAIN)
        return "end"

    @staticmethod
    def _forward(channel: BrowserChannel, stream: str, line: str) -> None:
        if stream == "stderr":
            channel.send(system("stderr", data=line))
            return
        try:
            is_object = isinstance(json.loads(line), dict)
        except ValueError:
            is_object = False
        if is_object:
            channel.send_text(line)
        else:
            channel.send({"type": "raw", "data": line})

    def _from_browser(
        self,
        text: str,
        channel: BrowserChannel,
        upstream: DataplaneChannel,
        session: ChatSession,
        template: ChatTemplate,
    ) -> str | None:
        try:
            message = json.loads(text)
        except ValueError:
            message = {"type": "user", "message": text}
        if not isinstance(message, dict):
            message = {"type": "user", "message": text}
        kind = message.get("type")
        try:
            if kind == "ping":
                channel.send({"type": "pong"})
            elif kind == "user":
                self._write(upstream, user_line(message.get("message")))
            elif kind == "command":
                command = message.get("command")
                if not isinstance(command, str) or not SLASH_COMMAND.fullmatch(command.strip()):
                    raise InvalidRequest(
                        "a command is a slash command for the agent, such as /compact"
                    )
                self._write(upstream, user_line(command.strip()))
            elif kind == "interrupt":
                upstream.send({"type": "signal", "signal": "SIGINT"})
                channel.send(system("interrupted", session_id=session.token))
            elif kind == "control":
                self._control(message, channel, upstream, session, template)
            elif kind == "control_response":
                self._write(upstream, message)
            elif kind == "restart":
                return "restart"
            else:
                raise InvalidRequest("unsupported message type")
        except SandlotError as exc:
            channel.send(system_error(exc))
        return None

    def _control(
        self,
        message: dict[str, Any],
        channel: BrowserChannel,
        upstream: DataplaneChannel,
        session: ChatSession,
        template: ChatTemplate,
    ) -> None:
        subtype = message.get("subtype")
        if subtype == "interrupt":
            upstream.send({"type": "signal", "signal": "SIGINT"})
            channel.send(system("interrupted", session_id=session.token))
            return
        if subtype == "set_permission_mode":
            mode = message.get("mode")
            ui_mode = PERMISSION_MODES.get(mode) if isinstance(mode, str) else None
            parameter = template.parameters.get("mode")
            if ui_mode is None or parameter is None:
                raise InvalidRequest("this permission mode is not offered here")
            parameter.arguments([ui_mode])
            self._write(upstream, {"type": "control", "subtype": subtype, "mode": mode})
            return
        if subtype == "set_model":
            model = message.get("model")
            parameter = template.parameters.get("model")
            if not isinstance(model, str) or parameter is None:
                raise InvalidRequest("the model cannot be changed here")
            parameter.arguments([model])
            self._write(upstream, {"type": "control", "subtype": subtype, "model": model})
            return
        raise InvalidRequest("unsupported control")

    @staticmethod
    def _write(upstream: DataplaneChannel, message: dict[str, Any]) -> None:
        """One stream-JSON line to the agent's stdin, in pieces the dataplane takes."""
        # ASCII: every character escaped, a lone surrogate included, as JSON allows.
        line = json.dumps(message, separators=(",", ":")) + "\n"
        for start in range(0, len(line), STDIN_PIECE_CHARS):
            upstream.send({"type": "stdin", "data": line[start : start + STDIN_PIECE_CHARS]})


def user_line(message: object) -> dict[str, Any]:
    """The stream-JSON line of a user message (text, content blocks, or a message)."""
    if isinstance(message, str):
        content: object = [{"type": "text", "text": message}]
    elif isinstance(message, dict) and isinstance(message.get("content"), (list, str)):
        content = message["content"]
    elif isinstance(message, list):
        content = message
    else:
        raise InvalidRequest("a user message is text or a list of content blocks")
    if isinstance(content, list) and not all(
        isinstance(b, dict) and isinstance(b.get("type"), str) for b in content
    ):
        raise InvalidRequest("content blocks are objects with a type")
    return {"type": "user", "session_id": "", "message": {"role": "user", "content": content}}


def chat_routes(
    *,
    gateway: Gateway | None = None,
    tokens: SessionTokens | None = None,
    auth: WebAuth | None = None,
    workspace_of: WorkspaceOf | None = None,
    templates: ChatTemplates = DEFAULT_TEMPLATES,
    limits: SocketLimits | SocketGate | None = None,
    refresh_seconds: float = 60.0,
) -> list[BaseRoute]:
    """``/ws/claude-stream``, for ``create_web_app(extra_routes=...)``.

    ``templates`` are the agent programs it may start
    (:func:`~sandlot.web.chat_templates.load_chat_templates`); the other arguments are
    :func:`~sandlot.web.terminals.terminal_routes`'s (left out, the app's own; pass the
    same :class:`SocketGate` to both to count connects across them).
    """
    gate = limits if isinstance(limits, SocketGate) else SocketGate(limits)
    deps = Deps(gateway=gateway, auth=auth, tokens=tokens, workspace_of=workspace_of)
    chat = Chat(deps=deps, gate=gate, templates=templates, refresh_seconds=refresh_seconds)
    return [WebSocketRoute("/ws/claude-stream", chat.stream)]
