"""A sandbox's full disk, reported in its event log (PROTOCOL.md 3.7, a ``service`` detail).

The kernel tells only the writer that a filesystem is full (ENOSPC). So the
dataplane looks: every :attr:`DiskMonitor.POLL_SECONDS` it reads the free
space of the sandbox's size-limited disk (one ``statvfs``, about a
microsecond), and a write through the API that fails for lack of space
reports at once (its partial file is gone by the time of the next look).

``service.disk_full`` when less than ``max(1 MiB, 1 %)`` is free, or an API
write got ENOSPC; ``service.disk_available`` once 10 % is free again (the gap
keeps a disk hovering at its limit from flapping). Details:
``{"name": "disk", "status": "full"|"available", "size_bytes", "free_bytes",
"source": "watch"|"api"}``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

Usage = Callable[[], "tuple[int, int] | None"]
Emit = Callable[[str, str, dict[str, Any]], int]


class DiskMonitor:
    POLL_SECONDS = 1.0

    def __init__(self, usage: Usage, emit: Emit) -> None:
        self.usage = usage
        self._emit = emit
        self._full = False
        self._timer: asyncio.TimerHandle | None = None

    def start(self) -> None:
        """Start looking (idempotent; needs the running event loop)."""
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.POLL_SECONDS, self._tick)

    def _tick(self) -> None:
        self._timer = None
        try:
            self.check()
        except OSError:
            return  # the disk is gone (the sandbox is being deleted)
        self.start()

    def check(self) -> None:
        found = self.usage()
        if found is None:
            return
        size, free = found
        if not self._full and free < max(1 << 20, size // 100):
            self._report("full", size, free, "watch")
        elif self._full and free >= size // 10:
            self._report("available", size, free, "watch")

    def write_failed(self) -> None:
        """A write through the API got ENOSPC."""
        if self._full:
            return
        found = None
        with contextlib.suppress(OSError):
            found = self.usage()
        size, free = found or (0, 0)
        self._report("full", size, free, "api")

    def _report(self, status: str, size: int, free: int, source: str) -> None:
        self._full = status == "full"
        self._emit(
            f"service.disk_{status}",
            "service",
            {
                "name": "disk",
                "status": status,
                "size_bytes": size,
                "free_bytes": free,
                "source": source,
            },
        )

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
