"""The unisolated runtime's OOM report, as the in-sandbox dataplane uses it: a command
ended by SIGKILL while its cgroup's OOM kill count rose is ``oom_killed`` (the count read
from the cgroup's file, both layouts)."""

from __future__ import annotations

from pathlib import Path

from sandlot.dataplane.standalone import oom_counter, read_oom_kills
from sandlot.protocol.sessions import Template
from sandlot.runtime.base import ProcessSpec
from sandlot.runtime.direct import DirectRuntime

V1 = "oom_kill_disable 0\nunder_oom 0\noom_kill {}\n"
V2 = "low 0\nhigh 0\nmax 3\noom 2\noom_kill {}\noom_group_kill 0\n"


def test_the_count_is_read_from_either_cgroup_layout(tmp_path: Path) -> None:
    v1, v2 = tmp_path / "memory.oom_control", tmp_path / "memory.events"
    v1.write_text(V1.format(4))
    v2.write_text(V2.format(7))
    assert read_oom_kills(v1) == 4 and read_oom_kills(v2) == 7
    assert read_oom_kills(tmp_path / "missing") is None
    (tmp_path / "old").write_text("oom_kill_disable 0\nunder_oom 0\n")  # kernels < 4.13
    assert read_oom_kills(tmp_path / "old") is None
    assert oom_counter([tmp_path / "missing", tmp_path / "old"]) is None
    counter = oom_counter([tmp_path / "missing", v2, v1])
    assert counter is not None and counter() == 7
    v2.write_text(V2.format(8))
    assert counter() == 8


async def test_a_sigkill_is_oom_killed_only_when_the_count_rose(tmp_path: Path) -> None:
    events = tmp_path / "memory.events"
    events.write_text(V2.format(0))
    counter = oom_counter([events])
    assert counter is not None
    runtime = DirectRuntime(
        "sb_oom", 1, Template(name="t", image="host"), tmp_path, oom_kills=counter
    )

    async def run(script: str) -> tuple[int, bool]:
        proc = await runtime.spawn(ProcessSpec(argv=["sh", "-c", script], cwd="/workspace"))
        status = await proc.wait()
        return status.exit_code, status.oom_killed

    assert await run("kill -9 $$") == (137, False)  # killed, the count unchanged
    # The count rises while the command runs, as when the kernel kills it.
    bump = f"printf '{V2.format(1)}' > {events}; "
    assert await run(bump + "kill -9 $$") == (137, True)
    # A shell whose child was killed exits 137 itself: the same.
    assert await run(f"printf '{V2.format(2)}' > {events}; sh -c 'kill -9 $$'") == (137, True)
    # An exit that is no kill is never one, whatever the count did.
    assert await run(f"printf '{V2.format(3)}' > {events}; exit 3") == (3, False)
