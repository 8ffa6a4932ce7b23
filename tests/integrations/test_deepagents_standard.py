"""deepagents' standard sandbox suite (langchain-tests) against a real ``sandlot serve``."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from deepagents.backends.protocol import SandboxBackendProtocol
from langchain_tests.integration_tests import SandboxIntegrationTests

from sandlot.integrations.deepagents import SandlotBackend
from tests.servers import SandlotServer

pytestmark = [
    pytest.mark.timeout(120),
    # langchain-tests' own class-scoped fixtures are instance methods.
    pytest.mark.filterwarnings("ignore:Class-scoped fixtures defined as instance methods"),
]


class TestSandlotStandard(SandboxIntegrationTests):
    @pytest.fixture(scope="class")
    def sandbox(self, server: SandlotServer, agent_key: str) -> Iterator[SandboxBackendProtocol]:
        backend = SandlotBackend.for_thread("thr_standard", url=server.url, api_key=agent_key)
        try:
            yield backend
        finally:
            backend.close()
