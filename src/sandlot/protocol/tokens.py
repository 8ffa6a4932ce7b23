"""Sandbox tokens (PROTOCOL.md section 4): the claims, and the checks every verifier makes.

The broker signs and verifies, the dataplane verifies with the broker's published
keys; both read a token's header with :func:`token_key_id` and its claims with
:func:`decode_token`, so a token is refused for the same reasons, with the same
errors, wherever it is presented.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jwt
from pydantic import Field

from sandlot.protocol.common import Actor, Capability, WireModel
from sandlot.protocol.errors import TokenExpired, Unauthenticated

TOKEN_AUDIENCE = "sandlot-dataplane"
TOKEN_TYPE = "sandbox+jwt"
TOKEN_ALGORITHM = "EdDSA"
#: Clock skew tolerated on ``exp``/``nbf``.
TOKEN_LEEWAY_SECONDS = 30
#: Tokens longer than this are refused before any parsing.
MAX_TOKEN_BYTES = 8192


class TokenClaims(WireModel):
    iss: str
    aud: str = TOKEN_AUDIENCE
    typ: str = TOKEN_TYPE
    sub: str = Field(description="principal id")
    act: Actor
    sid: str = Field(description="session (binding) id")
    sandbox_id: str
    scope: str = Field(description="scope key, e.g. thread:thr_123")
    caps: list[Capability]
    gen: int = Field(description="sandbox generation")
    iat: int
    nbf: int
    exp: int
    jti: str


#: Claims a token must carry.
REQUIRED_CLAIMS = ("exp", "nbf", "iat", "iss", "aud", "sub", "jti")


def token_key_id(token: str) -> str:
    """The ``kid`` of a token's header, once its size and algorithm are checked."""
    if not isinstance(token, str) or len(token) > MAX_TOKEN_BYTES:
        raise Unauthenticated("token too large")
    try:
        header = jwt.get_unverified_header(token)
    except jwt.PyJWTError as exc:
        raise Unauthenticated("malformed token") from exc
    if header.get("alg") != TOKEN_ALGORITHM:
        raise Unauthenticated("token algorithm not accepted")
    kid = header.get("kid")
    if not isinstance(kid, str):
        raise Unauthenticated("token has no key id")
    return kid


def decode_token(
    token: str,
    key: Any,
    *,
    issuer: str,
    audience: str = TOKEN_AUDIENCE,
    leeway: float = TOKEN_LEEWAY_SECONDS,
    required: Sequence[str] = REQUIRED_CLAIMS,
) -> dict[str, Any]:
    """Signature, standard claims and ``typ``; ``TokenExpired`` or ``Unauthenticated``."""
    try:
        claims: dict[str, Any] = jwt.decode(
            token,
            key,
            algorithms=[TOKEN_ALGORITHM],
            audience=audience,
            issuer=issuer,
            leeway=leeway,
            options={"require": list(required)},
        )
    except jwt.ExpiredSignatureError as exc:
        raise TokenExpired("token expired", code="TOKEN_EXPIRED") from exc
    except jwt.PyJWTError as exc:
        raise Unauthenticated(f"invalid token: {type(exc).__name__}") from exc
    if claims.get("typ") != TOKEN_TYPE:
        raise Unauthenticated("invalid token type")
    return claims


@dataclass(frozen=True)
class RevokedToken:
    """A token revoked before its expiry, pushed by the broker to the dataplanes."""

    jti: str
    #: Epoch seconds; the revocation can be forgotten once the token has expired anyway.
    expires_at: float


def on_sandbox(jti: str, sandbox_id: str) -> str:
    """The id that revokes ``jti`` on one sandbox alone: a :class:`RevokedToken` of it
    closes the sockets ``jti`` opened there and refuses it there, not elsewhere (the API
    key of a member removed from a shared scope, which still reaches his own sandboxes)."""
    return f"{jti}@{sandbox_id}"
