"""A command ended by the sandbox's memory limit is reported as such, on the command.

Against a real ``sandlot serve`` with isolated sandboxes (the memory limit is a cgroup's;
the unisolated mode has none), through the SDK: the one-shot answer, the streaming exit
frame, the exec snapshot and the ``exec.exited`` event all say ``oom_killed``.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sandlot.sdk import AsyncSandlot
from tests.servers import SandlotServer, isolation_mode

CONFIG = """
[templates.small]
image = "host"
network = "none"
resources = { cpu = 1.0, memory_mb = 64, pids = 64 }
shells = { default = ["/bin/sh"] }
"""

HOG = ["python3", "-c", "b = bytearray(300 << 20); print('survived')"]


@pytest.fixture
def server(tmp_path: Path) -> Iterator[SandlotServer]:
    if isolation_mode() != "isolated":
        pytest.skip("memory limits need isolated sandboxes (root)")
    srv = SandlotServer(tmp_path / "data", config=CONFIG).start()
    try:
        yield srv
    finally:
        srv.stop()
        srv.cleanup()


@pytest.mark.isolation
async def test_oom_killed_command_says_so(server: SandlotServer) -> None:
    key = server.key("alice", "agent")
    async with AsyncSandlot(server.url, key) as client:
        sandbox = await client.ensure(f"thr_{uuid.uuid4().hex[:6]}", template="small")
        # An ordinary failure is not an OOM.
        plain = await sandbox.exec(["sh", "-c", "exit 3"])
        assert plain.exit_code == 3 and not plain.oom_killed

        result = await sandbox.exec(HOG)
        assert "survived" not in result.stdout
        assert result.exit_code == 137 and result.oom_killed
        assert result.exec_id is not None
        snap = await sandbox.get_exec(result.exec_id)
        assert snap.oom_killed is True and snap.signal == "SIGKILL"

        cmd = await sandbox.stream(HOG)
        streamed = await cmd.wait(check=False)
        assert streamed.oom_killed and streamed.exit_code == 137

        ended: list[dict[str, Any]] = []
        async for event in sandbox.events(after=0, timeout=30):
            if event.kind == "exec" and event.event_type in ("exec.killed", "exec.exited"):
                ended.append(event.details["exec"])
                if len(ended) == 3:
                    break
        assert [e["oom_killed"] for e in ended] == [False, True, True]
