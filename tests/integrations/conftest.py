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


#: Expectations of langchain-tests that predate deepagents 0.7 (FACTS.md), or that
#: assume an image with a ``python`` command.
STANDARD_XFAIL = {
    "test_write_existing_file_fails": "deepagents 0.7: write overwrites",
    "test_glob": "deepagents 0.7: glob returns absolute paths",
    "test_glob_basic_pattern": "deepagents 0.7: glob returns absolute paths",
    "test_glob_hidden_files_explicitly": "deepagents 0.7: glob returns absolute paths",
    "test_glob_with_character_class": "deepagents 0.7: glob returns absolute paths",
    "test_glob_with_question_mark": "deepagents 0.7: glob returns absolute paths",
    "test_glob_with_directories": "deepagents 0.7: glob returns regular files only",
    "test_execute_large_stdout_payload": "the default image has python3, not python",
    "test_aexecute_large_stdout_payload": "the default image has python3, not python",
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.module is not None and item.module.__name__.endswith("test_deepagents_standard"):
            reason = STANDARD_XFAIL.get(getattr(item, "originalname", item.name))
            if reason:
                item.add_marker(pytest.mark.xfail(reason=reason, strict=True))
