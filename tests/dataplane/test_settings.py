"""The dataplane's switches: fields of its settings, also read from ``SANDLOT_DP_*``."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from sandlot.dataplane.http.host import DataplaneHost
from sandlot.dataplane.services import grepcache, native
from sandlot.dataplane.services.auth import TokenVerifier
from sandlot.dataplane.settings import DataplaneSettings


@pytest.fixture
def restored() -> Iterator[None]:
    yield
    native.configure(True)
    grepcache.configure(True)


def test_every_switch_is_a_setting_read_from_the_environment() -> None:
    env = {"SANDLOT_DP_NATIVE": "0", "SANDLOT_DP_GREP_CACHE": "no", "SANDLOT_DP_MAX_SHELLS": "3"}
    settings = DataplaneSettings.from_env(env)
    assert (settings.native, settings.grep_cache, settings.max_shells) == (False, False, 3)
    assert DataplaneSettings.from_env({}) == DataplaneSettings()
    with pytest.raises(ValueError, match="SANDLOT_DP_MAX_SHELLS"):
        DataplaneSettings.from_env({"SANDLOT_DP_MAX_SHELLS": "many"})


async def _no_keys() -> dict[str, object]:
    return {"keys": []}


def test_the_host_applies_the_switches(restored: None) -> None:
    verifier = TokenVerifier(_no_keys, issuer="test")
    DataplaneHost(verifier=verifier, settings=DataplaneSettings(grep_cache=False, native=False))
    assert not grepcache.enabled() and not native.wanted()
    DataplaneHost(verifier=verifier, settings=DataplaneSettings())
    assert grepcache.enabled() and native.wanted()
