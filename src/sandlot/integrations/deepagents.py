"""A deepagents (>= 0.7) sandbox backend on sandlot's native filesystem endpoints.

``BaseSandbox`` implements every file operation as a script run through
``execute``; :class:`SandlotBackend` answers them with the dataplane's own
``/fs/*`` and ``/files/*`` endpoints instead (one HTTP call each, no process
started), and runs commands with ``POST /exec``::

    backend = SandlotBackend.for_thread("thr_123")          # as an agent, kept fresh
    backend = SandlotBackend(config["configurable"]["sandbox"])  # a grant in hand
    backend = SandlotBackend.from_run()    # per call: the sandbox of the run's thread
    agent = create_deep_agent(model=..., backend=backend)

Every method returns deepagents' result dataclasses and never raises for an
expected failure (missing file, permission, ambiguous edit): the error is
carried in the result, in the words ``BaseSandbox`` uses.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any, cast

from deepagents.backends.protocol import (
    FILE_NOT_FOUND,
    INVALID_PATH,
    IS_DIRECTORY,
    PERMISSION_DENIED,
    DeleteResult,
    EditResult,
    ExecuteResponse,
    FileData,
    FileDownloadResponse,
    FileInfo,
    FileUploadResponse,
    GlobResult,
    GrepResult,
    LsResult,
    ReadResult,
    WriteResult,
)
from deepagents.backends.protocol import GrepMatch as DAGrepMatch
from deepagents.backends.sandbox import MAX_OUTPUT_BYTES, TRUNCATION_MSG, BaseSandbox
from langgraph.config import get_config

from sandlot.protocol.errors import (
    FileNotFound,
    Forbidden,
    InvalidRequest,
    PermissionDenied,
    SandlotError,
)
from sandlot.sdk import AsyncSandbox, Grant, Sandbox, Sandlot
from sandlot.sdk.settings import in_process, load_settings
from sandlot.sdk.types import FileEntry, GrepAnswer, Listing

EMPTY_FILE = "System reminder: File exists but has empty contents"
EMPTY_OLD_STRING = "Error: old_string cannot be empty. Provide the exact text to replace."
#: Largest binary file ``read`` returns (base64), as ``BaseSandbox`` does.
MAX_BINARY_BYTES = 500 * 1024
#: Seconds a command may run when the caller names no timeout.
DEFAULT_EXEC_TIMEOUT = 30 * 60
#: Seconds a run's sandbox no call used stays held (:meth:`SandlotBackend.from_run`).
RUN_SANDBOX_IDLE_SECONDS = 600.0


def _bounds(offset: int, limit: int) -> tuple[int, int]:
    return max(0, int(offset)), max(0, int(limit))


#: The dataplane's words (``INVALID_REQUEST``, perhaps followed by ``: detail``) for a
#: path it cannot take as written: deepagents' ``invalid_path``, which its local backend
#: also gives for a file where a directory should be and for a symlink loop.
_INVALID_PATH_WORDS = frozenset(
    {
        "path is required",
        "path contains a NUL byte",
        "path is not valid UTF-8",
        "path too long",
        "file name too long",
        "too many levels of symbolic links",
        "not a directory",
    }
)


def _server_words(exc: InvalidRequest) -> str:
    return exc.message.partition(":")[0]


def _file_error(exc: SandlotError) -> str:
    """The deepagents ``FileOperationError`` literal of an SDK error, else its message."""
    if isinstance(exc, FileNotFound):
        return FILE_NOT_FOUND
    if isinstance(exc, PermissionDenied | Forbidden):
        return PERMISSION_DENIED
    if isinstance(exc, InvalidRequest):
        words = _server_words(exc)
        if words == "is a directory":
            return IS_DIRECTORY
        if words in _INVALID_PATH_WORDS:
            return INVALID_PATH
    return exc.message


def _ls_error(exc: SandlotError, path: str) -> LsResult:
    # deepagents' own backends' words for a listing: its middleware takes
    # "not_a_directory" for a plain file when it checks a delete's permissions.
    if isinstance(exc, FileNotFound):
        word = "path_not_found"
    elif isinstance(exc, InvalidRequest) and _server_words(exc) == "not a directory":
        word = "not_a_directory"
    else:
        word = _file_error(exc)
    return LsResult(error=f"Path '{path}': {word}")


def _listing(found: Listing, path: str) -> LsResult:
    entries = [_info(e) for e in found]
    if not found.truncated:
        return LsResult(entries=entries)
    # LsResult has no truncated flag: like deepagents' local backend, a partial listing
    # comes with an error, so neither a model nor a caller takes it for all there is.
    return LsResult(
        entries=entries,
        error=f"Path '{path}': listing truncated after {len(entries)} entries; "
        "list a subdirectory or use glob to see the rest",
    )


def _sendable(path: str) -> bool:
    """Whether ``path`` can be sent at all.

    A model's JSON arguments may carry a lone surrogate (``"\\ud800"``), which UTF-8
    cannot encode: in a URL's query httpx raises ``UnicodeEncodeError`` out of the tool
    call, and in a JSON body the dataplane refuses it as invalid JSON.
    """
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _info(entry: FileEntry) -> FileInfo:
    info: FileInfo = {"path": entry.path, "is_dir": entry.is_dir}
    if entry.size is not None:
        info["size"] = entry.size
    if entry.modified_at is not None:
        info["modified_at"] = entry.modified_at
    return info


def _read_result(body: Any, file_path: str, offset: int, limit: int) -> ReadResult:
    if body.encoding == "base64":
        size = len(body.content) * 3 // 4 - body.content[-2:].count("=")
        if size > MAX_BINARY_BYTES:
            return ReadResult(
                error=f"File '{file_path}': Binary file exceeds maximum preview size of "
                f"{MAX_BINARY_BYTES} bytes"
            )
        return ReadResult(file_data=FileData(content=body.content, encoding="base64"))
    if body.total_lines == 0 and not body.content:
        return ReadResult(file_data=FileData(content=EMPTY_FILE, encoding="utf-8"))
    if limit == 0:
        return ReadResult(file_data=FileData(content="", encoding="utf-8"), no_lines_requested=True)
    if body.end_line <= body.start_line:
        return ReadResult(
            error=f"File '{file_path}': Line offset {offset} exceeds file length "
            f"({body.total_lines} lines)"
        )
    content = body.content.replace("\r\n", "\n")
    content = content.removesuffix("\n")
    end = body.end_line
    content, shown = _capped(content)
    if shown is not None:
        end = body.start_line + shown
    return ReadResult(
        file_data=FileData(content=content, encoding="utf-8"),
        total_lines=body.total_lines,
        start_line=body.start_line + 1,
        end_line=end,
        next_offset=end if end < body.total_lines else None,
    )


def _capped(content: str) -> tuple[str, int | None]:
    """``content`` cut as ``BaseSandbox.read`` cuts a page over ``MAX_OUTPUT_BYTES``: the
    lines that fit, what fits of the next one, then ``TRUNCATION_MSG``; with the number of
    lines to count as shown (at least one, so paging moves on), None when nothing is cut."""
    room = MAX_OUTPUT_BYTES - len(TRUNCATION_MSG.encode("utf-8"))
    if len(content) * 4 <= room:  # no need to encode: 4 bytes a character at most
        return content, None
    data = content.encode("utf-8")
    if len(data) <= room:
        return content, None
    cut = data[:room]
    shown = cut.count(b"\n")
    if data[room : room + 1] == b"\n":  # the cut fell at the end of a line: it is whole
        shown += 1
    return cut.decode("utf-8", errors="ignore") + TRUNCATION_MSG, max(shown, 1)


def _edit_error(exc: SandlotError, file_path: str, old_string: str) -> EditResult:
    if isinstance(exc, FileNotFound):
        return EditResult(error=f"Error: File '{file_path}' not found")
    if isinstance(exc, PermissionDenied | Forbidden):
        return EditResult(error=f"Error: Permission denied editing file '{file_path}'")
    occurrences = exc.metadata.get("occurrences")
    if occurrences == 0:
        return EditResult(error=f"Error: String not found in file: '{old_string}'")
    if isinstance(occurrences, int) and occurrences > 1:
        return EditResult(
            error=f"Error: String '{old_string}' appears multiple times. "
            "Use replace_all=True to replace all occurrences."
        )
    return EditResult(error=f"Error editing file '{file_path}': {exc.message}")


def _exec_response(result: Any, timeout: int | None) -> ExecuteResponse:
    output = result.stdout + result.stderr
    if result.timed_out:
        output += f"\n[Command timed out after {timeout} seconds]"
    return ExecuteResponse(output=output, exit_code=result.exit_code, truncated=result.truncated)


class SandlotBackend(BaseSandbox):
    """A deepagents sandbox backend for one sandlot sandbox.

    ``grant`` is a :class:`~sandlot.sdk.Sandbox`, a :class:`~sandlot.sdk.Grant`,
    or a mapping :meth:`Grant.from_response <sandlot.sdk.Grant.from_response>`
    accepts (the broker's answer, or the bootstrap object found in
    ``config["configurable"]["sandbox"]``). ``timeout`` is the client-side
    deadline of each file call; commands get their own ``timeout`` plus a margin.
    """

    def __init__(
        self,
        grant: Sandbox | Grant | Mapping[str, Any],
        *,
        timeout: float = 60.0,
        client: Sandlot | None = None,
    ) -> None:
        fixed = grant if isinstance(grant, Sandbox) else Sandbox(grant, timeout=timeout)
        #: The sandbox, when it is one for the backend's life (not :meth:`from_run`'s).
        self._fixed: Sandbox | None = fixed
        self._resolve: Callable[[], Sandbox] = lambda: fixed
        self._close: Callable[[], None] = fixed.close
        self._timeout = timeout
        self._client = client

    @classmethod
    def from_run(
        cls,
        *,
        url: str | None = None,
        api_key: str | None = None,
        on_behalf_of: str | None = None,
        timeout: float = 60.0,
        max_threads: int = 256,
        idle_seconds: float = RUN_SANDBOX_IDLE_SECONDS,
    ) -> SandlotBackend:
        """A backend whose sandbox is the current LangGraph run's, resolved on every call.

        The run's config (``langgraph.config.get_config()``) decides: a grant handed in
        ``configurable.sandbox`` (bootstrap mode, PROTOCOL.md 2.10) first, else the
        sandbox of ``configurable.thread_id``, ensured with the agent's key
        (``url``/``api_key`` default to ``SANDLOT_URL``/``SANDLOT_API_KEY``) and kept
        fresh while it is in use. So one graph, built once, serves every thread; the
        grants of the ``max_threads`` most recent threads are kept, those no call used
        for ``idle_seconds`` let go (their leases expire, so their sandboxes go idle as
        their policy says; a later run takes one up again). Used outside a run,
        or in a run with neither, an operation raises ``RuntimeError``: a set-up mistake,
        not a failure to report to the model.
        """
        runs = _RunSandboxes(url, api_key, on_behalf_of, timeout, max_threads, idle_seconds)
        backend = cls.__new__(cls)
        backend._fixed = None
        backend._resolve = runs.current
        backend._close = runs.close
        backend._timeout = timeout
        backend._client = None
        return backend

    @classmethod
    def for_thread(
        cls,
        thread_id: str,
        *,
        url: str | None = None,
        api_key: str | None = None,
        on_behalf_of: str | None = None,
        timeout: float = 60.0,
    ) -> SandlotBackend:
        """Ensure the thread's sandbox (with an agent's key) and keep its grant fresh.

        ``url``/``api_key`` default to ``SANDLOT_URL``/``SANDLOT_API_KEY``; the
        token is refreshed and the lease renewed by a daemon thread until
        :meth:`close`.
        """
        client = Sandlot(url, api_key, on_behalf_of=on_behalf_of, timeout=timeout)
        sandbox = client.ensure(thread_id, timeout=timeout)
        return cls(sandbox, timeout=timeout, client=client)

    @property
    def _sandbox(self) -> Sandbox:
        return self._resolve()

    @property
    def id(self) -> str:
        """The sandbox id (for :meth:`from_run`: the current run's)."""
        return self._sandbox.id

    @property
    def sandbox(self) -> Sandbox:
        """The SDK's sync sandbox this backend drives (for :meth:`from_run`: the run's)."""
        return self._sandbox

    @contextlib.asynccontextmanager
    async def _asandbox(self) -> AsyncIterator[AsyncSandbox]:
        # An async connection pool belongs to one event loop, and agents may run
        # each step on a new loop: each async call gets its own short-lived pool,
        # sharing the grant and its fresh token. A run's sandbox may first have to be
        # ensured over HTTP, perhaps from the very server running this loop: that
        # happens on a worker thread, never on the loop.
        sandbox = self._fixed
        if sandbox is None:
            sandbox = await asyncio.to_thread(self._resolve)
        renew = sandbox.renew

        async def arenew() -> bool:
            return await asyncio.to_thread(renew) if renew is not None else False

        async with AsyncSandbox(
            sandbox.grant, timeout=self._timeout, renew=arenew if renew else None
        ) as opened:
            yield opened

    def close(self) -> None:
        """Stop refreshing the grant (when this backend negotiated it) and close connections."""
        self._close()
        if self._client is not None:
            self._client.close()

    # --- commands ------------------------------------------------------------------

    def execute(self, command: str, *, timeout: int | None = None) -> ExecuteResponse:
        """Run a shell command (``POST /exec``); ``timeout`` in seconds, 0 for none."""
        limit = DEFAULT_EXEC_TIMEOUT if timeout is None else timeout
        try:
            result = self._sandbox.exec(
                command,
                timeout_seconds=limit or None,
                timeout=(limit + 30) if limit else None,
            )
        except SandlotError as exc:
            return ExecuteResponse(output=f"Error: {exc.message}", exit_code=None)
        return _exec_response(result, limit)

    async def aexecute(self, command: str, *, timeout: int | None = None) -> ExecuteResponse:
        """Async version of :meth:`execute`."""
        limit = DEFAULT_EXEC_TIMEOUT if timeout is None else timeout
        try:
            async with self._asandbox() as sandbox:
                result = await sandbox.exec(
                    command,
                    timeout_seconds=limit or None,
                    timeout=(limit + 30) if limit else None,
                )
        except SandlotError as exc:
            return ExecuteResponse(output=f"Error: {exc.message}", exit_code=None)
        return _exec_response(result, limit)

    # --- listing and reading -------------------------------------------------------

    def ls(self, path: str) -> LsResult:
        """Entries of a directory (``GET /fs/list``)."""
        if not _sendable(path):
            return LsResult(error=f"Path '{path}': {INVALID_PATH}")
        try:
            return _listing(self._sandbox.ls(path), path)
        except SandlotError as exc:
            return _ls_error(exc, path)

    async def als(self, path: str) -> LsResult:
        """Async version of :meth:`ls`."""
        if not _sendable(path):
            return LsResult(error=f"Path '{path}': {INVALID_PATH}")
        try:
            async with self._asandbox() as sandbox:
                return _listing(await sandbox.ls(path), path)
        except SandlotError as exc:
            return _ls_error(exc, path)

    def read(self, file_path: str, offset: int = 0, limit: int = 2000) -> ReadResult:
        """A window of a file's lines (``GET /fs/read``)."""
        offset, limit = _bounds(offset, limit)
        if not _sendable(file_path):
            return ReadResult(error=f"File '{file_path}': {INVALID_PATH}")
        try:
            body = self._sandbox.read(file_path, offset=offset, limit=max(limit, 1))
        except SandlotError as exc:
            return ReadResult(error=f"File '{file_path}': {_file_error(exc)}")
        return _read_result(body, file_path, offset, limit)

    async def aread(self, file_path: str, offset: int = 0, limit: int = 2000) -> ReadResult:
        """Async version of :meth:`read`."""
        offset, limit = _bounds(offset, limit)
        if not _sendable(file_path):
            return ReadResult(error=f"File '{file_path}': {INVALID_PATH}")
        try:
            async with self._asandbox() as sandbox:
                body = await sandbox.read(file_path, offset=offset, limit=max(limit, 1))
        except SandlotError as exc:
            return ReadResult(error=f"File '{file_path}': {_file_error(exc)}")
        return _read_result(body, file_path, offset, limit)

    # --- writing -------------------------------------------------------------------

    def write(self, file_path: str, content: str) -> WriteResult:
        """Create or overwrite a file, parents included (``PUT /fs/write``)."""
        if not _sendable(file_path):
            return WriteResult(error=f"Failed to write file '{file_path}': {INVALID_PATH}")
        try:
            self._sandbox.write(file_path, content)
        except SandlotError as exc:
            return WriteResult(error=f"Failed to write file '{file_path}': {_file_error(exc)}")
        return WriteResult(path=file_path)

    async def awrite(self, file_path: str, content: str) -> WriteResult:
        """Async version of :meth:`write`."""
        if not _sendable(file_path):
            return WriteResult(error=f"Failed to write file '{file_path}': {INVALID_PATH}")
        try:
            async with self._asandbox() as sandbox:
                await sandbox.write(file_path, content)
        except SandlotError as exc:
            return WriteResult(error=f"Failed to write file '{file_path}': {_file_error(exc)}")
        return WriteResult(path=file_path)

    def edit(
        self,
        file_path: str,
        old_string: str,
        new_string: str,
        replace_all: bool = False,
    ) -> EditResult:
        """Replace ``old_string`` by ``new_string`` (``POST /fs/edit``)."""
        if not old_string:
            return EditResult(error=EMPTY_OLD_STRING)
        if not _sendable(file_path):
            return EditResult(error=f"Error editing file '{file_path}': {INVALID_PATH}")
        try:
            body = self._sandbox.edit(file_path, old_string, new_string, replace_all=replace_all)
        except SandlotError as exc:
            return _edit_error(exc, file_path, old_string)
        return EditResult(path=file_path, occurrences=body.occurrences)

    async def aedit(
        self,
        file_path: str,
        old_string: str,
        new_string: str,
        replace_all: bool = False,
    ) -> EditResult:
        """Async version of :meth:`edit`."""
        if not old_string:
            return EditResult(error=EMPTY_OLD_STRING)
        if not _sendable(file_path):
            return EditResult(error=f"Error editing file '{file_path}': {INVALID_PATH}")
        try:
            async with self._asandbox() as sandbox:
                body = await sandbox.edit(
                    file_path, old_string, new_string, replace_all=replace_all
                )
        except SandlotError as exc:
            return _edit_error(exc, file_path, old_string)
        return EditResult(path=file_path, occurrences=body.occurrences)

    def delete(self, file_path: str) -> DeleteResult:
        """Delete a file or a directory tree (``DELETE /fs``)."""
        if not _sendable(file_path):
            return DeleteResult(error=f"Error deleting file '{file_path}': {INVALID_PATH}")
        try:
            self._sandbox.delete(file_path, recursive=True)
        except FileNotFound:
            return DeleteResult(error=f"Error: '{file_path}' not found")
        except SandlotError as exc:
            return DeleteResult(error=f"Error deleting file '{file_path}': {exc.message}")
        return DeleteResult(path=file_path)

    async def adelete(self, file_path: str) -> DeleteResult:
        """Async version of :meth:`delete`."""
        if not _sendable(file_path):
            return DeleteResult(error=f"Error deleting file '{file_path}': {INVALID_PATH}")
        try:
            async with self._asandbox() as sandbox:
                await sandbox.delete(file_path, recursive=True)
        except FileNotFound:
            return DeleteResult(error=f"Error: '{file_path}' not found")
        except SandlotError as exc:
            return DeleteResult(error=f"Error deleting file '{file_path}': {exc.message}")
        return DeleteResult(path=file_path)

    # --- searching -----------------------------------------------------------------

    def grep(
        self,
        pattern: str,
        path: str | None = None,
        glob: str | None = None,
        *,
        max_count: int | None = None,
    ) -> GrepResult:
        """Lines containing the literal ``pattern`` (``POST /fs/grep``), at most
        ``max_count`` of them (none for 0; a negative one, like None, is no cap)."""
        if path is not None and not _sendable(path):
            return GrepResult(error=f"Path '{path}': {INVALID_PATH}")
        cap = _grep_cap(max_count)
        try:
            found = self._sandbox.grep_raw(pattern, path or "/workspace", glob=glob, max_count=cap)
        except SandlotError as exc:
            return GrepResult(error=f"Error: {exc.message}")
        return _grep_result(found, max_count)

    async def agrep(
        self,
        pattern: str,
        path: str | None = None,
        glob: str | None = None,
        *,
        max_count: int | None = None,
    ) -> GrepResult:
        """Async version of :meth:`grep`."""
        if path is not None and not _sendable(path):
            return GrepResult(error=f"Path '{path}': {INVALID_PATH}")
        cap = _grep_cap(max_count)
        try:
            async with self._asandbox() as sandbox:
                found = await sandbox.grep_raw(
                    pattern, path or "/workspace", glob=glob, max_count=cap
                )
        except SandlotError as exc:
            return GrepResult(error=f"Error: {exc.message}")
        return _grep_result(found, max_count)

    def glob(self, pattern: str, path: str | None = None) -> GlobResult:
        """Regular files matching ``pattern`` under ``path`` (``POST /fs/glob``)."""
        if path is not None and not _sendable(path):
            return GlobResult(error=f"Path '{path}': {INVALID_PATH}")
        try:
            found = self._sandbox.glob(pattern, path or "/workspace")
        except FileNotFound:
            return GlobResult(matches=[])
        except SandlotError as exc:
            return GlobResult(error=f"Error: {exc.message}")
        return _glob_result(found)

    async def aglob(self, pattern: str, path: str | None = None) -> GlobResult:
        """Async version of :meth:`glob`."""
        if path is not None and not _sendable(path):
            return GlobResult(error=f"Path '{path}': {INVALID_PATH}")
        try:
            async with self._asandbox() as sandbox:
                found = await sandbox.glob(pattern, path or "/workspace")
        except FileNotFound:
            return GlobResult(matches=[])
        except SandlotError as exc:
            return GlobResult(error=f"Error: {exc.message}")
        return _glob_result(found)

    # --- transfers -----------------------------------------------------------------

    def upload_files(self, files: list[tuple[str, bytes]]) -> list[FileUploadResponse]:
        """Write each file (``POST /files/upload``); errors are reported per file."""
        out: list[FileUploadResponse] = []
        for path, data in files:
            if not path.startswith("/") or not _sendable(path):
                out.append(FileUploadResponse(path=path, error=INVALID_PATH))
                continue
            try:
                self._sandbox.upload(path, data)
                out.append(FileUploadResponse(path=path))
            except SandlotError as exc:
                out.append(FileUploadResponse(path=path, error=_file_error(exc)))
        return out

    async def aupload_files(self, files: list[tuple[str, bytes]]) -> list[FileUploadResponse]:
        """Async version of :meth:`upload_files`."""
        async with self._asandbox() as sandbox:
            out: list[FileUploadResponse] = []
            for path, data in files:
                if not path.startswith("/") or not _sendable(path):
                    out.append(FileUploadResponse(path=path, error=INVALID_PATH))
                    continue
                try:
                    await sandbox.upload(path, data)
                    out.append(FileUploadResponse(path=path))
                except SandlotError as exc:
                    out.append(FileUploadResponse(path=path, error=_file_error(exc)))
            return out

    def download_files(self, paths: list[str]) -> list[FileDownloadResponse]:
        """Read each file (``GET /files/download``); errors are reported per file."""
        out: list[FileDownloadResponse] = []
        for path in paths:
            if not path.startswith("/") or not _sendable(path):
                out.append(FileDownloadResponse(path=path, error=INVALID_PATH))
                continue
            try:
                out.append(FileDownloadResponse(path=path, content=self._sandbox.download(path)))
            except SandlotError as exc:
                out.append(FileDownloadResponse(path=path, error=_file_error(exc)))
        return out

    async def adownload_files(self, paths: list[str]) -> list[FileDownloadResponse]:
        """Async version of :meth:`download_files`."""
        async with self._asandbox() as sandbox:
            out: list[FileDownloadResponse] = []
            for path in paths:
                if not path.startswith("/") or not _sendable(path):
                    out.append(FileDownloadResponse(path=path, error=INVALID_PATH))
                    continue
                try:
                    content = await sandbox.download(path)
                    out.append(FileDownloadResponse(path=path, content=content))
                except SandlotError as exc:
                    out.append(FileDownloadResponse(path=path, error=_file_error(exc)))
            return out


#: The largest ``max_count`` the dataplane takes (its own cap is lower anyway).
_MAX_GREP_COUNT = 1_000_000


def _grep_cap(max_count: int | None) -> int | None:
    """The ``max_count`` to send: the dataplane takes 1 and up. For 0 it is asked for one
    match, to tell whether there were any (then ``truncated``); a negative count (the
    protocol gives it no meaning) is no cap."""
    if max_count is None or max_count < 0:
        return None
    return min(max(max_count, 1), _MAX_GREP_COUNT)


def _grep_result(found: GrepAnswer, max_count: int | None) -> GrepResult:
    # The wire's match objects are deepagents' GrepMatch dicts already: path, line, text
    # (and none of its optional context lines).
    matches = cast("list[DAGrepMatch]", found["matches"])
    truncated = found.get("truncated") is True
    if max_count == 0:
        return GrepResult(matches=[], truncated=truncated or bool(matches))
    return GrepResult(matches=matches, truncated=truncated)


def _glob_result(found: Listing) -> GlobResult:
    # The dataplane stops a glob at its match cap, its deadline or its depth limit: all
    # "budget" (a subtree it cannot read is skipped, not a cut).
    return GlobResult(
        matches=[_info(e) for e in found],
        truncated=found.truncated,
        truncation_reason="budget" if found.truncated else None,
    )


__all__ = ["SandlotBackend"]


class _RunSandboxes:
    """The sandboxes of :meth:`SandlotBackend.from_run`: one per thread (or bootstrap
    grant). One is let go (its lease no longer held, left to expire at the broker
    without a release) when it is the least recently used beyond ``limit``, or when no
    call used it for ``idle`` seconds (10 minutes): before, the client held every
    thread's lease it ever made for the process's life, and none of those sandboxes went
    idle. A later run of the thread takes its sandbox up again. The object let go is
    closed once a call still using it must have ended (:data:`DEFAULT_EXEC_TIMEOUT`).

    With no URL or key given or in the environment, inside a LangGraph server that
    serves :mod:`sandlot.integrations.langgraph`, the server's own key is used, acting
    for the run's LangGraph user (``configurable.langgraph_auth_user_id``).
    """

    def __init__(
        self,
        url: str | None,
        api_key: str | None,
        on_behalf_of: str | None,
        timeout: float,
        limit: int,
        idle: float = RUN_SANDBOX_IDLE_SECONDS,
    ) -> None:
        self._options = (url, api_key, on_behalf_of, timeout)
        self._clients: dict[str | None, Sandlot] = {}
        self._limit = max(1, limit)
        self._idle = idle
        self._sandboxes: OrderedDict[str, Sandbox] = OrderedDict()
        #: Per key: when a call last used it, and the client holding its lease.
        self._used: dict[str, float] = {}
        self._holder: dict[str, Sandlot] = {}
        #: Sandboxes let go, and when: closed :data:`DEFAULT_EXEC_TIMEOUT` later.
        self._retired: list[tuple[float, Sandbox]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._sweeper: threading.Thread | None = None

    def current(self) -> Sandbox:
        try:
            config = get_config()
        except RuntimeError:
            raise RuntimeError(
                "SandlotBackend.from_run() is used outside a LangGraph run"
            ) from None
        return self.for_config(config)

    def for_config(self, config: Mapping[str, Any]) -> Sandbox:
        configurable = config.get("configurable") or {}
        bootstrap = configurable.get("sandbox")
        thread_id = configurable.get("thread_id")
        url, api_key, on_behalf_of, timeout = self._options
        if isinstance(bootstrap, Mapping):
            grant = Grant.from_response(bootstrap)
            key = f"grant:{grant.token}"  # a refreshed grant is a new one (kept in memory only)
        elif thread_id:
            if on_behalf_of is None and _hosted(url, api_key):
                on_behalf_of = configurable.get("langgraph_auth_user_id") or None
            key = f"thread:{thread_id}@{on_behalf_of or ''}"
        else:
            raise RuntimeError(
                "SandlotBackend.from_run(): the run's config has neither "
                "configurable.sandbox nor configurable.thread_id"
            )
        gone: list[tuple[Sandbox, Sandlot | None]] = []
        with self._lock:
            self._used[key] = time.monotonic()
            found = self._sandboxes.get(key)
            if found is not None:
                self._sandboxes.move_to_end(key)
                return found
            if isinstance(bootstrap, Mapping):
                found = Sandbox(grant, timeout=timeout)
            else:
                client = self._clients.get(on_behalf_of)
                if client is None:
                    client = Sandlot(url, api_key, on_behalf_of=on_behalf_of, timeout=timeout)
                    self._clients[on_behalf_of] = client
                found = client.ensure(str(thread_id), timeout=timeout)
                self._holder[key] = client
            self._sandboxes[key] = found
            while len(self._sandboxes) > self._limit:
                gone.append(self._take(next(iter(self._sandboxes))))
            if self._sweeper is None:
                self._sweeper = threading.Thread(
                    target=self._sweep, name="sandlot-run-sandboxes", daemon=True
                )
                self._sweeper.start()
        self._let_go(gone)
        return found

    def _take(self, key: str) -> tuple[Sandbox, Sandlot | None]:
        """(Under the lock.) ``key``'s sandbox out of the cache, with its lease's holder."""
        self._used.pop(key, None)
        return self._sandboxes.pop(key), self._holder.pop(key, None)

    def _let_go(self, gone: list[tuple[Sandbox, Sandlot | None]]) -> None:
        for sandbox, holder in gone:
            session_id = sandbox.grant.session_id
            if holder is not None and session_id is not None:
                holder.forget(session_id)
            with self._lock:
                self._retired.append((time.monotonic(), sandbox))

    def _sweep(self) -> None:
        """Every tenth of ``idle``: the sandboxes no call used for ``idle`` let go, and
        those let go long enough ago closed."""
        while not self._stop.wait(max(self._idle / 10, 0.1)):
            now = time.monotonic()
            with self._lock:
                quiet = [k for k, at in self._used.items() if now - at >= self._idle]
                gone = [self._take(k) for k in quiet if k in self._sandboxes]
                done = [s for at, s in self._retired if now - at >= DEFAULT_EXEC_TIMEOUT]
                self._retired = [(at, s) for at, s in self._retired if s not in done]
            self._let_go(gone)
            for sandbox in done:
                sandbox.close()

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            for sandbox in [*self._sandboxes.values(), *(s for _, s in self._retired)]:
                sandbox.close()
            self._sandboxes.clear()
            self._retired.clear()
            self._used.clear()
            self._holder.clear()
            for client in self._clients.values():
                client.close()
            self._clients.clear()


def _hosted(url: str | None, api_key: str | None) -> bool:
    """Whether a client made with these arguments uses the in-process server's key."""
    hosted = in_process()
    return hosted is not None and load_settings(url, api_key) is hosted


class GraphFactory:
    """A LangGraph graph factory (``"graphs": {"agent": "./graph.py:make_graph"}``) that
    builds each run's graph on the sandbox of the run's config, as
    :meth:`SandlotBackend.from_run` resolves it (a bootstrap grant first, else the
    thread's sandbox)::

        make_graph = GraphFactory(lambda backend: create_deep_agent(model, backend=backend))

    The grants of the ``max_threads`` most recent threads are kept fresh and reused until
    :meth:`close`.
    """

    def __init__(
        self,
        build: Callable[[SandlotBackend], Any],
        *,
        url: str | None = None,
        api_key: str | None = None,
        timeout: float = 60.0,
        max_threads: int = 256,
    ) -> None:
        self._build = build
        self._timeout = timeout
        self._runs = _RunSandboxes(url, api_key, None, timeout, max_threads)

    def __call__(self, config: Mapping[str, Any]) -> Any:
        sandbox = self._runs.for_config(config)
        return self._build(SandlotBackend(sandbox, timeout=self._timeout))

    def close(self) -> None:
        """Stop keeping the grants fresh and close their connections."""
        self._runs.close()


#: The name the documentation uses: ``make_graph = graph_factory(build)``.
graph_factory = GraphFactory
