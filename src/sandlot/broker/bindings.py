"""A binding as the services read it: which sandbox serves a scope, and whether it still does."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class BindingRow:
    id: str
    scope_key: str
    sandbox_id: str
    owner_user_id: str
    live: bool
    created_at: float
    event_seq: int

    @classmethod
    def from_row(cls, r: Any) -> BindingRow:
        return cls(
            id=r.id,
            scope_key=r.scope_key,
            sandbox_id=r.sandbox_id,
            owner_user_id=r.owner_user_id,
            live=r.live_scope is not None,
            created_at=r.created_at,
            event_seq=r.event_seq,
        )
