"""The CLI's environment for tests: the module's ``server``, alice's key, a home of its own."""

from __future__ import annotations

import os

import pytest

from tests.servers import SandlotServer


@pytest.fixture(scope="module")
def env(server: SandlotServer, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    home = tmp_path_factory.mktemp("home")
    return {
        **os.environ,
        "SANDLOT_URL": server.url,
        "SANDLOT_API_KEY": server.key("alice"),
        "HOME": str(home),
        "XDG_CACHE_HOME": str(home / ".cache"),
        "XDG_CONFIG_HOME": str(home / ".config"),
        "COLUMNS": "200",
    }
