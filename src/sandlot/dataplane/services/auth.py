"""Who is calling: sandbox tokens (PROTOCOL.md section 4) and LangSmith API keys.

:class:`TokenVerifier` checks a token the broker minted: the algorithm is
pinned to EdDSA before anything else, the key comes from the broker's JWKS
(cached by ``kid``, re-fetched at most every ``refetch_interval`` seconds when
an unknown ``kid`` shows up, so a stream of forged kids cannot hammer the
broker), then ``iss``, ``aud``, ``typ``, ``exp``/``nbf`` (with leeway),
``sandbox_id``, ``gen``, revocation and the capability of the operation.
Verified tokens (and the caller each stands for) are cached by their text, so the
signature is checked once per token rather than once per request; everything that
can change (expiry, revocation, the sandbox and capability asked for) is checked
every time.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import jwt
from pydantic import ValidationError

from sandlot.protocol.common import Actor, Capability, expand_capabilities
from sandlot.protocol.errors import (
    CapabilityDenied,
    Forbidden,
    ProviderUnavailable,
    TokenExpired,
    Unauthenticated,
)
from sandlot.protocol.tokens import (
    MAX_TOKEN_BYTES,
    TOKEN_ALGORITHM,
    TOKEN_AUDIENCE,
    TOKEN_LEEWAY_SECONDS,
    RevokedToken,
    TokenClaims,
    decode_token,
    on_sandbox,
    token_key_id,
)

#: Returns the broker's ``/.well-known/jwks.json`` document.
JwksSource = Callable[[], Awaitable[Mapping[str, Any]]]


@dataclass(frozen=True)
class AuthContext:
    """An authenticated caller of one sandbox."""

    principal_id: str
    actor: Actor
    caps: frozenset[Capability]
    sandbox_id: str
    session_id: str | None = None
    jti: str | None = None
    #: Epoch seconds; ``None`` for credentials that do not expire on their own (API keys).
    expires_at: float | None = None
    generation: int | None = None

    def require(self, capability: Capability) -> None:
        if capability not in self.caps:
            raise CapabilityDenied(
                f"{capability.value} not granted", metadata={"capability": capability.value}
            )


#: ``(api key, sandbox_id)`` → the caller, or ``None`` when the key is not allowed there.
ApiKeyResolver = Callable[[str, str], Awaitable[AuthContext | None]]


def looks_like_jwt(value: str) -> bool:
    return value.startswith("eyJ") and value.count(".") == 2


class TokenVerifier:
    """Verifies sandbox tokens against a JWKS source; holds the revocation set."""

    def __init__(
        self,
        jwks_source: JwksSource,
        *,
        issuer: str,
        audience: str = TOKEN_AUDIENCE,
        leeway: float = TOKEN_LEEWAY_SECONDS,
        refetch_interval: float = 5.0,
        cache_size: int = 4096,
    ) -> None:
        if leeway > TOKEN_LEEWAY_SECONDS:
            raise ValueError(f"leeway is at most {TOKEN_LEEWAY_SECONDS} s")
        self._source = jwks_source
        self.issuer = issuer
        self.audience = audience
        self.leeway = leeway
        self.refetch_interval = refetch_interval
        self._keys: dict[str, Any] = {}
        self._fetched_at = -1.0
        self._fetch_lock = asyncio.Lock()
        self._cache: dict[str, TokenClaims] = {}
        #: The caller each verified token stands for (made once per token, not per call).
        self._contexts: dict[str, AuthContext] = {}
        self._cache_size = cache_size
        #: jti → expiry (epoch seconds); forgotten once the token would be expired anyway.
        self._revoked: dict[str, float] = {}

    # --- revocation ------------------------------------------------------------------

    def revoke(self, tokens: Iterable[RevokedToken]) -> None:
        now = time.time()
        for tok in tokens:
            # The longer of two revocations of one id holds (a key revoked for good, then
            # cut off one sandbox for a while).
            self._revoked[tok.jti] = max(tok.expires_at, self._revoked.get(tok.jti, 0.0))
        if len(self._revoked) > 1024:
            horizon = now - self.leeway
            self._revoked = {j: e for j, e in self._revoked.items() if e >= horizon}

    def is_revoked(self, jti: str | None) -> bool:
        """Whether ``jti`` is revoked: until its revocation's ``expires_at`` (and the
        leeway) — a token's expiry, after which it is refused anyway, or the end of an
        API key's cut from one sandbox (:func:`~sandlot.protocol.tokens.on_sandbox`)."""
        if jti is None:
            return False
        until = self._revoked.get(jti)
        return until is not None and until >= time.time() - self.leeway

    # --- keys ------------------------------------------------------------------------

    async def _refresh_keys(self, *, force: bool) -> None:
        async with self._fetch_lock:
            if not force and time.monotonic() - self._fetched_at < self.refetch_interval:
                return
            self._fetched_at = time.monotonic()
            try:
                doc = await self._source()
            except Exception as exc:
                raise ProviderUnavailable("signing keys unavailable") from exc
            keys: dict[str, Any] = {}
            raw_keys = doc.get("keys") if isinstance(doc, Mapping) else None
            for jwk in raw_keys if isinstance(raw_keys, list) else []:
                if not isinstance(jwk, Mapping) or jwk.get("kty") != "OKP":
                    continue
                kid = jwk.get("kid")
                if not isinstance(kid, str):
                    continue
                try:
                    keys[kid] = jwt.PyJWK(dict(jwk), algorithm=TOKEN_ALGORITHM).key
                except jwt.PyJWTError:
                    continue
            self._keys = keys

    async def load_keys(self) -> None:
        """Fetch the keys now (raises ``ProviderUnavailable``): a dataplane that starts
        with its sandbox has them before its first request."""
        await self._refresh_keys(force=True)

    async def _key_for(self, kid: str) -> Any:
        key = self._keys.get(kid)
        if key is None:
            # Unknown kid: the broker may have rotated. Rate-limited by _refresh_keys
            # (only the very first fetch is forced, so forged kids cannot hammer the broker).
            await self._refresh_keys(force=self._fetched_at < 0)
            key = self._keys.get(kid)
        if key is None:
            raise Unauthenticated("unknown signing key")
        return key

    # --- verification ----------------------------------------------------------------

    async def claims(self, token: str) -> TokenClaims:
        """Signature and standard claims; raises ``Unauthenticated``/``TokenExpired``."""
        if not isinstance(token, str) or len(token) > MAX_TOKEN_BYTES:
            raise Unauthenticated("token too large")
        cached = self._cache.get(token)
        if cached is not None:
            if cached.exp + self.leeway < time.time():
                raise TokenExpired("token expired", code="TOKEN_EXPIRED")
            return cached
        key = await self._key_for(token_key_id(token))
        payload = decode_token(
            token,
            key,
            issuer=self.issuer,
            audience=self.audience,
            leeway=self.leeway,
        )
        try:
            claims = TokenClaims.model_validate(payload)
        except ValidationError as exc:
            raise Unauthenticated("invalid token claims") from exc
        if len(self._cache) >= self._cache_size:
            self._cache.clear()
        self._cache[token] = claims
        return claims

    async def verify(
        self,
        token: str,
        *,
        sandbox_id: str,
        generation: int | None = None,
        capability: Capability | None = None,
    ) -> AuthContext:
        claims = await self.claims(token)
        if claims.sandbox_id != sandbox_id:
            raise Forbidden("token is for another sandbox")
        if generation is not None and claims.gen != generation:
            raise Unauthenticated("token is for another generation of this sandbox")
        if self.is_revoked(claims.jti):
            raise Unauthenticated("token revoked")
        ctx = self._contexts.get(token)
        if ctx is None:
            ctx = AuthContext(
                principal_id=claims.sub,
                actor=claims.act,
                caps=expand_capabilities(frozenset(claims.caps)),
                sandbox_id=claims.sandbox_id,
                session_id=claims.sid,
                jti=claims.jti,
                expires_at=float(claims.exp),
                generation=claims.gen,
            )
            if len(self._contexts) >= self._cache_size:
                self._contexts.clear()
            self._contexts[token] = ctx
        if capability is not None:
            ctx.require(capability)
        return ctx


class Authenticator:
    """Turns request credentials into an :class:`AuthContext` for one sandbox.

    Accepts ``Authorization: Bearer <token>``, ``X-Api-Key: <token>``, and
    ``X-Api-Key: <api key>`` when an :data:`ApiKeyResolver` is configured.
    """

    #: Seconds an API key lookup is reused (keys revoked at the broker stop working after it).
    API_KEY_TTL = 5.0

    def __init__(self, verifier: TokenVerifier, api_key_resolver: ApiKeyResolver | None) -> None:
        self.verifier = verifier
        self.api_key_resolver = api_key_resolver
        self._api_keys: dict[tuple[str, str], tuple[float, AuthContext | None]] = {}

    async def authenticate(
        self,
        *,
        bearer: str | None,
        api_key: str | None,
        sandbox_id: str,
        generation: int | None,
        capability: Capability | None,
    ) -> AuthContext:
        if bearer is not None:
            return await self.verifier.verify(
                bearer, sandbox_id=sandbox_id, generation=generation, capability=capability
            )
        if api_key is not None:
            if len(api_key) > MAX_TOKEN_BYTES:
                raise Unauthenticated("credential too large")
            if looks_like_jwt(api_key) or self.api_key_resolver is None:
                return await self.verifier.verify(
                    api_key, sandbox_id=sandbox_id, generation=generation, capability=capability
                )
            ctx = await self._resolve_api_key(api_key, sandbox_id)
            if capability is not None:
                ctx.require(capability)
            return ctx
        raise Unauthenticated("missing credentials")

    async def _resolve_api_key(self, api_key: str, sandbox_id: str) -> AuthContext:
        assert self.api_key_resolver is not None
        # Keep only a digest of the key in memory.
        cache_key = (hashlib.sha256(api_key.encode()).hexdigest(), sandbox_id)
        now = time.monotonic()
        hit = self._api_keys.get(cache_key)
        if hit is not None and hit[0] > now:
            ctx = hit[1]
        else:
            try:
                ctx = await self.api_key_resolver(api_key, sandbox_id)
            except Unauthenticated:
                ctx = None
            if len(self._api_keys) > 4096:
                self._api_keys.clear()
            self._api_keys[cache_key] = (now + self.API_KEY_TTL, ctx)
        if (
            ctx is None
            or ctx.sandbox_id != sandbox_id
            or self.verifier.is_revoked(ctx.jti)
            or (ctx.jti is not None and self.verifier.is_revoked(on_sandbox(ctx.jti, sandbox_id)))
        ):
            raise Unauthenticated("invalid API key")
        return ctx


def bearer_from_header(value: str | None) -> str | None:
    if value is None:
        return None
    scheme, _, credential = value.strip().partition(" ")
    if scheme.lower() != "bearer" or not credential.strip():
        raise Unauthenticated("expected a Bearer token")
    return credential.strip()
