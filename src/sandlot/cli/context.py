"""Where the CLI's client commands find the server: flags > environment > config file.

The config file is ``$SANDLOT_CLIENT_CONFIG`` or ``~/.config/sandlot/config.toml``::

    url = "http://127.0.0.1:8765"
    api_key = "sl_…"

Environment: ``SANDLOT_URL``, ``SANDLOT_API_KEY``.
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass
from pathlib import Path

import typer

from sandlot.cli.errors import fail

DEFAULT_URL = "http://127.0.0.1:8765"


@dataclass(frozen=True)
class ClientSettings:
    url: str
    api_key: str
    timeout: float = 30.0


def _config_file() -> Path:
    explicit = os.environ.get("SANDLOT_CLIENT_CONFIG")
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "sandlot" / "config.toml"


def load_client_settings(
    url: str | None, api_key: str | None, timeout: float | None = None
) -> ClientSettings:
    path = _config_file()
    file_values: dict[str, object] = {}
    if path.exists():
        try:
            file_values = tomllib.loads(path.read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise fail(f"cannot read {path}: {exc}", 2) from None
    resolved_url = (
        url or os.environ.get("SANDLOT_URL") or str(file_values.get("url") or DEFAULT_URL)
    )
    key = api_key or os.environ.get("SANDLOT_API_KEY") or file_values.get("api_key")
    if not key:
        raise fail(
            "no API key: pass --api-key, set SANDLOT_API_KEY, or put api_key in "
            f"{path} (create one with: sandlot keys create --user YOU)",
            2,
        )
    return ClientSettings(url=resolved_url.rstrip("/"), api_key=str(key), timeout=timeout or 30.0)


UrlOption = typer.Option(
    None, "--url", help="Server URL (env SANDLOT_URL; default http://127.0.0.1:8765)."
)
KeyOption = typer.Option(
    None, "--api-key", help="API key (env SANDLOT_API_KEY).", show_default=False
)
JsonOption = typer.Option(False, "--json", help="Print JSON.")
