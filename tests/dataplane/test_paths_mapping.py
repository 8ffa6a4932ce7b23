"""Sandbox and host paths map into each other through the mount table, both ways."""

from __future__ import annotations

from pathlib import Path

from sandlot.dataplane.services.paths import PathResolver
from sandlot.runtime.base import Mount


def test_sandbox_and_host_paths_map_both_ways(tmp_path: Path) -> None:
    ws, data = tmp_path / "ws", tmp_path / "vol"
    ws.mkdir()
    data.mkdir()
    resolver = PathResolver([Mount("/workspace", ws, True), Mount("/workspace/data", data, True)])
    cases = {
        "/workspace": str(ws),
        "/workspace/": str(ws),
        "/workspace/src/a.py": f"{ws}/src/a.py",
        "/workspace/data": str(data),  # the longest mount decides
        "/workspace/data/x/y": f"{data}/x/y",
        "/workspace/database": f"{ws}/database",  # a prefix of a name is not a parent
    }
    for spath, host in cases.items():
        assert resolver.sandbox_to_host(spath) == host, spath
        assert resolver.host_to_sandbox(host) == spath.rstrip("/"), host
    assert resolver.sandbox_to_host("/etc/passwd") is None
    assert resolver.host_to_sandbox("/etc/passwd") is None
