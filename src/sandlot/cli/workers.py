"""``sandlot serve --workers N``: N broker processes and one sandbox host.

Layout (all forked from this supervisor, which only watches them):

- N broker workers share the main listening socket (the kernel spreads
  connections among them). They use the store for everything and reach the
  sandboxes through :class:`sandlot.providers.remote.RemoteProvider`. Each serves
  the browser workspace too (its sessions are the store's).
- One sandbox host runs the configured providers (all of them, when there are
  several ``[providers.NAME]``: a hosted provider's relay, its commands and
  streams live in this one process too), their dataplanes and the reaper. It
  serves the dataplanes on its own port (``--port`` + 1 unless
  ``--dataplane-port`` says otherwise; grants carry that URL) and its
  provider API on a Unix socket in the data directory.

A worker or the host that dies is restarted; SIGTERM or SIGINT stops them all.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from fastapi import FastAPI

from sandlot.broker.app import create_app
from sandlot.broker.core import Broker, prepare_store
from sandlot.broker.settings import BrokerSettings
from sandlot.cli.server import (
    WebDispatch,
    banner,
    bind_socket,
    build_app,
    make_server,
    run_until_signalled,
    web_app,
)
from sandlot.protocol.errors import ResourceNotFound
from sandlot.providers.remote import RemoteProvider


def _run_host(
    settings: BrokerSettings, dp_sock: socket.socket, uds_path: str, secret: str, dp_url: str
) -> None:
    app, _ = build_app(settings, dataplane_url=dp_url, provider_secret=secret)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(uds_path)
    uds = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    uds.bind(uds_path)
    os.chmod(uds_path, 0o600)
    uds.listen(1024)
    run_until_signalled(make_server(app), [dp_sock, uds])


def _run_worker(
    settings: BrokerSettings, sock: socket.socket, uds_path: str, secret: str, dp_url: str
) -> None:
    # With registered sandbox hosts, workers reach those hosts as the broker does.
    provider = (
        None
        if settings.sandbox_hosts == "registered"
        else RemoteProvider(
            {
                "uds": uds_path,
                "secret": secret,
                "dataplane_url": dp_url,
                "name": settings.provider_name,
                # Several configured providers: the host runs them all (one process holds
                # every sandbox, relay and stream); workers choose among them by name.
                **(
                    {"members": list(settings.providers), "default": settings.default_provider}
                    if len(settings.providers) > 1
                    else {}
                ),
            }
        )
    )
    broker = Broker(settings, provider, run_reaper=False)
    app = create_app(broker)
    # The browser workspace on the main port too: its sessions, links and terminal ids
    # are the store's, so any worker serves any browser.
    web = web_app(
        broker,
        settings,
        dataplane_url=f"{dp_url.rstrip('/')}/dp",
        own_dataplane=True,
        registry=app.state.metrics.registry,
    )
    mcp_url = f"{dp_url.rstrip('/')}/mcp"

    @app.api_route("/mcp", methods=["GET", "POST", "DELETE"], include_in_schema=False)
    async def _mcp_elsewhere() -> None:
        # An MCP session lives in one process: the sandbox host's serves them all.
        raise ResourceNotFound(
            f"with --workers over 1, the MCP server is at {mcp_url}", metadata={"mcp_url": mcp_url}
        )

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        await broker.start(migrate=False, recover=False)
        try:
            async with web.router.lifespan_context(web):
                yield
        finally:
            await broker.stop()

    app.router.lifespan_context = lifespan
    run_until_signalled(make_server(WebDispatch(app, web)), [sock])


def _fork(target: Any, *args: Any) -> int:
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            target(*args)
        except BaseException:
            import traceback

            traceback.print_exc()
            code = 1
        finally:
            os._exit(code)
    return pid


def _wait_for_uds(path: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            try:
                s.connect(path)
                return
            except OSError:
                time.sleep(0.05)
    raise RuntimeError("the sandbox host did not start")


def serve_workers(settings: BrokerSettings) -> None:
    requested = settings.port
    sock = bind_socket(settings.host, requested)
    settings = replace(settings, port=sock.getsockname()[1])
    # A fixed port puts the dataplane next to it; an ephemeral one gets an ephemeral dataplane.
    dp_port = settings.dataplane_port or (requested + 1 if requested else 0)
    dp_sock = bind_socket(settings.host, dp_port)
    dp_base = replace(settings, port=dp_sock.getsockname()[1], public_url=None).base_url
    prepare_store(settings).dispose()
    run_dir = settings.data_dir.absolute()
    uds_path = str(run_dir / "provider.sock")
    secret = secrets.token_urlsafe(32)

    stopping = False

    def stop(*_: Any) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)

    host_pid = _fork(_run_host, settings, dp_sock, uds_path, secret, dp_base)
    _wait_for_uds(uds_path)
    workers = {
        _fork(_run_worker, settings, sock, uds_path, secret, dp_base): i
        for i in range(settings.workers)
    }
    sys.stdout.write(
        banner(settings, f"  workers: {settings.workers}; sandbox dataplane at {dp_base}\n")
    )
    sys.stdout.flush()
    while not stopping:
        try:
            pid, _status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            time.sleep(0.2)
            continue
        if pid == host_pid:
            host_pid = _fork(_run_host, settings, dp_sock, uds_path, secret, dp_base)
        elif pid in workers:
            idx = workers.pop(pid)
            workers[_fork(_run_worker, settings, sock, uds_path, secret, dp_base)] = idx
    for pid in [*workers, host_pid]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 10
    for pid in [*workers, host_pid]:
        while time.monotonic() < deadline:
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                break
            if done:
                break
            time.sleep(0.05)
        else:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
