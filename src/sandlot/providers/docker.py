"""The ``docker`` provider: a sandbox is a container (Docker Engine, or Podman's
Docker-compatible socket), driven with the ``docker`` SDK.

Each sandbox is one container of its template's image, with the template's memory,
pids and cpu limits, no network (``network_mode=none``) unless the template asks for
it, an unprivileged user, every capability dropped, ``no-new-privileges``, a
read-only root filesystem with a private ``/tmp``, and a named volume at
``/workspace``: a disk of the template's ``disk_mb`` where the provider can attach one
(:mod:`sandlot.providers.dockerdisk`: root on the engine's host), else the engine's
plain volume, with no limit (the provider warns when it starts). Its main process is
the dataplane in its standalone mode (``python -m sandlot.dataplane``,
:mod:`sandlot.dataplane.standalone`), which runs the
sandbox's commands and shells as its own children and verifies the broker's tokens
itself.

The dataplane listens on a Unix socket in a host directory bind-mounted at
``/run/sandlot``; the embedded server mounts :attr:`DockerProvider.app` (a
:class:`~sandlot.providers.socketrelay.SocketRelay`) at ``/dp``, so clients reach a
sandbox at ``{public_url}/dp/{sandbox_id}/v1`` exactly as with ``local``, and the
sandbox needs no network for it. The broker's public keys and the revoked tokens are
files in a second host directory, mounted read-only at ``/run/sandlot-trust``; the
provider rewrites them when the broker's keys change (checked every
``jwks_refresh_seconds``) and on :meth:`~DockerProvider.revoke`, then tells the
dataplane to re-read them.

Containers carry the labels ``sandlot.sandbox``, ``sandlot.generation`` and
``sandlot.instance`` (this server's data directory): a restarted broker re-adopts
them by label (:meth:`~DockerProvider.load_state`), and removes the containers,
workspace volumes and run directories of its instance that no live sandbox owns.
Suspend pauses the container (the cgroup freezer); resume unpauses it. A container
that stops on its own (its dataplane killed, out of memory, ``docker stop``) fails its
sandbox at once: the provider follows the engine's ``die`` events for its instance and
tells the broker. Events can be lost (Podman's ``file`` events log is truncated when
it reaches its size limit, and a follower may skip what was written meanwhile), so a
sweep lists the instance's containers every ``sweep_seconds`` as well: a lost event
costs that delay, never a sandbox left ``active`` over a stopped container.

Config keys (``[provider]`` in the server's configuration; ``data_dir``,
``public_url``, ``issuer`` and ``jwks`` are wired in by the server):

- ``url``: the engine's API (default ``unix:///var/run/docker.sock``; Podman:
  ``unix:///run/podman/podman.sock``).
- ``image``: the image of templates whose ``image`` is ``host`` or a path (default
  ``sandlot-sandbox``); ``images``: a table template name → image, which wins.
  A template whose ``image`` is anything else names its image itself.
- ``user``: ``uid:gid`` the sandbox runs as (default ``1000:1000``; never 0).
- ``python``: the image's interpreter (default ``python3``); ``pythonpath``: where
  sandlot and its server dependencies are in the image (default ``/opt/sandlot/lib``).
- ``network``: the network of templates with ``network = "host"`` (default ``bridge``);
  ``network = "none"`` templates (the default) get none.
- ``tmp_mb``: size of the private ``/tmp`` (default 256).
- ``read_only_root``: the image's filesystem read-only (default true).
- ``start_timeout_seconds``: how long a dataplane may take to answer (default 60).
- ``jwks_refresh_seconds``: how often the broker's keys are compared (default 2).
- ``keep_volumes``: keep workspace volumes (or disk images) when sandboxes are deleted
  (default false).
- ``sweep_seconds``: how often the containers of live sandboxes are listed, in case the
  engine's ``die`` event was lost (default 5).
- ``ulimits``: the sandbox's resource limits, name → limit (soft = hard) or
  ``[soft, hard]`` (default ``{nofile = 16384, nproc = 32768}``; a table given replaces
  it, and a limit left out is the engine's default). Explicit because the engines'
  defaults differ: Docker's containers inherit the daemon's limits, Podman sets
  ``nofile`` and ``nproc`` above many hosts' hard limits, which the runtime may not
  raise (the container then fails to start). ``nproc`` counts every process of the
  sandbox's uid on the host, all sandboxes together: the per-sandbox bound is ``pids``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import shutil
import stat
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import docker
import docker.errors
import httpx
from docker.types import LogConfig, Mount, Ulimit

from sandlot.protocol.errors import (
    InvalidRequest,
    ProviderUnavailable,
    SandboxNotFound,
    SandboxStarting,
)
from sandlot.protocol.sessions import NetworkMode, Template
from sandlot.protocol.states import SandboxState
from sandlot.protocol.tokens import RevokedToken
from sandlot.providers.base import (
    AdoptionRecord,
    ProviderStatus,
    SandboxSpec,
    StatusListener,
)
from sandlot.providers.dockerdisk import WorkspaceDisks
from sandlot.providers.inbox import InboxProvider, InboxSandbox, JwksSource
from sandlot.providers.socketrelay import Upstream, listener_pid, open_socket

log = logging.getLogger("sandlot.providers.docker")


class _ImageMissing(ProviderUnavailable):
    """The template's image is not on the engine (it is never pulled)."""


LABEL_SANDBOX = "sandlot.sandbox"
LABEL_GENERATION = "sandlot.generation"
LABEL_INSTANCE = "sandlot.instance"
RUN_MOUNT = "/run/sandlot"
TRUST_MOUNT = "/run/sandlot-trust"
SOCKET_NAME = "dp.sock"
WORKSPACE = "/workspace"
DEFAULT_ULIMITS: dict[str, int | list[int]] = {"nofile": 16384, "nproc": 32768}
#: What the engine keeps of a container's output (the dataplane's warnings) on its host:
#: at most two files of 1 MiB. A command can make the dataplane log (garbage sent to its
#: socket is a warning each time), and a log without a bound would fill the host's disk.
DEFAULT_LOG: dict[str, Any] = {
    "driver": "json-file",
    "options": {"max-size": "1m", "max-file": "2"},
}
#: The names both engines take (setrlimit's, less ``RLIMIT_``).
ULIMIT_NAMES = frozenset(
    [
        "core",
        "cpu",
        "data",
        "fsize",
        "locks",
        "memlock",
        "msgqueue",
        "nice",
        "nofile",
        "nproc",
        "rss",
        "rtprio",
        "rttime",
        "sigpending",
        "stack",
    ]
)


class _Sandbox(InboxSandbox):
    """What the provider knows of one container."""


class DockerProvider(InboxProvider[_Sandbox]):
    name = "docker"
    supports_suspend = True

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        super().__init__(config)
        cfg = self.config
        self.url = str(cfg.get("url", "unix:///var/run/docker.sock"))
        self.image = str(cfg.get("image", "sandlot-sandbox"))
        self.images: dict[str, str] = dict(cfg.get("images", {}))
        self.user = str(cfg.get("user", "1000:1000"))
        uid, _, gid = self.user.partition(":")
        if not uid.isdigit() or int(uid) == 0 or not (gid or uid).isdigit():
            raise InvalidRequest("the docker provider's user is a numeric uid:gid, never 0")
        self.uid, self.gid = int(uid), int(gid or uid)
        self.python = str(cfg.get("python", "python3"))
        self.pythonpath = str(cfg.get("pythonpath", "/opt/sandlot/lib"))
        self.network = str(cfg.get("network", "bridge"))
        self.tmp_mb = int(cfg.get("tmp_mb", 256))
        self.read_only_root = bool(cfg.get("read_only_root", True))
        self.start_timeout = float(cfg.get("start_timeout_seconds", 60.0))
        self.jwks_refresh = float(cfg.get("jwks_refresh_seconds", 2.0))
        self.keep_volumes = bool(cfg.get("keep_volumes", False))
        self.sweep_interval = float(cfg.get("sweep_seconds", 5.0))
        if not self.sweep_interval > 0:
            raise InvalidRequest("the docker provider's sweep_seconds is a positive number")
        self.ulimits = _ulimits(cfg.get("ulimits", DEFAULT_ULIMITS))
        self.log_config = _log_config(cfg.get("log", DEFAULT_LOG))
        data_dir = Path(cfg.get("data_dir", ".sandlot")).absolute()
        self.root = data_dir / "docker"
        self.disks = WorkspaceDisks(data_dir / "docker-disks", self.uid, self.gid)
        self.instance = hashlib.sha256(str(data_dir).encode()).hexdigest()[:16]
        self.public_url = str(cfg.get("public_url", "http://127.0.0.1:8765")).rstrip("/")
        self.issuer = str(cfg.get("issuer", ""))
        jwks = cfg.get("jwks")
        if jwks is None or not self.issuer:
            raise InvalidRequest("the docker provider needs the broker's issuer and JWKS source")
        self._jwks: JwksSource = jwks
        self._client: Any = None
        self._events: Any = None
        self._watcher: threading.Thread | None = None
        self._sweeper: asyncio.Task[None] | None = None

    # --- lifecycle of the provider --------------------------------------------------

    async def start(self, listener: StatusListener | None = None) -> None:
        self._listener = listener
        try:
            self._client = await asyncio.to_thread(docker.DockerClient, base_url=self.url)
            await asyncio.to_thread(self._client.ping)
        except Exception as exc:
            raise ProviderUnavailable(f"the container engine at {self.url} is unreachable") from exc
        self.root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o700)
        problem = (
            await asyncio.to_thread(self.disks.check)
            if self.url.startswith("unix://")
            else f"the engine at {self.url} is not on this host"
        )
        if problem is not None:
            log.warning(
                "SANDBOX DISK LIMITS ARE NOT ENFORCED: %s. Templates' disk_mb is ignored and "
                "a sandbox can fill the engine host's filesystem.",
                problem,
            )
        await self._refresh_keys()
        self._loop = asyncio.get_running_loop()
        self._refresher = self._loop.create_task(self._refresh_loop())
        self._watcher = threading.Thread(
            target=self._watch_engine, name="sandlot-docker-events", daemon=True
        )
        self._watcher.start()
        self._sweeper = self._loop.create_task(self._sweep_loop())

    async def close(self) -> None:
        self._closing.set()
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
        if self._events is not None:
            with contextlib.suppress(Exception):
                await asyncio.to_thread(self._events.close)
        await self._close_sandboxes()
        if self._client is not None:
            await asyncio.to_thread(self._client.close)
        if self._watcher is not None:
            await asyncio.to_thread(self._watcher.join, 5)

    def readiness(self) -> dict[str, Any]:
        return {
            "ok": self._client is not None,
            "engine": self.url,
            "sandboxes": len(self._sandboxes),
        }

    async def _docker(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """One blocking SDK call, off the event loop."""
        if self._client is None:
            raise ProviderUnavailable("the docker provider is not started")
        try:
            return await asyncio.to_thread(fn, *args, **kwargs)
        except docker.errors.NotFound:
            raise
        except docker.errors.DockerException as exc:
            raise ProviderUnavailable(f"container engine: {exc}") from exc

    # --- containers that stop on their own ---------------------------------------------

    def _watch_engine(self) -> None:
        """The engine's events for this instance's containers (a thread: the SDK's stream
        blocks), each ``die`` handed to the event loop; reconnects while the engine is away."""
        filters = {
            "type": "container",
            # Podman reports ``die`` but filters on its own name for it, ``died``.
            "event": ["die", "died"],
            "label": f"{LABEL_INSTANCE}={self.instance}",
        }
        delay = 0.5
        while not self._closing.is_set():
            # A client of its own: the stream holds its connection for as long as it runs.
            client = None
            try:
                client = docker.DockerClient(base_url=self.url)
                self._events = client.events(decode=True, filters=filters)
                delay = 0.5
                for event in self._events:
                    if self._closing.is_set():
                        return
                    attrs = event.get("Actor", {}).get("Attributes", {})
                    loop = self._loop
                    if loop is not None and not loop.is_closed():
                        asyncio.run_coroutine_threadsafe(self._died(attrs), loop)
            except Exception:
                if self._closing.is_set():
                    return
                log.warning("the container engine's events stopped; reconnecting")
            finally:
                if client is not None:
                    with contextlib.suppress(Exception):
                        client.close()
            self._closing.wait(delay)
            delay = min(delay * 2, 10.0)

    async def _sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(self.sweep_interval)
            try:
                await self._sweep()
            except ProviderUnavailable as exc:
                log.warning("listing the containers failed: %s", exc)
            except Exception:
                log.exception("listing the containers failed")

    async def _sweep(self) -> None:
        """Each live sandbox whose container is gone or stopped is handled as its
        ``die`` event would have been (the event may have been lost)."""
        live = {
            sid: box
            for sid, box in self._sandboxes.items()
            if box.state in (SandboxState.ACTIVE, SandboxState.SUSPENDED)
        }
        if not live:
            return
        listed = await self._docker(
            self._client.api.containers,
            all=True,
            filters={"label": f"{LABEL_INSTANCE}={self.instance}"},
        )
        running: set[tuple[str, str]] = set()
        for entry in listed:
            labels = entry.get("Labels") or {}
            if str(entry.get("State", "")).lower() in ("running", "paused"):
                running.add((labels.get(LABEL_SANDBOX, ""), labels.get(LABEL_GENERATION, "")))
        for sid, box in live.items():
            generation = str(box.spec.generation)
            if (sid, generation) not in running:
                await self._died({LABEL_SANDBOX: sid, LABEL_GENERATION: generation})

    async def _died(self, attrs: Mapping[str, str]) -> None:
        """A container stopped: its sandbox fails, unless the provider stopped it."""
        sid = attrs.get(LABEL_SANDBOX, "")
        box = self._sandboxes.get(sid)
        if box is None or attrs.get(LABEL_GENERATION) != str(box.spec.generation):
            return
        if box.state not in (SandboxState.ACTIVE, SandboxState.SUSPENDED):
            return  # still starting (_wait_ready reports it) or already ended
        try:
            failed = await self._check_alive(sid, box)
        except ProviderUnavailable:
            log.exception("checking the container of %s failed", sid)
            return
        if failed:
            if box.upstream is not None:
                await box.upstream.close()
                box.upstream = None
            log.warning("sandbox %s failed: %s", sid, box.reason)
            await self._notify(sid)

    # --- paths and names -------------------------------------------------------------

    def _dir(self, sandbox_id: str) -> Path:
        return self.root / sandbox_id

    def _container_name(self, sandbox_id: str) -> str:
        return f"sandlot-{self.instance[:8]}-{sandbox_id}"

    def _volume_name(self, sandbox_id: str) -> str:
        return f"sandlot-{self.instance[:8]}-{sandbox_id}-workspace"

    def image_for(self, template: Template) -> str:
        if template.name in self.images:
            return self.images[template.name]
        if template.image == "host" or template.image.startswith("/"):
            return self.image
        return template.image

    # --- the trust directory ------------------------------------------------------------

    def _write_trust(self, sandbox_id: str, name: str, doc: Mapping[str, Any]) -> None:
        trust = self._dir(sandbox_id) / "trust"
        trust.mkdir(parents=True, exist_ok=True)
        tmp = trust / f".{name}.tmp"
        tmp.write_text(json.dumps(doc))
        tmp.chmod(0o644)
        tmp.replace(trust / name)

    async def _write_keys(self, sandbox_id: str, doc: Mapping[str, Any]) -> None:
        with contextlib.suppress(OSError):
            await asyncio.to_thread(self._write_trust, sandbox_id, "jwks.json", doc)

    # --- the contract -----------------------------------------------------------------

    def _new_box(self, spec: SandboxSpec, state: SandboxState) -> _Sandbox:
        return _Sandbox(spec, state)

    async def _create(self, spec: SandboxSpec) -> None:
        sid = spec.sandbox_id
        try:
            container = await self._start_container(spec)
            upstream = await self._wait_ready(sid, container)
            await asyncio.to_thread(self._seal_run_dir, sid)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            said = getattr(exc, "message", None) or str(exc) or type(exc).__name__
            # The reason starts with its code, as the kubernetes provider's do.
            code = "IMAGE" if isinstance(exc, _ImageMissing) else "START"
            reason = f"{code}: {said}"
            log.error("creating sandbox %s failed: %s", sid, reason)
            box = self._sandboxes.get(sid)
            if box is not None:
                box.state, box.reason = SandboxState.FAILED, reason[:500]
                box.failure = code
                box.settled.set()
                await self._notify(sid)
            return
        box = self._sandboxes.get(sid)
        if box is None:  # deleted while it was being created
            await upstream.close()
            await self._remove(sid)
            return
        box.upstream = upstream
        box.state, box.reason = SandboxState.ACTIVE, "ready"
        box.settled.set()
        await self._notify(sid)

    def _container_config(self, spec: SandboxSpec, *, disk: bool = False) -> dict[str, Any]:
        sid, template = spec.sandbox_id, spec.template
        res = template.resources
        mounts = [
            Mount(WORKSPACE, self._volume_name(sid), type="volume"),
            Mount(RUN_MOUNT, str(self._dir(sid) / "run"), type="bind"),
            Mount(TRUST_MOUNT, str(self._dir(sid) / "trust"), type="bind", read_only=True),
        ]
        for vm in template.volume_mounts:
            name = f"sandlot-{self.instance[:8]}-vol-{vm.volume}"
            mounts.append(Mount(vm.path, name, type="volume", read_only=vm.read_only))
        command = [
            self.python,
            # Nothing of the workspace on the dataplane's import path (-P: not its working
            # directory; -s: not a user site under its HOME): a command that wrote
            # /workspace/websockets/ ran its code in the dataplane at its first import.
            "-s",
            "-P",
            "-m",
            "sandlot.dataplane",
            "--sandbox-id",
            sid,
            "--generation",
            str(spec.generation),
            "--issuer",
            self.issuer,
            "--trust-dir",
            TRUST_MOUNT,
            "--uds",
            f"{RUN_MOUNT}/{SOCKET_NAME}",
            "--workspace",
            WORKSPACE,
            "--shells",
            json.dumps(template.shells),
        ]
        if disk:
            command.append("--workspace-disk")
        network = "none" if template.network is NetworkMode.NONE else self.network
        memory = f"{res.memory_mb}m"
        return {
            "image": self.image_for(template),
            "command": command,
            "name": self._container_name(sid),
            "hostname": "sandbox",
            "labels": {
                LABEL_SANDBOX: sid,
                LABEL_GENERATION: str(spec.generation),
                LABEL_INSTANCE: self.instance,
            },
            "user": self.user,
            "working_dir": WORKSPACE,
            # The dataplane's own; commands get only the template's (DirectRuntime).
            "environment": {"PYTHONPATH": self.pythonpath, "PYTHONDONTWRITEBYTECODE": "1"},
            "network_mode": network,
            "mem_limit": memory,
            "memswap_limit": memory,
            "pids_limit": res.pids,
            "nano_cpus": int(res.cpu * 1e9),
            "read_only": self.read_only_root,
            "tmpfs": {"/tmp": f"rw,nosuid,nodev,size={self.tmp_mb}m,mode=1777"},
            "ulimits": [Ulimit(name=n, soft=soft, hard=hard) for n, (soft, hard) in self.ulimits],
            "log_config": self.log_config,
            "cap_drop": ["ALL"],
            "security_opt": ["no-new-privileges"],
            "mounts": mounts,
            # No init before the dataplane: as PID 1 it is the one process of the sandbox
            # its commands cannot signal, and it collects their orphans itself
            # (sandlot.dataplane.standalone). It handles no signal: the engine stops it
            # with SIGKILL at once (SIGTERM would wait out the stop timeout).
            "init": False,
            "stop_signal": "SIGKILL",
            "detach": True,
        }

    def _prepare_dirs(self, sandbox_id: str) -> None:
        """A fresh run directory and the trust directory's two files."""
        base = self._dir(sandbox_id)
        run = base / "run"
        if run.exists():
            shutil.rmtree(run)
        run.mkdir(parents=True)
        os.chown(run, self.uid, self.gid)
        run.chmod(0o700)
        self._write_trust(sandbox_id, "jwks.json", json.loads(self._jwks_text))
        self._write_trust(sandbox_id, "revoked.json", {"revoked": []})

    def _seal_run_dir(self, sandbox_id: str) -> None:
        """Once the dataplane listens, its socket's directory becomes root's: no process of
        the sandbox (the dataplane's user) can remove the socket or put another in its
        place, which a server that restarts would connect to. The socket becomes root's
        too (``0600``): no command can connect to it — to the dataplane's control routes
        (its status, figures and trust files' re-read), or with garbage for its log. Its
        listener, bound already, goes on accepting the server's connections."""
        if os.geteuid() != 0:
            return  # a server of the sandbox's own uid: the directory stays its own
        run = self._dir(sandbox_id) / "run"
        os.chown(run, 0, 0)
        run.chmod(0o755)
        # The directory is root's now: what is at the socket's name stays what it is.
        sock = run / SOCKET_NAME
        if stat.S_ISSOCK(os.lstat(sock).st_mode):
            os.chown(sock, 0, 0, follow_symlinks=False)
            sock.chmod(0o600)

    async def _start_container(self, spec: SandboxSpec) -> Any:
        """Create and start the container in one hop to a thread,
        unless a container of the same name is left from a crash mid-create (removed, the
        workspace volume kept) or the image is missing (never pulled: the image is the
        engine's own)."""
        sid = spec.sandbox_id
        await asyncio.to_thread(self._prepare_dirs, sid)
        size = spec.template.resources.disk_mb
        disk = bool(size and self.disks.available) and await self._docker(
            self._disk_volume, sid, size
        )
        config = self._container_config(spec, disk=disk)
        del config["detach"]
        try:
            return await self._docker(self._create_and_start, config)
        except docker.errors.NotFound as exc:  # the image (Podman's 404 is not ImageNotFound)
            raise _ImageMissing(f"image {config['image']!r} not found on the engine") from exc
        except ProviderUnavailable as exc:
            if "rlimit" in str(exc):  # above the engine's hard limit (Podman's default is)
                raise ProviderUnavailable(f"{exc} (lower the provider's ulimits)") from exc
            raise

    def _disk_volume(self, sandbox_id: str, size_mb: int) -> bool:
        """(In a thread.) The sandbox's workspace disk attached, and its workspace volume
        the engine's mount of that device, made again each time (the device may differ:
        the options of a volume never change). A plain volume a sandbox already has (from
        before disk limits) is kept, with its files and no limit. Whether the workspace is
        a disk."""
        name = self._volume_name(sandbox_id)
        try:
            existing = self._client.volumes.get(name)
        except docker.errors.NotFound:
            existing = None
        if existing is not None and not _on_device(existing):
            log.warning("sandbox %s keeps its workspace volume of before disk limits", sandbox_id)
            return False
        device = self.disks.attach(sandbox_id, size_mb)
        if existing is not None:
            # A container left by a crash mid-create holds it.
            with contextlib.suppress(docker.errors.NotFound):
                self._client.api.remove_container(self._container_name(sandbox_id), force=True)
            existing.remove(force=True)
        self._client.volumes.create(
            name=name,
            driver="local",
            driver_opts={"type": "ext4", "device": device, "o": "nosuid,nodev"},
            labels={LABEL_INSTANCE: self.instance, LABEL_SANDBOX: sandbox_id},
        )
        return True

    def _create_and_start(self, config: dict[str, Any]) -> Any:
        """(In a thread.) The container made from ``config`` and started (one left under
        its name by an earlier run is replaced)."""
        containers = self._client.containers
        try:
            container = containers.create(**config)
        except docker.errors.APIError as exc:
            if not _conflict(exc):
                raise
            self._client.api.remove_container(config["name"], force=True)
            container = containers.create(**config)
        container.start()
        return container

    async def _wait_ready(self, sandbox_id: str, container: Any) -> Upstream:
        """The dataplane answers on its socket: its upstream (its state read once).

        The socket appears when the dataplane listens (it binds once its app has
        started), so it is looked for every 5 ms (a failed ``open`` of a path), and the
        first status read is the proof it answers.
        """
        path = str(self._dir(sandbox_id) / "run" / SOCKET_NAME)
        deadline = time.monotonic() + self.start_timeout
        checked = time.monotonic()
        while True:
            fd = open_socket(path)
            if fd is not None:
                upstream = Upstream(fd)
                try:
                    resp = await upstream.client.get("/__control/status")
                    if resp.status_code == 200:
                        return upstream
                except httpx.TransportError:
                    pass
                await upstream.close()
            now = time.monotonic()
            if now > deadline:
                raise ProviderUnavailable(f"the dataplane did not start in {self.start_timeout} s")
            if now - checked > 0.5:
                checked = now
                await self._docker(container.reload)
                if container.status not in ("created", "running"):
                    logs = await self._docker(container.logs, tail=20)
                    tail = logs.decode(errors="replace").strip()[-400:]
                    raise ProviderUnavailable(f"the sandbox's container exited: {tail}")
            await asyncio.sleep(0.005)

    def _check_serving(self, box: _Sandbox) -> None:
        if box.state is SandboxState.SUSPENDED:
            raise SandboxStarting("sandbox is suspended", retry_after=1.0)

    async def _unanswered(self, sandbox_id: str, box: _Sandbox) -> None:
        await self._check_alive(sandbox_id, box)

    async def _check_alive(self, sandbox_id: str, box: _Sandbox) -> bool:
        """A container that stopped fails the sandbox: whether it did."""
        try:
            container = await self._docker(
                self._client.containers.get, self._container_name(sandbox_id)
            )
        except docker.errors.NotFound:
            box.state, box.reason = SandboxState.FAILED, "DELETED: the container is gone"
            box.failure = "DELETED"
            return True
        if container.status in ("running", "paused"):
            return False
        state = container.attrs.get("State", {})
        code = state.get("ExitCode")
        if state.get("OOMKilled"):
            box.failure = "OOM"
            reason = f"OOM: the sandbox ran out of memory (OOMKilled, exit code {code})"
        else:
            box.failure = "EXITED"
            reason = f"EXITED: the container is {container.status} (exit code {code})"
        box.state, box.reason = SandboxState.FAILED, reason
        return True

    async def suspend(self, sandbox_id: str) -> ProviderStatus:
        box = self._box(sandbox_id)
        if box.state is SandboxState.ACTIVE:
            container = await self._container(sandbox_id)
            await self._docker(container.pause)
            box.state, box.reason = SandboxState.SUSPENDED, "suspended"
        return await self.status(sandbox_id)

    async def resume(self, sandbox_id: str) -> ProviderStatus:
        box = self._box(sandbox_id)
        if box.state is SandboxState.SUSPENDED:
            container = await self._container(sandbox_id)
            await self._docker(container.unpause)
            box.state, box.reason = SandboxState.ACTIVE, "resumed"
        return await self.status(sandbox_id)

    async def _container(self, sandbox_id: str) -> Any:
        try:
            return await self._docker(self._client.containers.get, self._container_name(sandbox_id))
        except docker.errors.NotFound as exc:
            raise SandboxNotFound(f"no container for {sandbox_id}") from exc

    async def _remove(self, sandbox_id: str) -> None:
        """Container, workspace volume (unless kept) and run directory. Idempotent."""
        with contextlib.suppress(docker.errors.NotFound):
            container = await self._docker(
                self._client.containers.get, self._container_name(sandbox_id)
            )
            await self._docker(container.remove, force=True)
        with contextlib.suppress(docker.errors.NotFound):
            volume = await self._docker(self._client.volumes.get, self._volume_name(sandbox_id))
            # A disk's volume only names its device, detached next: never left behind.
            if not self.keep_volumes or _on_device(volume):
                await self._docker(volume.remove, force=True)
        await asyncio.to_thread(self.disks.release, sandbox_id, keep_image=self.keep_volumes)
        await asyncio.to_thread(shutil.rmtree, self._dir(sandbox_id), True)

    async def revoke(self, sandbox_id: str, tokens: Sequence[RevokedToken]) -> None:
        box = self._sandboxes.get(sandbox_id)
        if box is None:
            return
        doc = box.note_revoked(tokens)
        await asyncio.to_thread(self._write_trust, sandbox_id, "revoked.json", doc)
        if box.upstream is not None and box.state is SandboxState.ACTIVE:
            with contextlib.suppress(httpx.TransportError):
                await box.upstream.client.post("/__control/reload")

    async def load_state(self, records: Sequence[AdoptionRecord]) -> list[str]:
        containers = await self._docker(
            self._client.containers.list,
            all=True,
            filters={"label": f"{LABEL_INSTANCE}={self.instance}"},
        )
        by_id = {c.labels.get(LABEL_SANDBOX): c for c in containers}
        lost: list[str] = []
        for rec in records:
            container = by_id.get(rec.sandbox_id)
            if (
                rec.state is SandboxState.PROVISIONING
                or container is None
                or container.labels.get(LABEL_GENERATION) != str(rec.generation)
                or container.status not in ("running", "paused")
            ):
                lost.append(rec.sandbox_id)
                continue
            spec = SandboxSpec(rec.sandbox_id, rec.generation, rec.template)
            box = _Sandbox(spec, SandboxState.PROVISIONING)
            box.settled.set()
            self._sandboxes[rec.sandbox_id] = box
            path = str(self._dir(rec.sandbox_id) / "run" / SOCKET_NAME)
            fd = open_socket(path)
            if fd is not None and not await self._dataplanes_own(container, fd):
                log.warning(
                    "sandbox %s: the socket at %s is not its dataplane's: not re-adopted",
                    rec.sandbox_id,
                    path,
                )
                os.close(fd)
                fd = None
            if fd is None:
                self._sandboxes.pop(rec.sandbox_id)
                lost.append(rec.sandbox_id)
                continue
            box.upstream = Upstream(fd)
            # Sealed already, unless by a version that left the socket to the sandbox.
            with contextlib.suppress(OSError):
                await asyncio.to_thread(self._seal_run_dir, rec.sandbox_id)
            if container.status == "paused":
                box.state, box.reason = SandboxState.SUSPENDED, "re-adopted after restart"
            else:
                box.state, box.reason = SandboxState.ACTIVE, "re-adopted after restart"
            # The broker's keys may have changed while nobody watched.
            with contextlib.suppress(OSError, ValueError):
                doc = json.loads(self._jwks_text)
                await asyncio.to_thread(self._write_trust, rec.sandbox_id, "jwks.json", doc)
        await self.cleanup_leftovers(keep=set(self._sandboxes))
        return lost

    async def _dataplanes_own(self, container: Any, fd: int) -> bool:
        """Whether the socket ``fd`` is the one the container's PID 1 (its dataplane)
        listens on. A server of the sandbox's own uid leaves the socket's directory to the
        sandbox (see :meth:`_seal_run_dir`): a command could put a socket of its own in
        its place, which a restarted server would then send every client's requests to."""
        await self._docker(container.reload)
        pid = int(container.attrs.get("State", {}).get("Pid") or 0)
        return pid > 0 and await asyncio.to_thread(listener_pid, fd) == pid

    async def cleanup_leftovers(self, keep: set[str]) -> list[str]:
        """Remove this instance's containers, workspace volumes and run directories that
        belong to no sandbox in ``keep``; the ids removed."""
        label = {"label": f"{LABEL_INSTANCE}={self.instance}"}
        containers = await self._docker(self._client.containers.list, all=True, filters=label)
        leftover = {c.labels.get(LABEL_SANDBOX) for c in containers} - keep - {None}
        if self.root.is_dir():
            leftover |= {p.name for p in self.root.iterdir() if p.is_dir()} - keep
        if not self.keep_volumes:
            leftover |= await asyncio.to_thread(self.disks.sandboxes) - keep
        prefix = f"sandlot-{self.instance[:8]}-"
        volumes = [] if self.keep_volumes else await self._docker(self._client.volumes.list)
        for volume in volumes:
            name = volume.name
            if name.startswith(prefix) and name.endswith("-workspace"):
                sid = name[len(prefix) : -len("-workspace")]
                if sid not in keep:
                    leftover.add(sid)
        removed = []
        for sid in sorted(s for s in leftover if s):
            log.info("removing leftover sandbox %s", sid)
            await self._remove(sid)
            removed.append(sid)
        return removed

    async def list_sandboxes(self) -> set[str]:
        label = {"label": f"{LABEL_INSTANCE}={self.instance}"}
        containers = await self._docker(self._client.containers.list, all=True, filters=label)
        running = {c.labels.get(LABEL_SANDBOX) for c in containers} - {None}
        return set(self._sandboxes) | {str(s) for s in running}


def _on_device(volume: Any) -> bool:
    """Whether a volume is a workspace disk's (the engine mounts a device for it)."""
    return bool((volume.attrs.get("Options") or {}).get("device"))


def _ulimits(table: Any) -> list[tuple[str, tuple[int, int]]]:
    """``{name: limit | [soft, hard]}`` checked: ``(name, (soft, hard))`` pairs."""
    if not isinstance(table, Mapping):
        raise InvalidRequest("the docker provider's ulimits is a table: name = limit")
    out = []
    for name, value in table.items():
        pair = value if isinstance(value, (list, tuple)) else [value, value]
        if (
            name not in ULIMIT_NAMES
            or len(pair) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in pair)
            or pair[0] > pair[1]
        ):
            raise InvalidRequest(
                f"the docker provider's ulimit {name!r} is one of {', '.join(sorted(ULIMIT_NAMES))}"
                ", its value a limit or [soft, hard] (soft <= hard)"
            )
        out.append((name, (int(pair[0]), int(pair[1]))))
    return out


def _log_config(table: Any) -> LogConfig:
    """The ``log`` key: ``driver`` (the engine's log driver) and its ``options``."""
    if not isinstance(table, Mapping) or not set(table) <= {"driver", "options"}:
        raise InvalidRequest("the docker provider's log is a table of driver and options")
    driver = table.get("driver", DEFAULT_LOG["driver"])
    options = table.get("options", DEFAULT_LOG["options"] if "driver" not in table else {})
    if not isinstance(driver, str) or not driver:
        raise InvalidRequest("the docker provider's log driver is a name, e.g. json-file")
    if not isinstance(options, Mapping):
        raise InvalidRequest("the docker provider's log options are a table of strings")
    return LogConfig(type=driver, config={str(k): str(v) for k, v in options.items()})


def _conflict(exc: BaseException | None) -> bool:
    """The engine refused to create a container whose name is taken (Docker: 409;
    Podman's compatible API: 500, "the container name … is already in use")."""
    if not isinstance(exc, docker.errors.APIError):
        return False
    return exc.status_code == 409 or (
        exc.status_code == 500 and "already in use" in str(exc.explanation or "")
    )


__all__ = ["DockerProvider"]
