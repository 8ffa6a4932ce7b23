"""The ordered per-sandbox event log (PROTOCOL.md 3.7) and the workspace watcher.

The dataplane issues the sequence. Events are kept in a bounded deque and
serialised once: when appended where there is a journal, else when first read (the
broker's relay appends two events per command, most of which nobody reads); a cursor
older than what is kept gets 410 SEQUENCE_EXPIRED. Where the sandbox has a directory
that outlives the server (an isolated sandbox's spool), each event is also appended
to a journal there, one line per event, so a restarted server carries on the same
sequence with the same retained events: a client's cursor stays valid across a crash.

Changes made by commands are picked up by the workspace's watcher
(:mod:`sandlot.dataplane.services.watch`: inotify, coalesced over
``watch_debounce_ms``); a change the API itself just made (reported with its
actor) is not reported a second time by the watcher.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sandlot.dataplane.services.watch import Tree, shared
from sandlot.protocol.common import Actor
from sandlot.protocol.errors import SequenceExpired

log = logging.getLogger("sandlot.dataplane.services.events")


JOURNAL = "events.jsonl"


def expired_event(exc: SequenceExpired) -> bytes:
    """The SSE ``error`` event that ends a stream whose reader fell further behind than
    the log keeps: the error envelope's fields, the oldest kept sequence among them (a
    client carries on from there, knowing what it missed)."""
    body = {
        "code": exc.wire_code,
        "message": exc.message,
        "retryable": False,
        "metadata": exc.metadata,
    }
    return f"event: error\ndata: {json.dumps(body)}\n\n".encode()


#: The second an event's timestamp was last formatted in, and its text up to the second.
_stamp_second: tuple[int, str] = (-1, "")


def timestamp(now: float) -> str:
    """``now`` as RFC 3339 UTC with milliseconds (what :func:`rfc3339` gives), the text
    up to the second formatted once per second."""
    global _stamp_second
    second = int(now)
    cached, prefix = _stamp_second
    if second != cached:
        prefix = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
        _stamp_second = (second, prefix)
    return f"{prefix}.{min(int((now - second) * 1000), 999):03d}Z"


class _Entry:
    """One kept event: its JSON text, or, until it is first read, the event itself."""

    __slots__ = ("event", "event_type", "line", "sequence")

    def __init__(
        self, sequence: int, event_type: str, line: str, event: dict[str, Any] | None = None
    ) -> None:
        self.sequence = sequence
        self.event_type = event_type
        self.line = line
        self.event: dict[str, Any] | None = event

    def text(self) -> str:
        if self.event is not None:
            self.line = json.dumps(self.event, separators=(",", ":"))
            self.event = None
        return self.line

    def parsed(self) -> dict[str, Any]:
        if self.event is not None:
            return self.event
        doc: dict[str, Any] = json.loads(self.line)
        return doc


class EventLog:
    def __init__(self, sandbox_id: str, retention: int, state: Callable[[], str]) -> None:
        self.sandbox_id = sandbox_id
        self._events: deque[_Entry] = deque(maxlen=retention)
        self._sequence = 0
        self._state = state
        self._listeners: set[asyncio.Event] = set()
        self._journal: Path | None = None
        self._journal_fd = -1
        self._journal_lines = 0
        #: Actors as JSON data, by what they are (an actor is serialised once, not per event).
        self._actors: dict[tuple[str, str], dict[str, Any]] = {}

    @property
    def last_sequence(self) -> int:
        return self._sequence

    @property
    def oldest_sequence(self) -> int:
        """The sequence of the oldest event kept (the next one's while none is)."""
        return self._events[0].sequence if self._events else self._sequence + 1

    def append(
        self, event_type: str, kind: str, details: dict[str, Any], actor: Actor | None = None
    ) -> int:
        event = {
            "event_id": "",
            "sequence": 0,
            "sandbox_id": self.sandbox_id,
            "event_type": event_type,
            "timestamp": timestamp(time.time()),
            "sandbox_state": self._state(),
            "actor": self._actor(actor) if actor is not None else None,
            "details": {kind: details},
        }
        return self._add(event)

    def _actor(self, actor: Actor) -> dict[str, Any]:
        key = (actor.type, actor.id)
        found = self._actors.get(key)
        if found is None:
            if len(self._actors) >= 1024:
                self._actors.clear()
            found = self._actors[key] = actor.model_dump(mode="json")
        return found

    def _add(self, event: dict[str, Any]) -> int:
        self._sequence += 1
        seq = self._sequence
        event["event_id"] = f"{self.sandbox_id}-{seq}"
        event["sequence"] = seq
        if self._journal_fd >= 0:
            line = json.dumps(event, separators=(",", ":"))
            self._events.append(_Entry(seq, event["event_type"], line))
            self._write_journal(line)
        else:
            self._events.append(_Entry(seq, event["event_type"], "", event))
        for ev in self._listeners:
            ev.set()
        return seq

    # --- the journal ---------------------------------------------------------------------

    def attach(self, directory: Path) -> None:
        """Keep the log in ``directory`` too, carrying on what a previous server left there.

        Events appended before (none, when a restarted server re-adopts a sandbox; the
        first phases of a new one) follow the journal's, renumbered.
        """
        if self._journal is not None:
            return
        path = directory / JOURNAL
        earlier: list[_Entry] = []
        lines, clean = 0, True
        with contextlib.suppress(FileNotFoundError), open(path, "rb") as f:
            for raw in f:
                lines += 1
                try:
                    event = json.loads(raw)
                    line = raw.decode().rstrip("\n")
                    earlier.append(_Entry(int(event["sequence"]), str(event["event_type"]), line))
                except (ValueError, KeyError, TypeError):
                    clean = False  # a torn last line (the host, not the server, crashed)
        pending = [entry.parsed() for entry in self._events]
        self._events.clear()
        self._events.extend(earlier)
        self._sequence = earlier[-1].sequence if earlier else 0
        try:
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            self._journal = path
            if clean and lines <= 2 * (self._events.maxlen or 0):
                # Appended to as it is: a restart does not rewrite a sound journal.
                self._journal_fd = os.open(
                    path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600
                )
                self._journal_lines = lines
            else:
                self._compact()
        except OSError as exc:
            log.warning("cannot keep the event log of %s: %s", self.sandbox_id, exc)
            self._journal = None
        for event in pending:
            self._add(event)

    def _write_journal(self, line: str) -> None:
        try:
            # One write per event on an O_APPEND fd: a crash never leaves half a line.
            os.write(self._journal_fd, line.encode() + b"\n")
        except OSError as exc:
            log.warning("event journal of %s: %s", self.sandbox_id, exc)
            return
        self._journal_lines += 1
        if self._journal_lines > 2 * (self._events.maxlen or 0):
            try:
                self._compact()
            except OSError as exc:
                log.warning("event journal of %s: %s", self.sandbox_id, exc)

    def _compact(self) -> None:
        """Rewrite the journal with the retained events only (atomically)."""
        assert self._journal is not None
        tmp = self._journal.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            data = "".join(entry.text() + "\n" for entry in self._events).encode()
            while data:
                data = data[os.write(fd, data) :]
        finally:
            os.close(fd)
        os.replace(tmp, self._journal)
        self.close()
        self._journal_fd = os.open(self._journal, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC, 0o600)
        self._journal_lines = len(self._events)

    def close(self) -> None:
        if self._journal_fd >= 0:
            os.close(self._journal_fd)
            self._journal_fd = -1

    def since(self, after: int) -> list[tuple[int, str, str]]:
        """Events with a sequence above ``after`` as ``(sequence, type, json)``."""
        if not self._events:
            return []
        first = self._events[0].sequence
        if after < first - 1:
            raise SequenceExpired(
                "events before this cursor are no longer kept",
                metadata={"oldest_sequence": first},
            )
        if after >= self._sequence:
            return []
        skip = after - first + 1
        kept = self._events
        return [
            (entry.sequence, entry.event_type, entry.text())
            for entry in (kept[i] for i in range(max(skip, 0), len(kept)))
        ]

    def listen(self, event: asyncio.Event) -> None:
        self._listeners.add(event)

    def unlisten(self, event: asyncio.Event) -> None:
        self._listeners.discard(event)


class WorkspaceWatcher:
    """Reports changes made inside the workspace by the sandbox's own processes."""

    #: Seconds during which a change made through the API hides the watcher's report of it.
    ECHO_WINDOW = 3.0

    def __init__(
        self,
        host_dir: Path,
        to_sandbox: Callable[[str], str | None],
        to_host: Callable[[str], str | None],
        log: EventLog,
        debounce_ms: int,
    ) -> None:
        self.host_dir = host_dir
        self.to_sandbox = to_sandbox
        self.to_host = to_host
        self.log = log
        self.debounce_ms = debounce_ms
        self._recent: dict[str, float] = {}
        self._trees: dict[str, float] = {}
        self._tree: Tree | None = None

    def start(self) -> None:
        """Start watching (idempotent; needs the running event loop)."""
        if self._tree is None:
            try:
                self._tree = shared().watch(
                    str(self.host_dir), self._report, max(self.debounce_ms, 1) / 1000
                )
            except OSError as exc:
                # Without a watcher the API's own changes are still reported.
                log.warning("cannot watch %s for changes: %s", self.host_dir, exc)

    def api_changed(self, sandbox_path: str) -> None:
        now = time.monotonic()
        self._recent[sandbox_path] = now + self.ECHO_WINDOW
        if len(self._recent) > 4096:
            self._recent = {p: t for p, t in self._recent.items() if t > now}

    def api_tree(self, sandbox_path: str, *, done: bool = False) -> None:
        """A whole tree is being written through the API (an archive): hide the
        watcher's reports under it until a moment after it is ``done``."""
        until = time.monotonic() + self.ECHO_WINDOW if done else float("inf")
        self._trees[sandbox_path.rstrip("/") or "/"] = until
        # Drop the watcher's events under it as they are read (tens of thousands for a
        # large archive); what is read after ``done`` is still hidden by ``_trees``.
        host = self.to_host(sandbox_path)
        if self._tree is None or host is None:
            return
        if done:
            shared().unmute(self._tree, host)
        else:
            shared().mute(self._tree, host)

    def _in_api_tree(self, spath: str, now: float) -> bool:
        for prefix, until in list(self._trees.items()):
            if until <= now:
                del self._trees[prefix]
            elif spath == prefix or spath.startswith(prefix.rstrip("/") + "/"):
                return True
        return False

    def _report(self, changes: list[tuple[str, str]]) -> None:
        now = time.monotonic()
        for host_path, op in changes:
            name = host_path.rsplit("/", 1)[-1]
            if name.startswith(".sandlot-") and name.endswith(".tmp"):
                continue
            spath = self.to_sandbox(host_path)
            if spath is None or self._recent.get(spath, 0.0) > now:
                continue
            if self._trees and self._in_api_tree(spath, now):
                continue
            self.log.append(f"fs.{op}", "fs", {"path": spath, "op": op, "source": "watch"})

    async def close(self) -> None:
        if self._tree is not None:
            shared().unwatch(self._tree)
            self._tree = None
