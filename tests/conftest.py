"""Shared fixtures: a private Docker Engine and the sandbox image, once per test session
(tests/dockerengine.py), for the docker provider's tests and the dataplane suite's
docker variant; a private Podman (tests/podmanengine.py) with the same image, for the
same tests against Podman's Docker-compatible socket (``engine``/``image`` run a test on
both); the single-node cluster of scripts/k8s-cluster and the image in its node
(tests/k8scluster.py), for the kubernetes provider's tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.dockerengine import Engine, build_image
from tests.k8scluster import Cluster, node_image
from tests.k8scluster import start as k8s_start
from tests.k8scluster import stop as k8s_stop
from tests.podmanengine import PodmanEngine, copy_image


@pytest.fixture(scope="session")
def docker_engine() -> Iterator[Engine]:
    engine = Engine()
    try:
        yield engine
    finally:
        engine.stop()


@pytest.fixture(scope="session")
def docker_image(docker_engine: Engine) -> str:
    return build_image(docker_engine)


@pytest.fixture(scope="session")
def podman_engine() -> Iterator[PodmanEngine]:
    engine = PodmanEngine()
    try:
        yield engine
    finally:
        engine.stop()


@pytest.fixture(scope="session")
def podman_image(podman_engine: PodmanEngine, docker_engine: Engine, docker_image: str) -> str:
    """The Docker Engine's image, copied layer for layer (faster than building it again)."""
    return copy_image(docker_engine, podman_engine, docker_image)


#: The engines the docker provider is tested against.
ENGINES = ["docker", "podman"]


@pytest.fixture(params=ENGINES)
def engine(request: pytest.FixtureRequest) -> Engine | PodmanEngine:
    """Docker Engine, then Podman: a test taking it runs once on each."""
    found: Engine | PodmanEngine = request.getfixturevalue(f"{request.param}_engine")
    return found


@pytest.fixture
def image(request: pytest.FixtureRequest, engine: Engine | PodmanEngine) -> str:
    """The sandbox image in :func:`engine`."""
    return str(request.getfixturevalue(f"{engine.kind}_image"))


@pytest.fixture(scope="session")
def k8s_cluster() -> Iterator[Cluster]:
    """The cluster of scripts/k8s-cluster (built once per machine, started once per run)."""
    cluster = k8s_start()
    try:
        yield cluster
    finally:
        k8s_stop(cluster)


@pytest.fixture(scope="session")
def k8s_image(k8s_cluster: Cluster) -> str:
    return node_image(k8s_cluster)
