"""A glob's helper process works inside the sandbox's cgroup, and leaves it afterwards.

The walk is work done for the sandbox, so the sandbox's CPU, memory and pid limits
bound it as they bound its commands (issue 17: every process started on a sandbox's
behalf runs under its limits). The helpers are the server's, shared by all sandboxes:
each one moves in for a request and back out when it has answered.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

from sandlot.dataplane.services.fsops import FileOps
from sandlot.dataplane.services.paths import PathResolver
from sandlot.runtime.base import SandboxRuntime
from sandlot.runtime.isolated import IsolatedRuntime

FILES_PER_DIR = 400
DIRS = 10


def _tree(root: Path) -> None:
    for d in range(DIRS):
        sub = root / "tree" / f"d{d:03d}"
        sub.mkdir(parents=True)
        for f in range(FILES_PER_DIR):
            (sub / f"f{f:05d}.txt").touch()


def test_a_glob_helper_works_in_the_sandbox_cgroup_then_leaves_it(
    sandbox: SandboxRuntime,
) -> None:
    assert isinstance(sandbox, IsolatedRuntime)
    _tree(sandbox.workspace)
    charge = sandbox.helper_charge()
    files = FileOps(
        PathResolver(sandbox.mounts()),
        max_read_bytes=1 << 20,
        max_write_bytes=1 << 20,
        max_list_entries=10_000,
        max_glob_results=1_000_000,
        charge=(charge.enter, charge.leave),
    )
    before = set(sandbox.cgroup.pids())
    seen: dict[int, tuple[int, bytes]] = {}
    done = threading.Event()

    def watch() -> None:
        # Every process the sandbox's cgroup holds while the walk runs, and its command.
        while not done.is_set():
            for pid in set(sandbox.cgroup.pids()) - before - set(seen):
                try:
                    stat = Path(f"/proc/{pid}/stat").read_text()
                    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
                except FileNotFoundError:
                    continue
                seen[pid] = (int(stat.rsplit(")", 1)[1].split()[1]), cmdline)
            time.sleep(0.001)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        for _ in range(2):
            result = files.glob("**/*.txt", "/workspace")
            assert len(result["matches"]) == DIRS * FILES_PER_DIR
    finally:
        done.set()
        watcher.join()
    helpers = {
        pid for pid, (_, cmdline) in seen.items() if b"dataplane.services.globworker" in cmdline
    }
    assert helpers, "no glob helper was seen in the sandbox's cgroup while it walked"
    # Nothing else but the helpers and what they start (``ldconfig``, for ctypes).
    assert all(pid in helpers or ppid in helpers for pid, (ppid, _) in seen.items()), seen
    # Done: back in the server's cgroup, whatever it serves next.
    assert not helpers & set(sandbox.cgroup.pids())
