"""The browser workspace's one frozen settings object.

Precedence, highest first: explicit arguments > environment > defaults. An empty
variable counts as unset. Nothing else in :mod:`sandlot.web` reads the environment.

Environment variables:

- ``SANDLOT_WORKSPACE_MODE``: ``sandbox`` (default) serves a sandbox's workspace
  through its dataplane; ``local`` serves a folder of this machine, unisolated. The
  default is ``sandbox`` because that is what ``sandlot serve`` runs, and because
  exposing the host's own files must be asked for (``sandlot web`` asks for it).
- ``SANDLOT_WEB_ROOT``: in ``local`` mode, the folder served (default: the current
  directory of the process).
- ``SANDLOT_WEB_LOCAL_USERS``: in ``local`` mode, the users (comma separated) the folder is
  served to; anyone else signed in gets 403. ``sandlot web`` sets it to the user it prints
  the sign-in link for. Required in ``local`` mode.
- ``SANDLOT_DATA_DIR``: where the session-id signing key is kept when
  ``SESSION_TOKEN_SECRET`` is not set (default ``.sandlot``, as the broker's).
- ``SANDLOT_PUBLIC_URL``: how browsers reach this server, when it is not the address
  they connect to (behind a TLS proxy); its origin is then the only own origin, and
  an ``https`` URL makes the session cookie ``Secure``.
- ``SESSION_TOKEN_SECRET``: the key signing terminal session ids (at least 32 bytes).
  Unset, ``sandlot serve`` uses a random key made once per broker store (shared by its
  replicas), and ``sandlot web`` one created once in the data directory
  (``web-session.key``, mode 0600).
- ``SANDLOT_WEB_SESSION_TOKEN_TTL``: lifetime of a terminal session id in seconds,
  900-3600 (default 1800).
- ``SANDLOT_WEB_COOKIE_SECURE``: ``auto`` (default: ``Secure`` when the request came
  over TLS or the public URL is ``https``), ``true`` or ``false``.
- ``SANDLOT_WEB_SESSION_IDLE_SECONDS``: a browser session unused this long ends
  (default 28800, 8 hours).
- ``SANDLOT_WEB_SESSION_MAX_SECONDS``: a browser session ends this long after sign-in
  whatever its use (default 259200, 3 days).
- ``SANDLOT_WEB_LOGIN_LINK_TTL``: how long a one-time sign-in link stays valid, in
  seconds (default 300).
- ``SANDLOT_WEB_TREE_MAX_DEPTH``, ``SANDLOT_WEB_TREE_MAX_NODES``,
  ``SANDLOT_WEB_TREE_SECONDS``: bounds of ``GET /api/tree`` (deepest ``depth`` accepted,
  default 8; most entries answered, default 5000; seconds the walk may take before a
  partial listing is answered, default 5).
- ``SANDLOT_WEB_TREE_BURST``, ``SANDLOT_WEB_TREE_PER_SECOND``: each user's budget of
  ``GET /api/tree`` (default 20 at once, then 5 per second);
  ``SANDLOT_WEB_SEARCH_BURST``, ``SANDLOT_WEB_SEARCH_PER_SECOND``: of ``GET /api/search``
  and ``GET /api/v1/grep`` together (default 20, then 2 per second). Beyond, the route
  answers 429 ``RATE_LIMITED`` with ``Retry-After`` (:class:`~sandlot.web.limits.RouteLimits`).
- ``SANDLOT_WEB_WS_<FIELD>``: each field of :class:`~sandlot.web.limits.SocketLimits`,
  the limits of the terminal and chat sockets (defaults there, and in docs/WEB.md):
  ``…_USER_CONNECT_BURST``, ``…_USER_CONNECTS_PER_SECOND``, ``…_IP_CONNECT_BURST``,
  ``…_IP_CONNECTS_PER_SECOND``, ``…_MAX_SOCKETS_PER_USER``, ``…_INPUT_BURST_BYTES``,
  ``…_INPUT_BYTES_PER_SECOND``, ``…_MAX_INPUT_FRAME_BYTES``, ``…_MAX_CHAT_FRAME_BYTES``,
  ``…_OUTPUT_QUEUE_FRAMES``, ``…_OUTPUT_QUEUE_BYTES``, ``…_INPUT_QUEUE_FRAMES``,
  ``…_INPUT_QUEUE_BYTES``, ``…_MAX_BUCKETS``, ``…_CLOSE_TIMEOUT`` (seconds). Every limit
  is a positive number (a whole one where its default is).
- ``SANDLOT_WEB_MAX_ACTIVITY_STREAMS``: the live activity streams
  (``GET /api/v1/activity/stream``, one per open page) a user may have at once (default
  16); one more closes the user's oldest, whose page reconnects.
- ``SANDLOT_WEB_ALLOWED_ORIGINS``: other origins (``scheme://host[:port]``, comma
  separated) whose pages may make state-changing requests and open WebSockets.
- ``SANDLOT_WEB_CHAT_TEMPLATES``: a TOML file of the agent programs ``/ws/claude-stream``
  may start (:mod:`sandlot.web.chat_templates`); unset, the built-in ``claude`` one.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

from sandlot.web.limits import RouteLimits, SocketLimits

#: Bounds of a terminal session id's lifetime (seconds).
MIN_SESSION_TOKEN_TTL = 15 * 60
MAX_SESSION_TOKEN_TTL = 60 * 60
#: Shortest accepted ``SESSION_TOKEN_SECRET`` (HMAC-SHA256 wants a key of its hash's size).
MIN_SECRET_BYTES = 32


class ConfigError(ValueError):
    """The settings are invalid; the message says which one and why (never its value)."""


class WorkspaceMode(enum.StrEnum):
    LOCAL = "local"
    SANDBOX = "sandbox"


def normalize_origin(value: str) -> str | None:
    """``scheme://host[:port]`` in canonical form (lower case, no default port), or
    ``None`` when ``value`` is not an http(s)/ws(s) origin (``null``, garbage)."""
    try:
        parts = urlsplit(value.strip())
        port = parts.port
    except ValueError:
        return None
    scheme = {"ws": "http", "wss": "https"}.get(parts.scheme.lower(), parts.scheme.lower())
    host = parts.hostname
    if scheme not in ("http", "https") or not host:
        return None
    if ":" in host:
        host = f"[{host}]"
    if port is None or port == {"http": 80, "https": 443}[scheme]:
        return f"{scheme}://{host}"
    return f"{scheme}://{host}:{port}"


@dataclass(frozen=True)
class WebSettings:
    mode: WorkspaceMode = WorkspaceMode.SANDBOX
    data_dir: Path = Path(".sandlot")
    public_url: str | None = None
    session_token_secret: str | None = dataclasses.field(default=None, repr=False)
    session_token_ttl_seconds: int = 1800
    #: ``None``: decided per request (TLS, or an ``https`` public URL).
    cookie_secure: bool | None = None
    session_idle_seconds: int = 8 * 3600
    session_max_seconds: int = 3 * 24 * 3600
    login_link_ttl_seconds: int = 300
    allowed_origins: frozenset[str] = frozenset()
    #: Browser sessions kept at once; beyond, the least recently used ends.
    max_sessions: int = 10_000
    #: ``local`` mode: the folder served (``None``: the current directory).
    root: Path | None = None
    #: ``local`` mode: who the folder is served to.
    local_users: frozenset[str] = frozenset()
    #: ``GET /api/tree``: deepest ``depth`` asked, most entries answered, and how long the
    #: walk may take before a partial listing (``"truncated": true``) is answered instead.
    tree_max_depth: int = 8
    tree_max_nodes: int = 5000
    tree_seconds: float = 5.0
    #: ``GET /api/search`` and ``/api/v1/grep``: most results answered.
    max_search_results: int = 1000
    #: Each user's budgets of ``/api/tree``, ``/api/search`` and ``/api/v1/grep``.
    route_limits: RouteLimits = dataclasses.field(default_factory=RouteLimits)
    #: The terminal and chat sockets' limits.
    socket_limits: SocketLimits = dataclasses.field(default_factory=SocketLimits)
    #: Live activity streams of one user at once (one more closes the user's oldest).
    max_activity_streams: int = 16
    #: Largest JSON body a workspace route reads (a file written through ``PUT``).
    max_body_bytes: int = 16 * 1024 * 1024
    #: The chat's command templates (``None``: the built-in set).
    chat_templates_file: Path | None = None

    def __post_init__(self) -> None:
        ttl = self.session_token_ttl_seconds
        if not MIN_SESSION_TOKEN_TTL <= ttl <= MAX_SESSION_TOKEN_TTL:
            raise ConfigError(
                f"session token lifetime must be {MIN_SESSION_TOKEN_TTL}-"
                f"{MAX_SESSION_TOKEN_TTL} seconds (15-60 minutes), not {ttl}"
            )
        secret = self.session_token_secret
        if secret is not None and len(secret.encode()) < MIN_SECRET_BYTES:
            raise ConfigError(f"SESSION_TOKEN_SECRET must be at least {MIN_SECRET_BYTES} bytes")
        for name in ("session_idle_seconds", "session_max_seconds", "login_link_ttl_seconds"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive")
        if self.session_idle_seconds > self.session_max_seconds:
            raise ConfigError("session_idle_seconds cannot exceed session_max_seconds")
        if self.max_sessions <= 0:
            raise ConfigError("max_sessions must be positive")
        for name in (
            "tree_max_depth",
            "tree_max_nodes",
            "max_search_results",
            "max_body_bytes",
            "max_activity_streams",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive")
        if self.tree_seconds <= 0:
            raise ConfigError("tree_seconds must be positive")
        object.__setattr__(self, "local_users", frozenset(u.strip() for u in self.local_users))
        if "" in self.local_users:
            raise ConfigError("a local user cannot be empty")
        if self.public_url is not None and normalize_origin(self.public_url) is None:
            raise ConfigError(f"public URL {self.public_url!r} is not an http(s) URL")
        origins = set()
        for origin in self.allowed_origins:
            normal = normalize_origin(origin)
            if normal is None:
                raise ConfigError(f"allowed origin {origin!r} is not scheme://host[:port]")
            origins.add(normal)
        object.__setattr__(self, "allowed_origins", frozenset(origins))

    @property
    def public_origin(self) -> str | None:
        return normalize_origin(self.public_url) if self.public_url else None

    @property
    def secret_path(self) -> Path:
        """Where the session-id key lives when ``SESSION_TOKEN_SECRET`` is unset."""
        return self.data_dir / "web-session.key"


_INT_VARS = {
    "session_token_ttl_seconds": "SANDLOT_WEB_SESSION_TOKEN_TTL",
    "session_idle_seconds": "SANDLOT_WEB_SESSION_IDLE_SECONDS",
    "session_max_seconds": "SANDLOT_WEB_SESSION_MAX_SECONDS",
    "login_link_ttl_seconds": "SANDLOT_WEB_LOGIN_LINK_TTL",
    "tree_max_depth": "SANDLOT_WEB_TREE_MAX_DEPTH",
    "tree_max_nodes": "SANDLOT_WEB_TREE_MAX_NODES",
    "max_activity_streams": "SANDLOT_WEB_MAX_ACTIVITY_STREAMS",
}


Limits = TypeVar("Limits", RouteLimits, SocketLimits)


def _limits_from_env(cls: type[Limits], env: Mapping[str, str], prefix: str) -> Limits:
    """``cls`` with each field ``name`` read from ``<prefix><NAME>`` when set (the
    defaults are the class's own)."""
    values: dict[str, Any] = {}
    for field in dataclasses.fields(cls):
        name = f"{prefix}{field.name.upper()}"
        if not (raw := env.get(name)):
            continue
        whole = field.type in ("int", int)
        try:
            value = int(raw) if whole else float(raw)
        except ValueError:
            kind = "a whole number" if whole else "a number"
            raise ConfigError(f"{name}: {raw!r} is not {kind}") from None
        if not (math.isfinite(value) and value > 0):
            raise ConfigError(f"{name} must be positive")
        values[field.name] = value
    return cls(**values)


def load_web_settings(
    environ: Mapping[str, str] | None = None,
    *,
    default_mode: WorkspaceMode = WorkspaceMode.SANDBOX,
    **overrides: Any,
) -> WebSettings:
    """Build the settings: ``overrides`` (non-None values) > env > defaults (the mode's
    is ``default_mode``: ``sandlot web`` asks for ``local``)."""
    env = os.environ if environ is None else environ
    values: dict[str, Any] = {"mode": default_mode}
    if mode := env.get("SANDLOT_WORKSPACE_MODE"):
        try:
            values["mode"] = WorkspaceMode(mode.strip().lower())
        except ValueError:
            raise ConfigError(
                f"SANDLOT_WORKSPACE_MODE must be local or sandbox, not {mode!r}"
            ) from None
    if data_dir := env.get("SANDLOT_DATA_DIR"):
        values["data_dir"] = Path(data_dir)
    if public_url := env.get("SANDLOT_PUBLIC_URL"):
        values["public_url"] = public_url
    if secret := env.get("SESSION_TOKEN_SECRET"):
        values["session_token_secret"] = secret
    for field, name in _INT_VARS.items():
        if raw := env.get(name):
            try:
                values[field] = int(raw)
            except ValueError:
                raise ConfigError(f"{name}: {raw!r} is not a whole number") from None
    if seconds := env.get("SANDLOT_WEB_TREE_SECONDS"):
        try:
            values["tree_seconds"] = float(seconds)
        except ValueError:
            raise ConfigError(f"SANDLOT_WEB_TREE_SECONDS: {seconds!r} is not a number") from None
    values["route_limits"] = _limits_from_env(RouteLimits, env, "SANDLOT_WEB_")
    values["socket_limits"] = _limits_from_env(SocketLimits, env, "SANDLOT_WEB_WS_")
    if secure := env.get("SANDLOT_WEB_COOKIE_SECURE"):
        choice = secure.strip().lower()
        if choice not in ("auto", "true", "false", "1", "0"):
            raise ConfigError(
                f"SANDLOT_WEB_COOKIE_SECURE must be auto, true or false, not {secure!r}"
            )
        values["cookie_secure"] = None if choice == "auto" else choice in ("true", "1")
    if root := env.get("SANDLOT_WEB_ROOT"):
        values["root"] = Path(root)
    if users := env.get("SANDLOT_WEB_LOCAL_USERS"):
        values["local_users"] = frozenset(u for u in users.split(",") if u.strip())
    if templates := env.get("SANDLOT_WEB_CHAT_TEMPLATES"):
        values["chat_templates_file"] = Path(templates)
    if origins := env.get("SANDLOT_WEB_ALLOWED_ORIGINS"):
        values["allowed_origins"] = frozenset(o for o in origins.split(",") if o.strip())
    values.update({k: v for k, v in overrides.items() if v is not None})
    return WebSettings(**values)


def served_root(settings: WebSettings) -> Path:
    """The folder ``local`` mode serves, absolute."""
    return (settings.root or Path.cwd()).resolve()
