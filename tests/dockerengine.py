"""A private Docker Engine for the tests, and the sandbox image they run.

- :func:`ensure_engine` installs Debian's ``docker.io`` (and ``debootstrap``) when
  ``dockerd`` is missing (CI runs as root on a fresh Debian machine).
- :class:`Engine` starts ``dockerd`` with its own data root, exec root and socket, no
  bridge and no iptables rules, so it touches nothing of the machine's own engine.
- :func:`build_image` makes the sandbox image without a registry: a Debian bookworm
  root filesystem (``debootstrap --variant=minbase`` with ``python3``, built once per
  machine and kept as a tarball under ``~/.cache/sandlot/docker``) is ``docker
  import``-ed, then sandlot's package and its server dependencies, copied from the
  running interpreter's environment (same CPython minor version, same glibc: this is
  bookworm too), are added as a second layer and compiled there (unchecked hash-based
  pycs: the read-only root never changes under them).

Why debootstrap rather than a tree assembled from the host's files: the sandbox is a
real Debian userland (bash, coreutils, apt's view of the world) that behaves like the
images users build, and Debian's ``python3`` is a complete, relocatable interpreter;
the host's interpreter here is a pyenv build whose shared libraries would have to be
hunted down one by one.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from importlib import metadata
from pathlib import Path
from typing import Any

from docker.types import Ulimit
from packaging.requirements import Requirement

CACHE = Path(os.environ.get("SANDLOT_CACHE_DIR", Path.home() / ".cache" / "sandlot")) / "docker"
BASE_VERSION = "bookworm-minbase-python3-v1"
MIRROR = "http://deb.debian.org/debian"
IMAGE = "sandlot-sandbox:test"
SANDBOX_UID = 1000
#: Explicit, as the provider's are: Podman's default ``nofile`` (1,048,576) is above this
#: machine's hard limit, which the runtime may not raise.
ULIMITS = [Ulimit(name="nofile", soft=4096, hard=4096), Ulimit(name="nproc", soft=4096, hard=4096)]
#: How the image's Python files are compiled: hash-based pycs the interpreter does not
#: check against their sources (a module loads without a stat of its source; the image
#: never changes under them).
COMPILE = ["--invalidation-mode", "unchecked-hash"]
#: What the in-sandbox dataplane imports (``sandlot[server]`` less the broker's own).
DATAPLANE_DISTS = [
    "pydantic",
    "starlette",
    "uvicorn",
    "httpx",
    "pyjwt",
    "cryptography",
    "prometheus-client",
    "watchfiles",
    "websockets",
    "ripgrep",
    "python-multipart",
    "httptools",
    "uvloop",
]


def ensure_engine() -> None:
    """``dockerd`` and ``debootstrap`` are installed (with apt when missing and root)."""
    missing = [
        p
        for p, exe in (("docker.io", "dockerd"), ("debootstrap", "debootstrap"))
        if shutil.which(exe) is None and not Path(f"/usr/sbin/{exe}").exists()
    ]
    if not missing:
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise RuntimeError(f"install {' '.join(missing)} (apt-get install -y {' '.join(missing)})")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-qq"], check=True, env=env, capture_output=True)
    subprocess.run(
        ["apt-get", "install", "-y", "-qq", *missing], check=True, env=env, capture_output=True
    )


class Engine:
    """A private ``dockerd`` (stop it with :meth:`stop`)."""

    kind = "docker"

    def __init__(self) -> None:
        ensure_engine()
        # Short: the socket's path must fit in a sockaddr_un.
        self.dir = Path(tempfile.mkdtemp(prefix="sl-dockerd-", dir="/tmp"))
        self.socket = self.dir / "docker.sock"
        self.url = f"unix://{self.socket}"
        self.log = open(self.dir / "dockerd.log", "wb")  # noqa: SIM115
        dockerd = shutil.which("dockerd") or "/usr/sbin/dockerd"
        self.proc = subprocess.Popen(
            [
                dockerd,
                "--data-root", str(self.dir / "data"),
                "--exec-root", str(self.dir / "exec"),
                "--pidfile", str(self.dir / "dockerd.pid"),
                "-H", self.url,
                "--bridge=none",
                "--iptables=false",
                "--ip6tables=false",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
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
                        f"dockerd did not start: {(self.dir / 'dockerd.log').read_text()[-2000:]}"
                    ) from None
                time.sleep(0.05)

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            for c in self.client.containers.list(all=True):
                c.remove(force=True)
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
        # The data root holds overlay mounts until dockerd is gone; then it can go.
        subprocess.run(["umount", "-R", str(self.dir / "exec")], capture_output=True)
        shutil.rmtree(self.dir, ignore_errors=True)


# --- the image --------------------------------------------------------------------------


def base_tarball() -> Path:
    """The Debian root filesystem as a tarball, built once per machine."""
    target = CACHE / f"{BASE_VERSION}.tar"
    if target.exists():
        return target
    ensure_engine()
    CACHE.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="rootfs-", dir=CACHE))
    try:
        rootfs = work / "rootfs"
        subprocess.run(
            ["debootstrap", "--variant=minbase", "--include=python3", "bookworm", str(rootfs),
             MIRROR],
            check=True,
            capture_output=True,
        )  # fmt: skip
        for junk in ("var/cache/apt", "var/lib/apt/lists", "usr/share/doc", "usr/share/man",
                     "usr/share/locale", "usr/share/info"):  # fmt: skip
            shutil.rmtree(rootfs / junk, ignore_errors=True)
        (rootfs / "var/cache/apt").mkdir(parents=True)
        with open(rootfs / "etc/passwd", "a") as f:
            f.write(f"user:x:{SANDBOX_UID}:{SANDBOX_UID}:sandbox:/workspace:/bin/bash\n")
        with open(rootfs / "etc/group", "a") as f:
            f.write(f"user:x:{SANDBOX_UID}:\n")
        for d in ("workspace", "run/sandlot", "run/sandlot-trust"):
            (rootfs / d).mkdir(parents=True, exist_ok=True)
        os.chown(rootfs / "workspace", SANDBOX_UID, SANDBOX_UID)
        partial = work / "base.tar"
        subprocess.run(
            ["tar", "--numeric-owner", "-C", str(rootfs), "-cf", str(partial), "."], check=True
        )
        partial.replace(target)
    finally:
        subprocess.run(["rm", "-rf", str(work)], check=False)
    return target


def _dataplane_dists() -> list[metadata.Distribution]:
    """The distributions of :data:`DATAPLANE_DISTS` and everything they require."""
    seen: dict[str, metadata.Distribution] = {}
    todo = list(DATAPLANE_DISTS)
    while todo:
        name = todo.pop().lower().replace("_", "-")
        if name in seen:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        seen[name] = dist
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return list(seen.values())


def _sandlot_layer() -> bytes:
    """A tar of ``/opt/sandlot/lib`` (sandlot and its dataplane's dependencies) and ``rg``."""
    import sandlot

    buf = io.BytesIO()
    lib = "opt/sandlot/lib"

    def clean(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
        if "__pycache__" in info.name.split("/"):
            return None
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        return info

    with tarfile.open(fileobj=buf, mode="w") as tar:
        package = Path(sandlot.__file__).parent
        tar.add(package, f"{lib}/sandlot", filter=clean)
        for dist in _dataplane_dists():
            for rel in dist.files or []:
                src = Path(str(dist.locate_file(rel)))
                parts = Path(str(rel)).parts
                if parts and parts[0] == "..":
                    if src.name == "rg" and src.is_file():
                        tar.add(src, "usr/local/bin/rg", filter=clean)
                    continue
                if src.is_file() and "__pycache__" not in parts:
                    tar.add(src, f"{lib}/{rel}", filter=clean)
    return buf.getvalue()


def build_image(engine: Engine, tag: str = IMAGE) -> str:
    """Import the base root filesystem and add sandlot's layer: the image's tag."""
    client = engine.client
    repo, _, version = tag.partition(":")
    base = f"{repo}-base:{BASE_VERSION}"
    if not client.images.list(name=base):
        # The tag goes with the name: Podman's compatible import ignores a separate ``tag``.
        client.api.import_image_from_file(str(base_tarball()), repository=base)
    container = client.containers.create(
        base,
        ["python3", "-m", "compileall", "-q", "-j0", *COMPILE, "/opt/sandlot/lib"],
        network_mode="none",
        ulimits=ULIMITS,
    )
    try:
        container.put_archive("/", _sandlot_layer())
        container.start()
        result = container.wait(timeout=300)
        if result.get("StatusCode") != 0:
            raise RuntimeError(f"compiling the sandlot layer failed: {container.logs()[-2000:]!r}")
        container.commit(repository=repo, tag=version or "latest")
    finally:
        container.remove(force=True)
    return tag


if __name__ == "__main__":  # python -m tests.dockerengine: build the base tarball only
    print(base_tarball(), file=sys.stderr)
