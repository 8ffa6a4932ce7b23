"""Real sandboxes for the runtime tests: a manager over a throwaway data directory."""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from sandlot.protocol.sessions import Resources, Template
from sandlot.runtime.base import ExitStatus, ProcessSpec, SandboxProcess, SandboxRuntime
from sandlot.runtime.local import LocalRuntimeManager, RuntimeSettings


def require_isolation() -> None:
    """Isolation tests run as root in CI and must not skip there."""
    if os.geteuid() != 0 and not os.environ.get("CI"):
        pytest.skip("isolation tests need root (they run as root in CI)")


@dataclass
class Result:
    status: ExitStatus
    stdout: str
    stderr: str


async def _drain(fd: int) -> bytes:
    loop = asyncio.get_running_loop()
    chunks: list[bytes] = []
    done = loop.create_future()

    def readable() -> None:
        try:
            data = os.read(fd, 65536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if data:
            chunks.append(data)
        elif not done.done():
            done.set_result(None)

    loop.add_reader(fd, readable)
    try:
        await done
    finally:
        loop.remove_reader(fd)
        os.close(fd)
    return b"".join(chunks)


async def run(
    rt: SandboxRuntime,
    argv: list[str],
    *,
    stdin: bytes = b"",
    env: dict[str, str] | None = None,
    timeout: float = 20.0,
) -> Result:
    """Run a command in the sandbox with pipes; collect its output and exit status."""
    proc = await rt.spawn(ProcessSpec(argv=argv, env=env or {}))
    return await collect(proc, stdin=stdin, timeout=timeout)


async def collect(proc: SandboxProcess, *, stdin: bytes = b"", timeout: float = 20.0) -> Result:
    assert proc.stdin_fd is not None and proc.stdout_fd is not None and proc.stderr_fd is not None
    os.set_blocking(proc.stdin_fd, True)
    if stdin:
        os.write(proc.stdin_fd, stdin)
    os.close(proc.stdin_fd)
    out, err, status = await asyncio.wait_for(
        asyncio.gather(_drain(proc.stdout_fd), _drain(proc.stderr_fd), proc.wait()), timeout
    )
    return Result(status, out.decode(errors="replace"), err.decode(errors="replace"))


@pytest.fixture(scope="session")
def shared_root() -> Iterator[Path]:
    # 0700, like a home directory: the sandbox uids cannot walk in by themselves.
    path = Path(tempfile.mkdtemp(prefix="sandlot-rt-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def data_dir(shared_root: Path, request: pytest.FixtureRequest) -> Path:
    require_isolation()
    return Path(tempfile.mkdtemp(prefix="t-", dir=shared_root))


@pytest.fixture
def settings(shared_root: Path, data_dir: Path) -> RuntimeSettings:
    # One run dir for the session: its generated /etc and init binary are built once.
    # Every test leaves it empty (the manager fixture destroys what is left).
    return RuntimeSettings(
        run_dir=shared_root / "run",
        workspaces_dir=data_dir / "workspaces",
        volumes_dir=data_dir / "volumes",
    )


@pytest.fixture
async def manager(settings: RuntimeSettings) -> AsyncIterator[LocalRuntimeManager]:
    mgr = LocalRuntimeManager(settings)
    mgr.preflight()
    yield mgr
    await mgr.cleanup_leftovers(set())


@pytest.fixture
def template() -> Template:
    return Template(
        name="test",
        image="host",
        resources=Resources(cpu=1.0, memory_mb=256, pids=128),
        env={"SANDBOX_GREETING": "hello"},
    )


@pytest.fixture
async def sandbox(manager: LocalRuntimeManager, template: Template) -> SandboxRuntime:
    return await manager.create("sb-test", 1, template, {})
