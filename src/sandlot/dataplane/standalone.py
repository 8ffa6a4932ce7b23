"""The dataplane of one sandbox, run inside it: ``python -m sandlot.dataplane``.

A container-like provider (``docker``) starts this as the sandbox's main process,
the way hosted sandboxes run a daemon in each box. It serves the one sandbox whose
processes run where it runs (:class:`~sandlot.runtime.direct.DirectRuntime`: the
container is the sandbox), on a Unix socket (or a TCP port), and verifies the broker's
tokens itself.

The broker's trust material comes from a *trust directory* the provider keeps up to
date and mounts read-only (the sandbox cannot change it):

- ``jwks.json``: the broker's public keys (the ``/.well-known/jwks.json`` document),
  re-read when a token names a key it does not know;
- ``revoked.json``: ``{"revoked": [{"jti": …, "expires_at": …}]}``, re-read on
  ``POST /__control/reload``;
- ``control.key`` (optional): the secret a provider that cannot reach the trust
  directory at once (a kubelet syncs a mounted ConfigMap tens of seconds late) presents
  to push revocations.

Alternatively ``--jwks-url`` fetches the keys from the broker (a sandbox with network).

Control routes answer on the socket beside the sandbox's ``/v1/…`` and
``/{sandbox_id}/v1/…``: ``GET /__control/ready`` (200 once it serves, else 503: nothing
more, for a kubelet's readiness probe), ``GET /__control/status`` (state and last event
sequence, read together, and the activity the idle reaper weighs: running commands,
attached clients, last operation), ``POST /__control/reload`` (re-read the trust
directory) and ``POST /__control/revoke`` (a ``revoked.json`` document in the body, added
to the revoked tokens at once). ``X-Sandlot-Control`` must carry ``control.key`` (else
403) for a revocation always, and for the status, a reload and ``/metrics`` whenever the
trust directory holds a key: a pod's address is reachable from the cluster's network,
where what the sandbox is doing and how often it is reloaded is nobody else's business.
None says anything secret, revocations only ever add to the set, and the provider's relay
forwards none of them.

Started as its container's first process (PID 1, no init before it), the dataplane is
the one process of the sandbox its commands cannot stop, though they run as its user:
``kill -1`` passes over an init, the kernel never delivers it a ``SIGKILL`` or
``SIGSTOP`` sent from inside its PID namespace, it handles every other signal that
would end a process by doing nothing, and it cannot be traced (:class:`ContainerInit`).
An agent's ``pkill python3`` or ``kill -9 -1`` ends the sandbox's commands, not the
sandbox. It collects the processes its commands leave behind, which become its children
as they would an init's (:func:`~sandlot.runtime.direct.reap_orphans`, every second).
Only the engine stops it, with ``SIGKILL``.

A command the OOM killer ends (the container's memory limit) is reported ``oom_killed``:
the container's memory cgroup counts the kills (``memory.events`` or, on cgroup v1,
``memory.oom_control``). With ``--state-dir`` (a directory that outlives the container:
a volume) the event log is kept there, so a dataplane started again on the same volume
carries on the same sequence.

Tuning comes from ``SANDLOT_DP_*`` (:class:`~sandlot.dataplane.settings.DataplaneSettings`).
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import gc
import hmac
import importlib.util
import json
import logging
import os
import signal
import sys
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, cast

from sandlot.dataplane.http.connections import guarded_http
from sandlot.dataplane.http.host import create_standalone_app
from sandlot.dataplane.services.auth import JwksSource, TokenVerifier
from sandlot.dataplane.settings import DataplaneSettings
from sandlot.protocol.errors import ProviderUnavailable
from sandlot.protocol.templates import Resources, Template
from sandlot.protocol.tokens import RevokedToken
from sandlot.runtime.direct import DirectRuntime, reap_orphans

if TYPE_CHECKING:
    from uvicorn.config import Config
    from uvicorn.server import Server

log = logging.getLogger("sandlot.dataplane.standalone")

CONTROL_PREFIX = "/__control/"
JWKS_FILE = "jwks.json"
REVOKED_FILE = "revoked.json"
CONTROL_KEY_FILE = "control.key"
CONTROL_HEADER = b"x-sandlot-control"
METRICS = "/metrics"
#: A pushed revocation list is small: a few hundred tokens at most.
MAX_PUSH_BYTES = 1 << 20
COMMAND_OOM_SCORE_ADJ = 800
PR_SET_DUMPABLE = 4
#: Where a container sees its own memory cgroup's OOM kill count (v2, then v1).
OOM_COUNTERS = (
    Path("/sys/fs/cgroup/memory.events"),
    Path("/sys/fs/cgroup/memory/memory.oom_control"),
)


@dataclass(frozen=True)
class StandaloneOptions:
    """What one in-sandbox dataplane serves, and where."""

    sandbox_id: str
    generation: int
    issuer: str
    workspace: Path = Path("/workspace")
    trust_dir: Path | None = None
    jwks_url: str | None = None
    uds: str | None = None
    host: str = "127.0.0.1"
    port: int = 8080
    shells: Mapping[str, list[str]] | None = None
    state_dir: Path | None = None
    #: The workspace is a size-limited disk: its filling is reported (``service.disk_full``).
    workspace_disk: bool = False


def read_oom_kills(path: Path) -> int | None:
    """The ``oom_kill`` count of a cgroup's ``memory.events``/``memory.oom_control``."""
    try:
        text = path.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == "oom_kill" and value.strip().isdigit():
            return int(value)
    return None


def oom_counter(candidates: Sequence[Path] = OOM_COUNTERS) -> Callable[[], int] | None:
    """How many processes the OOM killer ended in this container's memory cgroup so far
    (a function), or ``None`` where no such count can be read."""
    for path in candidates:
        if read_oom_kills(path) is not None:
            return lambda: read_oom_kills(path) or 0
    return None


def file_jwks(trust_dir: Path) -> JwksSource:
    path = trust_dir / JWKS_FILE

    async def source() -> Mapping[str, Any]:
        text = await asyncio.to_thread(path.read_text)
        doc = json.loads(text)
        return doc if isinstance(doc, dict) else {}

    return source


def url_jwks(url: str) -> JwksSource:
    # Imported here: httpx (a tenth of the dataplane's start-up) serves this option only.
    import httpx

    async def source() -> Mapping[str, Any]:
        async with httpx.AsyncClient(timeout=5.0) as client:
            resp = await client.get(url)
            resp.raise_for_status()
            doc = resp.json()
            return doc if isinstance(doc, dict) else {}

    return source


def read_revoked(trust_dir: Path) -> list[RevokedToken]:
    try:
        doc = json.loads((trust_dir / REVOKED_FILE).read_text())
    except (OSError, ValueError):
        return []
    return parse_revoked(doc)


def parse_revoked(doc: Any) -> list[RevokedToken]:
    """The tokens of a ``revoked.json`` document (malformed entries are skipped)."""
    out = []
    for item in doc.get("revoked", []) if isinstance(doc, dict) else []:
        try:
            out.append(RevokedToken(str(item["jti"]), float(item["expires_at"])))
        except (KeyError, TypeError, ValueError):
            continue
    return out


class StandaloneDataplane:
    """The ASGI app: the sandbox's dataplane plus the two control routes."""

    def __init__(self, options: StandaloneOptions, settings: DataplaneSettings) -> None:
        self.options = options
        if options.trust_dir is not None:
            source = file_jwks(options.trust_dir)
            # A local file: re-reading it for an unknown key costs nothing.
            refetch = 0.2
        elif options.jwks_url is not None:
            source = url_jwks(options.jwks_url)
            refetch = 5.0
        else:
            raise ValueError("the dataplane needs --trust-dir or --jwks-url")
        verifier = TokenVerifier(source, issuer=options.issuer, refetch_interval=refetch)
        self.verifier = verifier
        # Constructed, not validated: the values are this file's constants (and the shells,
        # which a copy with ``update`` never validated either). Validating (the default
        # resources too) would build these models' validators before the dataplane serves
        # (about 6 ms), for models it never validates anything with.
        template = Template.model_construct(
            name="standalone", image="self", resources=Resources.model_construct()
        )
        if options.shells:
            template = template.model_copy(update={"shells": dict(options.shells)})
        # Out of memory, the kernel kills a command rather than the dataplane beside it.
        runtime = DirectRuntime(
            options.sandbox_id,
            options.generation,
            template,
            options.workspace,
            oom_score_adj=COMMAND_OOM_SCORE_ADJ,
            oom_kills=oom_counter(),
            spool=options.state_dir,
            disk=options.workspace_disk,
        )
        # Clients that met 423 while the container started wait on the log for this.
        self.inner = create_standalone_app(
            runtime, verifier=verifier, settings=settings, announce=True
        )
        self.host = self.inner.host
        #: Work that waits until the dataplane serves (started with the app, see :func:`main`).
        self.after_start: Callable[[], Coroutine[Any, Any, None]] | None = None
        #: Set when the dataplane is its container's init, started with the app.
        self.init: ContainerInit | None = None
        self._after: asyncio.Task[None] | None = None

    def reload(self) -> None:
        """Read the revoked tokens (at start-up, before the server runs)."""
        if self.options.trust_dir is not None:
            self.host.revoke(read_revoked(self.options.trust_dir))

    async def reload_running(self) -> None:
        """Re-read the revoked tokens while serving: the file in a thread, the revocation
        on the loop (it closes the tokens' open sockets and streams, tasks of the loop)."""
        if self.options.trust_dir is not None:
            revoked = await asyncio.to_thread(read_revoked, self.options.trust_dir)
            self.host.revoke(revoked)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await self.inner(scope, self._starting(receive), send)
            return
        if scope["type"] == "http" and scope["path"].startswith(CONTROL_PREFIX):
            await self._control(scope, receive, send)
            return
        if scope["type"] == "http" and scope["path"] == METRICS and not await self._keyed(scope):
            await _answer(send, 403, {"error": "the control key does not match"})
            return
        await self.inner(scope, receive, send)

    def _starting(self, receive: Any) -> Any:
        """``receive`` of the lifespan: at start-up, the broker's keys are read before the
        app starts (the socket is bound after), so the first request finds them."""

        async def wrapped() -> Any:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self.verifier.load_keys()
                except ProviderUnavailable:
                    log.warning("the broker's keys are unavailable yet; read on first use")
                if self.init is not None:
                    self.init.start()
                if self.after_start is not None:
                    self._after = asyncio.get_running_loop().create_task(self.after_start())
            return message

        return wrapped

    def _control_key(self) -> bytes | None:
        if self.options.trust_dir is None:
            return None
        try:
            key = (self.options.trust_dir / CONTROL_KEY_FILE).read_bytes().strip()
        except OSError:
            return None
        return key or None

    async def _keyed(self, scope: Any, *, required: bool = False) -> bool:
        """Whether the request carries the trust directory's control key — or, unless
        ``required``, the directory holds none (the dataplane is then reachable only
        through its provider: docker's socket in a host directory)."""
        key = await asyncio.to_thread(self._control_key)
        if key is None:
            return not required
        given = dict(scope.get("headers") or []).get(CONTROL_HEADER, b"")
        return hmac.compare_digest(given, key)

    async def _push(self, scope: Any, receive: Any) -> tuple[int, dict[str, Any]]:
        """``POST /__control/revoke``: the pushed revocations, if the key matches."""
        if not await self._keyed(scope, required=True):
            return 403, {"error": "the control key does not match"}
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return 400, {"error": "the request ended early"}
            body += message.get("body", b"")
            if len(body) > MAX_PUSH_BYTES:
                return 413, {"error": "the revocation list is too large"}
            if not message.get("more_body", False):
                break
        try:
            doc = json.loads(body)
        except ValueError:
            return 400, {"error": "the body is not JSON"}
        tokens = parse_revoked(doc)
        self.host.revoke(tokens)
        return 200, {"revoked": len(tokens)}

    async def _control(self, scope: Any, receive: Any, send: Any) -> None:
        action = scope["path"][len(CONTROL_PREFIX) :]
        status = 404
        body: dict[str, Any] = {"error": "no such control route"}
        if action == "ready" and scope["method"] == "GET":
            try:
                self.host.status(self.options.sandbox_id)
            except Exception:
                status, body = 503, {"ready": False}
            else:
                status, body = 200, {"ready": True}
        elif action in ("status", "reload") and not await self._keyed(scope):
            status, body = 403, {"error": "the control key does not match"}
        elif action == "status" and scope["method"] == "GET":
            sandbox_id = self.options.sandbox_id
            try:
                state, seq = self.host.status(sandbox_id)
                activity = self.host.activity(sandbox_id)
            except Exception:
                status, body = 503, {"error": "starting"}
            else:
                status, body = (
                    200,
                    {
                        "state": state.value,
                        "last_event_sequence": seq,
                        "running_execs": activity.running_execs,
                        "attached_clients": activity.attached_clients,
                        "last_active_at": activity.last_active_at,
                    },
                )
        elif action == "reload" and scope["method"] == "POST":
            await self.reload_running()
            status, body = 200, {}
        elif action == "revoke" and scope["method"] == "POST":
            status, body = await self._push(scope, receive)
        await _answer(send, status, body)


async def _answer(send: Any, status: int, body: Mapping[str, Any]) -> None:
    data = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(data))]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})


def parse_args(argv: Sequence[str] | None = None) -> StandaloneOptions:
    parser = argparse.ArgumentParser(
        prog="python -m sandlot.dataplane", description="The dataplane of the sandbox it runs in."
    )
    parser.add_argument("--sandbox-id", required=True)
    parser.add_argument("--generation", type=int, required=True)
    parser.add_argument("--issuer", required=True, help="the broker's token issuer")
    parser.add_argument("--workspace", type=Path, default=Path("/workspace"))
    keys = parser.add_mutually_exclusive_group(required=True)
    keys.add_argument("--trust-dir", type=Path, help="holds jwks.json and revoked.json")
    keys.add_argument("--jwks-url", help="the broker's /.well-known/jwks.json")
    parser.add_argument("--uds", help="serve on this Unix socket")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--shells", help="shell profiles as JSON: name → argv")
    parser.add_argument(
        "--state-dir", type=Path, help="keeps the event log (a volume that outlives the process)"
    )
    parser.add_argument(
        "--workspace-disk",
        action="store_true",
        help="the workspace is a size-limited disk: report when it fills",
    )
    args = parser.parse_args(argv)
    return StandaloneOptions(
        sandbox_id=args.sandbox_id,
        generation=args.generation,
        issuer=args.issuer,
        workspace=args.workspace,
        trust_dir=args.trust_dir,
        jwks_url=args.jwks_url,
        uds=args.uds,
        host=args.host,
        port=args.port,
        shells=json.loads(args.shells) if args.shells else None,
        state_dir=args.state_dir,
        workspace_disk=args.workspace_disk,
    )


def uvicorn_server() -> tuple[type[Config], type[Server]]:
    """uvicorn's ``Config`` and ``Server``, without running its package's ``__init__``.

    That ``__init__`` imports uvicorn's command line (click, the reloaders, watchfiles,
    multiprocessing): a tenth of the dataplane's start, for nothing it serves. The package
    is registered without it; any other name asked of it runs the real ``__init__`` then.
    """
    package = sys.modules.get("uvicorn")
    if package is None:
        spec = importlib.util.find_spec("uvicorn")
        if spec is None or spec.loader is None:
            raise ImportError("uvicorn is not installed")
        package = importlib.util.module_from_spec(spec)
        loader = spec.loader
        stub = package

        def rest(name: str) -> Any:
            del stub.__dict__["__getattr__"]
            loader.exec_module(stub)
            return getattr(stub, name)

        package.__dict__["__getattr__"] = rest
        sys.modules["uvicorn"] = package
    from uvicorn.config import Config
    from uvicorn.server import Server

    _define(package, Config=Config, Server=Server)
    return Config, Server


def _define(module: ModuleType, **names: Any) -> None:
    for name, value in names.items():
        module.__dict__.setdefault(name, value)


async def build_wire_models(served: Callable[[], bool]) -> None:
    """The validators of the wire models the dataplane's requests use, built once it
    serves, one model per turn of the event loop: its later requests are as fast as the
    next ones, and a request that comes first builds what it uses itself (every wire
    model's build is deferred to its first use; the broker's, which this process never
    uses, stay unbuilt). Before serving they would delay readiness by a tenth of the
    start-up."""
    from sandlot.protocol import common, dataplane, events, frames, tokens

    # uvicorn says it serves with a flag, not an event.
    while not served():  # noqa: ASYNC110
        await asyncio.sleep(0.005)
    for module in (common, tokens, dataplane, events, frames):
        for model in common.unbuilt_models(module):
            model.model_rebuild()
            await asyncio.sleep(0)
    frames.build()


def websocket_protocol() -> Callable[..., Any]:
    """uvicorn's WebSocket protocol, imported on the first upgrade: the ``websockets``
    library it stands on is a tenth of the dataplane's start, and most sandboxes open
    their first WebSocket (a shell, a streamed exec) well after they start, if ever."""
    loaded: list[Callable[..., Any]] = []

    def protocol(*args: Any, **kwargs: Any) -> Any:
        if not loaded:
            from uvicorn.config import WS_PROTOCOLS
            from uvicorn.importer import import_from_string

            loaded.append(import_from_string(WS_PROTOCOLS["auto"]))
        return loaded[0](*args, **kwargs)

    return protocol


class ContainerInit:
    """What the dataplane does as its container's init (PID 1): it heeds no signal a
    command may send to end a process, and collects orphans every :attr:`SWEEP_SECONDS`
    (the event loop keeps ``SIGCHLD`` to itself)."""

    SWEEP_SECONDS = 1.0
    #: Each is handled, by doing nothing. Left to their default action, the kernel drops
    #: them for an init only when its main thread does not block them: a process blocks
    #: every signal for a moment as it forks or starts a thread, and one that lands then
    #: ends it. Handlers, unlike ignored signals, are not inherited by the commands.
    #: (``SIGKILL`` and ``SIGSTOP`` from inside never reach an init; a fault's signal is
    #: left as it is.)
    UNHEEDED = (
        signal.SIGHUP,
        signal.SIGINT,
        signal.SIGQUIT,
        signal.SIGTERM,
        signal.SIGUSR1,
        signal.SIGUSR2,
        signal.SIGALRM,
        signal.SIGVTALRM,
        signal.SIGPROF,
        signal.SIGIO,
        signal.SIGPWR,
        signal.SIGXCPU,
        *range(signal.SIGRTMIN, signal.SIGRTMAX + 1),
    )

    def start(self) -> None:
        """At start-up, before any command can run (uvicorn's SIGINT and SIGTERM handlers,
        Python's SIGINT handler, would stop the dataplane at a command's word). Its
        process is made undumpable too: a command, of its user, could otherwise trace it
        (and end it so) or read its memory, where every client's token passes. A command
        it starts is dumpable again once it runs its program."""
        for signo in self.UNHEEDED:
            signal.signal(signo, self._unheeded)
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
        self._sweep(asyncio.get_running_loop())

    @staticmethod
    def _unheeded(signo: int, frame: object) -> None:
        return None

    def _sweep(self, loop: asyncio.AbstractEventLoop) -> None:
        try:
            reap_orphans()
        except OSError:
            log.exception("collecting the sandbox's orphans failed")
        loop.call_later(self.SWEEP_SECONDS, self._sweep, loop)


def main(argv: Sequence[str] | None = None) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    options = parse_args(argv)
    app = StandaloneDataplane(options, DataplaneSettings.from_env())
    app.reload()
    where: dict[str, Any] = (
        {"uds": options.uds} if options.uds else {"host": options.host, "port": options.port}
    )
    config_class, server_class = uvicorn_server()
    config = config_class(
        app,
        log_level="warning",
        lifespan="on",
        # Closes a connection that sends no request head in time (a pod's port is open to
        # other pods; a socket, to the sandbox's own commands).
        http=guarded_http(),
        # Called as a class is, once per upgrade.
        ws=cast("type[asyncio.Protocol]", websocket_protocol()),
        ws_ping_interval=None,
        access_log=False,
        **where,
    )
    config.load()
    server = server_class(config)
    if os.getpid() == 1:
        app.init = ContainerInit()
    app.after_start = lambda: build_wire_models(lambda: server.started)
    # The start-up's objects live as long as the process: out of the collector's way
    # (``__main__`` turned it off while the modules were imported).
    gc.freeze()
    gc.enable()
    server.run()


__all__ = ["StandaloneDataplane", "StandaloneOptions", "main"]
