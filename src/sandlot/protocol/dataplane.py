"""Dataplane request and response bodies (PROTOCOL.md 3.1, 3.3, 3.5, 3.6, 3.9).

Only shapes: the dataplane validates requests with these models and the SDK
builds them. Sizes of file content are capped by the server's settings, not
here, so the limits stay configurable.
"""

# No ``from __future__ import annotations``: pydantic would compile and evaluate each
# field's annotation string when its model is defined (a quarter of the time this
# module takes to import, for every process that imports it).

from typing import Annotated, Literal

from pydantic import AliasChoices, Field, field_validator

from sandlot.protocol.common import Actor, WireModel

#: A command: a string runs under a shell, a list runs directly.
Command = str | Annotated[list[str], Field(min_length=1, max_length=4096)]

Encoding = Literal["utf-8", "base64"]


def _check_env(env: dict[str, str]) -> dict[str, str]:
    for key, value in env.items():
        if not key or "=" in key or "\x00" in key or "\x00" in value:
            raise ValueError(f"invalid environment variable {key!r}")
    return env


class ExecRequest(WireModel):
    """``POST /exec`` (and ``POST /execute`` of the LangSmith surface)."""

    command: Command
    shell: str = Field(default="/bin/bash", min_length=1, max_length=4096)
    timeout_seconds: float | None = Field(
        default=None, gt=0, le=86400, validation_alias=AliasChoices("timeout_seconds", "timeout")
    )
    env: dict[str, str] = Field(default_factory=dict)
    cwd: str | None = Field(default=None, max_length=4096)
    stdin: str | None = None
    command_id: str | None = Field(default=None, min_length=1, max_length=200)

    _env = field_validator("env")(_check_env)

    @field_validator("command")
    @classmethod
    def _no_nul(cls, value: str | list[str]) -> str | list[str]:
        parts = [value] if isinstance(value, str) else value
        if any("\x00" in p for p in parts):
            raise ValueError("command contains a NUL byte")
        if isinstance(value, str) and not value.strip():
            raise ValueError("command is empty")
        return value


class ExecResult(WireModel):
    exec_id: str
    command_id: str | None
    stdout: str
    stderr: str
    exit_code: int | None
    timed_out: bool = False
    #: The kernel's OOM killer ended it (the sandbox's memory limit).
    oom_killed: bool = False
    truncated: bool = False
    duration_ms: float


class ExecSnapshot(WireModel):
    """``GET /execs/{exec_id}``."""

    exec_id: str
    command_id: str | None
    command: str | list[str]
    actor: Actor | None
    state: str
    exit_code: int | None
    signal: str | None = None
    oom_killed: bool = False
    pty: bool = False
    started_at: str
    ended_at: str | None
    stdout_offset: int
    stderr_offset: int
    clients: int = 0
    last_event_sequence: int


class ExecList(WireModel):
    """``GET /execs``."""

    execs: list[ExecSnapshot]


class SignalRequest(WireModel):
    signal: str = Field(min_length=1, max_length=16)


class ShellSnapshot(WireModel):
    """An entry of ``GET /shells``."""

    name: str
    session_id: str
    profile: str
    clients: int
    created_at: str
    offset: int
    state: str


class ShellList(WireModel):
    """``GET /shells``."""

    shells: list[ShellSnapshot]


class FsEntry(WireModel):
    path: str
    is_dir: bool
    size: int
    modified_at: str | None
    is_symlink: bool = False


class ListResponse(WireModel):
    entries: list[FsEntry]
    truncated: bool = False


class ReadResponse(WireModel):
    path: str
    content: str
    encoding: Encoding
    total_lines: int
    start_line: int
    end_line: int
    next_offset: int | None
    etag: str
    size: int


class WriteRequest(WireModel):
    path: str = Field(min_length=1, max_length=4096)
    content: str
    encoding: Encoding = "utf-8"
    if_match: str | None = None
    if_none_match: str | None = None


class WriteResponse(WireModel):
    path: str
    etag: str
    created: bool = False


class EditRequest(WireModel):
    path: str = Field(min_length=1, max_length=4096)
    old_string: str = Field(min_length=1)
    new_string: str
    replace_all: bool = False
    if_match: str | None = None


class EditResponse(WireModel):
    path: str
    occurrences: int
    etag: str


class GlobRequest(WireModel):
    pattern: str = Field(min_length=1, max_length=4096)
    path: str = Field(default="/workspace", min_length=1, max_length=4096)
    limit: int | None = Field(default=None, ge=1, le=1_000_000)


class GlobResponse(WireModel):
    matches: list[FsEntry]
    truncated: bool = False


class GrepRequest(WireModel):
    pattern: str = Field(min_length=1, max_length=4096)
    path: str = Field(default="/workspace", min_length=1, max_length=4096)
    glob: str | None = Field(default=None, max_length=4096)
    max_count: int | None = Field(
        default=None, ge=1, le=1_000_000, validation_alias=AliasChoices("max_count", "limit")
    )
    regex: bool = False
    ignore_case: bool = False


class GrepMatch(WireModel):
    path: str
    line: int
    text: str


class GrepResponse(WireModel):
    matches: list[GrepMatch]
    truncated: bool = False


class StatResponse(WireModel):
    path: str
    type: Literal["file", "directory", "symlink", "other"]
    size: int
    mode: int
    modified_at: str | None
    etag: str | None = None


class MkdirRequest(WireModel):
    path: str = Field(min_length=1, max_length=4096)
    parents: bool = True
    exist_ok: bool = True


class MoveRequest(WireModel):
    src: str = Field(min_length=1, max_length=4096)
    dst: str = Field(min_length=1, max_length=4096)
    overwrite: bool = True


class PathResponse(WireModel):
    path: str


class UploadResponse(WireModel):
    path: str
    size: int


class ArchiveResponse(WireModel):
    path: str
    files: int
    directories: int
    deleted: int
    bytes: int


class LangSmithExecuteResponse(WireModel):
    """``POST /execute`` of the LangSmith-compatible surface."""

    stdout: str
    stderr: str
    exit_code: int | None
    #: Sandlot's additions: the idempotency key given, and whether the timeout ended it.
    command_id: str | None = None
    timed_out: bool = False


class VersionResponse(WireModel):
    api_version: str
    server: str
