"""``sandlot keys``: API keys for humans, agents and services, straight in the store."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from sandlot.cli.errors import fail, friendly_errors

app = typer.Typer(help="Create, list and revoke API keys.", no_args_is_help=True)
console = Console(highlight=False)


def _services(data_dir: Path | None, store: str | None, config: Path | None):  # type: ignore[no-untyped-def]
    from sandlot.broker.keys import KeyService
    from sandlot.broker.settings import load_settings
    from sandlot.broker.store import Store

    settings = load_settings(config_file=config, data_dir=data_dir, store_url=store)
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    db = Store(settings.resolved_store_url)
    db.migrate()
    return KeyService(db, settings.admins)


DataDir = typer.Option(None, "--data-dir", help="The server's data directory (default: .sandlot).")
StoreUrl = typer.Option(
    None, "--store", help="The server's store URL, if not SQLite in the data dir."
)
ConfigFile = typer.Option(None, "--config", help="The server's config file.")


@app.command(
    "create",
    epilog="Example: sandlot keys create --user alice --actor agent --name claude --json",
)
def create(
    user: str = typer.Option(..., "--user", help="The user the key belongs to."),
    actor: str = typer.Option("human", "--actor", help="human, agent or service."),
    name: str = typer.Option(None, "--name", help="A label for the key."),
    principal: str = typer.Option(None, "--principal", help="Principal id (default: ACTOR:USER)."),
    as_json: bool = typer.Option(False, "--json", help='Print {"key": …} as JSON.'),
    data_dir: Path = DataDir,
    store: str = StoreUrl,
    config: Path = ConfigFile,
) -> None:
    """Create an API key and print it (it is shown once; only its hash is stored)."""
    from sandlot.protocol.common import PrincipalType

    try:
        ptype = PrincipalType(actor)
    except ValueError:
        raise fail("--actor must be human, agent or service", 2) from None
    with friendly_errors():
        key, info = _services(data_dir, store, config).create(
            user_id=user, principal_type=ptype, principal_id=principal, name=name
        )
    if as_json:
        typer.echo(
            json.dumps(
                {
                    "key": key,
                    "id": info.id,
                    "user_id": user,
                    "actor": actor,
                    "principal_id": info.principal_id,
                }
            )
        )
    else:
        typer.echo(key)


@app.command("list", epilog="Example: sandlot keys list --user alice")
def list_keys(
    user: str = typer.Option(None, "--user", help="Only this user's keys."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
    data_dir: Path = DataDir,
    store: str = StoreUrl,
    config: Path = ConfigFile,
) -> None:
    """List API keys (never the keys themselves)."""
    with friendly_errors():
        infos = _services(data_dir, store, config).list(user)
    if as_json:
        typer.echo(json.dumps([i.__dict__ for i in infos]))
        return
    table = Table("id", "user", "actor", "principal", "name", "created", "revoked")
    for i in infos:
        table.add_row(
            i.id,
            i.user_id,
            i.principal_type,
            i.principal_id,
            i.name or "",
            datetime.fromtimestamp(i.created_at, UTC).strftime("%Y-%m-%d %H:%M"),
            "yes" if i.revoked_at else "",
        )
    console.print(table)


@app.command(
    "revoke",
    epilog="Examples: sandlot keys revoke key_0123abcd; sandlot keys revoke --user alice",
)
def revoke(
    key_id: str | None = typer.Argument(None, help="The key's id (see sandlot keys list)."),
    user: str | None = typer.Option(
        None, "--user", help="Instead: every key of this user, and every token minted for them."
    ),
    data_dir: Path = DataDir,
    store: str = StoreUrl,
    config: Path = ConfigFile,
) -> None:
    """Revoke an API key, and every token minted with it, at once (running servers too)."""
    if (key_id is None) == (user is None):
        raise fail("give a key id or --user, not both", 2)
    with friendly_errors():
        keys = _services(data_dir, store, config)
        if user is not None:
            count, revoked = keys.revoke_user(user)
            typer.echo(f"revoked {count} keys of {user} and {revoked} tokens")
            return
        assert key_id is not None
        revoked = keys.revoke(key_id)
    typer.echo(f"revoked {key_id} and {revoked} tokens")


def _host_keys(data_dir: Path | None, store: str | None, config: Path | None):  # type: ignore[no-untyped-def]
    from sandlot.broker.hostkeys import HostKeyService

    return HostKeyService(_services(data_dir, store, config).store)


@app.command(
    "create-host",
    epilog="Example: sandlot keys create-host --name rack2-node7 --store postgresql://… --json",
)
def create_host(
    name: str = typer.Option(None, "--name", help="A label for the host."),
    host_id: str = typer.Option(
        None, "--host-id", help="Replace the revoked key of this host (default: a new host)."
    ),
    as_json: bool = typer.Option(False, "--json", help='Print {"key": …, "host_id": …} as JSON.'),
    data_dir: Path = DataDir,
    store: str = StoreUrl,
    config: Path = ConfigFile,
) -> None:
    """Issue the key of a sandbox host that registers through the brokers' API
    (sandlot host --broker URL --key-file FILE); shown once, only its hash is stored."""
    with friendly_errors():
        key, made = _host_keys(data_dir, store, config).create(name=name, host_id=host_id)
    if as_json:
        typer.echo(json.dumps({"key": key, "host_id": made, "name": name}))
    else:
        typer.echo(key)


@app.command("list-hosts", epilog="Example: sandlot keys list-hosts --store postgresql://…")
def list_hosts(
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
    data_dir: Path = DataDir,
    store: str = StoreUrl,
    config: Path = ConfigFile,
) -> None:
    """List host keys (never the keys themselves)."""
    with friendly_errors():
        infos = _host_keys(data_dir, store, config).list()
    if as_json:
        typer.echo(json.dumps([i.__dict__ for i in infos]))
        return
    table = Table("host", "name", "created", "revoked")
    for i in infos:
        table.add_row(
            i.host_id,
            i.name or "",
            datetime.fromtimestamp(i.created_at, UTC).strftime("%Y-%m-%d %H:%M"),
            "yes" if i.revoked_at else "",
        )
    console.print(table)


@app.command("revoke-host", epilog="Example: sandlot keys revoke-host h_0123456789abcdef")
def revoke_host(
    host_id: str = typer.Argument(..., help="The host whose key to revoke."),
    data_dir: Path = DataDir,
    store: str = StoreUrl,
    config: Path = ConfigFile,
) -> None:
    """Revoke a host's key: its calls are refused within a second; it is declared lost
    once its heartbeats lapse."""
    with friendly_errors():
        _host_keys(data_dir, store, config).revoke(host_id)
    typer.echo(f"revoked the key of {host_id}")
