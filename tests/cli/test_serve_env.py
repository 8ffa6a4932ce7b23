"""``sandlot serve`` takes the dataplane's settings from ``SANDLOT_DP_*``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def test_a_bad_dataplane_setting_is_a_configuration_error(tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "sandlot.cli.main", "serve", "--port", "0"]
    argv += ["--data-dir", str(tmp_path / "d"), "--unisolated"]
    env = {**os.environ, "SANDLOT_DP_MAX_WEBSOCKETS_PER_TOKEN": "many"}
    out = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 2, out
    message = " ".join(out.stderr.split())  # the terminal may wrap it
    assert "SANDLOT_DP_MAX_WEBSOCKETS_PER_TOKEN: 'many' is not a valid int" in message, out
    assert "Traceback" not in out.stderr
