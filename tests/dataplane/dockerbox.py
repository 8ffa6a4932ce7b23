"""Sandboxes in containers for the dataplane suite's ``docker`` variant.

:class:`Boxes` runs the docker provider and its relay (``tests/providers/dockerharness.py``)
on an event loop of its own thread, for the whole session, and hands each test a fresh
sandbox: one is always being created ahead while a test runs, and a used one is deleted
in the background, so a test waits for neither. The sandbox's workspace volume is
reachable from the test (root) at its mount point on the host; a default ACL on it lets
the sandbox's user (uid 1000) change what the test puts there, as a test running the
local variant can.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import struct
import tempfile
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from sandlot.protocol.states import SandboxState
from sandlot.protocol.tokens import RevokedToken
from tests.dockerengine import SANDBOX_UID, Engine
from tests.providers.dockerharness import Harness, serving

SHELLS = {"default": ["/bin/bash", "--norc", "--noprofile", "-i"], "sh": ["/bin/sh"]}

_ACL_USER_OBJ, _ACL_USER, _ACL_GROUP_OBJ, _ACL_MASK, _ACL_OTHER = 0x01, 0x02, 0x04, 0x10, 0x20
_NO_ID = 0xFFFFFFFF


def grant_sandbox_user(path: Path) -> None:
    """``path`` and whatever is created in it later are the sandbox user's to change (the
    access and default POSIX ACLs, written as the kernel's ``system.posix_acl_*``)."""
    entries = [
        (_ACL_USER_OBJ, 7, _NO_ID),
        (_ACL_USER, 7, SANDBOX_UID),
        (_ACL_GROUP_OBJ, 5, _NO_ID),
        (_ACL_MASK, 7, _NO_ID),
        (_ACL_OTHER, 5, _NO_ID),
    ]
    acl = struct.pack("<I", 2) + b"".join(struct.pack("<HHI", *e) for e in entries)
    os.setxattr(path, "system.posix_acl_access", acl)
    os.setxattr(path, "system.posix_acl_default", acl)


class Boxes:
    """The provider on its own loop, and a sandbox always ready for the next test."""

    def __init__(self, engine: Engine, image: str) -> None:
        self.engine = engine
        self.image = image
        self._dir = tempfile.TemporaryDirectory(prefix="sl-dpsuite-")
        self._ids = (f"sb_suite{n}" for n in itertools.count())
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self.loop = asyncio.new_event_loop()
        self.harness: Harness | None = None
        self._next: Future[str] | None = None
        self._deletes: list[Future[None]] = []
        self._thread = threading.Thread(target=self._run, name="dp-suite-docker", daemon=True)
        self._thread.start()
        if not self._ready.wait(120):
            raise RuntimeError("the docker provider did not start")
        if self.harness is None:
            raise RuntimeError("the docker provider failed to start")

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self._serve())
        finally:
            self.loop.close()

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        try:
            async with serving(self.engine, self.image, Path(self._dir.name)) as h:
                self.harness = h
                self._ready.set()
                await self._stop.wait()
        finally:
            self._ready.set()

    def _submit(self, coro: Any) -> Future[Any]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    async def _create(self) -> str:
        assert self.harness is not None
        sid = next(self._ids)
        await self.harness.create(sid, shells=SHELLS)
        return sid

    def take(self) -> str:
        """A sandbox just created for the caller (and the next one started)."""
        pending = self._next or self._submit(self._create())
        sid: str = pending.result(180)
        self._next = self._submit(self._create())
        return sid

    def release(self, sandbox_id: str) -> None:
        assert self.harness is not None
        self._deletes.append(self._submit(self.harness.provider.delete(sandbox_id)))

    def workspace(self, sandbox_id: str) -> Path:
        """The sandbox's workspace volume, as the host sees it."""
        assert self.harness is not None
        name = self.harness.provider._volume_name(sandbox_id)
        path = Path(self.engine.client.volumes.get(name).attrs["Mountpoint"])
        grant_sandbox_user(path)
        return path

    def state(self, sandbox_id: str) -> SandboxState:
        assert self.harness is not None
        status = self._submit(self.harness.provider.status(sandbox_id)).result(30)
        return status.state

    def last_sequence(self, sandbox_id: str) -> int:
        assert self.harness is not None
        status = self._submit(self.harness.provider.status(sandbox_id)).result(30)
        return status.last_event_sequence

    def revoke(self, sandbox_id: str, tokens: list[RevokedToken]) -> None:
        assert self.harness is not None
        self._submit(self.harness.provider.revoke(sandbox_id, tokens)).result(30)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            if self._next is not None:
                self.release(self._next.result(180))
        for done in self._deletes:
            with contextlib.suppress(Exception):
                done.result(60)
        if self._stop is not None:
            self.loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(60)
        self._dir.cleanup()


@contextlib.contextmanager
def boxes(engine: Engine, image: str) -> Iterator[Boxes]:
    found = Boxes(engine, image)
    try:
        yield found
    finally:
        found.close()
