"""``sandlot web`` (the browser workspace on its own) and ``sandlot open`` (a sign-in link).

``sandlot web`` serves :mod:`sandlot.web` alone and prints a one-time sign-in link, as
Jupyter does. ``--mode local`` (the default) serves a folder of this machine (``--root``,
else the current directory) to one user (``--user``, else your login name), with no
isolation; ``--mode sandbox`` serves sandboxes of a broker (``--url``), the link signing
in as the owner of ``--api-key``. With the broker's data directory at hand (``--data-dir``,
default ``.sandlot``, when it holds a store), browsers may also sign in with API keys.

``sandlot open [THREAD]`` asks a running server (``sandlot serve`` or ``sandlot web``) for
a one-time link with your API key (``POST /api/auth/links``) and opens it (``--print``:
only prints it).
"""

from __future__ import annotations

import getpass
import sys
import webbrowser
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import typer

from sandlot.cli.errors import fail, friendly_errors

WEB_HELP = "Serve the browser workspace: a local folder (default) or a broker's sandboxes."
WEB_EPILOG = (
    "Example: sandlot web --root ~/project --port 8780   "
    "(then open the link it prints; sandbox mode: sandlot web --mode sandbox "
    "--url http://127.0.0.1:8765 --api-key sl_…)"
)
OPEN_HELP = "Print and open a one-time sign-in link to a running server's workspace."
OPEN_EPILOG = "Example: sandlot open thr_1   (a sandbox by id: sandlot open --sandbox sb_123)"


def _key_service(data_dir: Path | None, store: str | None) -> Any:
    """The broker's key service over its store, when that store is at hand (else None)."""
    from sandlot.broker.keys import KeyService
    from sandlot.broker.settings import load_settings
    from sandlot.broker.store import Store

    settings = load_settings(data_dir=data_dir, store_url=store)
    if store is None and not (settings.data_dir / "sandlot.db").exists():
        return None
    db = Store(settings.resolved_store_url)
    db.migrate()
    return KeyService(db, settings.admins)


def web_command(
    mode: str | None = typer.Option(
        None, help="local (a folder of this machine) or sandbox (default: local)."
    ),
    root: Path | None = typer.Option(
        None, help="local mode: the folder to serve (default: the current directory)."
    ),
    user: str | None = typer.Option(
        None, help="local mode: who the folder is served to (default: your login name)."
    ),
    host: str = typer.Option("127.0.0.1", help="Interface to listen on."),
    port: int = typer.Option(8780, help="Port to listen on; 0 picks a free one."),
    url: str | None = typer.Option(None, help="sandbox mode: the broker (default: SANDLOT_URL)."),
    api_key: str | None = typer.Option(
        None, help="sandbox mode: the key the link signs in with (default: SANDLOT_API_KEY)."
    ),
    data_dir: Path | None = typer.Option(
        None, help="The broker's data directory, to accept API keys at sign-in."
    ),
    store: str | None = typer.Option(None, help="The broker's store URL, if not in the data dir."),
    open_browser: bool = typer.Option(False, "--open", help="Also open the link in a browser."),
) -> None:
    from sandlot.broker.logs import configure_logging
    from sandlot.cli.server import bind_socket, make_server, run_until_signalled
    from sandlot.web.app import WebContext, create_web_app
    from sandlot.web.live import live_routes
    from sandlot.web.settings import WorkspaceMode, load_web_settings, served_root

    try:
        chosen = WorkspaceMode(mode) if mode else None
    except ValueError:
        raise fail("--mode must be local or sandbox", 2) from None
    with friendly_errors():
        configure_logging()
        keys = _key_service(data_dir, store)
        settings = load_web_settings(
            default_mode=WorkspaceMode.LOCAL, mode=chosen, root=root, data_dir=data_dir
        )
        broker_url: str | None = None
        credential: str | None = None
        if settings.mode is WorkspaceMode.LOCAL:
            who = user or getpass.getuser()
            settings = replace(settings, local_users=settings.local_users | {who})
        else:
            from sandlot.cli.settings import ConfigError as CliConfigError
            from sandlot.cli.settings import load_settings

            try:
                client = load_settings(url, api_key)
            except CliConfigError as exc:
                raise fail(str(exc), 2) from None
            if keys is None:
                raise fail(
                    "sandbox mode checks keys in the broker's store: give --data-dir "
                    "(or --store) of the broker",
                    2,
                )
            broker_url, credential = client.url, client.api_key
            who = keys.authenticate(credential).user_id
        sock = bind_socket(host, port)
        bound = sock.getsockname()[1]
        try:
            app = create_web_app(
                settings,
                broker_url=broker_url,
                authenticator=keys,
                extra_routes=live_routes(settings),
            )
        except BaseException:
            sock.close()
            raise
        shown = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
        shown = f"[{shown}]" if ":" in shown else shown
        base = settings.public_url or f"http://{shown}:{bound}"
        context: WebContext = app.state.web
        link = context.auth.login_url(base, who, credential=credential)
        if settings.mode is WorkspaceMode.LOCAL:
            what = f"{served_root(settings)} (local mode, no isolation) to {who}"
        else:
            what = f"the sandboxes of {broker_url} (sandbox mode)"
        sys.stdout.write(
            f"sandlot web listening on {base}\n"
            f"  serving {what}\n"
            f"  open this link to sign in (once, within "
            f"{settings.login_link_ttl_seconds // 60} minutes):\n\n    {link}\n\n"
        )
        sys.stdout.flush()
        if open_browser:
            webbrowser.open(link)
        run_until_signalled(make_server(app), [sock])


def open_command(
    thread: str | None = typer.Argument(None, help="The thread whose workspace to open."),
    sandbox: str | None = typer.Option(None, "--sandbox", help="A sandbox by id instead."),
    url: str | None = typer.Option(None, help="The server (default: SANDLOT_URL, config)."),
    api_key: str | None = typer.Option(
        None, help="Your API key (default: SANDLOT_API_KEY, config)."
    ),
    print_only: bool = typer.Option(False, "--print", help="Only print the link."),
) -> None:
    from urllib.parse import urlencode

    from sandlot.cli.settings import ConfigError, load_settings

    if thread is not None and sandbox is not None:
        raise fail("name one workspace: THREAD or --sandbox ID", 2)
    try:
        settings = load_settings(url, api_key)
    except ConfigError as exc:
        raise fail(str(exc), 2) from None
    page = "/"
    if thread is not None:
        page = "/?" + urlencode({"thread": thread})
    elif sandbox is not None:
        page = "/?" + urlencode({"sandbox": sandbox})
    try:
        r = httpx.post(
            f"{settings.url}/api/auth/links",
            json={"next": page},
            headers={"Authorization": f"Bearer {settings.api_key}"},
            timeout=settings.timeout,
        )
    except httpx.HTTPError:
        raise fail(f"cannot reach the server at {settings.url} (is it running?)") from None
    if r.status_code != 201:
        try:
            error = r.json()["error"]
            message = f"{error['message']} ({error['code']})"
        except (ValueError, KeyError, TypeError):
            message = f"the server answered {r.status_code}"
        raise fail(message)
    link = str(r.json()["url"])
    typer.echo(link)
    if not print_only:
        webbrowser.open(link)
