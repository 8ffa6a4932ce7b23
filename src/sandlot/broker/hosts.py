"""Which sandbox host a broker process is, when several share one store.

A provider that runs sandboxes on the machine of the process (``local``, and
``remote``, through which ``--workers`` reach their server's sandbox host)
makes sandboxes only that machine can reach: another replica's provider does
not know them. Each such sandbox records its *host* in the store, and only
processes of that host re-adopt it at start, watch its activity, reap it, and
finish its teardown. Without this, every replica took the others' sandboxes
for vanished ones and ended them (and their bindings).

A host is its data directory: the server and its worker processes share one,
and two replicas never do. The id is made once and kept in the directory.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path

HOST_ID_FILE = "host-id"


def host_id(data_dir: Path) -> str:
    """The id of the host whose data directory is ``data_dir`` (made on first use)."""
    path = data_dir / HOST_ID_FILE
    with contextlib.suppress(FileNotFoundError):
        found = path.read_text().strip()
        if found:
            return found
    data_dir.mkdir(parents=True, exist_ok=True)
    made = f"h_{secrets.token_hex(8)}"
    tmp = data_dir / f".{HOST_ID_FILE}.{os.getpid()}.{secrets.token_hex(4)}"
    tmp.write_text(made + "\n")
    try:
        # A link fails if another process made the id first: then that one is the id.
        os.link(tmp, path)
    except FileExistsError:
        return path.read_text().strip()
    finally:
        tmp.unlink()
    return made
