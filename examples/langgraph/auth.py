"""Who may use this LangGraph server: a bearer token per user, and each user's threads
their own.

Tokens come from ``EXAMPLE_USERS`` (``token:user,token:user``). Replace this with your
identity provider; sandlot takes whatever user it returns. A user whose ``permissions``
include ``sandlot:agent`` is recorded as an agent, ``sandlot:admin`` is a sandlot admin.
"""

from __future__ import annotations

import os

from langgraph_sdk import Auth

auth = Auth()


def _users() -> dict[str, str]:
    pairs = (p.partition(":") for p in os.environ.get("EXAMPLE_USERS", "").split(",") if p)
    return {token: user for token, _, user in pairs if token and user}


@auth.authenticate
async def authenticate(authorization: str | None) -> Auth.types.MinimalUserDict:
    scheme, _, token = (authorization or "").partition(" ")
    user = _users().get(token) if scheme.lower() == "bearer" else None
    if user is None:
        raise Auth.exceptions.HTTPException(status_code=401, detail="unknown token")
    return {"identity": user, "permissions": []}


@auth.on
async def owner_only(ctx: Auth.types.AuthContext, value: dict) -> dict[str, str]:
    """What a user creates is marked theirs; what they read, update or delete must be."""
    owner = {"owner": ctx.user.identity}
    metadata = value.setdefault("metadata", {})
    if isinstance(metadata, dict):
        metadata.update(owner)
    return owner
