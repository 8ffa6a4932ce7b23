"""One real ``sandlot serve`` for the SDK tests, with short token and lease lifetimes
so that background refreshes and heartbeats happen within a test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.servers import SandlotServer, running

CONFIG = """
[policy]
token_ttl_seconds = 6
lease_ttl_seconds = 6

[quotas]
max_live_sandboxes_per_user = 1000

[policy.capabilities.agent]
default = ["fs_read", "fs_write", "exec"]
allowed = ["fs_read", "fs_write", "exec", "shell_observe"]
"""


@pytest.fixture(scope="package")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SandlotServer]:
    with running(tmp_path_factory.mktemp("sdk") / "d", config=CONFIG) as srv:
        yield srv


@pytest.fixture(scope="package")
def human_key(server: SandlotServer) -> str:
    return server.key("alice", "human")


@pytest.fixture(scope="package")
def agent_key(server: SandlotServer) -> str:
    return server.key("alice", "agent")


@pytest.fixture(scope="package")
def other_key(server: SandlotServer) -> str:
    return server.key("mallory", "human")
