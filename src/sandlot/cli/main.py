"""The ``sandlot`` command."""

from __future__ import annotations

import sys

import typer

from sandlot import __version__
from sandlot.cli import host, keys, live, mcp, resources, serve, sync, web

app = typer.Typer(
    name="sandlot",
    help="Shared sandboxes for a human and an AI agent.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
app.command("serve", help=serve.HELP, epilog=serve.EPILOG)(serve.serve_command)
app.command("host", help=host.HELP, epilog=host.EPILOG)(host.host_command)
app.command("web", help=web.WEB_HELP, epilog=web.WEB_EPILOG)(web.web_command)
app.command("open", help=web.OPEN_HELP, epilog=web.OPEN_EPILOG)(web.open_command)
app.add_typer(keys.app, name="keys")
app.add_typer(resources.session_app, name="session")
app.add_typer(resources.sandbox_app, name="sandbox")
app.add_typer(resources.template_app, name="template")
app.add_typer(resources.pool_app, name="pool")
app.command(
    "exec",
    cls=live.CommandAfterDashes,
    epilog=(
        "Example: sandlot exec thr_1 -- python3 -c 'print(42)'   "
        "(one argument runs under the shell: sandlot exec thr_1 -- 'ls | wc -l'; "
        "a sandbox by id: sandlot exec --sandbox sb_123 -- ls)"
    ),
)(live.exec_command)
app.command(
    "shell",
    epilog=(
        "Example: sandlot shell thr_1   (another terminal: sandlot shell thr_1 --observe; "
        "a sandbox by id: sandlot shell --sandbox sb_123)"
    ),
)(live.shell_command)
app.command(
    "watch",
    epilog="Example: sandlot watch thr_1   (a sandbox by id: sandlot watch --sandbox sb_123)",
)(live.watch_command)
app.command(
    "sync",
    epilog=(
        "Example: sandlot sync ./myproject thr_1:/workspace --watch   "
        "(a sandbox by id: sandlot sync ./myproject --sandbox sb_123:/workspace)"
    ),
)(sync.sync_command)
app.command(
    "pull",
    epilog=(
        "Example: sandlot pull thr_1 ./myproject   "
        "(a sandbox by id: sandlot pull --sandbox sb_123 ./myproject)"
    ),
)(sync.pull_command)
app.command("mcp", help=mcp.HELP, epilog=mcp.EPILOG)(mcp.mcp_command)
app.command("audit", epilog="Example: sandlot audit --scope thread:thr_1")(resources.audit_command)


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
