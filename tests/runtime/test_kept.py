"""Kept processes: the init holds a command's pipes, record and exit status for the server.

A server "dies" here by dropping its connection to the init and its copies of the pipes,
exactly what a killed process does; a second manager then adopts the sandbox as a
restarted server would.
"""

from __future__ import annotations

import asyncio
import os

from sandlot.protocol.sessions import Template
from sandlot.runtime.base import Keep, ProcessSpec, SandboxProcess, SandboxRuntime
from sandlot.runtime.control import InitProcess
from sandlot.runtime.local import LocalRuntimeManager, RuntimeSettings


def drop(process: SandboxProcess) -> None:
    """What a server's death does to a process it started: every fd of it closes."""
    assert isinstance(process, InitProcess)
    process._loop.remove_reader(process._sock.fileno())
    process._sock.close()
    for fd in (process.stdin_fd, process.stdout_fd, process.stderr_fd, process.pty_fd):
        if fd is not None:
            os.close(fd)


async def read_all(fd: int) -> bytes:
    os.set_blocking(fd, True)
    chunks = []
    while chunk := await asyncio.to_thread(os.read, fd, 65536):
        chunks.append(chunk)
    os.close(fd)
    return b"".join(chunks)


async def restarted(settings: RuntimeSettings, rt: SandboxRuntime) -> SandboxRuntime:
    other = LocalRuntimeManager(settings)
    adopted = await other.adopt(rt.sandbox_id, rt.generation, rt.template)
    assert adopted is not None
    return adopted


async def test_a_kept_command_outlives_its_server(
    manager: LocalRuntimeManager, settings: RuntimeSettings, template: Template
) -> None:
    rt = await manager.create("sb-kept", 1, template, {})
    assert rt.keeps_processes
    spec = ProcessSpec(argv=["sh", "-c", "echo one; read x; echo got $x; echo err >&2; exit 4"])
    process = await rt.spawn(spec, Keep(tag=7, record=b'{"mine": 1}'))
    drop(process)  # stdin, stdout and stderr stay open: the init holds the server's ends

    again = await restarted(settings, rt)
    kept = await again.kept()
    assert [(k.tag, k.record, k.status) for k in kept] == [(7, b'{"mine": 1}', None)]
    adopted = await again.adopt(7)
    stdin, stdout, stderr = adopted.held
    os.write(stdin, b"two\n")
    os.close(stdin)
    assert await read_all(stdout) == b"one\ngot two\n"
    assert await read_all(stderr) == b"err\n"
    status = await adopted.wait()
    assert status.exit_code == 4
    # Exited and adopted: still listed with its status until forgotten.
    [k] = await again.kept()
    assert k.status is not None and k.status.exit_code == 4
    await again.forget(7)
    assert await again.kept() == []


async def test_exit_while_no_server_is_there_is_kept_with_the_output(
    manager: LocalRuntimeManager, settings: RuntimeSettings, template: Template
) -> None:
    rt = await manager.create("sb-kept2", 1, template, {})
    process = await rt.spawn(
        ProcessSpec(argv=["sh", "-c", "echo bye; exit 3"]), Keep(tag=9, record=b"r")
    )
    drop(process)
    again = await restarted(settings, rt)
    for _ in range(100):
        [k] = await again.kept()
        if k.status is not None:
            break
        await asyncio.sleep(0.02)
    assert k.status is not None and k.status.exit_code == 3
    adopted = await again.adopt(9)
    assert (await adopted.wait()).exit_code == 3
    _, stdout, _ = adopted.held
    assert await read_all(stdout) == b"bye\n"
    # Released: the init no longer holds its pipes, and a later adoption gets none.
    await again.release_held(9)
    assert (await again.adopt(9)).held == []
    # A tag names one process.
    try:
        await again.spawn(ProcessSpec(argv=["true"]), Keep(tag=9, record=b""))
    except OSError as exc:
        assert exc.errno == 17  # EEXIST
    else:
        raise AssertionError("a second process with the same tag was started")


async def test_a_server_dying_with_an_unread_answer_leaves_the_held_pipes_alone(
    manager: LocalRuntimeManager, settings: RuntimeSettings, template: Template
) -> None:
    """The exit status arrives and sits unread when the server dies: its socket closes with
    data in it, the init's read fails (a reset), and the held pipes must stay held."""
    rt = await manager.create("sb-kept5", 1, template, {})
    process = await rt.spawn(
        ProcessSpec(argv=["sh", "-c", "echo bye; exit 3"]), Keep(tag=12, record=b"r")
    )
    assert isinstance(process, InitProcess)
    process._loop.remove_reader(process._sock.fileno())
    for _ in range(200):  # the exit status is waiting in the server's socket
        [k] = await rt.kept()
        if k.status is not None:
            break
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)
    drop(process)
    again = await restarted(settings, rt)
    adopted = await again.adopt(12)
    _, stdout, _ = adopted.held
    assert await read_all(stdout) == b"bye\n"
    assert (await adopted.wait()).exit_code == 3


async def test_more_kept_processes_than_one_buffer_holds_are_all_listed(
    manager: LocalRuntimeManager, settings: RuntimeSettings, template: Template
) -> None:
    # The init sent one message per kept process without waiting for room: past the
    # connection's buffer (some hundreds of short commands, or a dozen long ones) the
    # rest and the list's end were lost, and a restarted server could not start.
    rt = await manager.create("sb-kept-many", 1, template, {})
    records = {tag: bytes([65 + tag % 26]) * 16000 for tag in range(1, 121)}
    for tag, record in records.items():
        drop(await rt.spawn(ProcessSpec(argv=["true"]), Keep(tag=tag, record=record)))
    again = await restarted(settings, rt)
    kept = await again.kept()
    assert {k.tag: k.record for k in kept} == records


async def test_record_is_replaced(manager: LocalRuntimeManager, template: Template) -> None:
    rt = await manager.create("sb-kept3", 1, template, {})
    process = await rt.spawn(
        ProcessSpec(argv=["sleep", "5"], pty=(80, 24)), Keep(tag=11, record=b"spare")
    )
    await rt.update_record(11, b"named")
    [k] = await rt.kept()
    assert k.record == b"named"
    process.send_signal(9)
    assert (await process.wait()).exit_code == 137


async def test_a_request_after_a_quick_exit_never_loses_the_exit_status(
    manager: LocalRuntimeManager, template: Template
) -> None:
    """A request the server sends (close stdin, a signal) may cross the exit of a quick
    command: the exit status must arrive all the same (a reset connection lost it)."""
    rt = await manager.create("sb-kept4", 1, template, {})
    codes = []
    for i in range(300):
        process = await rt.spawn(ProcessSpec(argv=["true"]), Keep(tag=100 + i, record=b""))
        process.release(0)
        process.send_signal(0)
        codes.append((await process.wait()).exit_code)
        for fd in (process.stdin_fd, process.stdout_fd, process.stderr_fd):
            if fd is not None:
                os.close(fd)
    assert codes == [0] * 300
