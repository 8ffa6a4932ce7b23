"""What the dataplane of a container (its PID 1: ``docker``, ``kubernetes``) outlives:
every signal its sandbox's commands may send, and the orphans they leave behind."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from sandlot.protocol.states import SandboxState
from sandlot.sdk import AsyncSandbox

# Each subshell ends at once, leaving its `sleep` to the container's init: a zombie until
# the init collects it.
ORPHANS = "for i in $(seq {n}); do (sleep 0.2 &); done"
# Zombies outside the dataplane's own session (its helpers' are its own to collect).
ZOMBIES = "awk '$3 == \"Z\" && $6 != 1' /proc/[0-9]*/stat | wc -l"
# Signals that end a process, sent while the dataplane forks and starts threads (it
# blocks every signal for a moment then).
STORM = (
    "for i in $(seq 30); do "
    "for s in INT TERM HUP QUIT USR1 USR2 ALRM PROF 9 STOP; do kill -$s 1; done; done"
)

# PTRACE_ATTACH to the dataplane: a tracer stops it (and, attached, could end it); if it
# is let in, it is let go at once (the dataplane resumes: the test fails, not hangs).
TRACE = """import ctypes, os
libc = ctypes.CDLL(None)
attached = libc.ptrace(16, 1, 0, 0)
print(attached)
if attached == 0:
    os.waitpid(1, 0x40000000)
    libc.ptrace(17, 1, 0, 0)
"""


async def no_command_stops_the_dataplane(
    sb: AsyncSandbox, state: Callable[[], Awaitable[SandboxState]]
) -> None:
    """A storm of signals and ``kill -9 -1``: the sandbox stays active with its files;
    every other process of it ends; its helpers start again."""
    await sb.write("/workspace/kept.txt", "kept\n")
    shell = await sb.stream("sleep 60")
    await asyncio.gather(sb.run(STORM), *(sb.run("true") for _ in range(20)))
    for kill in ("kill -INT 1", "kill -TERM 1", "kill -9 1", "kill -9 -1"):
        await sb.run(f"{kill}; sleep 0.3", check=False)
        assert await state() is SandboxState.ACTIVE, kill
        assert (await sb.run("cat /workspace/kept.txt")).stdout == "kept\n", kill
    # Nor trace it or read its memory, where every client's token passes.
    assert (await sb.run(f"python3 - <<'EOF'\n{TRACE}EOF")).stdout == "-1\n"
    probe = await sb.run("cat /proc/1/environ; ls /proc/1/fd", check=False)
    assert probe.stdout == "" and probe.stderr.count("Permission denied") == 2
    # `kill -9 -1` ended every other process of the sandbox, the glob helper too.
    assert (await shell.wait()).exit_code == 137
    assert [f.path for f in await sb.glob("*.txt")] == ["/workspace/kept.txt"]


async def orphans_are_collected(sb: AsyncSandbox, batches: int) -> None:
    """``batches`` of 40 orphans: none stays a zombie holding a pid (the container's
    limit is reached otherwise), and commands run beside them keep their exit codes."""

    async def orphans() -> None:
        for _ in range(batches):
            await sb.run(ORPHANS.format(n=40))
            await asyncio.sleep(0.3)

    async def exits() -> list[int]:
        return [(await sb.run(f"exit {i}", check=False)).exit_code for i in range(40)]

    _, codes = await asyncio.gather(orphans(), exits())
    assert codes == list(range(40))
    # Collected every second.
    async with asyncio.timeout(10):
        while (await sb.run(ZOMBIES)).stdout.strip() != "0":
            await asyncio.sleep(0.2)
    assert (await sb.run("echo alive")).stdout == "alive\n"
