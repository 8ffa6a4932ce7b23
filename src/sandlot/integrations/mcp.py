"""An MCP server over the SDK: environments as tools, sandbox files as resources.

Built on the official ``mcp`` package (2.x, ``MCPServer``). Every call reaches the
broker and the dataplane through :mod:`sandlot.sdk` only, as the caller: over
streamable HTTP the caller's ``Authorization: Bearer <API key>`` is the SDK's
``api_key`` (one :class:`~sandlot.sdk.AsyncSandlot` per key, kept); over stdio the
key comes from the CLI settings. Capabilities are enforced by the dataplane itself.

Tools (docs/INTEGRATIONS.md has their shapes):

- ``environment_acquire``, ``environment_refresh``, ``environment_heartbeat``,
  ``environment_release``: the session (binding) of a scope, by ``session_id``;
- ``exec``, ``read``, ``write``, ``edit``, ``ls``, ``glob``, ``grep``, ``upload``,
  ``download``: keyed by ``session_id`` (or ``thread_id``, which ensures the thread's
  sandbox). ``exec`` streams the command and sends each chunk as an MCP progress
  notification when the caller asked for progress.

Every :class:`~sandlot.protocol.errors.SandlotError` becomes a tool result with
``isError`` set whose text (and ``structuredContent``) is
``{"code": "CAPABILITY_DENIED", "message": …, "retryable": …}``: the wire code of
PROTOCOL.md section 1. Resource reads fail with a JSON-RPC error carrying the same
object in ``data``.

Resources: ``sandlot://{session_id}/{+path}`` is a sandbox file, ``path`` being its
absolute path inside the sandbox without the leading ``/``
(``sandlot://ssn_1/workspace/a.py`` is ``/workspace/a.py``): the form of
:mod:`sandlot.protocol.uris`, which A2A parts share (with a sandbox id).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import hashlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Literal, ParamSpec

import anyio
from mcp.server.mcpserver import Context, MCPServer
from mcp.shared.exceptions import MCPError
from mcp.shared.jsonrpc_dispatcher import progress_token_from_params
from mcp_types import INTERNAL_ERROR, INVALID_PARAMS, CallToolResult, TextContent
from pydantic import BaseModel
from starlette.types import ASGIApp, Receive, Scope, Send

from sandlot.protocol.errors import (
    Forbidden,
    InvalidRequest,
    NotFound,
    PayloadTooLarge,
    ProviderUnavailable,
    SandlotError,
    SessionExpired,
    Unauthenticated,
)
from sandlot.protocol.uris import sandbox_uri
from sandlot.sdk import AsyncSandbox, AsyncSandlot, CommandResult, FileEntry

#: Largest file ``download`` (and a resource read) returns: MCP messages are held whole.
MAX_DOWNLOAD_BYTES = 8 << 20
#: Characters of stdout and of stderr an ``exec`` result carries (the rest is cut).
MAX_OUTPUT_CHARS = 256 << 10
#: Seconds ``exec`` gives a command that names no ``timeout``.
EXEC_TIMEOUT_SECONDS = 300.0
#: Seconds a session no call used stays held by the server (its lease kept).
SESSION_IDLE_SECONDS = 600.0
#: How long the broker's word on a key opening an MCP session is kept (a revoked key is
#: refused by every call it makes, whatever this says).
KEY_CHECK_SECONDS = 10.0
#: The modes of ``environment_acquire`` and the protocol's (PROTOCOL.md 2.1).
MODES = {"ensure": "ensure", "attach": "attach_only", "create": "create_only"}

P = ParamSpec("P")
Json = dict[str, Any]


class ScopeArg(BaseModel):
    """A scope of PROTOCOL.md 2.1: ``type`` (thread, assistant, workspace, …) and ``id``."""

    type: str
    id: str


class Caller:
    """What one API key reaches: its broker client and the sandboxes of its sessions,
    each with when a call last used it."""

    def __init__(self, url: str, api_key: str) -> None:
        self.client = AsyncSandlot(url=url, api_key=api_key)
        self.sandboxes: dict[str, AsyncSandbox] = {}
        self.used: dict[str, float] = {}
        #: When a call last came with this key, and how many of its calls run now.
        self.called = time.monotonic()
        self.in_flight = 0

    def _use(self, sandbox: AsyncSandbox) -> AsyncSandbox:
        if sandbox.grant.session_id is not None:
            self.used[sandbox.grant.session_id] = time.monotonic()
        return sandbox

    async def let_go(self, idle: float) -> None:
        """Stop holding the sessions no call used for ``idle`` seconds: their leases
        then expire at the broker, so a sandbox whose MCP client went away goes idle
        and is reaped as any other (it was held for the server's life). A later call
        naming the session takes it up again."""
        if self.in_flight:
            return
        now = time.monotonic()
        for session_id, at in list(self.used.items()):
            if now - at < idle:
                continue
            del self.used[session_id]
            sandbox = self.sandboxes.pop(session_id, None)
            await self.client.forget(session_id)
            if sandbox is not None:
                await sandbox.aclose()

    async def acquire(
        self,
        *,
        scope_type: str,
        scope_id: str,
        mode: str = "ensure",
        template: str | None = None,
        capabilities: list[str] | None = None,
    ) -> AsyncSandbox:
        sandbox = await self.client.ensure(
            scope_type=scope_type,
            scope_id=scope_id,
            mode=mode,
            template=template,
            capabilities=capabilities,
        )
        if sandbox.grant.session_id is not None:
            self.sandboxes[sandbox.grant.session_id] = sandbox
        return self._use(sandbox)

    async def sandbox(self, session_id: str | None, thread_id: str | None) -> AsyncSandbox:
        """The sandbox of a session this server acquired, or one it adopts by attaching to
        the session's scope (a session acquired before a restart, say)."""
        if session_id:
            known = self.sandboxes.get(session_id)
            if known is not None:
                return self._use(known)
            scope = (await self.client.session(session_id)).binding.scope
            adopted = await self.acquire(
                scope_type=scope.type, scope_id=scope.id, mode="attach_only"
            )
            if adopted.grant.session_id != session_id:
                # The scope is bound anew: never act on another session than the one named.
                raise SessionExpired(f"session {session_id} has ended")
            return adopted
        if thread_id:
            return await self.acquire(scope_type="thread", scope_id=thread_id)
        raise InvalidRequest("name the environment: session_id (or thread_id)")

    async def aclose(self) -> None:
        await self.client.aclose()


class Callers:
    """One :class:`Caller` per API key, made on first use. Over stdio there is one key,
    ``default_key``; over HTTP each request names its own."""

    def __init__(
        self, url: str, default_key: str | None = None, idle: float = SESSION_IDLE_SECONDS
    ) -> None:
        self.url = url
        self.default_key = default_key
        self.idle = idle
        self.by_key: dict[str, Caller] = {}
        self._sweeper: asyncio.Task[None] | None = None
        #: Digest of a key → until when, and why it may open no session (or None).
        self._checked: dict[str, tuple[float, SandlotError | None]] = {}

    def key(self, ctx: Context) -> str | None:
        headers = ctx.headers
        return _bearer(headers.get("authorization")) if headers is not None else self.default_key

    def of(self, ctx: Context) -> Caller:
        key = self.key(ctx)
        if not key:
            raise Unauthenticated("no API key: send Authorization: Bearer <sandlot API key>")
        caller = self.by_key.get(key)
        if caller is None:
            caller = self.by_key[key] = Caller(self.url, key)
        caller.called = time.monotonic()
        if self._sweeper is None or self._sweeper.done():
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep())
        return caller

    async def _sweep(self) -> None:
        """Every tenth of :attr:`idle`: sessions no call used that long let go, and the
        clients of keys left holding none closed."""
        while self.by_key:
            await asyncio.sleep(max(self.idle / 10, 0.1))
            for key, caller in list(self.by_key.items()):
                with contextlib.suppress(Exception):
                    await caller.let_go(self.idle)
                quiet = time.monotonic() - caller.called > self.idle and not caller.in_flight
                if quiet and not caller.sandboxes and self.by_key.get(key) is caller:
                    del self.by_key[key]
                    await caller.aclose()

    async def check_key(self, key: str) -> SandlotError | None:
        """Why ``key`` may not open an MCP session (``None``: it may), asked of the
        broker and remembered for :data:`KEY_CHECK_SECONDS`. Sessions are one pool for
        every client of the server: opened with any bearer value at all, they were all
        taken, and every user was refused (503 "Too many open sessions")."""
        digest = hashlib.sha256(key.encode()).hexdigest()
        now = time.monotonic()
        known = self._checked.get(digest)
        if known is not None and known[0] > now:
            return known[1]
        caller = self.by_key.get(key)
        client = caller.client if caller is not None else AsyncSandlot(url=self.url, api_key=key)
        refused: SandlotError | None = None
        try:
            await client.list_templates(timeout=10)
        except (Unauthenticated, Forbidden) as exc:
            refused = Unauthenticated(f"the API key is not accepted: {exc.message}")
        except SandlotError as exc:
            # Not known either way: nothing remembered, the next session asks again.
            return ProviderUnavailable(f"the broker cannot say who this key is: {exc.message}")
        finally:
            if caller is None:
                await client.aclose()
        if len(self._checked) > 10_000:
            self._checked.clear()
        self._checked[digest] = (now + KEY_CHECK_SECONDS, refused)
        return refused

    async def forget(self, ctx: Context) -> None:
        """Drop the client of a key whose call failed, unless it holds sessions: keys
        that were never valid must not pile up."""
        key = self.key(ctx)
        caller = self.by_key.get(key) if key else None
        # Not while another call of the key runs (this one counts itself).
        if key and caller is not None and not caller.sandboxes and caller.in_flight <= 1:
            del self.by_key[key]
            await caller.aclose()

    async def aclose(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
        for caller in self.by_key.values():
            await caller.aclose()
        self.by_key.clear()


def _bearer(value: str | None) -> str | None:
    if value and value[:7].lower() == "bearer ":
        return value[7:].strip() or None
    return None


def error_body(exc: SandlotError) -> Json:
    """The protocol's error object (PROTOCOL.md section 1) an MCP client is shown."""
    body: Json = {"code": exc.wire_code, "message": exc.message, "retryable": exc.retryable}
    if exc.metadata:
        body["metadata"] = exc.metadata
    return body


def _tool(
    callers: Callers,
) -> Callable[[Callable[P, Awaitable[Json]]], Callable[P, Awaitable[Json | CallToolResult]]]:
    """Turn a :class:`SandlotError` into an ``isError`` result carrying the wire code."""

    def wrap(fn: Callable[P, Awaitable[Json]]) -> Callable[P, Awaitable[Json | CallToolResult]]:
        @functools.wraps(fn)
        async def run(*args: P.args, **kwargs: P.kwargs) -> Json | CallToolResult:
            ctx = kwargs.get("ctx")
            caller: Caller | None = None
            try:
                if isinstance(ctx, Context):
                    # A key's sessions are not let go while one of its calls runs.
                    caller = callers.of(ctx)
                    caller.in_flight += 1
                return await fn(*args, **kwargs)
            except SandlotError as exc:
                if isinstance(ctx, Context):
                    # Whatever failed, a key that holds no session keeps no client: a
                    # call refused before the broker was asked (a missing argument) left
                    # one per key ever sent, which anyone could send by the thousand.
                    await callers.forget(ctx)
                body = error_body(exc)
                return CallToolResult(
                    content=[TextContent(type="text", text=json.dumps(body))],
                    structured_content=body,
                    is_error=True,
                )
            finally:
                if caller is not None:
                    caller.in_flight -= 1

        return run

    return wrap


def _grant_summary(sandbox: AsyncSandbox, *, include_token: bool) -> Json:
    grant = sandbox.grant
    out: Json = {
        "session_id": grant.session_id,
        "sandbox_id": grant.sandbox_id,
        "scope": grant.scope,
        "state": grant.state,
        "capabilities": list(grant.capabilities),
        "expires_at": grant.raw.get("expires_at"),
    }
    if include_token:
        out["token"] = grant.token
        out["http_base_url"] = grant.http_base_url
    return out


def _entry(entry: FileEntry) -> Json:
    return {
        "path": entry.path,
        "is_dir": entry.is_dir,
        "size": entry.size,
        "modified_at": entry.modified_at,
    }


def _cut(text: str) -> tuple[str, bool]:
    if len(text) <= MAX_OUTPUT_CHARS:
        return text, False
    return text[:MAX_OUTPUT_CHARS], True


def _exec_result(result: CommandResult) -> Json:
    stdout, cut_out = _cut(result.stdout)
    stderr, cut_err = _cut(result.stderr)
    return {
        "exit_code": result.exit_code,
        "stdout": stdout,
        "stderr": stderr,
        "timed_out": result.timed_out,
        "truncated": result.truncated or cut_out or cut_err,
        "exec_id": result.exec_id,
    }


async def _stream(sandbox: AsyncSandbox, command: str, ctx: Context, **kw: Any) -> CommandResult:
    """Run a command over the streaming socket, each chunk sent as a progress notification
    (``progress`` counts the output bytes so far; ``message`` is the chunk)."""
    cmd = await sandbox.stream(command, **kw)
    seen = 0
    parts: dict[str, list[str]] = {"stdout": [], "stderr": []}
    sizes = {"stdout": 0, "stderr": 0}
    lost = 0
    try:
        async for chunk in cmd:
            seen += len(chunk.data.encode("utf-8")) + chunk.lost
            lost += chunk.lost
            if sizes[chunk.stream] < MAX_OUTPUT_CHARS:
                parts[chunk.stream].append(chunk.data)
                sizes[chunk.stream] += len(chunk.data)
            await ctx.report_progress(seen, None, chunk.data)
    except anyio.get_cancelled_exc_class():
        # The call was cancelled: so is its command (left, it would run on unseen).
        with (
            anyio.CancelScope(shield=True),
            anyio.move_on_after(5),
            contextlib.suppress(Exception),
        ):
            await cmd.signal("SIGKILL")
        raise
    finally:
        await cmd.aclose()
    return CommandResult(
        exit_code=cmd.exit_code,
        stdout="".join(parts["stdout"]),
        stderr="".join(parts["stderr"]),
        exec_id=cmd.exec_id,
        command_id=cmd.command_id,
        timed_out=cmd.timed_out,
        truncated=lost > 0 or any(size >= MAX_OUTPUT_CHARS for size in sizes.values()),
    )


async def _download(sandbox: AsyncSandbox, path: str) -> bytes:
    parts: list[bytes] = []
    size = 0
    async for chunk in sandbox.download_stream(path):
        size += len(chunk)
        if size > MAX_DOWNLOAD_BYTES:
            raise PayloadTooLarge(
                f"{path} is larger than {MAX_DOWNLOAD_BYTES} bytes: fetch it with the SDK or CLI",
                metadata={"limit": MAX_DOWNLOAD_BYTES},
            )
        parts.append(chunk)
    return b"".join(parts)


def build_server(callers: Callers) -> MCPServer[Any]:
    """The MCP server: its tools and its resource template, over ``callers``."""
    tool = _tool(callers)
    mcp: MCPServer[Any] = MCPServer(
        "sandlot",
        instructions=(
            "Shared sandboxes. Call environment_acquire (a thread_id is enough) and use the "
            "session_id it returns with exec, read, write, edit, ls, glob, grep, upload and "
            "download. Paths are inside the sandbox; relative ones start at /workspace."
        ),
    )

    @mcp.tool()
    @tool
    async def environment_acquire(
        ctx: Context,
        thread_id: str | None = None,
        scope: ScopeArg | None = None,
        mode: Literal["ensure", "attach", "create"] = "ensure",
        template: str | None = None,
        capabilities: list[str] | None = None,
        include_token: bool = False,
    ) -> Json:
        """Attach to a scope's sandbox (a thread's, by default), creating it with mode ensure.

        Returns the session: session_id, sandbox_id, scope, state, capabilities and the
        token's expires_at (the token itself with include_token). capabilities narrows
        the grant (fs_read, fs_write, exec, shell).
        """
        if scope is not None and scope.id:
            scope_type, scope_id = scope.type, scope.id
        elif scope is not None:
            raise InvalidRequest("scope.id cannot be empty")
        elif thread_id:
            scope_type, scope_id = "thread", thread_id
        else:
            raise InvalidRequest("name a scope: thread_id or scope {type, id}")
        sandbox = await callers.of(ctx).acquire(
            scope_type=scope_type,
            scope_id=scope_id,
            mode=MODES[mode],
            template=template,
            capabilities=capabilities,
        )
        return _grant_summary(sandbox, include_token=include_token)

    @mcp.tool()
    @tool
    async def environment_refresh(ctx: Context, session_id: str) -> Json:
        """Mint a fresh token for the session (capabilities never wider than granted)."""
        caller = callers.of(ctx)
        result = await caller.client.refresh(session_id)
        known = caller.sandboxes.get(session_id)
        if known is not None:
            known.grant.update_token(result)
        return {
            "session_id": session_id,
            "expires_at": result.expires_at,
            "capabilities": result.credentials.granted_capabilities,
        }

    @mcp.tool()
    @tool
    async def environment_heartbeat(ctx: Context, session_id: str) -> Json:
        """Extend this caller's lease on the session: its state and the lease's new expiry."""
        result = await callers.of(ctx).client.heartbeat(session_id)
        return {
            "session_id": session_id,
            "state": result.state,
            "lease_expires_at": result.lease_expires_at,
        }

    @mcp.tool()
    @tool
    async def environment_release(ctx: Context, session_id: str, terminate: bool = False) -> Json:
        """Detach from the session (its tokens are revoked); terminate tears the sandbox down."""
        if not session_id:
            raise InvalidRequest("session_id cannot be empty")
        caller = callers.of(ctx)
        snapshot = await caller.client.release(session_id, terminate=terminate)
        caller.sandboxes.pop(session_id, None)
        caller.used.pop(session_id, None)
        state = snapshot.binding.state if snapshot is not None else None
        return {"session_id": session_id, "released": True, "state": state}

    @mcp.tool(name="exec")
    @tool
    async def exec_(
        ctx: Context,
        command: str,
        session_id: str | None = None,
        thread_id: str | None = None,
        timeout: float | None = None,
        cwd: str | None = None,
    ) -> Json:
        """Run a shell command in the sandbox and return exit_code, stdout and stderr.

        timeout (seconds, 300 by default) bounds the command (exit code 124 when it is
        hit). With a progress token, output is streamed as progress notifications while
        it runs.
        """
        # Never unbounded: a command that outlived the call's answer ran on unseen, and
        # each retry of the call started another.
        timeout = EXEC_TIMEOUT_SECONDS if timeout is None else timeout
        sandbox = await callers.of(ctx).sandbox(session_id, thread_id)
        # Without exec in the grant, POST /exec lets the dataplane answer CAPABILITY_DENIED
        # itself (the SDK's socket reports a refused socket only as a broken one).
        wanted = progress_token_from_params(ctx.request_context.params) is not None
        if wanted and "exec" in sandbox.grant.capabilities:
            result = await _stream(sandbox, command, ctx, timeout_seconds=timeout, cwd=cwd)
        else:
            result = await sandbox.exec(command, timeout_seconds=timeout, cwd=cwd)
        return _exec_result(result)

    @mcp.tool()
    @tool
    async def read(
        ctx: Context,
        path: str,
        session_id: str | None = None,
        thread_id: str | None = None,
        offset: int = 0,
        limit: int = 2000,
    ) -> Json:
        """Lines offset .. offset+limit of a file (0-based), with its etag (base64 if binary)."""
        sandbox = await callers.of(ctx).sandbox(session_id, thread_id)
        result = await sandbox.read(path, offset=offset, limit=limit)
        return {
            "content": result.content,
            "encoding": result.encoding,
            "total_lines": result.total_lines,
            "start_line": result.start_line,
            "end_line": result.end_line,
            "next_offset": result.next_offset,
            "etag": result.etag,
        }

    @mcp.tool()
    @tool
    async def write(
        ctx: Context,
        path: str,
        content: str,
        session_id: str | None = None,
        thread_id: str | None = None,
        if_match: str | None = None,
    ) -> Json:
        """Write a text file (parents created); if_match writes only over that etag."""
        sandbox = await callers.of(ctx).sandbox(session_id, thread_id)
        etag = await sandbox.write(path, content, if_match=if_match)
        return {"path": path, "etag": etag}

    @mcp.tool()
    @tool
    async def edit(
        ctx: Context,
        path: str,
        old_string: str,
        new_string: str,
        session_id: str | None = None,
        thread_id: str | None = None,
        replace_all: bool = False,
    ) -> Json:
        """Replace old_string by new_string in a file (every occurrence with replace_all)."""
        sandbox = await callers.of(ctx).sandbox(session_id, thread_id)
        result = await sandbox.edit(path, old_string, new_string, replace_all=replace_all)
        return {"path": result.path, "occurrences": result.occurrences, "etag": result.etag}

    @mcp.tool()
    @tool
    async def ls(
        ctx: Context,
        path: str = "/workspace",
        session_id: str | None = None,
        thread_id: str | None = None,
        depth: int = 1,
    ) -> Json:
        """Entries of a directory (depth levels), with absolute paths."""
        sandbox = await callers.of(ctx).sandbox(session_id, thread_id)
        listing = await sandbox.ls(path, depth=depth)
        return {"entries": [_entry(e) for e in listing], "truncated": listing.truncated}

    @mcp.tool()
    @tool
    async def glob(
        ctx: Context,
        pattern: str,
        path: str = "/workspace",
        session_id: str | None = None,
        thread_id: str | None = None,
    ) -> Json:
        """Regular files matching pattern under path (** spans directories)."""
        sandbox = await callers.of(ctx).sandbox(session_id, thread_id)
        found = await sandbox.glob(pattern, path)
        return {"matches": [_entry(e) for e in found], "truncated": found.truncated}

    @mcp.tool()
    @tool
    async def grep(
        ctx: Context,
        pattern: str,
        path: str = "/workspace",
        session_id: str | None = None,
        thread_id: str | None = None,
        glob: str | None = None,
        max_count: int | None = None,
        regex: bool = False,
    ) -> Json:
        """Lines containing pattern (literal unless regex): matches of path, line, text."""
        sandbox = await callers.of(ctx).sandbox(session_id, thread_id)
        answer = await sandbox.grep_raw(pattern, path, glob=glob, max_count=max_count, regex=regex)
        return {"matches": list(answer["matches"]), "truncated": bool(answer.get("truncated"))}

    @mcp.tool()
    @tool
    async def upload(
        ctx: Context,
        path: str,
        content_base64: str,
        session_id: str | None = None,
        thread_id: str | None = None,
    ) -> Json:
        """Write a file of any bytes, given base64-encoded (parents created)."""
        try:
            data = base64.b64decode(content_base64, validate=True)
        except ValueError:
            raise InvalidRequest("content_base64 is not base64") from None
        sandbox = await callers.of(ctx).sandbox(session_id, thread_id)
        result = await sandbox.upload(path, data)
        return {"path": result.path, "size": result.size}

    @mcp.tool()
    @tool
    async def download(
        ctx: Context,
        path: str,
        session_id: str | None = None,
        thread_id: str | None = None,
    ) -> Json:
        """A file's bytes, base64-encoded (up to 8 MiB)."""
        sandbox = await callers.of(ctx).sandbox(session_id, thread_id)
        data = await _download(sandbox, path)
        return {"path": path, "size": len(data), "content_base64": base64.b64encode(data).decode()}

    @mcp.resource(
        "sandlot://{session_id}/{+path}",
        name="sandbox-file",
        description="A file of a session's sandbox: sandlot://SESSION_ID/workspace/a.py",
    )
    async def sandbox_file(session_id: str, path: str, ctx: Context) -> str | bytes:
        try:
            uri = sandbox_uri(session_id, "/" + path)
        except ValueError as exc:
            raise MCPError(code=INVALID_PARAMS, message=str(exc)) from None
        try:
            sandbox = await callers.of(ctx).sandbox(session_id, None)
            data = await _download(sandbox, "/" + path)
        except SandlotError as exc:
            if isinstance(exc, Unauthenticated):
                await callers.forget(ctx)
            code = INVALID_PARAMS if isinstance(exc, NotFound | InvalidRequest) else INTERNAL_ERROR
            raise MCPError(
                code=code, message=exc.message, data={**error_body(exc), "uri": uri}
            ) from None
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            return data

    return mcp


class RequireBearer:
    """Answer 401 (the protocol's error envelope) to an HTTP request without a bearer
    credential before it reaches MCP, and to one that opens a session (no
    ``mcp-session-id``) with a key the broker does not accept (``check``); whether a
    key may do what a call asks is the broker's to say, on that call."""

    def __init__(
        self, app: ASGIApp, check: Callable[[str], Awaitable[SandlotError | None]] | None = None
    ) -> None:
        self.app = app
        self.check = check

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = dict(scope.get("headers") or [])
            key = _bearer(headers.get(b"authorization", b"").decode("latin-1"))
            error: SandlotError | None = None
            if not key:
                error = Unauthenticated("send Authorization: Bearer <sandlot API key>")
            elif self.check is not None and b"mcp-session-id" not in headers:
                error = await self.check(key)
            if error is not None:
                body = json.dumps(error.to_wire()).encode()
                await send(
                    {
                        "type": "http.response.start",
                        "status": error.status,
                        "headers": [
                            (b"content-type", b"application/json"),
                            (b"www-authenticate", b"Bearer"),
                            (b"content-length", str(len(body)).encode()),
                        ],
                    }
                )
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)


class HttpMcp:
    """The MCP server over streamable HTTP at ``path``, in front of ``app`` (which serves
    every other path): what ``sandlot serve`` puts at ``/mcp``. Every MCP request must
    carry a bearer API key; ``url`` is the broker the SDK clients talk to.

    Its :meth:`lifespan` must run while it serves (it runs the MCP session manager).
    """

    def __init__(
        self, app: ASGIApp, url: str, *, path: str = "/mcp", allowed_hosts: list[str] | None = None
    ) -> None:
        from mcp.server.transport_security import TransportSecuritySettings

        self.app = app
        self.path = path
        self.callers = Callers(url)
        self.server = build_server(self.callers)
        # The bearer key is the defence; Host checks apply only when hosts are named.
        security = (
            TransportSecuritySettings(allowed_hosts=allowed_hosts, allowed_origins=[])
            if allowed_hosts
            else TransportSecuritySettings(enable_dns_rebinding_protection=False)
        )
        self.mcp_app: ASGIApp = RequireBearer(
            self.server.streamable_http_app(streamable_http_path=path, transport_security=security),
            self.callers.check_key,
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].rstrip("/") == self.path:
            await self.mcp_app(scope, receive, send)
            return
        await self.app(scope, receive, send)

    @contextlib.asynccontextmanager
    async def lifespan(self) -> AsyncIterator[None]:
        """Run the MCP session manager; close the SDK clients after it."""
        async with self.server.session_manager.run():
            try:
                yield
            finally:
                await self.callers.aclose()


def run_stdio(url: str, api_key: str) -> None:
    """Serve MCP over stdin/stdout with one API key (``sandlot mcp``)."""
    import anyio

    callers = Callers(url, default_key=api_key)
    server = build_server(callers)

    async def main() -> None:
        try:
            await server.run_stdio_async()
        finally:
            await callers.aclose()

    anyio.run(main)
