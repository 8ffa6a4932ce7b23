"""Who may use this LangGraph server: a bearer token per user, and each user's threads
their own.

Tokens come from ``EXAMPLE_USERS``: ``token:user`` pairs separated by commas, a user
optionally followed by ``/`` and its permissions joined by ``+``
(``ci-token:ci-bot/sandlot:agent``). Replace this with your identity provider; sandlot
takes whatever user it returns. A user whose ``permissions`` include ``sandlot:agent``
is recorded as an agent, ``sandlot:admin`` is a sandlot admin.
"""

from __future__ import annotations

import functools
import os

from langgraph_sdk import Auth

auth = Auth()


def _users() -> dict[str, tuple[str, list[str]]]:
    return _parse(os.environ.get("EXAMPLE_USERS", ""))


@functools.lru_cache(maxsize=1)
def _parse(spec: str) -> dict[str, tuple[str, list[str]]]:
    """The token → (user, permissions) table, parsed once per value of the variable."""
    users = {}
    for entry in spec.split(","):
        token, _, rest = entry.partition(":")
        user, _, permissions = rest.partition("/")
        if token and user:
            users[token] = (user, [p for p in permissions.split("+") if p])
    return users


@auth.authenticate
async def authenticate(authorization: str | None) -> Auth.types.MinimalUserDict:
    scheme, _, token = (authorization or "").partition(" ")
    found = _users().get(token) if scheme.lower() == "bearer" else None
    if found is None:
        raise Auth.exceptions.HTTPException(status_code=401, detail="unknown token")
    user, permissions = found
    return {"identity": user, "permissions": permissions}


@auth.on
async def owner_only(ctx: Auth.types.AuthContext, value: dict) -> dict[str, str]:
    """What a user creates is marked theirs; what they read, update or delete must be."""
    owner = {"owner": ctx.user.identity}
    metadata = value.setdefault("metadata", {})
    if isinstance(metadata, dict):
        metadata.update(owner)
    return owner
