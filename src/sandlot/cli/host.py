"""``sandlot host``: a sandbox host for brokers on other machines.

One process runs a provider (``local`` by default, or the configured one, e.g.
``docker``), the dataplane of its sandboxes at ``/dp``, and its provider API
(:func:`sandlot.providers.remote.provider_router`, the one ``--workers`` uses) at
``/internal/provider``, guarded by its credential. It registers in the brokers' store
(:mod:`sandlot.broker.fleet`): its provider URL, credential, public dataplane URL and
capacity, then a heartbeat every ``hosts.heartbeat_seconds``. Like the sandbox host of
``--workers`` it re-adopts its sandboxes at start, reaps them (idleness, TTLs,
teardowns, orphans) and pushes token revocations to its dataplane, all from the store.

It serves no broker API: clients negotiate with the brokers (``hosts.mode =
"registered"``), which place sandboxes here and grant tokens for this dataplane.

A host without access to the database registers through the brokers' API instead:
``--broker URL`` with the host key an admin issued (``--key``, ``--key-file`` or
``SANDLOT_HOST_KEY``; see :mod:`sandlot.cli.hostagent`). The key names the host: its
id is the key's, kept in the data directory like the id of a host with the store.

Every flag has an environment variable, for units and scripted topologies:

- ``--store`` / ``SANDLOT_STORE``: the brokers' PostgreSQL (required).
- ``--broker-url`` / ``SANDLOT_PUBLIC_URL``: the brokers' public URL, the issuer of
  the tokens its dataplane verifies (required).
- ``--listen`` / ``SANDLOT_HOST_LISTEN``: ``ADDRESS:PORT`` for the dataplane and the
  provider API (default ``127.0.0.1:8766``; port 0 picks one).
- ``--public-url`` / ``SANDLOT_DATAPLANE_URL``: where clients reach this dataplane
  (default ``http://LISTEN``).
- ``--provider-url`` / ``SANDLOT_HOST_PROVIDER_URL``: where brokers reach the provider
  API (default ``http://LISTEN``).
- ``--credential-file`` / ``SANDLOT_HOST_CREDENTIAL``: the provider API's secret (a file
  holding it, or the value in the variable); default: made once and kept in
  ``DATA_DIR/host-credential`` (mode 0600).
- ``--capacity`` / ``SANDLOT_HOST_CAPACITY``: the most sandboxes it runs (default 100).
- ``--data-dir`` / ``SANDLOT_DATA_DIR``: its sandboxes, workspaces and host id.
- ``--broker`` / ``SANDLOT_HOST_BROKER``: instead of ``--store``, a broker's URL (or the
  balancer's) to register and report through.
- ``--key`` / ``--key-file`` / ``SANDLOT_HOST_KEY``: the host key, with ``--broker``.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import anyio
import typer

from sandlot.cli.errors import fail, friendly_errors

HELP = "Run sandboxes and their dataplane for brokers elsewhere (registered in their store)."
EPILOG = (
    "Example: sandlot host --store postgresql://sandlot@db/sandlot "
    "--broker-url https://sandlot.example --listen 0.0.0.0:8766 "
    "--public-url https://sandlot.example/hosts/h1 --capacity 50 --data-dir /var/lib/sandlot-host"
    " — or, without the database: sandlot host --broker https://sandlot.example "
    "--key-file /etc/sandlot/host-key --listen 0.0.0.0:8766 …"
)

DEFAULT_LISTEN = "127.0.0.1:8766"


def host_command(
    store: str = typer.Option(None, help="The brokers' store URL (env SANDLOT_STORE)."),
    broker_url: str = typer.Option(
        None, help="The brokers' public URL: the tokens' issuer (env SANDLOT_PUBLIC_URL)."
    ),
    listen: str = typer.Option(
        None, help="ADDRESS:PORT to serve on (env SANDLOT_HOST_LISTEN; default 127.0.0.1:8766)."
    ),
    public_url: str = typer.Option(
        None, help="Where clients reach this dataplane (env SANDLOT_DATAPLANE_URL)."
    ),
    provider_url: str = typer.Option(
        None, help="Where brokers reach its provider API (env SANDLOT_HOST_PROVIDER_URL)."
    ),
    credential_file: Path = typer.Option(
        None, help="A file holding the provider API's secret (env SANDLOT_HOST_CREDENTIAL)."
    ),
    capacity: int = typer.Option(
        None, help="The most sandboxes it runs (env SANDLOT_HOST_CAPACITY; default 100)."
    ),
    data_dir: Path = typer.Option(
        None, help="Where its sandboxes and workspaces live (default: .sandlot-host)."
    ),
    config: Path = typer.Option(None, help="A TOML config file ([provider], [hosts])."),
    unisolated: bool = typer.Option(
        False, "--unisolated", help="Run sandboxes as plain processes (no isolation)."
    ),
    log_format: str = typer.Option(None, help="text or json (default: text)."),
    broker: str = typer.Option(
        None, help="Register through this broker's API, not the store (env SANDLOT_HOST_BROKER)."
    ),
    key: str = typer.Option(
        None, help="The host key an admin issued, with --broker (env SANDLOT_HOST_KEY)."
    ),
    key_file: Path = typer.Option(None, help="A file holding the host key, with --broker."),
) -> None:
    from sandlot.broker.logs import configure_logging
    from sandlot.broker.settings import ConfigError, load_settings

    env = os.environ
    broker = broker or env.get("SANDLOT_HOST_BROKER") or ""
    with friendly_errors():
        host_key = _host_key(key, key_file)
        if host_key and not broker:
            raise ConfigError("a host key goes with the broker it registers with: --broker URL")
        if broker and not host_key:
            raise ConfigError(
                "--broker needs the host's key: --key-file, --key or SANDLOT_HOST_KEY "
                "(an admin issues one: sandlot keys create-host)"
            )
        if broker and store:
            raise ConfigError("give either --store (the database) or --broker (its API), not both")
        address = listen or env.get("SANDLOT_HOST_LISTEN") or DEFAULT_LISTEN
        host, _, port_text = address.rpartition(":")
        host = host.strip("[]")
        if not host or not port_text.isdigit():
            raise ConfigError(f"--listen must be ADDRESS:PORT, not {address!r}")
        settings = load_settings(
            config_file=config,
            host=host,
            port=int(port_text),
            data_dir=data_dir or (None if env.get("SANDLOT_DATA_DIR") else Path(".sandlot-host")),
            store_url=None if broker else store,
            public_url=None if broker else broker_url,
            dataplane_url=public_url,
            host_capacity=capacity,
            provider_mode="unisolated" if unisolated else None,
            log_format=log_format,
            sandbox_hosts="embedded",
        )
        if broker:
            configure_logging(settings.log_format)
            _run_agent(settings, broker, host_key, credential_file, provider_url, address)
            return
        if not settings.store_url or settings.resolved_store_url.startswith("sqlite"):
            raise ConfigError("sandlot host needs the brokers' store: --store postgresql://…")
        if not settings.public_url:
            raise ConfigError("sandlot host needs the brokers' public URL: --broker-url")
        configure_logging(settings.log_format)
        credential = _credential(settings.data_dir, credential_file)
        from sandlot.cli.server import bind_socket

        try:
            sock = bind_socket(settings.host, settings.port)
        except OSError as exc:
            if exc.errno == 98:
                raise fail(f"{address} is already in use") from None
            raise
        settings = replace(settings, port=sock.getsockname()[1])
        listen_url = replace(settings, public_url=None).base_url
        settings = replace(settings, dataplane_url=settings.dataplane_url or listen_url)
        api_url = provider_url or env.get("SANDLOT_HOST_PROVIDER_URL") or listen_url
        run_host(settings, sock, api_url, credential)


def _host_key(given: str | None, path: Path | None) -> str:
    """The host key: ``--key``, ``--key-file`` or ``SANDLOT_HOST_KEY`` (never logged)."""
    if path is not None:
        try:
            return path.read_text().strip()
        except OSError as exc:
            raise typer.BadParameter(f"cannot read the host key file {path}: {exc}") from None
    return (given or os.environ.get("SANDLOT_HOST_KEY") or "").strip()


def _claim_host_id(data_dir: Path, wanted: str) -> None:
    """Keep the key's host id in the data directory; refuse a directory of another host."""
    from sandlot.broker.hosts import HOST_ID_FILE
    from sandlot.broker.settings import ConfigError

    path = data_dir / HOST_ID_FILE
    with contextlib.suppress(FileNotFoundError):
        found = path.read_text().strip()
        if found and found != wanted:
            raise ConfigError(
                f"{data_dir} holds the sandboxes of host {found}; this key is for host "
                f"{wanted}: use another --data-dir, or that host's key"
            )
        if found:
            return
    data_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(wanted + "\n")


def _run_agent(
    settings: Any,
    broker: str,
    host_key: str,
    credential_file: Path | None,
    provider_url: str | None,
    address: str,
) -> None:
    """A host without the store: check the key with the brokers, then serve."""
    from sandlot.broker.hostkeys import host_of_key
    from sandlot.broker.settings import ConfigError
    from sandlot.cli.hostagent import BrokerLink, BrokerUnreachable, HostKeyRefused, hello
    from sandlot.cli.server import bind_socket
    from sandlot.protocol.errors import SandlotError

    try:
        wanted = host_of_key(host_key)
    except SandlotError:
        raise ConfigError("the host key is not one (it reads slh_…)") from None
    _claim_host_id(settings.data_dir, wanted)
    # What is wrong here is said before the brokers are asked anything.
    credential = _credential(settings.data_dir, credential_file)
    try:
        config = hello(broker, host_key)
    except HostKeyRefused as exc:
        raise fail(
            f"the broker at {broker} refuses this host key ({exc}): it was revoked, "
            "replaced, or never issued there"
        ) from None
    except BrokerUnreachable as exc:
        raise fail(str(exc)) from None
    except SandlotError as exc:
        raise fail(f"the broker at {broker} cannot register hosts: {exc.message}") from None
    try:
        sock = bind_socket(settings.host, settings.port)
    except OSError as exc:
        if exc.errno == 98:
            raise fail(f"{address} is already in use") from None
        raise
    settings = replace(settings, port=sock.getsockname()[1], public_url=None)
    listen_url = settings.base_url
    settings = replace(
        settings, dataplane_url=settings.dataplane_url or listen_url, public_url=config.issuer
    )
    api_url = provider_url or os.environ.get("SANDLOT_HOST_PROVIDER_URL") or listen_url
    from sandlot.cli.hostagent import agent_app

    app = agent_app(settings, BrokerLink(broker, host_key), config, api_url, credential)
    _serve(app, settings, sock, wanted, listen_url, api_url, via=f"the brokers at {broker}")


def _credential(data_dir: Path, given: Path | None) -> str:
    """The provider API's secret (:func:`sandlot.broker.hosts.host_credential`)."""
    from sandlot.broker.hosts import host_credential
    from sandlot.broker.settings import ConfigError

    try:
        return host_credential(data_dir, given)
    except ConfigError as exc:
        raise typer.BadParameter(str(exc)) from None


def host_app(settings: Any, provider_url: str, credential: str) -> tuple[Any, Any]:
    """The host's ASGI app (provider API, health, dataplane at ``/dp``) and its broker."""
    from sandlot.broker.assembly import build_provider
    from sandlot.broker.core import Broker
    from sandlot.cli.hostagent import host_frame

    ref: list[Broker] = []
    provider = build_provider(settings, ref, dataplane_url=settings.dataplane_url)
    broker = Broker(settings, provider, provider_api=(provider_url, credential))
    broker.reaper.refill_pools = False
    ref.append(broker)

    async def readiness() -> tuple[bool, dict[str, Any]]:
        store_ok = await anyio.to_thread.run_sync(broker.store.ping)
        ready = store_ok and bool(provider.readiness().get("ok")) and broker.started
        return ready, {
            "ready": ready,
            "host": broker.sandboxes.host,
            "store": {"ok": store_ok},
            "provider": {"name": provider.name},
        }

    @contextlib.asynccontextmanager
    async def lifespan(_app: Any) -> AsyncIterator[None]:
        # The brokers migrate the store and write templates and signing keys.
        await anyio.to_thread.run_sync(broker.store.migrate)
        await broker.start(migrate=False)
        try:
            yield
        finally:
            await broker.stop()

    return host_frame(provider, credential, readiness, lifespan), broker


def run_host(settings: Any, sock: Any, provider_url: str, credential: str) -> None:
    from sandlot.broker.hosts import host_id

    app, _broker = host_app(settings, provider_url, credential)
    listen_url = replace(settings, public_url=None).base_url
    _serve(
        app, settings, sock, host_id(settings.data_dir), listen_url, provider_url, via="the store"
    )


def _serve(
    app: Any, settings: Any, sock: Any, host: str, listen_url: str, provider_url: str, via: str
) -> None:
    from sandlot.cli.server import make_server, run_until_signalled

    sys.stdout.write(
        f"sandlot host {host} listening on {listen_url}\n"
        f"  dataplane: {settings.dataplane_url}\n"
        f"  provider API: {provider_url}/internal/provider\n"
        f"  provider: {settings.provider_name} ({settings.provider_mode}); "
        f"capacity {settings.host_capacity}\n"
        f"  registered through {via}\n"
        f"  data directory: {settings.data_dir.absolute()}\n"
    )
    sys.stdout.flush()
    run_until_signalled(make_server(app), [sock])
