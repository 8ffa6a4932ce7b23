"""Which sandbox host a broker process is, when several share one store.

A provider that runs sandboxes on the machine of the process (``local``, and
``remote``, through which ``--workers`` reach their server's sandbox host)
makes sandboxes only that machine can reach: another replica's provider does
not know them. Each such sandbox records its *host* in the store, and only
processes of that host re-adopt it at start, watch its activity, reap it, and
finish its teardown. Without this, every replica took the others' sandboxes
for vanished ones and ended them (and their bindings).

A host is its data directory: the server and its worker processes share one,
and two replicas never do. The id is made once and kept in the directory, and so is
the credential its provider API asks for (:func:`host_credential`), which other
processes read from the host's row in the store to act on its sandboxes.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Callable
from pathlib import Path

HOST_ID_FILE = "host-id"
CREDENTIAL_FILE = "host-credential"


def host_id(data_dir: Path) -> str:
    """The id of the host whose data directory is ``data_dir`` (made on first use)."""
    return _kept_once(data_dir / HOST_ID_FILE, lambda: f"h_{secrets.token_hex(8)}")


def _kept_once(path: Path, make: Callable[[], str], mode: int = 0o644) -> str:
    """The value kept in ``path``, or one made by ``make`` and kept there (file ``mode``):
    processes starting at once all answer the first one's, since a link fails if another
    process linked first."""
    with contextlib.suppress(FileNotFoundError):
        kept = path.read_text().strip()
        if kept:
            return kept
    path.parent.mkdir(parents=True, exist_ok=True)
    made = make()
    tmp = path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "w") as f:
        f.write(made + "\n")
    try:
        os.link(tmp, path)
    except FileExistsError:
        return path.read_text().strip()
    finally:
        tmp.unlink()
    return made


def host_credential(data_dir: Path, given: Path | None = None) -> str:
    """The secret of the provider API of the host whose data directory is ``data_dir``:
    the file ``given``, ``SANDLOT_HOST_CREDENTIAL``, or one made once and kept in
    ``DATA_DIR/host-credential`` (mode 0600)."""
    from sandlot.broker.settings import ConfigError

    if given is not None:
        value = given.read_text().strip()
        if len(value) < 16:
            raise ConfigError(f"the credential in {given} must be at least 16 characters")
        return value
    if os.environ.get("SANDLOT_HOST_CREDENTIAL"):
        value = os.environ["SANDLOT_HOST_CREDENTIAL"].strip()
        if len(value) < 16:
            raise ConfigError("SANDLOT_HOST_CREDENTIAL must be at least 16 characters")
        return value
    return _kept_once(data_dir / CREDENTIAL_FILE, lambda: secrets.token_urlsafe(32), 0o600)
