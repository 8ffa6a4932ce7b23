"""Templates kept in the store that this version refuses (stored by one that allowed them)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from sandlot.broker.store import Store
from sandlot.broker.store.schema import templates
from sandlot.broker.templates import TemplateService
from sandlot.protocol.errors import ResourceConflict, ResourceNotFound
from sandlot.protocol.sessions import Template


def test_a_stored_template_no_longer_valid_fails_alone(tmp_path: Path) -> None:
    """Its sandboxes cannot be made (409, saying why and what to do), every other
    template still can, and an admin can delete it (before, one such row made every
    template read fail: every ensure a 500)."""
    store = Store(f"sqlite:///{tmp_path / 'sandlot.db'}")
    store.migrate()
    service = TemplateService(store)
    with store.write() as conn:
        for name, idle in (("fine", 60), ("forever", 2**40)):
            conn.execute(
                templates.insert().values(
                    name=name,
                    spec={"name": name, "image": "host", "idle_timeout_seconds": idle},
                    source="api",
                    created_at=time.time(),
                )
            )
    assert [t.name for t in service.list()] == ["fine"]
    assert service.get("fine").idle_timeout_seconds == 60
    with pytest.raises(ResourceConflict, match="'forever' as stored is no longer valid") as err:
        service.get("forever")
    assert "idle_timeout_seconds: Input should be less than or equal to" in str(err.value)
    service.delete("forever")
    with pytest.raises(ResourceNotFound):
        service.get("forever")
    store.dispose()


def test_a_template_made_through_another_replica_is_found_at_once(tmp_path: Path) -> None:
    """Two services on one store, as two replicas: one has just read the templates
    (kept a moment), the other creates one; the first finds it on the next request
    (a pool or an ensure naming it through the balancer was 404 for up to 2 s)."""
    store = Store(f"sqlite:///{tmp_path / 'sandlot.db'}")
    store.migrate()
    here, there = TemplateService(store), TemplateService(store)
    assert here.list() == []
    there.create(Template(name="fresh", image="host"))
    assert here.get("fresh").name == "fresh"
    with pytest.raises(ResourceNotFound):
        here.get("never-made")
    store.dispose()
