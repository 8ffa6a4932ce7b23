"""The options every client command shares: where the server is, and the output format.

The values they give are the highest in the CLI's precedence (:mod:`sandlot.cli.settings`:
flags > ``SANDLOT_URL`` / ``SANDLOT_API_KEY`` > config file > defaults).
"""

from __future__ import annotations

import typer

UrlOption = typer.Option(
    None, "--url", help="Server URL (env SANDLOT_URL; default http://127.0.0.1:8765)."
)
KeyOption = typer.Option(
    None, "--api-key", help="API key (env SANDLOT_API_KEY).", show_default=False
)
JsonOption = typer.Option(False, "--json", help="Print JSON.")
SandboxOption = typer.Option(
    None,
    "--sandbox",
    metavar="ID",
    help="A sandbox by id (one `sandlot sandbox create` made) instead of a thread.",
    show_default=False,
)
SandboxDirOption = typer.Option(
    None,
    "--sandbox",
    metavar="ID[:DIR]",
    help="A sandbox by id (one `sandlot sandbox create` made) instead of THREAD[:DIR].",
    show_default=False,
)
IdleTimeoutOption = typer.Option(
    None,
    "--idle-timeout",
    metavar="SECONDS",
    help="Fail the transfer once no byte moved for this long (env SANDLOT_IDLE_TIMEOUT;"
    " default 120). There is no limit on the whole transfer.",
    show_default=False,
)
