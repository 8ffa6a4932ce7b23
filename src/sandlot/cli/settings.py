"""The CLI's one frozen settings object: where its client commands find the server.

Precedence, highest first: arguments (``--url``, ``--api-key``) > environment > the
config file > defaults. An empty value counts as none. ``sandlot serve`` and ``sandlot
keys`` take the broker's settings instead (:mod:`sandlot.broker.settings`).

Environment variables:

- ``SANDLOT_URL``: the server (default ``http://127.0.0.1:8765``).
- ``SANDLOT_API_KEY``: the API key (no default: a client command without one fails).
- ``SANDLOT_CLIENT_CONFIG``: the config file, instead of
  ``$XDG_CONFIG_HOME/sandlot/config.toml``.
- ``XDG_CONFIG_HOME``: where that file is looked for (default ``~/.config``).
- ``XDG_CACHE_HOME``: where ``sandlot watch`` keeps the cursor of each sandbox it
  watched, in ``sandlot/watch/`` (default ``~/.cache``).
- ``SANDLOT_IDLE_TIMEOUT``: seconds a ``sync`` or ``pull`` transfer may go without a
  byte moving before it fails (default 120; ``--idle-timeout``). A transfer has
  no overall deadline: a large tree over a slow link takes what it takes.

The config file (TOML; read when it exists)::

    url = "http://127.0.0.1:8765"
    api_key = "sl_…"
    idle_timeout = 120

Nothing else in the CLI reads the environment.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_URL = "http://127.0.0.1:8765"
DEFAULT_TIMEOUT = 30.0
DEFAULT_IDLE_TIMEOUT = 120.0


class ConfigError(ValueError):
    """The settings cannot be made (the config file is unreadable, no API key)."""


@dataclass(frozen=True)
class CliSettings:
    """What a client command runs with (``url`` without a trailing slash)."""

    url: str
    api_key: str
    timeout: float = DEFAULT_TIMEOUT
    #: Seconds an archive transfer (``sync``, ``pull``) may go without a byte moving.
    idle_timeout: float = DEFAULT_IDLE_TIMEOUT
    #: Where ``sandlot watch`` keeps its cursors, one file per sandbox.
    watch_dir: Path = field(default_factory=lambda: Path.home() / ".cache" / "sandlot" / "watch")


def config_file(environ: Mapping[str, str] | None = None) -> Path:
    """The config file's path (whether or not it exists)."""
    env = os.environ if environ is None else environ
    explicit = env.get("SANDLOT_CLIENT_CONFIG")
    if explicit:
        return Path(explicit).expanduser()
    base = env.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "sandlot" / "config.toml"


def load_settings(
    url: str | None = None,
    api_key: str | None = None,
    timeout: float | None = None,
    *,
    idle_timeout: float | None = None,
    environ: Mapping[str, str] | None = None,
) -> CliSettings:
    """Arguments (non-empty) > env > config file > defaults; raises :class:`ConfigError`."""
    env = os.environ if environ is None else environ
    path = config_file(env)
    file_values: dict[str, object] = {}
    if path.exists():
        try:
            file_values = tomllib.loads(path.read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"cannot read {path}: {exc}") from None
    resolved_url = url or env.get("SANDLOT_URL") or str(file_values.get("url") or DEFAULT_URL)
    key = api_key or env.get("SANDLOT_API_KEY") or file_values.get("api_key")
    if not key:
        raise ConfigError(
            "no API key: pass --api-key, set SANDLOT_API_KEY, or put api_key in "
            f"{path} (create one with: sandlot keys create --user YOU)"
        )
    cache = Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    idle = idle_timeout or env.get("SANDLOT_IDLE_TIMEOUT") or file_values.get("idle_timeout")
    try:
        idle_seconds = float(str(idle)) if idle else DEFAULT_IDLE_TIMEOUT
    except (TypeError, ValueError):
        idle_seconds = -1.0
    if not idle_seconds > 0:
        raise ConfigError(f"the idle timeout must be a number of seconds above 0, not {idle!r}")
    return CliSettings(
        url=resolved_url.rstrip("/"),
        api_key=str(key),
        timeout=timeout or DEFAULT_TIMEOUT,
        idle_timeout=idle_seconds,
        watch_dir=cache / "sandlot" / "watch",
    )
