"""``sandlot mcp``: the MCP server over stdio, for desktop clients."""

from __future__ import annotations

import typer
from rich.markup import escape

from sandlot.cli.errors import fail
from sandlot.cli.settings import ConfigError, load_settings

HELP = "Serve MCP over stdin/stdout: sandbox tools for a desktop client, as your API key."
EPILOG = (
    'Example (a desktop client\'s config): {"command": "sandlot", "args": ["mcp"], '
    '"env": {"SANDLOT_URL": "http://127.0.0.1:8765", "SANDLOT_API_KEY": "sl_…"}}'
)


def mcp_command(
    url: str = typer.Option(None, help="The sandlot server (default: SANDLOT_URL, config)."),
    api_key: str = typer.Option(None, help="Your API key (default: SANDLOT_API_KEY, config)."),
) -> None:
    try:
        settings = load_settings(url, api_key)
    except ConfigError as exc:
        raise fail(str(exc), 2) from None
    try:
        from sandlot.integrations.mcp import run_stdio
    except ModuleNotFoundError as exc:
        if (exc.name or "").partition(".")[0] not in ("mcp", "mcp_types"):
            raise
        message = "the MCP server needs the mcp extra: pip install 'sandlot[mcp]'"
        raise fail(escape(message), 2) from None
    run_stdio(settings.url, settings.api_key)
