"""Shared fixtures: a private Docker Engine and the sandbox image, once per test session
(tests/dockerengine.py), for the docker provider's tests and the dataplane suite's
docker variant."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.dockerengine import Engine, build_image


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
