"""Browser sessions and one-time sign-in links in the broker's store
(:mod:`sandlot.broker.browsersessions`): two stores on one database stand for two
replicas (or two worker processes), on SQLite and on PostgreSQL."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import select

from sandlot.broker.browsersessions import StoredLinks, StoredSessions, csrf_token, unseal
from sandlot.broker.store import Store
from sandlot.broker.store.schema import web_links, web_sessions
from sandlot.protocol.errors import InvalidRequest
from tests.pg import postgres_cluster

IDLE, MAX = 600.0, 3600.0


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def pg_url() -> Iterator[str]:
    with postgres_cluster() as url:
        yield url


@pytest.fixture(params=["sqlite", "postgresql"])
def stores(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[Store, Store]]:
    """Two stores on one database, migrated: two replicas' views of it."""
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'broker.db'}"
    else:
        url = request.getfixturevalue("pg_url")
    first, second = Store(url), Store(url)
    first.migrate()
    try:
        yield first, second
    finally:
        first.dispose()
        second.dispose()


def sessions(store: Store, clock: Clock, max_sessions: int = 1000) -> StoredSessions:
    return StoredSessions(
        store, idle_seconds=IDLE, max_seconds=MAX, max_sessions=max_sessions, clock=clock
    )


def user() -> str:
    return f"u_{uuid.uuid4().hex[:10]}"


def test_a_session_made_at_one_replica_is_known_at_the_other(
    stores: tuple[Store, Store],
) -> None:
    clock = Clock()
    a, b = sessions(stores[0], clock), sessions(stores[1], clock)
    ada = user()
    raw, made = a.create(ada, credential="sl_secret_key_of_ada")
    found = b.get(raw)
    assert found is not None
    assert (found.user_id, found.credential, found.key) == (ada, "sl_secret_key_of_ada", made.key)
    # The CSRF token the page got at sign-in is the one every replica checks.
    assert found.csrf_token == made.csrf_token == csrf_token(raw)
    assert b.get(raw + "x") is None and b.get(None) is None and b.get("x" * 300) is None
    # What the store holds opens nothing: neither the cookie's id nor the key in clear,
    # and the sealed key does not open with what the store knows (the id's SHA-256).
    with stores[0].read() as conn:
        row = conn.execute(select(web_sessions).where(web_sessions.c.user_id == ada)).one()
    assert raw not in str(tuple(row)) and "sl_secret_key_of_ada" not in str(tuple(row))
    assert row.key == made.key and row.credential
    with pytest.raises(ValueError):
        unseal(row.key, row.key, row.credential)
    assert unseal(raw, row.key, row.credential) == "sl_secret_key_of_ada"
    # Another session of the same user has another CSRF token.
    other, _ = a.create(ada, credential=None)
    assert csrf_token(other) != csrf_token(raw)
    assert b.get(other) is not None and b.get(other).credential is None  # type: ignore[union-attr]


def test_signing_out_at_one_replica_ends_the_session_at_the_other(
    stores: tuple[Store, Store],
) -> None:
    clock = Clock()
    a, b = sessions(stores[0], clock), sessions(stores[1], clock)
    ada, bob = user(), user()
    raw, made = a.create(ada, credential="k")
    b.discard(made)
    assert a.get(raw) is None
    raw, _ = a.create(ada, credential="k")
    assert b.delete(raw) is True and b.delete(raw) is False
    assert a.get(raw) is None
    one, _ = a.create(ada, credential="k")
    two, _ = a.create(ada, credential="k")
    bobs, _ = a.create(bob, credential="k")
    assert b.end_user(ada) == 2
    assert a.get(one) is None and a.get(two) is None and a.get(bobs) is not None


def test_sessions_end_when_idle_or_old_and_last_seen_is_written_once_a_minute(
    stores: tuple[Store, Store],
) -> None:
    clock = Clock()
    a, b = sessions(stores[0], clock), sessions(stores[1], clock)
    raw, made = a.create(user(), credential="k")

    def last_seen() -> float:
        with stores[0].read() as conn:
            return float(
                conn.execute(
                    select(web_sessions.c.last_seen).where(web_sessions.c.key == made.key)
                ).scalar_one()
            )

    start = clock.now
    clock.now += 30
    assert b.get(raw) is not None
    assert last_seen() == start  # within a minute of the last write: not written again
    clock.now += 31
    assert b.get(raw) is not None
    assert last_seen() == clock.now
    # Used at one replica, the session lives on at the other.
    clock.now += IDLE - 1
    assert a.get(raw) is not None
    clock.now += IDLE
    assert b.get(raw) is None  # idle
    with stores[0].read() as conn:
        gone = conn.execute(select(web_sessions).where(web_sessions.c.key == made.key))
        assert gone.first() is None
    # However often it is used, a session ends at its absolute expiry.
    raw, second = a.create(user(), credential="k")
    while clock.now + 300 < second.expires_at:
        clock.now += 300
        assert a.get(raw) is not None
    clock.now = second.expires_at
    assert b.get(raw) is None


def test_a_recheck_at_one_replica_is_seen_by_the_other(stores: tuple[Store, Store]) -> None:
    clock = Clock()
    a, b = sessions(stores[0], clock), sessions(stores[1], clock)
    raw, made = a.create(user(), credential="k")
    clock.now += 100
    b.checked(made, clock.now)
    found = a.get(raw)
    assert found is not None and found.checked_at == clock.now


def test_one_user_signing_in_again_and_again_ends_their_own_oldest_sessions(
    stores: tuple[Store, Store], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(StoredSessions, "MAX_PER_USER", 5)
    clock = Clock()
    a, b = sessions(stores[0], clock), sessions(stores[1], clock)
    other, _ = a.create(user(), credential="k")
    mallory = user()
    made = []
    for _ in range(8):
        clock.now += 1
        made.append(a.create(mallory, credential="k")[0])
    assert [b.get(raw) is not None for raw in made] == [False] * 3 + [True] * 5
    assert b.get(other) is not None


def test_beyond_the_servers_cap_the_least_recently_used_sessions_end(
    stores: tuple[Store, Store],
) -> None:
    clock = Clock()
    a, b = sessions(stores[0], clock, max_sessions=10), sessions(stores[1], clock, max_sessions=10)
    with stores[0].write() as conn:  # the other tests' sessions (on PostgreSQL)
        conn.execute(web_sessions.delete())
    made = []
    for _ in range(10):
        clock.now += 1
        made.append(a.create(user(), credential=None)[0])
    clock.now += 61
    assert all(b.get(raw) is not None for raw in made[5:])  # used again (written)
    clock.now += 1
    newcomers = [b.create(user(), credential=None)[0] for _ in range(3)]
    assert [a.get(raw) is not None for raw in made] == [False] * 3 + [True] * 7
    assert all(a.get(raw) is not None for raw in newcomers)


def test_a_link_made_at_one_replica_signs_in_once_at_the_other(
    stores: tuple[Store, Store],
) -> None:
    clock = Clock()
    a = StoredLinks(stores[0], ttl_seconds=300, clock=clock)
    b = StoredLinks(stores[1], ttl_seconds=300, clock=clock)
    ada = user()
    token = a.create(ada, credential="sl_key_of_ada", next_path="/?thread=thr_1")
    link_id, _, secret = token.partition(".")
    with stores[0].read() as conn:
        row = conn.execute(select(web_links).where(web_links.c.id == link_id)).one()
    assert secret not in str(tuple(row)) and "sl_key_of_ada" not in str(tuple(row))
    found = b.redeem(token)
    assert found is not None
    assert (found.user_id, found.credential, found.next_path) == (
        ada,
        "sl_key_of_ada",
        "/?thread=thr_1",
    )
    assert a.redeem(token) is None and b.redeem(token) is None  # spent
    # A wrong secret spends the link too.
    token = a.create(ada)
    assert b.redeem(token.partition(".")[0] + ".wrong") is None
    assert a.redeem(token) is None
    # An expired link signs nobody in.
    token = a.create(ada)
    clock.now += 301
    assert b.redeem(token) is None
    for bad in (None, "", "nodot", "x" * 300, "." * 40, "\x00" + token, "ab\x00cd.x"):
        assert b.redeem(bad) is None
    with pytest.raises(InvalidRequest):
        a.create(ada, next_path="//evil.example")


def test_a_link_redeemed_at_once_at_many_replicas_signs_in_one_browser(
    stores: tuple[Store, Store],
) -> None:
    links = [StoredLinks(s, ttl_seconds=300) for s in stores]

    def race(token: str) -> list[bool]:
        start = threading.Barrier(16)
        won: list[bool] = []

        def redeem(i: int) -> None:
            start.wait()
            won.append(links[i % 2].redeem(token) is not None)

        threads = [threading.Thread(target=redeem, args=(i,)) for i in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return won

    for _ in range(3):
        assert sorted(race(links[0].create(user(), credential="k"))) == [False] * 15 + [True]
