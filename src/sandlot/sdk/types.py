"""Plain result types of the SDK, shared by the async and the sync client (no I/O).

``Grant`` is what the broker hands out (PROTOCOL.md 2.1, also the 2.9 alias
shape and the bootstrap object of 2.10). The others are the answers of the
dataplane (PROTOCOL.md 3) and of the broker (2.2-2.4, 2.8) as frozen
dataclasses: the SDK stays free of pydantic, so these are light twins of the
wire models in :mod:`sandlot.protocol`, with the same field names and types
(``tests/sdk/test_types_match_protocol.py`` derives one side from the other).
Timestamps stay RFC 3339 strings, as on the wire. Each top-level answer keeps
the body as the server sent it (``raw``, :meth:`~WireResult.to_dict`): what the
CLI prints with ``--json``, including fields a newer server added.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, ClassVar, NamedTuple, Self, TypedDict, cast

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


_FIELDS: dict[type, tuple[tuple[str, bool], ...]] = {}


def _fields_of(cls: type) -> tuple[tuple[str, bool], ...]:
    """(name, required) of each field of a result class, in order."""
    plan = _FIELDS.get(cls)
    if plan is None:
        plan = _FIELDS[cls] = tuple(
            (f.name, f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
            for f in dataclasses.fields(cast(Any, cls))
        )
    return plan


def _each(parse: Callable[[Any], Any]) -> Callable[[Any], list[Any]]:
    """The parser of a list of objects, from the parser of one."""
    return lambda items: [parse(item) for item in items]


class WireResult:
    """Base of the results parsed from a JSON object: each field is the member of its name.

    A member the server did not send takes the field's default (a required one
    missing is a :class:`ValueError`: not an answer of this protocol); members the
    SDK does not know are ignored, as a newer minor version of the protocol may
    add some. Members holding objects are parsed by the class's ``_nested`` parsers.
    A top-level answer also keeps its body as sent in ``raw`` (neither shown nor
    compared: two answers are equal by their fields).
    """

    #: Field name → parser of its member, for the fields that hold objects.
    _nested: ClassVar[Mapping[str, Callable[[Any], Any]]] = {}

    @classmethod
    def from_wire(cls, body: Mapping[str, Any]) -> Self:
        """Parse the server's JSON object."""
        if not isinstance(body, Mapping):
            raise ValueError(f"{cls.__name__}: expected a JSON object, not {type(body).__name__}")
        kwargs: dict[str, Any] = {}
        for name, required in _fields_of(cls):
            if name == "raw":
                kwargs["raw"] = dict(body)
            elif name in body:
                value = body[name]
                parse = cls._nested.get(name)
                kwargs[name] = value if parse is None or value is None else parse(value)
            elif required:
                raise ValueError(f"{cls.__name__}: the answer has no {name!r}")
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready data: the body exactly as the server sent it, when parsed from one."""
        raw: dict[str, Any] | None = getattr(self, "raw", None)
        if raw:
            return dict(raw)
        data: dict[str, Any] = dataclasses.asdict(cast(Any, self))
        data.pop("raw", None)
        return data


@dataclass(frozen=True, kw_only=True)
class Actor(WireResult):
    """Who acted: ``type`` is ``human`` or ``agent``, ``id`` the principal or the agent it named."""

    type: str
    id: str


@dataclass(frozen=True, kw_only=True)
class Scope(WireResult):
    """What a binding serves: ``type`` (``thread``, ``assistant``, …) and ``id``."""

    type: str
    id: str

    def key(self) -> str:
        """The scope as the audit and the tokens write it: ``thread:thr_123``."""
        return f"{self.type}:{self.id}"


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
    #: Never in its repr: a logged grant must not leak it.
    token: str = field(repr=False)
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

    def update_token(self, body: RefreshResult | Mapping[str, Any]) -> None:
        """Take a refreshed token (the 2.3 answer)."""
        if isinstance(body, RefreshResult):
            body = body.to_dict()
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


@dataclass(frozen=True, kw_only=True)
class ExecSnapshot(WireResult):
    """A command of the sandbox as the server sees it (``GET /execs[/{id}]``, PROTOCOL.md 3.3).

    ``state`` is ``running``, ``exited``, ``killed`` or ``failed``; the offsets are
    the bytes each stream has produced so far (where :meth:`AsyncSandbox.attach
    <sandlot.sdk.AsyncSandbox.attach>` continues from), ``last_event_sequence`` the
    sandbox's event log at the time of the snapshot (subscribe after it, no race).
    """

    exec_id: str
    command_id: str | None
    command: str | list[str]
    actor: Actor | None
    state: str
    exit_code: int | None
    #: The signal that ended it (``SIGKILL``, …), if one did.
    signal: str | None = None
    #: The kernel's OOM killer ended it: the sandbox ran out of memory.
    oom_killed: bool = False
    pty: bool = False
    started_at: str
    ended_at: str | None
    stdout_offset: int
    stderr_offset: int
    #: Clients attached to its output now.
    clients: int = 0
    last_event_sequence: int
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    _nested = {"actor": Actor.from_wire}

    @property
    def running(self) -> bool:
        """Whether the command has not ended yet."""
        return self.state == "running"


@dataclass(frozen=True, kw_only=True)
class ShellSnapshot(WireResult):
    """A shared shell of the sandbox (``GET /shells``, PROTOCOL.md 3.4).

    ``offset`` is the bytes of output so far, ``clients`` the clients attached now,
    ``state`` ``running`` or ``exited``; ``profile`` names the template's shell
    command it runs.
    """

    name: str
    session_id: str
    profile: str
    clients: int
    created_at: str
    offset: int
    state: str
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)


class FileEntry(NamedTuple):
    """One file or directory of a listing or glob (absolute sandbox path).

    ``is_symlink``: the entry is a symbolic link (listed, never followed). A named
    tuple rather than a dataclass: a listing makes thousands of them, and a tuple
    is built in a third of the time and is no work for the garbage collector.
    """

    path: str
    is_dir: bool
    size: int = 0
    modified_at: str | None = None
    is_symlink: bool = False

    @classmethod
    def from_wire(cls, body: Mapping[str, Any]) -> FileEntry:
        """Parse an entry of ``/fs/list`` or ``/fs/glob``."""
        return cls.many_from_wire((body,))[0]

    @classmethod
    def many_from_wire(cls, bodies: Iterable[Mapping[str, Any]]) -> list[FileEntry]:
        """Parse the entries of a listing or a glob."""
        new = tuple.__new__
        return [
            new(
                cls,
                (
                    b["path"],
                    b.get("is_dir") is True,
                    b.get("size", 0),
                    b.get("modified_at"),
                    b.get("is_symlink") is True,
                ),
            )
            for b in bodies
        ]


class Listing(list[FileEntry]):
    """The entries of a listing or a glob: a list, and ``truncated`` when the dataplane
    stopped at its cap (there are more than listed: a caller, a model say, must not take
    the list for all there is)."""

    truncated: bool

    def __init__(self, entries: Iterable[FileEntry] = (), *, truncated: bool = False) -> None:
        super().__init__(entries)
        self.truncated = truncated

    @classmethod
    def from_wire(cls, body: Mapping[str, Any], key: str) -> Listing:
        """The entries under ``key`` of an ``/fs/list`` or ``/fs/glob`` answer."""
        entries = FileEntry.many_from_wire(body[key])
        return cls(entries, truncated=body.get("truncated") is True)


@dataclass(frozen=True)
class ReadResult:
    """A window of a file's lines (``/fs/read``); ``etag`` guards a later write.

    ``encoding`` is ``base64`` for a file that is not UTF-8 text (``content`` is
    then the whole file); ``path`` is the absolute sandbox path, ``size`` the
    file's size in bytes.
    """

    content: str
    encoding: str
    total_lines: int
    start_line: int
    end_line: int
    next_offset: int | None
    etag: str
    path: str = ""
    size: int = 0

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
            etag=body.get("etag", ""),
            path=body.get("path", ""),
            size=body.get("size", 0),
        )


@dataclass(frozen=True)
class GrepMatch:
    """One matching line (1-based ``line``)."""

    path: str
    line: int
    text: str


class GrepMatchDict(TypedDict):
    """One matching line as the server sends it (the items of :class:`GrepAnswer`)."""

    path: str
    line: int
    text: str


class GrepAnswer(TypedDict):
    """The ``/fs/grep`` answer as sent (:meth:`AsyncSandbox.grep_raw
    <sandlot.sdk.AsyncSandbox.grep_raw>`): ``truncated`` when a cap or the
    server's deadline stopped the search.

    The SDK's one deliberate dict: a caller that passes the matches on as dicts
    (the deepagents backend) would pay for a dataclass per match and a dict again
    (about 8 ms per 10,000 matches, more than parsing the JSON itself takes).
    """

    matches: list[GrepMatchDict]
    truncated: bool


@dataclass(frozen=True, kw_only=True)
class FileStat(WireResult):
    """A path's metadata (``GET /fs/stat``).

    ``type`` is ``file``, ``directory``, ``symlink`` or ``other``; ``mode`` the
    permission bits; ``etag`` the content's (files of at most 1 MiB, as
    :meth:`~AsyncSandbox.read` gives it).
    """

    path: str
    type: str
    size: int
    mode: int
    modified_at: str | None
    etag: str | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def is_dir(self) -> bool:
        """Whether the path is a directory."""
        return self.type == "directory"

    @property
    def is_file(self) -> bool:
        """Whether the path is a regular file."""
        return self.type == "file"


@dataclass(frozen=True, kw_only=True)
class EditResult(WireResult):
    """An edit done (``POST /fs/edit``): how many ``occurrences`` were replaced, the new etag."""

    path: str
    occurrences: int
    etag: str
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)


@dataclass(frozen=True, kw_only=True)
class UploadResult(WireResult):
    """A file stored (``POST /files/upload``): its absolute path and size in bytes."""

    path: str
    size: int
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)


@dataclass(frozen=True, kw_only=True)
class ArchiveResult(WireResult):
    """A tar extracted (``POST /files/archive``): what it wrote, what ``delete_missing`` removed.

    ``files`` and ``directories`` written, ``deleted`` paths removed, ``bytes`` of
    file content written, all under the directory ``path``.
    """

    path: str
    files: int
    directories: int
    deleted: int
    bytes: int
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)


@dataclass(frozen=True)
class Event:
    """One entry of a sandbox's (or a binding's) ordered event log (PROTOCOL.md 3.7, 2.6).

    Dispatch on :attr:`kind` (the one member of ``details``), not on ``event_type``.
    ``state`` is the sandbox's (or, on a binding's log, the binding's) state after
    the event: the wire's ``sandbox_state`` or ``state``. ``sandbox_id`` is set on
    a sandbox's log, ``binding_id`` on a binding's.
    """

    sequence: int
    event_type: str
    details: dict[str, Any]
    actor: dict[str, Any] | None = None
    state: str | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False)
    event_id: str | None = None
    timestamp: str | None = None
    sandbox_id: str | None = None
    binding_id: str | None = None

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
            event_id=body.get("event_id"),
            timestamp=body.get("timestamp"),
            sandbox_id=body.get("sandbox_id"),
            binding_id=body.get("binding_id"),
        )


# --- the broker's answers (PROTOCOL.md 2.2-2.4, 2.8) -----------------------------------


@dataclass(frozen=True, kw_only=True)
class Binding(WireResult):
    """A binding: the lease of a scope on a sandbox (the ``binding`` of a session snapshot).

    ``state`` follows the sandbox (``provisioning``, ``active``, ``idle``,
    ``suspended``, ``terminating``, ``terminated``, ``failed``);
    ``lease_expires_at`` is the calling actor's lease, if it holds one.
    """

    id: str
    scope: Scope
    sandbox_id: str
    provider: str
    state: str
    #: This negotiation created the sandbox.
    created: bool = False
    lease_expires_at: str | None = None
    last_event_sequence: int = 0
    created_at: str | None = None
    owner_user_id: str | None = None

    _nested = {"scope": Scope.from_wire}


@dataclass(frozen=True, kw_only=True)
class DataplaneCoordinates(WireResult):
    """Where a sandbox's dataplane answers (opaque base URLs, PROTOCOL.md 3)."""

    http_base_url: str
    ws_base_url: str


@dataclass(frozen=True, kw_only=True)
class SandboxRef(WireResult):
    """The sandbox of a binding: its id, provider and dataplane base URLs."""

    id: str
    provider: str
    http_base_url: str
    ws_base_url: str


@dataclass(frozen=True, kw_only=True)
class Policy(WireResult):
    """The lifetimes that apply to a binding, in seconds."""

    idle_timeout_seconds: int
    hard_ttl_seconds: int
    token_ttl_seconds: int
    lease_ttl_seconds: int


@dataclass(frozen=True, kw_only=True)
class Credentials(WireResult):
    """A sandbox token and the capabilities it grants."""

    token_type: str = "Bearer"
    access_token: str
    expires_at: str
    granted_capabilities: list[str]


@dataclass(frozen=True, kw_only=True)
class SessionSnapshot(WireResult):
    """A binding's snapshot, without a token (``GET /v1/sandbox/sessions/{id}``, PROTOCOL.md 2.2).

    ``binding.last_event_sequence`` is read with its state: subscribe to the
    binding's events after it to wait for a change, with no race.
    """

    session_id: str
    binding: Binding
    sandbox: SandboxRef
    dataplane: DataplaneCoordinates
    policy: Policy
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    _nested = {
        "binding": Binding.from_wire,
        "sandbox": SandboxRef.from_wire,
        "dataplane": DataplaneCoordinates.from_wire,
        "policy": Policy.from_wire,
    }

    @property
    def state(self) -> str:
        """The binding's state."""
        return self.binding.state


@dataclass(frozen=True, kw_only=True)
class RefreshResult(WireResult):
    """A fresh token for a binding (PROTOCOL.md 2.3)."""

    token: str
    expires_at: str
    credentials: Credentials
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    _nested = {"credentials": Credentials.from_wire}


@dataclass(frozen=True, kw_only=True)
class HeartbeatResult(WireResult):
    """A lease extended (PROTOCOL.md 2.4): the binding's state and the lease's new expiry."""

    state: str
    lease_expires_at: str
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)


@dataclass(frozen=True, kw_only=True)
class SandboxSnapshot(WireResult):
    """A sandbox as the broker sees it (``/v1/sandboxes[/{id}]``, PROTOCOL.md 2.8).

    ``scope`` is the scope it serves (``thread:thr_1``), if any; ``generation``
    counts its re-creations (a new one never honours old tokens);
    ``last_event_sequence`` is the position of its phase events at the time of
    the snapshot.
    """

    id: str
    name: str | None
    template: str
    state: str
    provider: str
    dataplane: DataplaneCoordinates
    created_at: str
    last_event_sequence: int
    owner_user_id: str | None = None
    scope: str | None = None
    generation: int = 1
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    _nested = {"dataplane": DataplaneCoordinates.from_wire}


@dataclass(frozen=True, kw_only=True)
class Resources(WireResult):
    """A template's limits: CPUs, memory and disk in MiB, processes."""

    cpu: float = 1.0
    memory_mb: int = 2048
    pids: int = 1024
    disk_mb: int | None = None


@dataclass(frozen=True, kw_only=True)
class VolumeMount(WireResult):
    """A volume mounted at ``path`` in the sandboxes of a template."""

    volume: str
    path: str
    read_only: bool = False


@dataclass(frozen=True, kw_only=True)
class Template(WireResult):
    """A sandbox template (``/v1/templates``, PROTOCOL.md 2.8).

    ``image`` is ``host`` or a root filesystem's path, ``network`` ``none`` or
    ``host``; ``shells`` are the named command profiles a shell may run.
    """

    name: str
    image: str
    resources: Resources = field(default_factory=Resources)
    network: str = "none"
    env: dict[str, str] = field(default_factory=dict)
    volume_mounts: list[VolumeMount] = field(default_factory=list)
    shells: dict[str, list[str]] = field(default_factory=lambda: {"default": ["/bin/bash", "-l"]})
    idle_timeout_seconds: int | None = None
    hard_ttl_seconds: int | None = None
    #: The configured provider its sandboxes come from (None: the request's or the default).
    provider: str | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    _nested = {"resources": Resources.from_wire, "volume_mounts": _each(VolumeMount.from_wire)}


@dataclass(frozen=True, kw_only=True)
class Pool(WireResult):
    """A warm pool (``/v1/pools``): its bounds and how many sandboxes are ready or on the way."""

    name: str
    template: str
    min_ready: int = 1
    max_ready: int = 4
    ready: int = 0
    provisioning: int = 0
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)


@dataclass(frozen=True, kw_only=True)
class Volume(WireResult):
    """A persistent volume (``/v1/volumes``)."""

    name: str
    created_at: str | None = None
    size_bytes: int | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)


@dataclass(frozen=True, kw_only=True)
class AuditEntry(WireResult):
    """One action of the audit log (``GET /v1/audit``): who, when, what, to which sandbox.

    ``principal_id`` is the key's principal (``system`` for the server's own
    actions), ``actor`` who acted (the agent a request named, else the principal),
    ``outcome`` ``ok`` or what went wrong, ``scope`` the scope key (``thread:thr_1``).
    """

    id: int
    timestamp: str
    request_id: str | None
    action: str
    outcome: str
    principal_id: str | None
    user_id: str | None
    actor: Actor | None
    scope: str | None
    session_id: str | None
    sandbox_id: str | None
    details: dict[str, Any]
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    _nested = {"actor": Actor.from_wire}
