"""One running isolated sandbox: its record on disk, and how the dataplane uses it."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from sandlot.protocol.states import SandboxState
from sandlot.protocol.templates import Template
from sandlot.runtime.base import (
    WORKSPACE,
    ExitStatus,
    HelperCharge,
    Keep,
    KeptProcess,
    Mount,
    ProcessSpec,
    SandboxProcess,
    SandboxRuntime,
)
from sandlot.runtime.bwrap import SANDBOX_USER, image_entries
from sandlot.runtime.cgroups import SandboxCgroup, own_cgroup
from sandlot.runtime.control import (
    INIT_PROTOCOL,
    ControlSocketError,
    adopt_kept,
    forget_kept,
    list_kept,
    record_kept,
    release_kept,
    spawn_via_init,
)
from sandlot.runtime.disk import DiskManager

BASE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


@dataclass
class SandboxRecord:
    """What survives a server restart about one sandbox (``state.json``)."""

    generation: int
    mode: str
    uid: int
    gid: int
    workspace: str
    image: str
    #: ``[sandbox path, host path, writable]``
    volumes: list[tuple[str, str, bool]] = field(default_factory=list)
    #: The host directory of ``/tmp`` (``""``: ``run_dir/<id>/tmp``).
    tmp: str = ""
    #: Size of the sandbox's disk (``disk.py``) holding the workspace and ``/tmp``; 0: none.
    disk_mb: int = 0
    #: The control protocol its init speaks (a sandbox started by an older version: 1).
    init_protocol: int = 1

    @classmethod
    def load(cls, path: Path) -> SandboxRecord | None:
        try:
            data = json.loads(path.read_text())
            data["volumes"] = [tuple(v) for v in data.get("volumes", [])]
            return cls(**data)
        except (OSError, ValueError, TypeError):
            return None

    def tmp_dir(self, run: Path) -> Path:
        """The host directory of the sandbox's ``/tmp`` (``run`` is its run directory)."""
        return Path(self.tmp) if self.tmp else run / "tmp"

    def save(self, path: Path) -> None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self)))
        tmp.replace(path)


def _oom_aware(cgroup: SandboxCgroup, before: int) -> Callable[[ExitStatus], ExitStatus]:
    def on_exit(status: ExitStatus) -> ExitStatus:
        killed = status.signal == "SIGKILL" or status.exit_code == 137
        if killed and cgroup.oom_kills() > before:
            return ExitStatus(exit_code=status.exit_code, signal=status.signal, oom_killed=True)
        return status

    return on_exit


class IsolatedRuntime(SandboxRuntime):
    """A running isolated sandbox, as the dataplane uses it."""

    def __init__(
        self,
        sandbox_id: str,
        generation: int,
        template: Template,
        *,
        record: SandboxRecord,
        run: Path,
        cgroup: SandboxCgroup,
        init_pid: int,
    ) -> None:
        self.sandbox_id = sandbox_id
        self.generation = generation
        self.template = template
        self.init_pid = init_pid
        self.cgroup = cgroup
        self._record = record
        self._run = run
        self._state = SandboxState.ACTIVE
        self._loop = asyncio.get_running_loop()
        self._pidfd: int | None = os.pidfd_open(init_pid)
        self._loop.add_reader(self._pidfd, self._init_exited)
        # sun_path holds 108 bytes; a deep data directory is reached through a dir fd.
        self._run_fd = os.open(run, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        path = run / "ctl"
        self._control = path if len(str(path)) < 100 else Path(f"/proc/self/fd/{self._run_fd}/ctl")

    def _init_exited(self) -> None:
        if self._state.live:
            self._state = SandboxState.FAILED
        self.close()

    def close(self) -> None:
        """Stop watching the sandbox (it keeps running; a new manager may adopt it)."""
        if self._pidfd is not None:
            with contextlib.suppress(RuntimeError):  # the loop may be closed already
                self._loop.remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = None
        if self._run_fd >= 0:
            os.close(self._run_fd)
            self._run_fd = -1

    @property
    def state(self) -> SandboxState:
        return self._state

    @state.setter
    def state(self, value: SandboxState) -> None:
        self._state = value

    @property
    def uid(self) -> int:
        return self._record.uid

    @property
    def fs_ids(self) -> tuple[int, int] | None:
        return (self._record.uid, self._record.gid)

    def mounts(self) -> list[Mount]:
        mounts = [
            Mount(WORKSPACE, Path(self._record.workspace), True),
            Mount("/tmp", self._record.tmp_dir(self._run), True),
        ]
        mounts += [Mount(p, Path(h), w) for p, h, w in self._record.volumes if p != WORKSPACE]
        if self._record.image == "host":
            mounts += [Mount(p, h, False) for p, h in image_entries("host")]
        else:
            mounts.append(Mount("/", Path(self._record.image), False))
        return mounts

    def disk_usage(self) -> tuple[int, int] | None:
        if not self._record.disk_mb:
            return None
        return DiskManager.usage(self._record.tmp_dir(self._run))

    def helper_charge(self) -> HelperCharge:
        return HelperCharge(self.cgroup.admit, _server_cgroup().admit)

    def environment(self, spec: ProcessSpec) -> dict[str, str]:
        env = {
            "PATH": BASE_PATH,
            "HOME": WORKSPACE,
            "USER": SANDBOX_USER,
            "LOGNAME": SANDBOX_USER,
            "LANG": "C.UTF-8",
            **self.template.env,
            **spec.env,
        }
        if spec.pty is not None:
            env.setdefault("TERM", "xterm-256color")
        return env

    async def spawn(self, spec: ProcessSpec, keep: Keep | None = None) -> SandboxProcess:
        if not self._state.live:
            raise ControlSocketError(f"sandbox {self.sandbox_id} is {self._state.value}")
        if not spec.argv:
            raise ValueError("empty argv")
        on_exit = _oom_aware(self.cgroup, self.cgroup.oom_kills())
        legacy = self._record.init_protocol < INIT_PROTOCOL
        return await spawn_via_init(
            self._control, spec, self.environment(spec), on_exit, keep, legacy=legacy
        )

    @property
    def keeps_processes(self) -> bool:
        # An init started by an older version keeps nothing (until the sandbox is recreated).
        return self._record.init_protocol >= INIT_PROTOCOL

    @property
    def spool_dir(self) -> Path:
        return self._run / "spool"

    async def kept(self) -> list[KeptProcess]:
        return await list_kept(self._control)

    async def adopt(self, tag: int) -> SandboxProcess:
        # The OOM count from now on: a kill meanwhile is told by the exit status alone.
        return await adopt_kept(
            self._control, tag, _oom_aware(self.cgroup, self.cgroup.oom_kills())
        )

    async def forget(self, tag: int) -> None:
        await forget_kept(self._control, tag)

    async def release_held(self, tag: int) -> None:
        await release_kept(self._control, tag)

    async def update_record(self, tag: int, record: bytes) -> None:
        await record_kept(self._control, tag, record)


@functools.cache
def _server_cgroup() -> SandboxCgroup:
    """Where helper processes go back to when they are done with a sandbox."""
    return own_cgroup()


def find_init(cgroup: SandboxCgroup) -> int | None:
    """Host pid of the sandbox's init: the cgroup member that is pid 1 of a child pid ns."""
    for pid in cgroup.pids():
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("NSpid:"):
                ids = line.split()[1:]
                if len(ids) > 1 and ids[-1] == "1":
                    return pid
    return None
