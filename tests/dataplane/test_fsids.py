"""Cheap file operations run inline, as the sandbox user, and give the thread its identity back."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from sandlot.dataplane.services.fsids import FsExecutor, run_as

NOBODY = (65534, 65534)

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="acting as another uid needs root (CI runs as root)"
)


def identity() -> tuple[int, int, str]:
    """This thread's filesystem uid and gid, and its supplementary groups."""
    status = Path("/proc/thread-self/status").read_text().splitlines()
    fields = dict(line.split(":", 1) for line in status if ":" in line)
    return (
        int(fields["Uid"].split()[3]),
        int(fields["Gid"].split()[3]),
        fields["Groups"].strip(),
    )


def test_run_as_switches_and_restores(tmp_path: Path) -> None:
    own = identity()
    secret = tmp_path / "secret"
    secret.write_text("x")
    secret.chmod(0o600)
    assert run_as(*NOBODY, identity) == (*NOBODY, "")
    with pytest.raises(PermissionError):
        run_as(*NOBODY, secret.read_text)  # the server could; the sandbox user cannot
    assert identity() == own
    home = tmp_path / "home"
    home.mkdir()
    os.chown(home, *NOBODY)
    dfd = os.open(home, os.O_RDONLY | os.O_DIRECTORY)
    try:
        flags = os.O_CREAT | os.O_WRONLY
        os.close(run_as(*NOBODY, lambda: os.open("made", flags, 0o600, dir_fd=dfd)))
    finally:
        os.close(dfd)
    st = (home / "made").stat()
    assert (st.st_uid, st.st_gid) == NOBODY
    assert identity() == own
    assert secret.read_text() == "x"


async def test_light_runs_inline_as_the_sandbox_user() -> None:
    executor = FsExecutor(NOBODY)
    try:
        own = identity()
        here = threading.get_ident()
        seen = await executor.light(lambda: (threading.get_ident(), identity()))
        assert seen == (here, (*NOBODY, ""))
        assert identity() == own
        # Heavy operations run on the pool, whose threads switched once.
        thread, ids = await executor.heavy(lambda: (threading.get_ident(), identity()))
        assert thread != here and ids == (*NOBODY, "")
        assert identity() == own
    finally:
        executor.shutdown()
