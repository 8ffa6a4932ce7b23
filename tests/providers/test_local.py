"""The local provider's contract on this machine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from sandlot.protocol.errors import SandboxNotFound
from sandlot.providers.local import LocalProvider


async def _jwks() -> dict[str, Any]:
    return {"keys": []}


async def test_deleting_a_deleted_sandbox_is_a_no_op(tmp_path: Path) -> None:
    """A second delete (a repeated DELETE, the reaper's retry) found nothing to do instead
    of failing on the dataplane entry already gone."""
    provider = LocalProvider(
        {"mode": "unisolated", "data_dir": tmp_path, "issuer": "https://b.test", "jwks": _jwks}
    )
    try:
        await provider.delete("sb_gone")
        await provider.delete("sb_gone")
        with pytest.raises(SandboxNotFound):
            await provider.status("sb_gone")
        with pytest.raises(SandboxNotFound):
            await provider.activity("sb_gone")
    finally:
        await provider.close()
