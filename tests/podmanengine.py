"""A private Podman for the tests: its Docker-compatible socket, as the docker provider
reaches it.

- :func:`ensure_podman` installs Debian's ``podman`` (Podman 4.3) and ``runc`` when
  missing, as :func:`tests.dockerengine.ensure_engine` installs ``docker.io``.
- :class:`PodmanEngine` starts ``podman system service`` on a socket of its own, with
  its own storage root, run root, temporary directory, network configuration directory
  and configuration files (``CONTAINERS_CONF``, ``CONTAINERS_STORAGE_CONF``), so the
  machine's default storage (``/var/lib/containers``) and its default socket are never
  used. The service runs in a mount namespace of its own: the overlay mounts of its
  containers never show on the host (none is left behind if it dies), and the one file
  Podman 4.3 writes outside its storage root whatever it is told (the image copier's
  blob cache, ``/var/lib/containers/cache`` for root) lands in a directory of the
  engine's bind-mounted there. It has the attributes the tests use of
  :class:`tests.dockerengine.Engine` (``url``, ``client``, ``stop()``).
- :func:`copy_image` puts the image the Docker Engine built (:func:`tests.dockerengine.
  build_image`) into it, layer for layer: ``docker save`` streamed to ``podman load``
  through the two compatible APIs, 8 to 19 s here where building it again (the same
  import, then compiling sandlot's layer) takes 25 to 30 s. ``build_image`` also works
  against this engine, for a Podman-only run.

Why ``runc``: on this machine's hybrid cgroup layout (v1 controllers, a v2 mount with
none) ``crun`` fails to create containers; ``runc`` works. Why ``cgroupfs``: there is no
systemd to ask for scopes. Why the ``file`` events backend: the provider follows the
engine's ``die`` events, and there is no journald.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any


def ensure_podman() -> None:
    """``podman`` and ``runc`` are installed (with apt when missing and root).

    ``runc`` named, so it is the one that satisfies Podman's ``crun | runc`` (``crun``
    fails here); without recommends (buildah, fuse-overlayfs, slirp4netns and more),
    which the tests do not use.
    """
    missing = [
        pkg
        for pkg, path in (("podman", "podman"), ("runc", "runc"))
        if shutil.which(path) is None and not Path(f"/usr/sbin/{path}").exists()
    ]
    if not missing:
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise RuntimeError(f"install {' '.join(missing)} (apt-get install -y {' '.join(missing)})")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-qq"], check=True, env=env, capture_output=True)
    subprocess.run(
        ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *missing],
        check=True,
        env=env,
        capture_output=True,
    )


def _containers_conf(base: Path) -> str:
    runc = shutil.which("runc") or "/usr/sbin/runc"
    return f"""[network]
network_config_dir = "{base / "net"}"

[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
tmp_dir = "{base / "tmp"}"
volume_path = "{base / "root" / "volumes"}"
static_dir = "{base / "root" / "libpod"}"

[engine.runtimes]
runc = ["{runc}"]
"""


def _storage_conf(base: Path) -> str:
    return f"""[storage]
driver = "overlay"
graphroot = "{base / "root"}"
runroot = "{base / "runroot"}"
"""


class PodmanEngine:
    """A private ``podman system service`` (stop it with :meth:`stop`)."""

    kind = "podman"

    def __init__(self) -> None:
        ensure_podman()
        # Short: the socket's path must fit in a sockaddr_un.
        self.dir = Path(tempfile.mkdtemp(prefix="sl-podman-", dir="/tmp"))
        for sub in ("net", "tmp", "root", "runroot", "varlib"):
            (self.dir / sub).mkdir()
        (self.dir / "containers.conf").write_text(_containers_conf(self.dir))
        (self.dir / "storage.conf").write_text(_storage_conf(self.dir))
        self.socket = self.dir / "podman.sock"
        self.url = f"unix://{self.socket}"
        self.env = {
            **os.environ,
            "CONTAINERS_CONF": str(self.dir / "containers.conf"),
            "CONTAINERS_STORAGE_CONF": str(self.dir / "storage.conf"),
            # No registry is reachable: nothing to search, nothing to pull.
            "CONTAINERS_REGISTRIES_CONF": str(self.dir / "registries.conf"),
        }
        (self.dir / "registries.conf").write_text("unqualified-search-registries = []\n")
        self.log = open(self.dir / "podman.log", "wb")  # noqa: SIM115
        # The mount point of the private /var/lib/containers (an empty directory at most).
        Path("/var/lib/containers").mkdir(parents=True, exist_ok=True)
        in_namespace = 'mount --bind "$1" /var/lib/containers && shift && exec "$@"'
        argv = ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", in_namespace]
        argv += ["sh", str(self.dir / "varlib"), self.podman(), "system", "service", "--time=0"]
        self.proc = subprocess.Popen(
            [*argv, self.url],
            # Its own directory: conmon writes an `oom` file into its working directory
            # when a container is killed out of memory.
            cwd=self.dir,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=self.env,
            start_new_session=True,
        )
        import docker

        deadline = time.monotonic() + 30
        while True:
            while not self.socket.exists() and self.proc.poll() is None:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.02)
            self.client: Any = docker.DockerClient(base_url=self.url)
            try:
                self.client.ping()
                break
            except Exception:
                self.client.close()
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(
                        f"podman did not start: {(self.dir / 'podman.log').read_text()[-2000:]}"
                    ) from None
                time.sleep(0.05)

    @staticmethod
    def podman() -> str:
        return shutil.which("podman") or "/usr/bin/podman"

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            for c in self.client.containers.list(all=True):
                c.remove(force=True, v=True)
        with contextlib.suppress(Exception):
            self.client.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()
        # Its mounts went with its namespace.
        shutil.rmtree(self.dir, ignore_errors=True)


def copy_image(source: Any, engine: PodmanEngine, tag: str) -> str:
    """``tag`` saved from the engine ``source`` and loaded into ``engine``: the tag."""
    archive = engine.dir / "image.tar"
    with open(archive, "wb") as f:
        for chunk in source.client.images.get(tag).save(named=True):
            f.write(chunk)
    try:
        with open(archive, "rb") as f:
            loaded = engine.client.images.load(f)
    finally:
        archive.unlink()
    # Podman names a loaded short name ``localhost/…``; a short name still finds it.
    if not any(t.endswith(f"/{tag}") or t == tag for image in loaded for t in image.tags):
        raise RuntimeError(f"podman load did not tag {tag}: {[i.tags for i in loaded]}")
    return tag
