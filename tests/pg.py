"""A throwaway PostgreSQL cluster for tests (Debian's PostgreSQL, run as the postgres user)."""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator

import pytest


def _bin(name: str) -> str | None:
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    return found[-1] if found else shutil.which(name)


def _as_postgres(argv: list[str]) -> list[str]:
    if os.geteuid() == 0:
        return ["runuser", "-u", "postgres", "--", *argv]
    return argv


@contextlib.contextmanager
def postgres_cluster(options: str = "") -> Iterator[str]:
    """Yield a SQLAlchemy URL of a fresh database; fails in CI if PostgreSQL is missing.
    ``options``: more server settings (``-c name=value …``)."""
    initdb, pg_ctl = _bin("initdb"), _bin("pg_ctl")
    if initdb is None or pg_ctl is None:
        if os.environ.get("CI"):
            pytest.fail("PostgreSQL is not installed (apt-get install postgresql)")
        pytest.skip("PostgreSQL is not installed")
    base = tempfile.mkdtemp(prefix="sandlot-pg-")
    os.chmod(base, 0o755)
    data = os.path.join(base, "data")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    if os.geteuid() == 0:
        shutil.chown(base, "postgres", "postgres")
    subprocess.run(
        _as_postgres([initdb, "-D", data, "-U", "postgres", "--auth=trust", "-E", "UTF8"]),
        check=True,
        capture_output=True,
    )
    opts = (
        f"-c listen_addresses=127.0.0.1 -p {port} -k {base} -c fsync=off "
        f"-c max_connections=300 {options}"
    )
    subprocess.run(
        _as_postgres(
            [pg_ctl, "-D", data, "-o", opts, "-l", os.path.join(base, "log"), "-w", "start"]
        ),
        check=True,
        capture_output=True,
    )
    try:
        url = f"postgresql://postgres@127.0.0.1:{port}/postgres"
        deadline = time.monotonic() + 10
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        yield url
    finally:
        subprocess.run(
            _as_postgres([pg_ctl, "-D", data, "-m", "immediate", "stop"]), capture_output=True
        )
        shutil.rmtree(base, ignore_errors=True)


@contextlib.contextmanager
def on_store(config: str, store: str) -> Iterator[str]:
    """A server's ``config`` for ``store``: as is (SQLite in its data directory), or
    pointed at a fresh PostgreSQL (``postgresql``), for tests run on both."""
    if store == "sqlite":
        yield config
        return
    with postgres_cluster() as url:
        yield config + f'\n[server]\nstore_url = "{url}"\n'
