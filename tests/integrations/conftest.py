"""One real ``sandlot serve`` per test module, and keys for a human and an agent."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.servers import SandlotServer, running


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SandlotServer]:
    with running(tmp_path_factory.mktemp("srv") / "d") as srv:
        yield srv


@pytest.fixture(scope="module")
def agent_key(server: SandlotServer) -> str:
    return server.key("alice", "agent")


@pytest.fixture(scope="module")
def human_key(server: SandlotServer) -> str:
    return server.key("alice", "human")
