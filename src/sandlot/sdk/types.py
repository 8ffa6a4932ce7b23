"""Plain result types of the SDK, shared by the async and the sync client (no I/O).

``Grant`` is what the broker hands out (PROTOCOL.md 2.1, also the 2.9 alias
shape and the bootstrap object of 2.10); the others are the dataplane's
answers (PROTOCOL.md 3) as frozen dataclasses.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, NamedTuple

from sandlot.protocol.errors import RequestTimeout
from sandlot.protocol.version import check_protocol_version


def parse_time(value: Any) -> float | None:
    """An RFC 3339 timestamp (or epoch seconds) as epoch seconds; ``None`` if absent."""
    if value is None or value == "":
        return None
    if isinstance(value, int | float):
        return float(value)
    text = str(value)
    if text.endswith("Z"):
        text = text[:-1] + "+00:00"
    return datetime.fromisoformat(text).timestamp()


@dataclass
class Grant:
    """Access to one sandbox: dataplane coordinates and a bearer token.

    Built from the broker's negotiate answer with :meth:`from_response`, which
    accepts the full 2.1 shape, the 2.9 alias shape (``http_url``/``ws_url``) and
    the bootstrap object an agent finds in ``config["configurable"]["sandbox"]``.
    The token is updated in place when it is refreshed.
    """

    sandbox_id: str
    http_base_url: str
    ws_base_url: str
    token: str
    expires_at: float | None = None
    session_id: str | None = None
    capabilities: tuple[str, ...] = ()
    state: str | None = None
    last_event_sequence: int | None = None
    token_ttl_seconds: float | None = None
    lease_ttl_seconds: float | None = None
    scope: dict[str, Any] | None = None
    protocol_version: str | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_response(cls, body: Grant | Mapping[str, Any]) -> Grant:
        """Parse a negotiate answer (2.1), an alias grant (2.9) or a bootstrap object (2.10).

        Its ``protocol_version``, when it has one, must be of this client's major
        version (a newer minor only adds fields, which are ignored): else
        :class:`~sandlot.protocol.errors.ProtocolVersionError`, before anything is used.
        """
        if isinstance(body, Grant):
            return body
        if not isinstance(body, Mapping):
            raise TypeError(
                f"a grant is a Grant or the broker's answer as a mapping, not "
                f"{type(body).__name__} (ensure(thread_id) returns a ready Sandbox)"
            )
        version = body.get("protocol_version")
        check_protocol_version(version)
        sandbox = body.get("sandbox") or {}
        dataplane = body.get("dataplane") or sandbox or {}
        binding = body.get("binding") or {}
        creds = body.get("credentials") or {}
        policy = body.get("policy") or {}
        http = (
            dataplane.get("http_base_url") or sandbox.get("http_base_url") or body.get("http_url")
        )
        ws = dataplane.get("ws_base_url") or sandbox.get("ws_base_url") or body.get("ws_url")
        token = body.get("token") or creds.get("access_token")
        sandbox_id = sandbox.get("id") or body.get("sandbox_id") or binding.get("sandbox_id")
        if not (http and token and sandbox_id):
            raise ValueError("not a sandbox grant: needs a sandbox id, a dataplane URL and a token")
        if not ws:
            ws = "ws" + str(http)[4:] if str(http).startswith("http") else str(http)
        caps = creds.get("granted_capabilities") or body.get("scopes") or ()
        return cls(
            sandbox_id=str(sandbox_id),
            http_base_url=str(http).rstrip("/"),
            ws_base_url=str(ws).rstrip("/"),
            token=str(token),
            expires_at=parse_time(body.get("expires_at") or creds.get("expires_at")),
            session_id=body.get("session_id") or binding.get("id"),
            capabilities=tuple(caps),
            state=binding.get("state"),
            last_event_sequence=binding.get("last_event_sequence"),
            token_ttl_seconds=policy.get("token_ttl_seconds"),
            lease_ttl_seconds=policy.get("lease_ttl_seconds"),
            scope=binding.get("scope"),
            protocol_version=version,
            raw=dict(body),
        )

    def update_token(self, body: Mapping[str, Any]) -> None:
        """Take a refreshed token (the 2.3 answer)."""
        creds = body.get("credentials") or {}
        self.token = str(body.get("token") or creds.get("access_token"))
        self.expires_at = parse_time(body.get("expires_at") or creds.get("expires_at"))
        if creds.get("granted_capabilities"):
            self.capabilities = tuple(creds["granted_capabilities"])

    def seconds_left(self) -> float:
        """Seconds until the token expires (infinite when the grant names no expiry)."""
        if self.expires_at is None:
            return float("inf")
        return self.expires_at - time.time()

    def refresh_delay(self) -> float:
        """Seconds from now until a refresh is due: at about 2/3 of the token's lifetime."""
        left = self.seconds_left()
        if left == float("inf"):
            return 3600.0
        ttl = self.token_ttl_seconds or left
        return max(1.0, left - ttl / 3)


@dataclass(frozen=True)
class CommandResult:
    """A finished command: its output, exit code and whether it timed out."""

    exit_code: int | None
    stdout: str
    stderr: str
    exec_id: str | None = None
    command_id: str | None = None
    timed_out: bool = False
    truncated: bool = False
    duration_ms: float | None = None
    #: The kernel's OOM killer ended it: the sandbox ran out of memory.
    oom_killed: bool = False

    @property
    def output(self) -> str:
        """stdout followed by stderr."""
        return self.stdout + self.stderr

    @classmethod
    def from_wire(cls, body: Mapping[str, Any]) -> CommandResult:
        """Parse a ``POST /exec`` answer."""
        return cls(
            exit_code=body.get("exit_code"),
            stdout=body.get("stdout", ""),
            stderr=body.get("stderr", ""),
            exec_id=body.get("exec_id"),
            command_id=body.get("command_id"),
            timed_out=bool(body.get("timed_out")),
            truncated=bool(body.get("truncated")),
            duration_ms=body.get("duration_ms"),
            oom_killed=bool(body.get("oom_killed")),
        )


@dataclass(frozen=True)
class OutputChunk:
    """Bytes of one output stream (``stdout``/``stderr``) starting at ``offset``.

    ``lost`` is non-zero only for a gap: the server's buffer no longer held the
    ``lost`` bytes before ``offset + lost`` (never a silent loss).
    """

    stream: str
    data: str
    offset: int
    lost: int = 0

    @property
    def end(self) -> int:
        """Offset just after this chunk."""
        return self.offset + self.lost + len(self.data.encode("utf-8"))


class FileEntry(NamedTuple):
    """One file or directory of a listing or glob (absolute sandbox path).

    A named tuple rather than a dataclass: a listing makes thousands of them, and a
    tuple is built in a third of the time and is no work for the garbage collector.
    """

    path: str
    is_dir: bool
    size: int | None = None
    modified_at: str | None = None

    @classmethod
    def from_wire(cls, body: Mapping[str, Any]) -> FileEntry:
        """Parse an entry of ``/fs/list`` or ``/fs/glob``."""
        return cls.many_from_wire((body,))[0]

    @classmethod
    def many_from_wire(cls, bodies: Iterable[Mapping[str, Any]]) -> list[FileEntry]:
        """Parse the entries of a listing or a glob."""
        new = tuple.__new__
        return [
            new(cls, (b["path"], b.get("is_dir") is True, b.get("size"), b.get("modified_at")))
            for b in bodies
        ]


@dataclass(frozen=True)
class ReadResult:
    """A window of a file's lines (``/fs/read``); ``etag`` guards a later write."""

    content: str
    encoding: str
    total_lines: int
    start_line: int
    end_line: int
    next_offset: int | None
    etag: str | None

    @classmethod
    def from_wire(cls, body: Mapping[str, Any]) -> ReadResult:
        """Parse a ``/fs/read`` answer."""
        return cls(
            content=body.get("content", ""),
            encoding=body.get("encoding", "utf-8"),
            total_lines=body.get("total_lines", 0),
            start_line=body.get("start_line", 0),
            end_line=body.get("end_line", 0),
            next_offset=body.get("next_offset"),
            etag=body.get("etag"),
        )


@dataclass(frozen=True)
class GrepMatch:
    """One matching line (1-based ``line``)."""

    path: str
    line: int
    text: str


@dataclass(frozen=True)
class Event:
    """One entry of a sandbox's (or a binding's) ordered event log.

    Dispatch on :attr:`kind` (the one member of ``details``), not on ``event_type``.
    """

    sequence: int
    event_type: str
    details: dict[str, Any]
    actor: dict[str, Any] | None = None
    state: str | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def kind(self) -> str | None:
        """``phase``, ``exec``, ``shell``, ``fs``, ``binding`` or ``service``."""
        return next(iter(self.details), None)

    @classmethod
    def from_wire(cls, body: Mapping[str, Any]) -> Event:
        """Parse an event envelope (PROTOCOL.md 3.7 / 2.6)."""
        return cls(
            sequence=int(body["sequence"]),
            event_type=str(body.get("event_type", "")),
            details=dict(body.get("details") or {}),
            actor=body.get("actor"),
            state=body.get("sandbox_state") or body.get("state"),
            raw=dict(body),
        )


@dataclass(frozen=True)
class Response:
    """A whole HTTP answer: status, headers (names in lower case) and body."""

    status_code: int
    headers: Mapping[str, str]
    content: bytes

    def json(self) -> Any:
        """The body parsed as JSON (``ValueError`` if it is not)."""
        return json.loads(self.content)


class Deadline:
    """A client-side deadline shared by every step of one call."""

    def __init__(self, seconds: float | None) -> None:
        self.seconds = seconds
        self.at = None if seconds is None else time.monotonic() + seconds

    def remaining(self) -> float | None:
        """Seconds left (``None``: no deadline); raises ``TimeoutError`` once past."""
        if self.at is None:
            return None
        left = self.at - time.monotonic()
        if left <= 0:
            raise RequestTimeout(f"deadline of {self.seconds} s exceeded")
        return left


class RetryBudget:
    """When to stop reconnecting a stream whose connection broke.

    Given up after ``attempts`` consecutive failures; once the server has
    acknowledged the stream (a command's ``ready``, an event), only when those
    failures also span ``window`` seconds: a running command outlives a network
    outage of that long, while a server that never answered fails fast. Every
    acknowledgement starts a new budget.
    """

    def __init__(self, attempts: int = 5, window: float = 30.0) -> None:
        self.attempts = attempts
        self.window = window
        self.failures = 0
        self.acknowledged = False
        self._since: float | None = None

    def acknowledge(self) -> None:
        """The server acknowledged the stream: a new budget."""
        self.failures = 0
        self.acknowledged = True
        self._since = None

    def fail(self) -> bool:
        """Count one failure; whether to try again (after :meth:`backoff` seconds)."""
        now = time.monotonic()
        if self._since is None:
            self._since = now
        self.failures += 1
        if self.failures <= self.attempts:
            return True
        return self.acknowledged and now - self._since < self.window

    def backoff(self) -> float:
        """Seconds to wait before the next attempt (doubling, at most 2 s)."""
        return min(0.05 * (1 << min(self.failures, 8)), 2.0)
