"""An API key the broker has not cached is read from its store off the event loop: keys
nobody has (anyone may send some, each one a miss) and a slow store or one out of reach
never hold the loop, and with it every other request."""

from __future__ import annotations

import asyncio
import secrets
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from tests.broker.conftest import Harness


@pytest.fixture
def store_reads(harness: Harness, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The thread of each read of the broker's store from now on."""
    threads: list[int] = []
    store = harness.broker.keys.store
    read = store.read

    @contextmanager
    def recorded(*args: Any, **kwargs: Any) -> Iterator[Any]:
        threads.append(threading.get_ident())
        with read(*args, **kwargs) as conn:
            yield conn

    monkeypatch.setattr(store, "read", recorded)
    return threads


async def test_keys_not_cached_are_read_off_the_event_loop(
    harness: Harness, store_reads: list[int]
) -> None:
    loop_thread = threading.get_ident()
    valid = harness.key("alice")
    unknown = [f"sl_{secrets.token_hex(6)}_{secrets.token_urlsafe(32)}" for _ in range(20)]
    answers = await asyncio.gather(
        *(
            harness.client.get("/v1/templates", headers={"Authorization": f"Bearer {k}"})
            for k in unknown
        ),
        harness.client.get("/v1/templates", headers=valid),
    )
    assert [r.status_code for r in answers] == [401] * 20 + [200]
    assert {r.json()["error"]["code"] for r in answers[:20]} == {"UNAUTHENTICATED"}
    assert len(store_reads) >= 21 and loop_thread not in store_reads
    # Cached now: the same keys answer the same.
    again = await harness.client.get("/v1/templates", headers=valid)
    wrong = await harness.client.get(
        "/v1/templates", headers={"Authorization": f"Bearer {unknown[0]}"}
    )
    assert (again.status_code, wrong.status_code) == (200, 401)
    # A known prefix with the wrong secret is refused from the cache too.
    prefix = valid["Authorization"].split("_")[1]
    forged = f"Bearer sl_{prefix}_{secrets.token_urlsafe(32)}"
    assert (
        await harness.client.get("/v1/templates", headers={"Authorization": forged})
    ).status_code == 401
    assert loop_thread not in store_reads
