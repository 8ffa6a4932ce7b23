"""The SDK's own dependency set: importing it loads neither pydantic nor any server library."""

from __future__ import annotations

import subprocess
import sys

SERVER_ONLY = ("pydantic", "starlette", "fastapi", "sqlalchemy", "httpx", "jwt", "uvicorn", "h11")


def test_sdk_import_stays_light() -> None:
    code = (
        "import sys, sandlot.sdk, sandlot.integrations\n"
        f"print(','.join(m for m in {SERVER_ONLY!r} if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_protocol_names_load_on_first_use() -> None:
    import sandlot.protocol as protocol

    assert protocol.Capability.FS_READ.value == "fs_read"
    assert protocol.SandlotError.__name__ == "SandlotError"
    assert sorted(protocol.__all__) == sorted(protocol._HOME)


def test_websockets_load_with_the_first_socket() -> None:
    """HTTP-only work (a CLI ``sync``, file tools) never pays for the WebSocket library."""
    code = "import sys, sandlot.sdk, sandlot.cli.main\nprint('websockets' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
