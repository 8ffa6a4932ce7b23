"""``sandlot serve`` takes the dataplane's settings from ``SANDLOT_DP_*``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


def test_a_bad_dataplane_setting_is_a_configuration_error(tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "sandlot.cli.main", "serve", "--port", "0"]
    argv += ["--data-dir", str(tmp_path / "d"), "--unisolated"]
    env = {**os.environ, "SANDLOT_DP_MAX_WEBSOCKETS_PER_TOKEN": "many"}
    out = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 2, out
    message = " ".join(out.stderr.split())  # the terminal may wrap it
    assert "SANDLOT_DP_MAX_WEBSOCKETS_PER_TOKEN: 'many' is not a valid int" in message, out
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize(
    ("config", "said"),
    [
        (
            '[policy]\nidle_timeout_seconds = "15m"',
            "policy.idle_timeout_seconds must be a whole number, not '15m'",
        ),
        ("[policy]\nhard_ttl_seconds = 1e12", "policy.hard_ttl_seconds must be a whole number"),
        (
            "[policy]\nidle_timeout_seconds = 4294967296",
            "policy.idle_timeout_seconds must be from 1 to 315360000",
        ),
        ("[policy]\ntoken_ttl_seconds = 0", "policy.token_ttl_seconds must be from 1 to"),
        (
            "[policy]\nreaper_interval_seconds = true",
            "policy.reaper_interval_seconds must be a number, not True",
        ),
        ("[quotas]\nnegotiation_burst = -5", "quotas.negotiation_burst must be from 1 to"),
        (
            '[templates.slow]\nimage = "host"\nidle_timeout_seconds = 2147483648',
            "templates.slow.idle_timeout_seconds: Input should be less than or equal to 315360000",
        ),
    ],
)
def test_a_policy_out_of_range_is_a_configuration_error(
    tmp_path: Path, config: str, said: str
) -> None:
    """Said at start, with the key: before, such a value was taken, and every ensure
    then failed (a string in arithmetic; a number past 32 bits on PostgreSQL)."""
    path = tmp_path / "sandlot.toml"
    path.write_text(config + "\n")
    argv = [sys.executable, "-m", "sandlot.cli.main", "serve", "--port", "0"]
    argv += ["--data-dir", str(tmp_path / "d"), "--unisolated", "--config", str(path)]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out
    assert said in " ".join(out.stderr.split()), out.stderr
    assert "Traceback" not in out.stderr
