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
    def from_row(cls, r: Any, prefix: str = "") -> BindingRow:
        """From a row of ``bindings``, its columns named ``prefix`` + their names."""
        m = r._mapping
        return cls(
            id=m[prefix + "id"],
            scope_key=m[prefix + "scope_key"],
            sandbox_id=m[prefix + "sandbox_id"],
            owner_user_id=m[prefix + "owner_user_id"],
            live=m[prefix + "live_scope"] is not None,
            created_at=m[prefix + "created_at"],
            event_seq=m[prefix + "event_seq"],
        )
