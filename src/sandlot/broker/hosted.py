"""Scopes a hosting platform owns: the live ones, and ending them when the platform's
resource is gone.

A LangGraph server hosting the broker (:mod:`sandlot.integrations.langgraph`) owns its
threads and runs: when one is deleted (or a run ends), the sandbox bound to it is torn
down like a release with ``terminate``: every token revoked, the binding ended, the
sandbox deleted. A promoted sandbox (bound to an assistant) is not a thread's and is
not ended with one.
"""

from __future__ import annotations

from collections.abc import Iterable

import anyio
from sqlalchemy import select

from sandlot.broker.sandboxes import SandboxService
from sandlot.broker.store import Store
from sandlot.broker.store.schema import bindings
from sandlot.protocol.common import ScopeType
from sandlot.protocol.errors import SandboxNotFound


def live_scopes(store: Store, kind: ScopeType) -> dict[str, str]:
    """The live bindings of scopes of one type: scope id → sandbox id."""
    prefix = f"{kind.value}:"
    query = select(bindings.c.live_scope, bindings.c.sandbox_id).where(
        bindings.c.live_scope.is_not(None), bindings.c.live_scope.startswith(prefix)
    )
    with store.read() as conn:
        rows = conn.execute(query).all()
    return {row.live_scope[len(prefix) :]: row.sandbox_id for row in rows}


async def end_scopes(
    sandboxes: SandboxService, store: Store, keys: Iterable[str], reason: str
) -> list[str]:
    """Tear down the sandboxes bound to these scope keys (``thread:…``); the ids of those
    whose teardown this accepted. The provider's deletion finishes in the background."""
    wanted = list(dict.fromkeys(keys))
    if not wanted:
        return []

    def find() -> list[str]:
        query = select(bindings.c.sandbox_id).where(bindings.c.live_scope.in_(wanted))
        with store.read() as conn:
            return [row.sandbox_id for row in conn.execute(query)]

    ended = []
    for sandbox_id in await anyio.to_thread.run_sync(find):
        try:
            await sandboxes.terminate(sandbox_id, reason=reason, wait=False)
        except SandboxNotFound:
            continue
        ended.append(sandbox_id)
    return ended
