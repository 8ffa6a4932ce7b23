"""Engine, migrations and transactions.

SQLite (the embedded default) runs in WAL mode; every write transaction
starts with ``BEGIN IMMEDIATE`` so that concurrent writers, in any number of
worker processes, serialize on the database lock instead of failing with
"database is locked" at commit time. PostgreSQL is used as is (READ
COMMITTED); atomicity of ``ensure`` comes from unique constraints, not locks.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from sqlalchemy import Connection, Engine, create_engine, event, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError, DisconnectionError, InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout

from sandlot.protocol.errors import ProviderUnavailable

MIGRATIONS = str(Path(__file__).with_name("migrations"))

#: Seconds a new PostgreSQL connection may take: a database that stopped answering fails
#: a request with 503 BACKEND_UNAVAILABLE instead of holding it.
CONNECT_TIMEOUT = 5

#: libpq settings of every PostgreSQL connection, for a database cut off by the network
#: (its packets dropped, nothing reset): a connection whose sent data goes unacknowledged
#: for 5 s is closed (``tcp_user_timeout``), so a request on it fails with 503 instead of
#: waiting minutes for TCP to give up; an idle one is probed by keepalives and found dead
#: in about 11 s. On the server's side, a transaction left open by a replica that was cut
#: off is ended after 30 s idle (``idle_in_transaction_session_timeout``), releasing its
#: locks for the other replicas (sandlot never keeps a transaction idle that long).
POSTGRES_CONNECT_ARGS: dict[str, object] = {
    "connect_timeout": CONNECT_TIMEOUT,
    "keepalives": 1,
    "keepalives_idle": 5,
    "keepalives_interval": 2,
    "keepalives_count": 3,
    "tcp_user_timeout": 5000,
    "options": "-c idle_in_transaction_session_timeout=30000",
}


def _unreachable(exc: Exception) -> bool:
    """Whether ``exc`` says the database is out of reach (rather than a bug or a conflict)."""
    if isinstance(exc, OperationalError | InterfaceError | PoolTimeout):
        return True
    return isinstance(exc, DBAPIError) and exc.connection_invalidated


def backend_unavailable() -> ProviderUnavailable:
    """What a request meets while the store is out of reach (retryable; PROTOCOL.md's
    ``BACKEND_UNAVAILABLE``, an alias of ``PROVIDER_UNAVAILABLE``)."""
    return ProviderUnavailable("the store is unavailable, retry", code="BACKEND_UNAVAILABLE")


#: A pooled connection unused for longer than this is pinged before it is handed out.
PING_AFTER_IDLE_SECONDS = 1.0


def _ping_when_idle(engine: Engine) -> None:
    """Check a connection that sat idle in the pool before using it (a server restarted
    or a connection dropped meanwhile: a fresh one is made instead).

    SQLAlchemy's ``pool_pre_ping`` pings on every checkout: a round trip more per
    transaction, the cost of a statement. A connection that was in use a moment ago
    is not pinged; if the database went away since, the request that meets the dead
    connection fails with 503 BACKEND_UNAVAILABLE (retryable) and the pool drops every
    connection made before (SQLAlchemy invalidates the pool on a disconnection). The
    pool hands out the most recently used connection first (``pool_use_lifo``), so a
    steady load keeps a few connections warm and lets the others age into a ping.
    """

    @event.listens_for(engine, "checkin")
    def _on_checkin(_dbapi_conn: Any, record: Any) -> None:
        if record is not None:
            record.info["used_at"] = time.monotonic()

    @event.listens_for(engine, "checkout")
    def _on_checkout(dbapi_conn: Any, record: Any, _proxy: Any) -> None:
        used = record.info.get("used_at")
        if used is None or time.monotonic() - used <= PING_AFTER_IDLE_SECONDS:
            return  # new, or in use a moment ago
        try:
            cur = dbapi_conn.cursor()
            try:
                cur.execute("SELECT 1")
            finally:
                cur.close()
            if not getattr(dbapi_conn, "autocommit", True):
                dbapi_conn.rollback()  # the ping's implicit transaction
        except Exception as exc:
            # The pool discards this connection and checks out another (a new one).
            raise DisconnectionError(str(exc)) from exc


def _sqlite_engine(url: str) -> Engine:
    engine = create_engine(
        url,
        # More connections than the thread pool has threads: a connection is never the bottleneck.
        pool_size=16,
        max_overflow=48,
        connect_args={"check_same_thread": False, "timeout": 30},
    )

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        # Let SQLAlchemy's "begin" event issue BEGIN itself (pysqlite would defer it).
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA synchronous=NORMAL")
        cur.execute("PRAGMA busy_timeout=30000")
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        # On the driver's connection itself: through SQLAlchemy's execution machinery
        # this statement costs about as much as the rest of an empty transaction.
        driver = conn.connection.driver_connection
        assert driver is not None
        driver.execute("BEGIN IMMEDIATE" if conn.info.get("immediate") else "BEGIN")

    return engine


class _WriteLock:
    """Serializes SQLite writers across threads and processes without polling.

    SQLite's own busy handler sleeps in growing steps (up to 100 ms) while
    another connection writes, which collapses throughput when several
    worker processes write at once. Writers queue on an ``flock`` instead
    and wake the moment the previous one commits; ``BEGIN IMMEDIATE`` then
    finds the database free.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._thread_lock = threading.Lock()
        self._fd: int | None = None

    def __enter__(self) -> None:
        self._thread_lock.acquire()
        try:
            if self._fd is None:
                self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            fcntl.flock(self._fd, fcntl.LOCK_EX)
        except BaseException:
            self._thread_lock.release()
            raise

    def __exit__(self, *exc: object) -> None:
        try:
            if self._fd is not None:
                fcntl.flock(self._fd, fcntl.LOCK_UN)
        finally:
            self._thread_lock.release()


class Store:
    """The broker's database. Services run their transactions through it."""

    def __init__(self, url: str) -> None:
        self._write_lock: _WriteLock | None = None
        parsed = make_url(url)
        self.url = url
        self.dialect = parsed.get_backend_name()
        if self.dialect == "sqlite":
            if parsed.database and parsed.database != ":memory:":
                Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
            self.engine = _sqlite_engine(url)
            if parsed.database and parsed.database != ":memory:":
                self._write_lock = _WriteLock(parsed.database + ".writelock")
        else:
            if self.dialect == "postgresql" and parsed.drivername == "postgresql":
                parsed = parsed.set(drivername="postgresql+psycopg")
            args = POSTGRES_CONNECT_ARGS if self.dialect == "postgresql" else {}
            self.engine = create_engine(
                parsed, pool_size=8, max_overflow=24, pool_use_lifo=True, connect_args=args
            )
            _ping_when_idle(self.engine)

    def migrate(self) -> None:
        """Bring the schema to the newest revision (idempotent)."""
        cfg = Config()
        cfg.set_main_option("script_location", MIGRATIONS)
        with self.engine.connect() as conn:
            if self.dialect == "postgresql":
                # One migrator at a time across replicas.
                conn.execute(text("SELECT pg_advisory_lock(724011)"))
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, "head")
            if self.dialect == "postgresql":
                conn.execute(text("SELECT pg_advisory_unlock(724011)"))
            conn.commit()

    @contextlib.contextmanager
    def write(self) -> Iterator[Connection]:
        """A write transaction (``BEGIN IMMEDIATE`` on SQLite); commits on success."""
        lock = self._write_lock or contextlib.nullcontext()
        try:
            with lock, self.engine.connect() as conn:
                conn.info["immediate"] = True
                try:
                    with conn.begin():
                        yield conn
                finally:
                    conn.info["immediate"] = False
        except (DBAPIError, PoolTimeout) as exc:
            if _unreachable(exc):
                raise backend_unavailable() from exc
            raise

    @contextlib.contextmanager
    def autocommit(self) -> Iterator[Connection]:
        """A connection whose every statement is a transaction of its own (no ``BEGIN``,
        no ``COMMIT``: one round trip for a statement that does a whole transaction's
        work, such as a server-side function)."""
        try:
            with self.engine.connect() as conn:
                yield conn.execution_options(isolation_level="AUTOCOMMIT")
        except (DBAPIError, PoolTimeout) as exc:
            if _unreachable(exc):
                raise backend_unavailable() from exc
            raise

    def serialize(self, conn: Connection, name: str) -> None:
        """Hold the lock called ``name`` until the write transaction ``conn`` ends.

        For a check-then-insert that no unique constraint covers. SQLite's write
        transactions are serialized already; PostgreSQL takes a transaction-level
        advisory lock, so replicas queue on it.
        """
        if self.dialect == "postgresql":
            conn.execute(text("SELECT pg_advisory_xact_lock(hashtext(:name))"), {"name": name})

    @contextlib.contextmanager
    def read(self) -> Iterator[Connection]:
        """A read transaction (a consistent snapshot)."""
        try:
            with self.engine.connect() as conn, conn.begin():
                yield conn
        except (DBAPIError, PoolTimeout) as exc:
            if _unreachable(exc):
                raise backend_unavailable() from exc
            raise

    def ping(self) -> bool:
        try:
            with self.engine.connect() as conn:
                conn.execute(text("SELECT 1"))
            return True
        except Exception:
            return False

    def dispose(self) -> None:
        self.engine.dispose()
