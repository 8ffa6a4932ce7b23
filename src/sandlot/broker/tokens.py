"""Signing keys and sandbox tokens (PROTOCOL.md section 4).

Tokens are EdDSA (Ed25519) JWTs with a ``kid`` header. Signing keys live in
the store so every worker and replica signs with, and publishes, the same
set; rotation adds a new key and retires the old one, which keeps verifying
(and stays in the JWKS) until every token it signed has expired.
"""

from __future__ import annotations

import json
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any

import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from jwt.algorithms import OKPAlgorithm
from sqlalchemy import Connection, select, update

from sandlot.broker.store import Store
from sandlot.broker.store.schema import signing_keys
from sandlot.protocol.common import Actor, Capability, new_id
from sandlot.protocol.errors import Unauthenticated
from sandlot.protocol.tokens import (
    TOKEN_ALGORITHM,
    TOKEN_AUDIENCE,
    TOKEN_LEEWAY_SECONDS,
    TOKEN_TYPE,
    decode_token,
    token_key_id,
)


@dataclass(frozen=True)
class SigningKey:
    kid: str
    private: Ed25519PrivateKey
    public: Ed25519PublicKey
    public_jwk: dict[str, Any]
    created_at: float
    retired_at: float | None


@dataclass(frozen=True)
class MintedToken:
    token: str
    jti: str
    issued_at: int
    expires_at: int


def _public_jwk(kid: str, public: Ed25519PublicKey) -> dict[str, Any]:
    jwk = json.loads(OKPAlgorithm.to_jwk(public))
    return {**jwk, "kid": kid, "alg": TOKEN_ALGORITHM, "use": "sig"}


class KeyRing:
    """The broker's signing keys, shared through the store."""

    #: How often a worker re-reads the store for keys added by others.
    RELOAD_SECONDS = 30.0

    def __init__(self, store: Store, *, issuer: str, max_token_ttl: int) -> None:
        self.store = store
        self.issuer = issuer
        self.max_token_ttl = max_token_ttl
        self._keys: dict[str, SigningKey] = {}
        self._loaded_at = 0.0
        self._lock = threading.Lock()

    def ensure_key(self) -> None:
        """Load the keys, creating the first one if the store has none.

        Replicas starting together make one key between them: the check and the
        insert run under the store's lock on signing keys.
        """
        self.reload()
        if self._active():
            return
        with self.store.write() as conn:
            self.store.serialize(conn, "signing_keys")
            live = conn.execute(
                select(signing_keys.c.kid).where(signing_keys.c.retired_at.is_(None))
            ).first()
            if live is None:
                self._insert_key(conn, time.time())
        self.reload()

    def reload(self) -> None:
        with self.store.read() as conn:
            rows = conn.execute(select(signing_keys)).all()
        horizon = time.time() - self.max_token_ttl - TOKEN_LEEWAY_SECONDS
        keys: dict[str, SigningKey] = {}
        for row in rows:
            if row.retired_at is not None and row.retired_at < horizon:
                continue
            existing = self._keys.get(row.kid)
            if existing is not None:
                keys[row.kid] = SigningKey(
                    row.kid,
                    existing.private,
                    existing.public,
                    existing.public_jwk,
                    row.created_at,
                    row.retired_at,
                )
                continue
            private = serialization.load_pem_private_key(row.private_pem.encode(), password=None)
            assert isinstance(private, Ed25519PrivateKey)
            keys[row.kid] = SigningKey(
                row.kid,
                private,
                private.public_key(),
                dict(row.public_jwk),
                row.created_at,
                row.retired_at,
            )
        with self._lock:
            self._keys = keys
            self._loaded_at = time.monotonic()

    def refresh_if_stale(self) -> None:
        """Pick up keys added by other workers; call outside any transaction."""
        self._maybe_reload()

    def _maybe_reload(self) -> None:
        if time.monotonic() - self._loaded_at > self.RELOAD_SECONDS:
            self.reload()

    def _active(self) -> SigningKey | None:
        live = [k for k in self._keys.values() if k.retired_at is None]
        return max(live, key=lambda k: k.created_at) if live else None

    def rotate(self) -> str:
        """Add a new signing key and retire the others; returns the new kid."""
        now = time.time()
        with self.store.write() as conn:
            self.store.serialize(conn, "signing_keys")
            conn.execute(
                update(signing_keys)
                .where(signing_keys.c.retired_at.is_(None))
                .values(retired_at=now)
            )
            kid = self._insert_key(conn, now)
        self.reload()
        return kid

    @staticmethod
    def _insert_key(conn: Connection, now: float) -> str:
        private = Ed25519PrivateKey.generate()
        kid = f"k_{secrets.token_hex(8)}"
        pem = private.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        ).decode()
        conn.execute(
            signing_keys.insert().values(
                kid=kid,
                private_pem=pem,
                public_jwk=_public_jwk(kid, private.public_key()),
                created_at=now,
            )
        )
        return kid

    def jwks(self) -> dict[str, Any]:
        self._maybe_reload()
        return {"keys": [k.public_jwk for k in self._keys.values()]}

    def mint(
        self,
        *,
        principal_id: str,
        actor: Actor,
        session_id: str,
        sandbox_id: str,
        scope_key: str,
        caps: list[Capability],
        generation: int,
        ttl: int,
        now: float | None = None,
    ) -> MintedToken:
        # No store access here: minting happens inside write transactions
        # (see refresh_if_stale, called before them).
        key = self._active()
        if key is None:
            raise RuntimeError("no signing key loaded (KeyRing.ensure_key was not called)")
        iat = int(now if now is not None else time.time())
        jti = new_id("tok", 12)
        claims = {
            "iss": self.issuer,
            "aud": TOKEN_AUDIENCE,
            "typ": TOKEN_TYPE,
            "sub": principal_id,
            "act": {"type": actor.type.value, "id": actor.id},
            "sid": session_id,
            "sandbox_id": sandbox_id,
            "scope": scope_key,
            "caps": [c.value for c in caps],
            "gen": generation,
            "iat": iat,
            "nbf": iat,
            "exp": iat + ttl,
            "jti": jti,
        }
        token = jwt.encode(claims, key.private, algorithm=TOKEN_ALGORITHM, headers={"kid": key.kid})
        return MintedToken(token=token, jti=jti, issued_at=iat, expires_at=iat + ttl)

    def verify(self, token: str) -> dict[str, Any]:
        """Check signature and standard claims (the broker side; no capability check)."""
        kid = token_key_id(token)
        key = self._keys.get(kid)
        if key is None:
            self.reload()
            key = self._keys.get(kid)
        if key is None:
            raise Unauthenticated("unknown signing key")
        claims = decode_token(token, key.public, issuer=self.issuer)
        return claims
