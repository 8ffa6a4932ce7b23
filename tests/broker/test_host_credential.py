"""The secret that guards a sandbox host's provider API (``host_credential``): at least
16 characters wherever it comes from, and a host given a shorter one says so at start,
before it asks the brokers anything."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

from sandlot.broker.hosts import host_credential
from sandlot.broker.settings import ConfigError


def test_a_credential_is_16_characters_or_more_from_a_file_or_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SANDLOT_HOST_CREDENTIAL", raising=False)
    made = host_credential(tmp_path)
    assert len(made) >= 16 and host_credential(tmp_path) == made  # made once, kept
    short = tmp_path / "short"
    short.write_text("abc\n")
    with pytest.raises(ConfigError, match="at least 16 characters"):
        host_credential(tmp_path, short)
    for value in ("a", "fifteen-chars!!", "   padded  "):
        monkeypatch.setenv("SANDLOT_HOST_CREDENTIAL", value)
        with pytest.raises(ConfigError, match="SANDLOT_HOST_CREDENTIAL must be at least 16"):
            host_credential(tmp_path)
    monkeypatch.setenv("SANDLOT_HOST_CREDENTIAL", " sixteen-chars!!! \n")
    assert host_credential(tmp_path) == "sixteen-chars!!!"


def test_a_host_with_a_short_credential_stops_at_start(tmp_path: Path) -> None:
    key = tmp_path / "host.key"
    key.write_text(f"slh_{secrets.token_hex(8)}_{secrets.token_urlsafe(32)}\n")
    argv = [sys.executable, "-m", "sandlot.cli.main", "host", "--broker", "http://127.0.0.1:9"]
    argv += ["--key-file", str(key), "--data-dir", str(tmp_path / "data")]
    env = {**os.environ, "SANDLOT_HOST_CREDENTIAL": "abc"}
    # Before, it went on to the brokers and retried their refusal for good.
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 2
    assert "SANDLOT_HOST_CREDENTIAL must be at least 16 characters" in out.stderr
    assert "Traceback" not in out.stderr
