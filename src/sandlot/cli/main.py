"""The ``sandlot`` command."""

from __future__ import annotations

import sys

import typer

from sandlot import __version__
from sandlot.cli import keys, serve

app = typer.Typer(
    name="sandlot",
    help="Shared sandboxes for a human and an AI agent.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
app.command("serve", help=serve.HELP, epilog=serve.EPILOG)(serve.serve_command)
app.add_typer(keys.app, name="keys")


def _version(value: bool) -> None:
    if value:
        typer.echo(f"sandlot {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """Shared sandboxes for a human and an AI agent."""


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
