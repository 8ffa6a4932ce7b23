"""How many WebSockets a sandbox and a credential may hold open at once.

Every WebSocket route takes a :class:`Place` before it accepts the socket: one of the
sandbox's ``max_websockets_per_sandbox``. A socket whose credentials come in its
headers is authenticated at once and its place then counts against that token's
``max_websockets_per_token`` too. A socket that will authenticate with its first
frame counts, until then, against the sandbox's *unauthenticated* sockets, limited like
one token: nobody without a token can take all of a sandbox's places, and nobody can
hold more than a token's worth of them for longer than the auth timeout. Over a limit
the socket is closed at once with 4429 (nothing else is started for it). The place is
given back exactly once, when the socket's handler ends, however it ends.

A "token" is the credential's ``jti``; for an API key (which has none) it is the key's
principal.
"""

from __future__ import annotations

from typing import TypeVar

from sandlot.dataplane.services.auth import AuthContext
from sandlot.protocol.errors import RateLimited

K = TypeVar("K")

#: The key of a sandbox's sockets still waiting for their ``auth`` frame.
UNAUTHENTICATED = ""


def _decrement(counts: dict[K, int], key: K) -> None:
    left = counts[key] - 1
    if left:
        counts[key] = left
    else:
        del counts[key]


def token_key(ctx: AuthContext) -> str:
    return ctx.jti if ctx.jti is not None else f"principal:{ctx.principal_id}"


class SocketLimits:
    """The counts, for one dataplane host (all of them on its event loop)."""

    def __init__(self, per_token: int, per_sandbox: int) -> None:
        self.per_token = per_token
        self.per_sandbox = per_sandbox
        self.by_sandbox: dict[str, int] = {}
        self.by_token: dict[tuple[str, str], int] = {}
        #: Open sockets by route (``/exec/ws``...), for the metrics.
        self.by_route: dict[str, int] = {}
        #: Sockets refused, by the limit that refused them (``token``, ``sandbox``).
        self.refused: dict[str, int] = {}

    def admit(self, sandbox_id: str, route: str, *, authenticated: bool) -> Place:
        """A place for a socket about to be accepted (``RateLimited`` when there is none).

        ``authenticated=False``: the socket waits for its ``auth`` frame, and is counted
        with the sandbox's other unauthenticated sockets until :meth:`Place.claim`.
        """
        if self.by_sandbox.get(sandbox_id, 0) >= self.per_sandbox:
            self._refuse("sandbox")
            raise RateLimited(
                f"too many WebSockets open on this sandbox (limit {self.per_sandbox})",
                metadata={"limit": self.per_sandbox},
            )
        if not authenticated and self._full(sandbox_id, UNAUTHENTICATED):
            self._refuse("unauthenticated")
            raise RateLimited(
                "too many WebSockets waiting to authenticate on this sandbox "
                f"(limit {self.per_token}); send credentials in the headers or retry",
                metadata={"limit": self.per_token},
            )
        self.by_sandbox[sandbox_id] = self.by_sandbox.get(sandbox_id, 0) + 1
        self.by_route[route] = self.by_route.get(route, 0) + 1
        place = Place(self, sandbox_id, route)
        if not authenticated:
            place._hold(UNAUTHENTICATED)
        return place

    def _full(self, sandbox_id: str, key: str) -> bool:
        return self.by_token.get((sandbox_id, key), 0) >= self.per_token

    def _refuse(self, limit: str) -> None:
        self.refused[limit] = self.refused.get(limit, 0) + 1

    @property
    def open(self) -> int:
        return sum(self.by_sandbox.values())


class Place:
    """One open socket's place; :meth:`release` gives it back (only the first call counts)."""

    __slots__ = ("key", "limits", "released", "route", "sandbox_id")

    def __init__(self, limits: SocketLimits, sandbox_id: str, route: str) -> None:
        self.limits = limits
        self.sandbox_id = sandbox_id
        self.route = route
        self.key: str | None = None
        self.released = False

    def _hold(self, key: str) -> None:
        counts = self.limits.by_token
        slot = (self.sandbox_id, key)
        counts[slot] = counts.get(slot, 0) + 1
        self.key = key

    def _let_go(self) -> None:
        if self.key is not None:
            _decrement(self.limits.by_token, (self.sandbox_id, self.key))
            self.key = None

    def claim(self, ctx: AuthContext) -> None:
        """The socket authenticated as ``ctx``: count it against that token from now on."""
        key = token_key(ctx)
        if self.key == key or self.released:
            return
        self._let_go()
        if self.limits._full(self.sandbox_id, key):
            self.limits._refuse("token")
            limit = self.limits.per_token
            raise RateLimited(
                f"too many WebSockets open with this token (limit {limit})",
                metadata={"limit": limit},
            )
        self._hold(key)

    def switch(self, ctx: AuthContext) -> None:
        """A refreshed token (a later ``auth`` frame): the socket now counts against it.

        Never refused: a refresh does not close a socket that works.
        """
        if self.released:
            return
        self._let_go()
        self._hold(token_key(ctx))

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        self._let_go()
        _decrement(self.limits.by_sandbox, self.sandbox_id)
        _decrement(self.limits.by_route, self.route)
