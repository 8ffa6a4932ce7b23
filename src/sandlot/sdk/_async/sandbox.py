"""One sandbox's dataplane: commands, shells, files, filesystem operations, events.

An :class:`AsyncSandbox` is built from a grant: the one :meth:`AsyncSandlot.ensure
<sandlot.sdk.AsyncSandlot.ensure>` returns (kept fresh by the client), or a
grant in hand, including the bootstrap object of PROTOCOL.md 2.10::

    sandbox = AsyncSandbox(config["configurable"]["sandbox"])
    result = await sandbox.run("pytest -q")
"""

from __future__ import annotations

import io
import os
import tarfile
import uuid
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Mapping
from typing import Any
from urllib.parse import urlencode

from sandlot.protocol.errors import CommandExitError, SandboxStarting, SandlotError
from sandlot.sdk import _aio
from sandlot.sdk._async._http import KEEPALIVE, AsyncHTTP
from sandlot.sdk._async._wire import AsyncWire
from sandlot.sdk._async.commands import AsyncCommand
from sandlot.sdk._async.events import AsyncEventStream
from sandlot.sdk._async.shells import AsyncShell
from sandlot.sdk.transport import Deadline, seg
from sandlot.sdk.types import (
    ArchiveResult,
    CommandResult,
    EditResult,
    ExecSnapshot,
    FileStat,
    Grant,
    GrepAnswer,
    GrepMatch,
    Listing,
    ReadResult,
    ShellSnapshot,
    UploadResult,
)

#: Block size of streamed uploads from local files.
CHUNK = 1 << 20

_ENDED = ("failed", "terminated")


class AsyncSandbox:
    """The dataplane of one sandbox, reached with a grant's token.

    ``grant`` is a :class:`~sandlot.sdk.types.Grant` or any mapping
    :meth:`Grant.from_response <sandlot.sdk.types.Grant.from_response>` accepts.
    ``timeout`` is the default deadline of every call (each method also takes
    its own). ``renew`` (given by the broker client) obtains a fresh token after
    a 401; a bootstrap grant has none. ``wire`` is a connection pool to share
    (the broker client passes its own). ``keepalive`` is the interval of the pings
    that detect a dead WebSocket (commands, shells, events): a socket is taken
    as dead after about twice that without an answer (``None``: no pings).
    """

    def __init__(
        self,
        grant: Grant | Mapping[str, Any],
        *,
        timeout: float | None = 60.0,
        wire: AsyncWire | None = None,
        renew: Callable[[], Awaitable[bool]] | None = None,
        keepalive: float | None = KEEPALIVE,
    ) -> None:
        self.grant = Grant.from_response(grant)
        self.timeout = timeout
        self.keepalive = keepalive
        self._renew = renew
        self._http = AsyncHTTP(
            self.grant.http_base_url,
            self._auth,
            timeout=timeout,
            wire=wire,
            on_unauthenticated=self._renew_token if renew else None,
        )

    @classmethod
    def from_config(cls, config: Mapping[str, Any], **kwargs: Any) -> AsyncSandbox:
        """The sandbox of a LangGraph ``config``: ``config["configurable"]["sandbox"]``."""
        return cls(config["configurable"]["sandbox"], **kwargs)

    @property
    def id(self) -> str:
        """The sandbox id (``sb_…``)."""
        return self.grant.sandbox_id

    def _auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.grant.token}"}

    @property
    def renew(self) -> Callable[[], Awaitable[bool]] | None:
        """What obtains a fresh token for this grant when the current one expires (given by
        the broker client; ``None``: nothing does). Another sandbox object made for the
        same grant (on another event loop, say) can be given it."""
        return self._renew

    async def _renew_token(self) -> bool:
        return await self._renew() if self._renew is not None else False

    def _ws_url(self, path: str, **params: Any) -> str:
        query = urlencode({k: v for k, v in params.items() if v is not None})
        return self.grant.ws_base_url + path + (f"?{query}" if query else "")

    async def _call(
        self, method: str, path: str, timeout: float | None, *, idle: float | None = None, **kw: Any
    ) -> Any:
        """A JSON call that waits out 423 SANDBOX_STARTING on the sandbox's event log.

        The log is read from its start once per call, and the call is retried after
        each activation it reports: an activation older than the 423 only costs one
        retry, and the cursor has then moved past it. No polling.
        """
        deadline = self._transfer_deadline(timeout, idle)
        log: AsyncEventStream | None = None
        try:
            while True:
                try:
                    return await self._http.json(method, path, deadline=deadline, **kw)
                except SandboxStarting as exc:
                    if log is None:
                        log = AsyncEventStream(
                            self._http, "/events", after=0, timeout=deadline.remaining()
                        )
                    await self._next_activation(log, exc, deadline)
        finally:
            if log is not None:
                await log.aclose()

    def _transfer_deadline(self, timeout: float | None, idle: float | None) -> Deadline:
        """The client's default deadline; with ``idle``, only the one given (if any), and
        each step bounded by ``idle``."""
        return self._http.deadline(timeout) if idle is None else Deadline(timeout, idle=idle)

    async def _next_activation(
        self, log: AsyncEventStream, exc: SandboxStarting, deadline: Deadline
    ) -> None:
        try:
            async for event in log:
                phase = event.details.get("phase") or {}
                if phase.get("to") in _ENDED:
                    raise SandlotError(f"sandbox {self.id} is {phase.get('to')}")
                if phase.get("to") in ("active", "idle"):
                    return
        except SandboxStarting:
            # The log itself is not served yet: the one place left to wait is Retry-After.
            await _aio.sleep(min(exc.retry_after or 0.5, deadline.remaining() or 0.5))
            return
        raise SandlotError("event log ended while the sandbox was starting")

    async def _ensure_started(self, timeout: float | None) -> None:
        # Sockets cannot answer 423: before opening one on a sandbox not known to be
        # active, wait for it (one HTTP call when it is).
        if self.grant.state not in ("active", "idle"):
            await self.wait_ready(timeout=timeout)
            self.grant.state = "active"

    async def wait_ready(self, *, timeout: float | None = None) -> None:
        """Return once the sandbox is active (waiting on its event log, never polling)."""
        await self._call("GET", "/fs/stat", timeout, params={"path": "/workspace"})

    # --- commands ------------------------------------------------------------------

    async def exec(
        self,
        command: str | list[str],
        *,
        shell: str | None = None,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        stdin: str | None = None,
        timeout_seconds: float | None = None,
        command_id: str | None = None,
        check: bool = False,
        timeout: float | None = None,
    ) -> CommandResult:
        """Run a command to completion and return its result (``POST /exec``).

        A string runs under ``shell`` (``/bin/bash`` by default), a list directly.
        ``timeout_seconds`` bounds the command inside the sandbox (exit code 124);
        ``timeout`` is this call's client-side deadline. ``check=True`` raises
        :class:`~sandlot.protocol.errors.CommandExitError` (carrying the result)
        on a non-zero exit. A ``command_id`` makes a retry return the first
        run's result instead of running the command again.
        """
        body: dict[str, Any] = {"command": command, "command_id": command_id or _command_id()}
        for key, value in (
            ("shell", shell),
            ("env", env),
            ("cwd", cwd),
            ("stdin", stdin),
            ("timeout_seconds", timeout_seconds),
        ):
            if value is not None:
                body[key] = value
        if timeout is None and self.timeout is not None and timeout_seconds is not None:
            timeout = max(self.timeout, timeout_seconds + 10)
        result = CommandResult.from_wire(await self._call("POST", "/exec", timeout, json_body=body))
        if check and result.exit_code != 0:
            raise CommandExitError(result)
        return result

    async def run(
        self,
        command: str | list[str],
        *,
        shell: str | None = None,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        stdin: str | None = None,
        timeout_seconds: float | None = None,
        command_id: str | None = None,
        check: bool = True,
        wait: bool = True,
        timeout: float | None = None,
    ) -> CommandResult | AsyncCommand:
        """Run a command; by default wait for it and raise on a non-zero exit.

        With ``wait=False`` the command is started over the streaming socket and
        its :class:`AsyncCommand` is returned at once (``await cmd.wait()`` later).
        """
        if not wait:
            return await self.stream(
                command,
                shell=shell,
                env=env,
                cwd=cwd,
                timeout_seconds=timeout_seconds,
                command_id=command_id,
                timeout=timeout,
            )
        return await self.exec(
            command,
            shell=shell,
            env=env,
            cwd=cwd,
            stdin=stdin,
            timeout_seconds=timeout_seconds,
            command_id=command_id,
            check=check,
            timeout=timeout,
        )

    async def stream(
        self,
        command: str | list[str],
        *,
        shell: str | None = None,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        pty: bool = False,
        cols: int | None = None,
        rows: int | None = None,
        timeout_seconds: float | None = None,
        command_id: str | None = None,
        timeout: float | None = None,
    ) -> AsyncCommand:
        """Start a command and return it as an async iterator of output chunks.

        A broken connection is resumed with ``attach`` from the last offsets
        seen; the command is never started twice.
        """
        start: dict[str, Any] = {"command": command, "command_id": command_id or _command_id()}
        for key, value in (
            ("shell", shell),
            ("env", env),
            ("cwd", cwd),
            ("timeout_seconds", timeout_seconds),
            ("cols", cols),
            ("rows", rows),
        ):
            if value is not None:
                start[key] = value
        if pty:
            start["pty"] = True
        await self._ensure_started(timeout)
        cmd = AsyncCommand(
            self._ws_url("/exec/ws"),
            self._auth,
            start=start,
            renew=self._renew_token if self._renew else None,
            timeout=timeout,
            keepalive=self.keepalive,
        )
        return await cmd.connect()

    async def attach(
        self,
        exec_id: str,
        *,
        stdout_offset: int = 0,
        stderr_offset: int = 0,
        timeout: float | None = None,
    ) -> AsyncCommand:
        """Attach to a running or recently finished command from the given offsets."""
        cmd = AsyncCommand(
            self._ws_url("/exec/ws"),
            self._auth,
            exec_id=exec_id,
            stdout_offset=stdout_offset,
            stderr_offset=stderr_offset,
            renew=self._renew_token if self._renew else None,
            timeout=timeout,
            keepalive=self.keepalive,
        )
        return await cmd.connect()

    async def list_execs(self, *, timeout: float | None = None) -> list[ExecSnapshot]:
        """Snapshots of the sandbox's commands, running and recently ended (``GET /execs``)."""
        body = await self._call("GET", "/execs", timeout)
        return [ExecSnapshot.from_wire(e) for e in body["execs"]]

    async def get_exec(self, exec_id: str, *, timeout: float | None = None) -> ExecSnapshot:
        """One command's snapshot, with ``last_event_sequence`` (``GET /execs/{id}``)."""
        return ExecSnapshot.from_wire(await self._call("GET", f"/execs/{seg(exec_id)}", timeout))

    async def signal_exec(
        self, exec_id: str, signal: str = "SIGINT", *, timeout: float | None = None
    ) -> ExecSnapshot:
        """Send a signal to a command; return its snapshot as the signal was sent."""
        body = await self._call(
            "POST", f"/execs/{seg(exec_id)}/signal", timeout, json_body={"signal": signal}
        )
        return ExecSnapshot.from_wire(body)

    # --- shells --------------------------------------------------------------------

    async def shell(
        self,
        name: str = "main",
        *,
        role: str = "driver",
        profile: str | None = None,
        cols: int | None = None,
        rows: int | None = None,
        create: bool = True,
        timeout: float | None = None,
    ) -> AsyncShell:
        """Attach to the named shared shell as ``driver`` or ``observer`` (created if missing)."""
        await self._ensure_started(timeout)
        url = self._ws_url(
            "/shell/ws",
            session=name,
            role=role,
            profile=profile,
            cols=cols,
            rows=rows,
            create=None if create else "false",
        )
        return await AsyncShell.connect(
            url,
            self._auth,
            name=name,
            role=role,
            timeout=timeout or self.timeout,
            keepalive=self.keepalive,
        )

    async def list_shells(self, *, timeout: float | None = None) -> list[ShellSnapshot]:
        """The sandbox's shells (``GET /shells``)."""
        body = await self._call("GET", "/shells", timeout)
        return [ShellSnapshot.from_wire(s) for s in body["shells"]]

    async def delete_shell(self, name: str, *, timeout: float | None = None) -> None:
        """End a shell for every client."""
        await self._call("DELETE", f"/shells/{seg(name)}", timeout)

    # --- files ---------------------------------------------------------------------

    async def upload(
        self,
        path: str,
        data: bytes | str | os.PathLike[str] | AsyncIterable[bytes],
        *,
        timeout: float | None = None,
    ) -> UploadResult:
        """Write a file, streamed: ``data`` is bytes, a local file path, or chunks of bytes.

        A ``str`` is a local path (``os.PathLike`` too); pass ``text.encode()`` for content.
        """
        content: Any = data
        if isinstance(data, str | os.PathLike):
            content = _local_chunks(os.fspath(data))
        body = await self._call(
            "POST", "/files/upload", timeout, params={"path": path}, content=content
        )
        return UploadResult.from_wire(body)

    async def download(self, path: str, *, timeout: float | None = None) -> bytes:
        """A file's bytes."""
        parts = [chunk async for chunk in self.download_stream(path, timeout=timeout)]
        return b"".join(parts)

    async def download_stream(
        self, path: str, *, timeout: float | None = None
    ) -> AsyncIterator[bytes]:
        """A file's bytes, chunk by chunk as they arrive."""
        deadline = self._http.deadline(timeout)
        async with self._http.stream(
            "/files/download", deadline=deadline, params={"path": path}
        ) as resp:
            async for chunk in resp.aiter_bytes():
                yield chunk

    async def download_to(self, path: str, dest: str, *, timeout: float | None = None) -> int:
        """Save a file of the sandbox to the local path ``dest``; return its size."""
        size = 0
        with open(dest, "wb") as out:  # noqa: ASYNC230 - local disk, short writes
            async for chunk in self.download_stream(path, timeout=timeout):
                out.write(chunk)
                size += len(chunk)
        return size

    async def upload_archive(
        self,
        path: str,
        data: bytes | str | os.PathLike[str] | AsyncIterable[bytes],
        *,
        delete_missing: bool = False,
        timeout: float | None = None,
        idle_timeout: float | None = None,
    ) -> ArchiveResult:
        """Extract a tar into ``path``: bytes, a local directory packed first, or a stream
        of chunks sent as they come (a tar written while a tree is walked, say).

        ``delete_missing=True`` removes what the archive does not name (a sync). The
        answer counts what was written (``files``, ``bytes``...) and removed (``deleted``).
        With ``idle_timeout``, the upload has no overall deadline (unless ``timeout``
        is given too) and fails only once nothing moved for that many seconds.
        """
        if isinstance(data, str | os.PathLike):
            data = _tar_directory(os.fspath(data))
        body = await self._call(
            "POST",
            "/files/archive",
            timeout,
            idle=idle_timeout,
            params={"path": path, "delete_missing": delete_missing},
            content=data,
        )
        return ArchiveResult.from_wire(body)

    async def download_archive(self, path: str, *, timeout: float | None = None) -> bytes:
        """A tar of the directory ``path``, whole in memory (see
        :meth:`download_archive_stream` for trees of any size)."""
        deadline = self._http.deadline(timeout)
        resp = await self._http.request(
            "GET", "/files/archive", deadline=deadline, params={"path": path}
        )
        return resp.content

    async def download_archive_stream(
        self, path: str, *, timeout: float | None = None, idle_timeout: float | None = None
    ) -> AsyncIterator[bytes]:
        """A tar of the directory ``path``, chunk by chunk as it arrives (bounded memory).

        With ``idle_timeout``, the download has no overall deadline (unless ``timeout``
        is given too) and fails only once no byte came for that many seconds. The
        archive ends with two zero blocks: a stream that stops before them was cut
        short (the dataplane stops one when a file cannot be read mid-walk).
        """
        deadline = self._transfer_deadline(timeout, idle_timeout)
        async with self._http.stream(
            "/files/archive", deadline=deadline, params={"path": path}
        ) as resp:
            async for chunk in resp.aiter_bytes():
                yield chunk

    # --- filesystem operations ------------------------------------------------------

    async def ls(
        self, path: str = "/workspace", *, depth: int = 1, timeout: float | None = None
    ) -> Listing:
        """Entries of a directory (``depth`` levels), with absolute paths (a list;
        ``.truncated`` when there are more than the dataplane lists at once)."""
        body = await self._call("GET", "/fs/list", timeout, params={"path": path, "depth": depth})
        return Listing.from_wire(body, "entries")

    async def read(
        self, path: str, *, offset: int = 0, limit: int = 2000, timeout: float | None = None
    ) -> ReadResult:
        """Lines ``offset`` .. ``offset + limit`` of a file (0-based), with its etag."""
        params = {"path": path, "offset": offset, "limit": limit}
        return ReadResult.from_wire(await self._call("GET", "/fs/read", timeout, params=params))

    async def read_text(self, path: str, *, timeout: float | None = None) -> str:
        """A whole text file."""
        return (await self.download(path, timeout=timeout)).decode("utf-8")

    async def write(
        self,
        path: str,
        content: str,
        *,
        encoding: str = "utf-8",
        if_match: str | None = None,
        if_none_match: str | None = None,
        timeout: float | None = None,
    ) -> str:
        """Write a file (parents created) and return its new etag.

        ``if_match`` writes only over that version (else
        :class:`~sandlot.protocol.errors.PreconditionFailed`); ``if_none_match="*"``
        only creates.
        """
        body: dict[str, Any] = {"path": path, "content": content, "encoding": encoding}
        if if_match is not None:
            body["if_match"] = if_match
        if if_none_match is not None:
            body["if_none_match"] = if_none_match
        return str((await self._call("PUT", "/fs/write", timeout, json_body=body))["etag"])

    async def edit(
        self,
        path: str,
        old_string: str,
        new_string: str,
        *,
        replace_all: bool = False,
        if_match: str | None = None,
        timeout: float | None = None,
    ) -> EditResult:
        """Replace ``old_string`` by ``new_string`` (every occurrence with ``replace_all``).

        More than one occurrence without ``replace_all`` is
        :class:`~sandlot.protocol.errors.InvalidRequest`; ``if_match`` edits only that
        version of the file.
        """
        body: dict[str, Any] = {
            "path": path,
            "old_string": old_string,
            "new_string": new_string,
            "replace_all": replace_all,
        }
        if if_match is not None:
            body["if_match"] = if_match
        return EditResult.from_wire(await self._call("POST", "/fs/edit", timeout, json_body=body))

    async def glob(
        self, pattern: str, path: str = "/workspace", *, timeout: float | None = None
    ) -> Listing:
        """Regular files matching ``pattern`` under ``path`` (``**`` spans directories;
        a list, ``.truncated`` when there are more than the dataplane answers at once)."""
        body = await self._call(
            "POST", "/fs/glob", timeout, json_body={"pattern": pattern, "path": path}
        )
        return Listing.from_wire(body, "matches")

    async def grep(
        self,
        pattern: str,
        path: str = "/workspace",
        *,
        glob: str | None = None,
        max_count: int | None = None,
        regex: bool = False,
        timeout: float | None = None,
    ) -> list[GrepMatch]:
        """Lines containing ``pattern`` (literal unless ``regex``), 1-based line numbers.

        Whether a cap or the server's deadline cut the search short is in
        :meth:`grep_raw`'s ``truncated``.
        """
        out = await self.grep_raw(
            pattern, path, glob=glob, max_count=max_count, regex=regex, timeout=timeout
        )
        return [GrepMatch(m["path"], m["line"], m["text"]) for m in out["matches"]]

    async def grep_raw(
        self,
        pattern: str,
        path: str = "/workspace",
        *,
        glob: str | None = None,
        max_count: int | None = None,
        regex: bool = False,
        timeout: float | None = None,
    ) -> GrepAnswer:
        """:meth:`grep`'s answer as the server sent it: ``matches`` (dicts of ``path``,
        ``line``, ``text``) and ``truncated``, for callers that pass plain dicts on.

        The one answer the SDK leaves as a dict (:class:`~sandlot.sdk.types.GrepAnswer`),
        typed as one: a dataclass per match would cost such a caller more than
        parsing the JSON does.
        """
        body: dict[str, Any] = {"pattern": pattern, "path": path, "regex": regex}
        if glob is not None:
            body["glob"] = glob
        if max_count is not None:
            body["max_count"] = max_count
        answer: GrepAnswer = await self._call("POST", "/fs/grep", timeout, json_body=body)
        return answer

    async def stat(self, path: str, *, timeout: float | None = None) -> FileStat:
        """A path's type, size, mode, modification time and (small files) etag."""
        return FileStat.from_wire(
            await self._call("GET", "/fs/stat", timeout, params={"path": path})
        )

    async def exists(self, path: str, *, timeout: float | None = None) -> bool:
        """Whether ``path`` exists."""
        from sandlot.protocol.errors import FileNotFound

        try:
            await self.stat(path, timeout=timeout)
        except FileNotFound:
            return False
        return True

    async def delete(
        self, path: str, *, recursive: bool = False, timeout: float | None = None
    ) -> None:
        """Delete a file (or a directory tree with ``recursive=True``)."""
        await self._call("DELETE", "/fs", timeout, params={"path": path, "recursive": recursive})

    async def mkdir(self, path: str, *, timeout: float | None = None) -> None:
        """Create a directory and its parents."""
        await self._call("POST", "/fs/mkdir", timeout, json_body={"path": path})

    async def move(self, src: str, dst: str, *, timeout: float | None = None) -> None:
        """Rename ``src`` to ``dst``."""
        await self._call("POST", "/fs/move", timeout, json_body={"src": src, "dst": dst})

    # --- events --------------------------------------------------------------------

    def events(
        self, *, after: int | None = None, transport: str = "sse", timeout: float | None = None
    ) -> AsyncEventStream:
        """The sandbox's ordered event log after sequence ``after`` (SSE or ``"ws"``).

        Dispatch on ``event.kind`` (``fs``, ``exec``, ``shell``, ``phase``). The
        stream resumes by itself after a dropped connection; ``timeout`` bounds
        the whole iteration.
        """
        return AsyncEventStream(
            self._http,
            "/events",
            after=after,
            timeout=timeout,
            transport=transport,
            ws_url=lambda seq: self._ws_url("/events/ws", after=seq),
            keepalive=self.keepalive,
        )

    async def aclose(self) -> None:
        """Close the connections of this sandbox object (the sandbox keeps running)."""
        await self._http.aclose()

    async def __aenter__(self) -> AsyncSandbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


def _command_id() -> str:
    return f"cmd_{uuid.uuid4().hex}"


async def _local_chunks(path: str) -> AsyncIterator[bytes]:
    with open(path, "rb") as src:  # noqa: ASYNC230 - local disk, block by block
        while block := src.read(CHUNK):
            yield block


def _tar_directory(path: str) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name in sorted(os.listdir(path)):
            tar.add(os.path.join(path, name), arcname=name)
    return buf.getvalue()


__all__ = ["AsyncSandbox", "SandlotError"]
