"""The provider a server runs, wired to the broker in its process: what ``sandlot serve``
and a LangGraph server hosting sandlot (:mod:`sandlot.integrations.langgraph`) share."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from sandlot.broker.core import Broker
from sandlot.broker.identities import identity
from sandlot.broker.principals import Principal
from sandlot.broker.revocations import api_key_jti
from sandlot.broker.settings import BrokerSettings, ConfigError
from sandlot.dataplane.services.auth import AuthContext
from sandlot.dataplane.settings import DataplaneSettings
from sandlot.protocol.common import Scope
from sandlot.protocol.errors import SandlotError, Unauthenticated
from sandlot.providers.base import Provider, provider_class
from sandlot.providers.multi import MultiProvider

JwksSource = Callable[[], Awaitable[Mapping[str, Any]]]
ApiKeyResolver = Callable[[str, str], Awaitable[AuthContext | None]]


def build_provider(
    settings: BrokerSettings,
    broker_ref: list[Broker],
    *,
    dataplane_url: str | None = None,
    jwks_source: JwksSource | None = None,
    key_resolver: ApiKeyResolver | None = None,
) -> Provider:
    """Instantiate the configured provider, wiring in what an in-process dataplane needs:
    the signing keys and the API keys of the broker in ``broker_ref``, or (a host without
    the store, :mod:`sandlot.cli.hostagent`) ``jwks_source`` and ``key_resolver``."""

    async def jwks() -> Mapping[str, Any]:
        # Read afresh: another replica may have signed with a key it added since (the
        # dataplane asks at most every few seconds).
        keyring = broker_ref[0].keyring
        await asyncio.to_thread(keyring.reload)
        return await asyncio.to_thread(keyring.jwks)

    async def api_key_resolver(api_key: str, sandbox_id: str) -> AuthContext | None:
        return await resolve_api_key(broker_ref[0], api_key, sandbox_id)

    async def store_identity(name: str, proposed: str) -> str:
        # Replicas on one store share what the first of them proposed.
        return await asyncio.to_thread(identity, broker_ref[0].store, name, proposed)

    try:
        dataplane_settings = DataplaneSettings.from_env()
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    wired: dict[str, Any] = {
        "mode": settings.provider_mode,
        "data_dir": settings.data_dir,
        "public_url": dataplane_url or settings.dataplane_url or settings.base_url,
        "issuer": settings.issuer,
        "jwks": jwks_source or jwks,
        "api_key_resolver": key_resolver or api_key_resolver,
        "dataplane_settings": dataplane_settings,
    }
    if jwks_source is None:  # a process with the store
        wired["identity_source"] = store_identity
    members: dict[str, Provider] = {}
    for name, table in settings.providers.items():
        config = {k: v for k, v in table.items() if k != "kind"}
        members[name] = provider_class(str(table["kind"]))({**wired, **config})
    if len(members) == 1:
        return next(iter(members.values()))
    return MultiProvider(members, settings.default_provider)


async def resolve_api_key(broker: Broker, api_key: str, sandbox_id: str) -> AuthContext | None:
    """Who an API key used on a sandbox's dataplane (``X-Api-Key``) is, or None if the key
    is invalid or its user may not reach the sandbox (its owner, an admin, a member of
    its scope)."""
    try:
        principal: Principal = await asyncio.to_thread(broker.keys.authenticate, api_key)
        row = await asyncio.to_thread(broker.sandboxes.get, sandbox_id)
    except (Unauthenticated, SandlotError):
        return None
    allowed = row.owner_user_id == principal.effective_user or principal.is_admin
    if not allowed and row.scope_key is not None:
        try:
            members = await asyncio.to_thread(
                broker.members.members, principal, _scope_of(row.scope_key)
            )
            allowed = principal.effective_user in members.members
        except SandlotError:
            allowed = False
    if not allowed:
        return None
    policy = broker.settings.policy_for(principal.actor_type)
    return AuthContext(
        principal_id=principal.id,
        actor=principal.actor,
        caps=frozenset(policy.allowed),
        sandbox_id=sandbox_id,
        generation=row.generation,
        # Revoking the key revokes this id: its sockets close like a token's.
        jti=api_key_jti(principal.key_id) if principal.key_id else None,
    )


def _scope_of(key: str) -> Scope:
    return Scope.parse(key)
