"""The single-node cluster of ``scripts/k8s-cluster`` for the tests, and the sandbox image
in its node's engine.

:func:`cluster` brings the cluster up (building it the first time on a machine, cached
under ``~/.cache/sandlot/k8s``) unless one is already up and Ready, and takes it down
again after the tests only if it started it. :func:`node_image` builds the sandbox image
of :mod:`tests.dockerengine` in the node's own Docker Engine (pods never pull it).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.dockerengine import IMAGE, build_image

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "k8s-cluster"


@dataclass
class Cluster:
    kubeconfig: str
    docker_host: str
    started_here: bool
    #: Seconds the build took (0 when cached) and the start took, for the report.
    build_seconds: float
    up_seconds: float

    def docker(self) -> Any:
        import docker

        return docker.DockerClient(base_url=self.docker_host)


def _env() -> dict[str, str]:
    out = subprocess.run([SCRIPT, "env"], check=True, capture_output=True, text=True).stdout
    env = {}
    for line in out.splitlines():
        key, _, value = line.removeprefix("export ").partition("=")
        env[key] = value
    return env


def start() -> Cluster:
    status = subprocess.run([SCRIPT, "status"], capture_output=True, text=True)
    if status.returncode == 0:
        if "provisioner: running" not in status.stdout:
            # Up, from a version of the script without the volume provisioner: ``up``
            # starts what is missing and leaves the rest running.
            subprocess.run([SCRIPT, "up"], check=True, capture_output=True)
        env = _env()
        return Cluster(env["KUBECONFIG"], env["DOCKER_HOST"], False, 0.0, 0.0)
    # What a stopped cluster left behind (its state, bridge, rules) goes first.
    subprocess.run([SCRIPT, "down"], check=True, capture_output=True)
    t0 = time.monotonic()
    subprocess.run([SCRIPT, "build"], check=True, capture_output=True)
    t1 = time.monotonic()
    up = subprocess.run([SCRIPT, "up"], capture_output=True, text=True)
    if up.returncode != 0:
        subprocess.run([SCRIPT, "down"], capture_output=True)
        raise RuntimeError(f"scripts/k8s-cluster up failed:\n{up.stderr[-4000:]}")
    t2 = time.monotonic()
    env = _env()
    return Cluster(env["KUBECONFIG"], env["DOCKER_HOST"], True, t1 - t0, t2 - t1)


def stop(cluster: Cluster) -> None:
    if cluster.started_here and not os.environ.get("SANDLOT_K8S_KEEP"):
        subprocess.run([SCRIPT, "down"], check=True, capture_output=True)


class _NodeEngine:
    """What :func:`tests.dockerengine.build_image` needs of an engine: its client."""

    def __init__(self, client: Any) -> None:
        self.client = client


def source_digest() -> str:
    """A digest of the sandlot package's files: the image's tag."""
    import sandlot

    package = Path(sandlot.__file__).parent
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts:
            digest.update(str(path.relative_to(package)).encode() + b"\0")
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def node_image(cluster: Cluster) -> str:
    """The sandbox image of this tree's sandlot, tagged by its digest: several work trees
    share the cluster, and none may run another's pods on its code."""
    repo = IMAGE.partition(":")[0]
    tag = f"{repo}:{source_digest()}"
    client = cluster.docker()
    try:
        if client.images.list(name=tag):
            return tag
        return build_image(_NodeEngine(client), tag)  # type: ignore[arg-type]
    finally:
        client.close()
