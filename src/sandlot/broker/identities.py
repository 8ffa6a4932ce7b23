"""Identities made once per store and shared by every process on it.

A provider whose sandboxes are objects of a shared engine names them with an identity of
the deployment (``kubernetes``: the ``sandlot.instance`` label of its pods, a prefix of
their names). Broker replicas on one store must agree on it, or each would see only the
pods it made itself: the identity is a row of the store, made by the first process that
asks (with the value it proposes) and read by every later one. A single server proposes
what it used before the row existed (a hash of its data directory), so its pods keep
their labels and are re-adopted across the upgrade.
"""

from __future__ import annotations

import time

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError

from sandlot.broker.store import Store
from sandlot.broker.store.schema import identities


def identity(store: Store, name: str, proposed: str) -> str:
    """The store's value of ``name``; ``proposed`` becomes it if there is none yet."""
    with store.read() as conn:
        found = conn.execute(select(identities.c.value).where(identities.c.name == name)).first()
    if found is not None:
        return str(found.value)
    try:
        with store.write() as conn:
            store.serialize(conn, f"identity:{name}")
            found = conn.execute(
                select(identities.c.value).where(identities.c.name == name)
            ).first()
            if found is not None:
                return str(found.value)
            conn.execute(
                identities.insert().values(name=name, value=proposed, created_at=time.time())
            )
    except IntegrityError:  # another process made it meanwhile
        with store.read() as conn:
            found = conn.execute(
                select(identities.c.value).where(identities.c.name == name)
            ).first()
        assert found is not None
        return str(found.value)
    return proposed


__all__ = ["identity"]
