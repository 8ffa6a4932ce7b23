"""``sandlot serve``: the embedded default server."""

from __future__ import annotations

from pathlib import Path

import typer

from sandlot.cli.errors import fail, friendly_errors

HELP = "Run the broker, the dataplane and local sandboxes in one process on one port."
EPILOG = (
    "Example: sandlot serve --port 8765 --data-dir ~/.sandlot   "
    "(then: sandlot keys create --user alice --actor human --data-dir ~/.sandlot)"
)


def serve_command(
    host: str = typer.Option(None, help="Interface to listen on (default: 127.0.0.1)."),
    port: int = typer.Option(None, help="Port to listen on; 0 picks a free one (default: 8765)."),
    data_dir: Path = typer.Option(
        None, help="Where the store, workspaces and runs live (default: .sandlot)."
    ),
    config: Path = typer.Option(
        None, help="A TOML config file (templates, pools, policy, quotas)."
    ),
    store: str = typer.Option(
        None, help="Store URL, e.g. postgresql://user@host/db (default: SQLite in the data dir)."
    ),
    workers: int = typer.Option(None, help="Broker worker processes (default: 1)."),
    dataplane_port: int = typer.Option(
        None, help="With --workers > 1: the sandbox dataplane's port (default: port + 1)."
    ),
    public_url: str = typer.Option(
        None, help="The URL clients reach this server at, if not http://HOST:PORT."
    ),
    unisolated: bool = typer.Option(
        False,
        "--unisolated",
        help="Run sandboxes as plain processes (no isolation; for machines without namespaces).",
    ),
    log_format: str = typer.Option(None, help="text or json (default: text)."),
) -> None:
    from sandlot.broker.logs import configure_logging
    from sandlot.broker.settings import load_settings

    with friendly_errors():
        settings = load_settings(
            config_file=config,
            host=host,
            port=port,
            data_dir=data_dir,
            store_url=store,
            workers=workers,
            dataplane_port=dataplane_port,
            public_url=public_url,
            provider_mode="unisolated" if unisolated else None,
            log_format=log_format,
        )
        configure_logging(settings.log_format)
        if settings.workers > 1:
            from sandlot.cli.workers import serve_workers

            serve_workers(settings)
            return
        from sandlot.cli.server import serve

        try:
            serve(settings)
        except OSError as exc:
            if exc.errno == 98:
                raise fail(f"port {settings.port} on {settings.host} is already in use") from None
            raise
