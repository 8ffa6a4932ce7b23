"""Per-sandbox cgroups: limits, freezer, OOM counter and teardown (v2, or v1 controllers).

A sandbox's cgroup lives at ``<hierarchy>/sandlot-<tag>/<sandbox_id>`` in each
hierarchy used (one on v2; memory, pids, cpu and freezer on v1), where ``tag``
tells apart the servers (data directories) sharing a host, so that one
server's clean-up never touches another's sandboxes.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
V1_CONTROLLERS = ("memory", "pids", "cpu", "freezer")
V2_CONTROLLERS = ("memory", "pids", "cpu")
CPU_PERIOD_US = 100_000


class CgroupError(Exception):
    """The cgroup hierarchy is missing, or not writable by this process."""


@dataclass(frozen=True)
class Limits:
    memory_bytes: int
    pids: int
    cpu: float


def _own_cgroup(controller: str) -> str:
    """This process's cgroup path in the hierarchy of ``controller`` (``""``: v2)."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if (controller == "" and controllers == "") or (
            controller and controller in controllers.split(",")
        ):
            return path
    return "/"


def _v1_mounts() -> dict[str, Path]:
    mounts: dict[str, Path] = {}
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        pre, _, post = line.partition(" - ")
        fields = post.split()
        if len(fields) < 3 or fields[0] != "cgroup":
            continue
        mountpoint = Path(pre.split()[4])
        for option in fields[2].split(","):
            if option in V1_CONTROLLERS and option not in mounts:
                mounts[option] = mountpoint
    return mounts


class CgroupLayout:
    """Where this server's sandbox cgroups live, and how to drive them."""

    def __init__(self, tag: str) -> None:
        self.tag = tag
        self.version = 2 if (CGROUP_ROOT / "cgroup.controllers").exists() else 1
        self.parents: dict[str, Path] = {}
        if self.version == 2:
            own = _own_cgroup("")
            # Root may use the top; otherwise the delegated parent of our own cgroup
            # (a v2 cgroup with processes in it cannot enable controllers below).
            base = CGROUP_ROOT if os.geteuid() == 0 else (CGROUP_ROOT / own.lstrip("/")).parent
            self.parents["unified"] = base / f"sandlot-{tag}"
        else:
            mounts = _v1_mounts()
            missing = [c for c in V1_CONTROLLERS if c not in mounts]
            if missing:
                raise CgroupError(
                    "cgroup v1 controllers not mounted: "
                    + ", ".join(missing)
                    + " (mount them under /sys/fs/cgroup, or boot with cgroup v2)"
                )
            for controller in V1_CONTROLLERS:
                base = mounts[controller]
                if os.geteuid() != 0:
                    base = base / _own_cgroup(controller).lstrip("/")
                self.parents[controller] = base / f"sandlot-{tag}"

    def ensure_parents(self) -> None:
        for key, parent in self.parents.items():
            try:
                parent.mkdir(exist_ok=True)
            except OSError as exc:
                raise CgroupError(f"cannot create {parent}: {exc.strerror}") from exc
            if key == "unified":
                self._enable_v2_controllers(parent)

    @staticmethod
    def _enable_v2_controllers(parent: Path) -> None:
        for level in (parent.parent, parent):
            available = set((level / "cgroup.controllers").read_text().split())
            wanted = [c for c in V2_CONTROLLERS if c in available]
            missing = set(V2_CONTROLLERS) - available
            if missing:
                raise CgroupError(
                    f"cgroup v2 controllers not available in {level}: {', '.join(sorted(missing))}"
                )
            try:
                (level / "cgroup.subtree_control").write_text(" ".join(f"+{c}" for c in wanted))
            except OSError as exc:
                raise CgroupError(
                    f"cannot enable controllers in {level}/cgroup.subtree_control: {exc.strerror}"
                ) from exc

    def remove_parents_if_empty(self) -> None:
        """Remove this server's parent cgroups once no sandbox is left under them."""
        for parent in self.parents.values():
            with contextlib.suppress(OSError):  # busy (sandboxes left) or already gone
                parent.rmdir()

    def sandbox(self, sandbox_id: str) -> SandboxCgroup:
        return SandboxCgroup(self.version, {k: p / sandbox_id for k, p in self.parents.items()})

    def existing(self) -> set[str]:
        names: set[str] = set()
        for parent in self.parents.values():
            with contextlib.suppress(FileNotFoundError):
                names.update(e.name for e in os.scandir(parent) if e.is_dir())
        return names

    def other_tags(self) -> set[str]:
        """Tags of the other servers with sandbox cgroups on this host."""
        tags: set[str] = set()
        for parent in self.parents.values():
            with contextlib.suppress(FileNotFoundError):
                tags.update(
                    e.name.removeprefix("sandlot-")
                    for e in os.scandir(parent.parent)
                    if e.is_dir() and e.name.startswith("sandlot-")
                )
        tags.discard(self.tag)
        return tags


def own_cgroup() -> SandboxCgroup:
    """This process's own cgroup (in each hierarchy a sandbox's would use)."""
    if (CGROUP_ROOT / "cgroup.controllers").exists():
        return SandboxCgroup(2, {"unified": CGROUP_ROOT / _own_cgroup("").lstrip("/")})
    mounts = _v1_mounts()
    return SandboxCgroup(
        1, {c: mounts[c] / _own_cgroup(c).lstrip("/") for c in V1_CONTROLLERS if c in mounts}
    )


class SandboxCgroup:
    """The cgroup (one directory per hierarchy) of one sandbox."""

    def __init__(self, version: int, dirs: dict[str, Path]) -> None:
        self.version = version
        self.dirs = dirs

    def _dir(self, key: str) -> Path:
        return self.dirs["unified" if self.version == 2 else key]

    @property
    def procs_files(self) -> list[Path]:
        return [d / "cgroup.procs" for d in self.dirs.values()]

    def admit(self, pid: int) -> None:
        """Move the process ``pid`` into this cgroup (in every hierarchy)."""
        for procs in self.procs_files:
            procs.write_text(str(pid))

    def exists(self) -> bool:
        return any(d.is_dir() for d in self.dirs.values())

    def create(self, limits: Limits) -> None:
        for d in self.dirs.values():
            d.mkdir(exist_ok=True)
        quota = max(1000, int(limits.cpu * CPU_PERIOD_US))
        if self.version == 2:
            d = self.dirs["unified"]
            (d / "memory.max").write_text(str(limits.memory_bytes))
            with contextlib.suppress(FileNotFoundError):
                (d / "memory.swap.max").write_text("0")
            (d / "pids.max").write_text(str(limits.pids))
            (d / "cpu.max").write_text(f"{quota} {CPU_PERIOD_US}")
            return
        mem = self.dirs["memory"]
        (mem / "memory.limit_in_bytes").write_text(str(limits.memory_bytes))
        # Without swap accounting a hog would page out instead of being stopped.
        with contextlib.suppress(FileNotFoundError):
            (mem / "memory.memsw.limit_in_bytes").write_text(str(limits.memory_bytes))
        (self.dirs["pids"] / "pids.max").write_text(str(limits.pids))
        cpu = self.dirs["cpu"]
        (cpu / "cpu.cfs_period_us").write_text(str(CPU_PERIOD_US))
        (cpu / "cpu.cfs_quota_us").write_text(str(quota))

    def pids(self) -> list[int]:
        try:
            text = (self._dir("freezer") / "cgroup.procs").read_text()
        except FileNotFoundError:
            return []
        return [int(p) for p in text.split()]

    def oom_kills(self) -> int:
        """How many processes the OOM killer ended in this cgroup so far."""
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        try:
            text = (self._dir("memory") / name).read_text()
        except FileNotFoundError:
            return 0
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    # --- freezer -------------------------------------------------------------------

    def _write_freeze(self, frozen: bool) -> None:
        if self.version == 2:
            (self.dirs["unified"] / "cgroup.freeze").write_text("1" if frozen else "0")
        else:
            (self.dirs["freezer"] / "freezer.state").write_text("FROZEN" if frozen else "THAWED")

    def is_frozen(self) -> bool:
        if self.version == 2:
            events = (self.dirs["unified"] / "cgroup.events").read_text()
            return "frozen 1" in events
        return (self.dirs["freezer"] / "freezer.state").read_text().strip() == "FROZEN"

    async def freeze(self, timeout: float = 5.0) -> None:
        self._write_freeze(True)
        deadline = time.monotonic() + timeout
        delay = 0.0001
        while not self.is_frozen():
            if time.monotonic() > deadline:
                raise TimeoutError("cgroup did not freeze")
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.01)

    def thaw(self) -> None:
        self._write_freeze(False)

    # --- teardown ------------------------------------------------------------------

    async def kill_all(self, timeout: float = 5.0) -> None:
        """Kill every process of the cgroup, including ones forking right now."""
        if not self.exists():
            return
        if self.version == 2 and (self.dirs["unified"] / "cgroup.kill").exists():
            (self.dirs["unified"] / "cgroup.kill").write_text("1")
        else:
            # Frozen processes cannot fork away from the kill; SIGKILL lands on thaw.
            with contextlib.suppress(TimeoutError, FileNotFoundError):
                await self.freeze(timeout=1.0)
            for pid in self.pids():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(FileNotFoundError):
                self.thaw()
        deadline = time.monotonic() + timeout
        delay = 0.0002
        while self.pids():
            if time.monotonic() > deadline:
                raise TimeoutError(f"processes survived SIGKILL in {self._dir('freezer')}")
            for pid in self.pids():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.02)

    async def remove(self, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        for d in self.dirs.values():
            while True:
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError as exc:
                    # Exiting processes leave the cgroup a moment after they vanish from procs.
                    if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                        raise
                    await asyncio.sleep(0.001)
