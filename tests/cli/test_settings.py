"""The CLI's settings: flags > environment > config file > defaults."""

from __future__ import annotations

from pathlib import Path

import pytest

from sandlot.cli.settings import DEFAULT_URL, ConfigError, config_file, load_settings


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("HOME", str(tmp_path))
    return tmp_path


def test_flags_over_environment_over_file_over_defaults(home: Path, tmp_path: Path) -> None:
    config = tmp_path / "cfg.toml"
    config.write_text('url = "http://file:1/"\napi_key = "sl_file"\n')
    env = {"SANDLOT_CLIENT_CONFIG": str(config)}
    s = load_settings(environ=env)
    assert (s.url, s.api_key, s.timeout) == ("http://file:1", "sl_file", 30.0)
    env |= {"SANDLOT_URL": "http://env:2", "SANDLOT_API_KEY": "sl_env"}
    s = load_settings(environ=env)
    assert (s.url, s.api_key) == ("http://env:2", "sl_env")
    s = load_settings("http://flag:3/", "sl_flag", 5.0, environ=env)
    assert (s.url, s.api_key, s.timeout) == ("http://flag:3", "sl_flag", 5.0)
    # An empty value counts as none.
    s = load_settings("", "", environ={**env, "SANDLOT_URL": ""})
    assert (s.url, s.api_key) == ("http://file:1", "sl_env")
    config.write_text('api_key = "sl_file"\n')
    assert load_settings(environ={"SANDLOT_CLIENT_CONFIG": str(config)}).url == DEFAULT_URL


def test_where_the_files_are(home: Path, tmp_path: Path) -> None:
    assert config_file({}) == home / ".config" / "sandlot" / "config.toml"
    assert config_file({"XDG_CONFIG_HOME": "/x"}) == Path("/x/sandlot/config.toml")
    explicit = {"XDG_CONFIG_HOME": "/x", "SANDLOT_CLIENT_CONFIG": "~/c.toml"}
    assert config_file(explicit) == home / "c.toml"
    key = {"SANDLOT_API_KEY": "sl_k"}
    assert load_settings(environ=key).watch_dir == home / ".cache" / "sandlot" / "watch"
    cache = {**key, "XDG_CACHE_HOME": str(tmp_path / "c")}
    assert load_settings(environ=cache).watch_dir == tmp_path / "c" / "sandlot" / "watch"


def test_what_is_wrong_is_said(home: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no API key: pass --api-key, set SANDLOT_API_KEY"):
        load_settings(environ={})
    config = tmp_path / "bad.toml"
    config.write_text("url = ")
    with pytest.raises(ConfigError, match="cannot read"):
        load_settings(api_key="sl_k", environ={"SANDLOT_CLIENT_CONFIG": str(config)})
