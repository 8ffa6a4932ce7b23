"""Ordered event logs kept in the store: one per binding (2.6), one per sandbox (2.8).

Appending happens inside the caller's transaction, so an event is visible
exactly when the change it describes is. Subscribers in this process are woken
at once through :class:`EventHub`. On PostgreSQL the append also sends
``NOTIFY sandlot_events`` with the stream id, delivered when the transaction
commits; every broker process (every worker, every replica) runs a
:class:`StoreListener` that wakes its own subscribers of that stream. A
notification sent while a listener is disconnected is lost, so each process
also reads, every ``EventHub.POLL_SECONDS``, where every stream its subscribers
follow stands (:class:`EventReconciler`, the reconciling read: one query for all
of them) and wakes those of a stream that moved: a lost notification costs
latency, never an event. On SQLite (one machine) that read is how other worker
processes' events arrive.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

import anyio
from sqlalchemy import Connection, Table, bindparam, delete, select, text, update
from sqlalchemy.engine import make_url

from sandlot.broker.store.database import POSTGRES_CONNECT_ARGS, Store
from sandlot.broker.store.schema import bindings, events, sandboxes
from sandlot.protocol.common import Actor, rfc3339

#: Events kept per stream; older cursors get 410 SEQUENCE_EXPIRED.
RETAINED_EVENTS = 10_000


_NEXT_SEQ = {
    t.name: update(t)
    .where(t.c.id == bindparam("stream"))
    .values(event_seq=t.c.event_seq + 1)
    .returning(t.c.event_seq)
    for t in (bindings, sandboxes)
}
_INSERT_EVENT = events.insert()
#: The PostgreSQL channel of :class:`StoreListener` (payload: a stream id, ≤ 8000 bytes).
CHANNEL = "sandlot_events"
#: Where an event names its stream and the state it left: binding or sandbox.
_STREAM_KEYS = {"bindings": ("binding_id", "state"), "sandboxes": ("sandbox_id", "sandbox_state")}


def _append_pg(table: str) -> Any:
    """PostgreSQL: the next sequence, the event and its ``NOTIFY`` in one statement (one
    round trip instead of three); the envelope is :func:`append_event`'s, key for key."""
    stream_key, state_key = _STREAM_KEYS[table]
    # Table and key names from _STREAM_KEYS, never from a request.
    return text(
        f"""
        WITH s AS (
            UPDATE {table} SET event_seq = event_seq + 1
            WHERE id = CAST(:stream AS text) RETURNING event_seq
        ), e AS (
            INSERT INTO events (stream_id, sequence, event, created_at)
            SELECT CAST(:stream AS text), s.event_seq, json_build_object(
                'event_id', CAST(:stream AS text) || '-' || s.event_seq,
                'sequence', s.event_seq,
                'event_type', CAST(:event_type AS text),
                'timestamp', CAST(:timestamp AS text),
                'actor', CAST(:actor AS json),
                'details', CAST(:details AS json),
                '{stream_key}', CAST(:stream AS text),
                '{state_key}', CAST(:state AS text)
            ), CAST(:now AS double precision) FROM s
        )
        SELECT s.event_seq, pg_notify('{CHANNEL}', CAST(:stream AS text)) FROM s
        """  # noqa: S608
    )


_APPEND_PG = {t: _append_pg(t) for t in _STREAM_KEYS}

log = logging.getLogger("sandlot.broker.events")

T = TypeVar("T")


def append_event(
    conn: Connection,
    stream: Table,
    stream_id: str,
    event_type: str,
    details: dict[str, Any],
    *,
    state: str,
    actor: Actor | None = None,
    now: float | None = None,
) -> int:
    """Append to the log of a binding (``stream=bindings``) or a sandbox; return its sequence."""
    now = time.time() if now is None else now
    if conn.dialect.name == "postgresql":
        seq = conn.execute(
            _APPEND_PG[stream.name],
            {
                "stream": stream_id,
                "event_type": event_type,
                "timestamp": rfc3339(now),
                "actor": json.dumps(actor.model_dump(mode="json")) if actor else None,
                "details": json.dumps(details),
                "state": state,
                "now": now,
            },
        ).scalar_one()
        _trim(conn, stream_id, seq)
        return int(seq)
    seq = conn.execute(_NEXT_SEQ[stream.name], {"stream": stream_id}).scalar_one()
    envelope: dict[str, Any] = {
        "event_id": f"{stream_id}-{seq}",
        "sequence": seq,
        "event_type": event_type,
        "timestamp": rfc3339(now),
        "actor": actor.model_dump(mode="json") if actor else None,
        "details": details,
    }
    if stream is bindings:
        envelope["binding_id"] = stream_id
        envelope["state"] = state
    else:
        envelope["sandbox_id"] = stream_id
        envelope["sandbox_state"] = state
    conn.execute(
        _INSERT_EVENT,
        {"stream_id": stream_id, "sequence": seq, "event": envelope, "created_at": now},
    )
    _trim(conn, stream_id, seq)
    return int(seq)


def _trim(conn: Connection, stream_id: str, seq: int) -> None:
    """Now and then, drop a stream's events beyond :data:`RETAINED_EVENTS`."""
    if seq > RETAINED_EVENTS and seq % 256 == 0:
        conn.execute(
            delete(events).where(
                events.c.stream_id == stream_id, events.c.sequence <= seq - RETAINED_EVENTS
            )
        )


def read_events(
    conn: Connection, stream_id: str, after: int, limit: int = 500
) -> tuple[list[dict[str, Any]], int | None]:
    """Events after ``after`` and the oldest retained sequence (None if the log is empty)."""
    oldest = conn.execute(
        select(events.c.sequence)
        .where(events.c.stream_id == stream_id)
        .order_by(events.c.sequence)
        .limit(1)
    ).scalar()
    rows = conn.execute(
        select(events.c.event)
        .where(events.c.stream_id == stream_id, events.c.sequence > after)
        .order_by(events.c.sequence)
        .limit(limit)
    ).all()
    return [dict(r.event) for r in rows], oldest


class EventHub:
    """Wakes this process's subscribers when a stream gets new events.

    Each stream has a version counter; a subscriber remembers the version it
    read before fetching, so a notification that lands between its fetch and
    its wait is never lost.
    """

    POLL_SECONDS = 0.5

    def __init__(self) -> None:
        self._versions: dict[str, int] = {}
        self._waiters: dict[str, set[asyncio.Future[None]]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        #: Where each followed stream stood at the last reconciling read (sequence, state).
        self._heads: dict[str, tuple[int, str]] = {}
        #: Reads under way, by what they read (:meth:`shared`).
        self._reads: dict[Hashable, asyncio.Future[Any]] = {}

    def bind_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def version(self, stream_id: str) -> int:
        """The stream's version; from this call on, its notifications are counted."""
        return self._versions.setdefault(stream_id, 0)

    def notify(self, stream_id: str) -> None:
        """Safe to call from any thread."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            self._wake(stream_id)
        elif stream_id in self._waiters or stream_id in self._versions:
            # A stream no one here follows is not worth waking the loop for (with replicas,
            # every attach anywhere notifies every replica): a subscriber that starts
            # following it after this check reads its version first, then the store,
            # where the event already is.
            loop.call_soon_threadsafe(self._wake, stream_id)

    def _wake(self, stream_id: str) -> None:
        if stream_id in self._waiters or stream_id in self._versions:
            self._versions[stream_id] = self._versions.get(stream_id, 0) + 1
        for fut in self._waiters.pop(stream_id, ()):
            if not fut.done():
                fut.set_result(None)

    async def wait(self, stream_id: str, timeout: float, seen: int | None = None) -> None:
        """Wait for a notification newer than version ``seen`` (or for ``timeout``)."""
        if seen is not None and self._versions.get(stream_id, 0) != seen:
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(stream_id, set()).add(fut)
        self._versions.setdefault(stream_id, 0)
        try:
            await asyncio.wait_for(fut, timeout)
        except TimeoutError:
            waiters = self._waiters.get(stream_id)
            if waiters is not None:
                waiters.discard(fut)
                if not waiters:
                    del self._waiters[stream_id]

    def forget(self, stream_id: str) -> None:
        if stream_id not in self._waiters:
            self._versions.pop(stream_id, None)

    async def shared(self, key: Hashable, read: Callable[[], T]) -> T:
        """``read()`` in a worker thread, shared by every caller that asks with the same
        ``key`` while it runs: the subscribers of a stream that one event wakes make one
        read of it, however many they are. One caller cancelled cancels no other's."""
        task = self._reads.get(key)
        if task is None:
            task = asyncio.ensure_future(anyio.to_thread.run_sync(read))
            self._reads[key] = task

            def done(t: asyncio.Future[Any]) -> None:
                if self._reads.get(key) is t:
                    del self._reads[key]
                if not t.cancelled():
                    t.exception()  # retrieved: each caller gets it from its await

            task.add_done_callback(done)
        result: T = await asyncio.shield(task)
        return result

    def followed(self) -> list[str]:
        """The streams somebody in this process is waiting on."""
        return list(self._waiters)

    def reconciled(self, heads: dict[str, tuple[int, str]]) -> None:
        """Wake the subscribers of each followed stream whose newest sequence or state
        differs from the last read's, or that the last read did not see (they may have
        read it before a change this read is the first to see). On the loop's thread."""
        for stream_id, head in heads.items():
            if self._heads.get(stream_id) != head:
                self._heads[stream_id] = head
                self._wake(stream_id)
        for stream_id in [s for s in self._heads if s not in heads]:
            del self._heads[stream_id]

    def notify_all(self) -> None:
        """Wake every subscriber (notifications may have been lost): each re-reads."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._wake_all)

    def _wake_all(self) -> None:
        for stream_id in list(self._waiters):
            self._wake(stream_id)


def stream_heads(conn: Connection, stream_ids: list[str]) -> dict[str, tuple[int, str]]:
    """Each stream's newest sequence and the state it is in: a sandbox's own (their ids
    start ``sb_``), a binding's its sandbox's. A few hundred ids per query."""
    of_sandboxes = select(sandboxes.c.id, sandboxes.c.event_seq, sandboxes.c.state)
    of_bindings = select(bindings.c.id, bindings.c.event_seq, sandboxes.c.state).select_from(
        bindings.outerjoin(sandboxes, sandboxes.c.id == bindings.c.sandbox_id)
    )
    heads: dict[str, tuple[int, str]] = {}
    for query, key, sandbox in (
        (of_sandboxes, sandboxes.c.id, True),
        (of_bindings, bindings.c.id, False),
    ):
        ids = [s for s in stream_ids if s.startswith("sb_") == sandbox]
        for start in range(0, len(ids), 500):
            rows = conn.execute(query.where(key.in_(ids[start : start + 500])))
            heads.update({r.id: (int(r.event_seq), str(r.state)) for r in rows})
    return heads


class EventReconciler:
    """The reconciling read of a process: every ``EventHub.POLL_SECONDS``, where each
    stream its subscribers follow stands, in one read for all of them, and a wake for
    the subscribers of those that moved (events of other processes whose notification
    was lost, or that never notify: SQLite's other workers).

    Subscribers themselves only wait (a keep-alive apart): a stream's followers cost
    nothing while it is quiet, however many they are. (Each used to re-read its stream
    every half second: 200 idle event streams kept two cores busy and every other
    request waited about 400 ms.)
    """

    def __init__(self, store: Store, hub: EventHub) -> None:
        self.store = store
        self.hub = hub
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def run_once(self) -> None:
        followed = self.hub.followed()
        if followed:
            self.hub.reconciled(await asyncio.to_thread(self._read, followed))

    def _read(self, stream_ids: list[str]) -> dict[str, tuple[int, str]]:
        with self.store.read() as conn:
            return stream_heads(conn, stream_ids)

    async def _run(self) -> None:
        failing = False
        while True:
            await asyncio.sleep(self.hub.POLL_SECONDS)
            try:
                await self.run_once()
            except Exception as exc:  # the store away: the next read tries again
                if not failing:
                    log.warning("reconciling read of event streams failed (%s)", exc)
                failing = True
            else:
                failing = False


#: The listener's connection: the store's settings (a partition found in seconds: it then
#: reconnects and every subscriber re-reads), without the server-side option.
LISTEN_CONNECT_ARGS: dict[str, Any] = {
    k: v for k, v in POSTGRES_CONNECT_ARGS.items() if k != "options"
}


class StoreListener:
    """Feeds an :class:`EventHub` with PostgreSQL notifications of every process's events.

    A thread holds one ``LISTEN`` connection (psycopg, autocommit) and reconnects by
    itself; after a reconnection it wakes every subscriber, whose re-read finds what
    was committed meanwhile.
    """

    #: How long a wait for notifications lasts before the thread checks it should stop.
    TICK_SECONDS = 0.5
    RECONNECT_SECONDS = 1.0

    def __init__(self, url: str, hub: EventHub) -> None:
        self.conninfo = make_url(url).set(drivername="postgresql").render_as_string(False)
        self.hub = hub
        self.connected = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="sandlot-listen", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(self.TICK_SECONDS * 4)
            self._thread = None

    def _run(self) -> None:
        import psycopg

        while not self._stopping.is_set():
            try:
                with psycopg.connect(self.conninfo, autocommit=True, **LISTEN_CONNECT_ARGS) as conn:
                    conn.execute(f"LISTEN {CHANNEL}")
                    self.connected.set()
                    self.hub.notify_all()
                    while not self._stopping.is_set():
                        for note in conn.notifies(timeout=self.TICK_SECONDS):
                            self.hub.notify(note.payload)
            except psycopg.Error as exc:
                self.connected.clear()
                if not self._stopping.is_set():
                    log.warning("event notifications interrupted (%s); reconnecting", exc)
                    self._stopping.wait(self.RECONNECT_SECONDS)


__all__ = [
    "CHANNEL",
    "RETAINED_EVENTS",
    "EventHub",
    "EventReconciler",
    "StoreListener",
    "append_event",
    "bindings",
    "read_events",
    "sandboxes",
]
