"""Sandbox token claims (PROTOCOL.md section 4). Signing and verification live in
the broker and the dataplane; this is only the shape both agree on."""

from __future__ import annotations

from pydantic import Field

from sandlot.protocol.common import Actor, Capability, WireModel

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
