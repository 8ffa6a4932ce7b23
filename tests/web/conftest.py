"""A real dataplane for the gateway's tests, and an upstream that misbehaves."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest

from sandlot.sdk import Grant, Sandlot
from tests.servers import SandlotServer, running
from tests.web.upstreams import Misbehaving, serving


@pytest.fixture
async def misbehaving() -> AsyncIterator[Misbehaving]:
    state = Misbehaving()
    async with serving(state.app()) as port:
        state.port = port
        try:
            yield state
        finally:
            state.release.set()


@pytest.fixture(scope="module")
def dataplane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[SandlotServer, Grant]]:
    """A real ``sandlot serve`` and a grant to one of its sandboxes (URLs and token)."""
    with running(tmp_path_factory.mktemp("gateway") / "d") as server:
        client = Sandlot(server.url, server.key("alice"), auto_refresh=False)
        with client:
            sandbox = client.ensure("thr_gateway")
            yield server, sandbox.grant
