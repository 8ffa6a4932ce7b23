"""The SDK's settings: the client's arguments > ``SANDLOT_URL`` / ``SANDLOT_API_KEY``."""

from __future__ import annotations

import pytest

from sandlot.sdk.settings import ClientSettings, load_settings


def test_arguments_over_environment() -> None:
    env = {"SANDLOT_URL": "http://env:1/", "SANDLOT_API_KEY": "sl_env"}
    assert load_settings(environ=env) == ClientSettings("http://env:1", "sl_env")
    assert load_settings("http://arg:2", "sl_arg", environ=env) == ClientSettings(
        "http://arg:2", "sl_arg"
    )
    assert load_settings("", None, environ=env) == ClientSettings("http://env:1", "sl_env")


def test_what_is_missing_is_said() -> None:
    with pytest.raises(ValueError, match="no broker URL: pass url= or set SANDLOT_URL"):
        load_settings(environ={"SANDLOT_API_KEY": "sl_k"})
    with pytest.raises(ValueError, match="no API key: pass api_key= or set SANDLOT_API_KEY"):
        load_settings("http://h", environ={"SANDLOT_API_KEY": ""})


async def test_both_clients_read_them(monkeypatch: pytest.MonkeyPatch) -> None:
    from sandlot.sdk import AsyncSandlot, Sandlot

    monkeypatch.setenv("SANDLOT_URL", "http://127.0.0.1:9/")
    monkeypatch.setenv("SANDLOT_API_KEY", "sl_env")
    sync = Sandlot(auto_refresh=False)
    sync.close()
    asynchronous = AsyncSandlot(auto_refresh=False)
    await asynchronous.aclose()
    for client in (sync, asynchronous):
        assert client.url == "http://127.0.0.1:9"
        assert client._api_key == "sl_env"
