"""What a browser works on: a workspace, reached through one sandbox dataplane.

Both modes end at a dataplane the web server reaches through its
:class:`~sandlot.web.gateway.Gateway`, so the routes above are the same code whatever
the mode (parity by construction):

- ``sandbox``: the sandbox bound to a thread (or a standalone sandbox), its grant
  negotiated with the broker by the server for the signed-in user, and refreshed by it;
- ``local``: a folder of the machine running the server, served by a dataplane of the
  server's own on loopback (plain processes, no isolation), with tokens it mints.

The browser never sees a :class:`Dataplane`: it holds the token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class Dataplane:
    """One sandbox's dataplane as the gateway calls it: ``http_base_url`` and
    ``ws_base_url`` end in ``/v1`` (``…/dp/sb_1/v1``); ``token`` is current when handed out."""

    sandbox_id: str
    http_base_url: str
    ws_base_url: str
    token: str = field(repr=False)
    #: Which capabilities the token carries (``fs_read``, ``fs_write``, ``exec``, ``shell``…).
    capabilities: frozenset[str] = frozenset()


class Workspace(Protocol):
    """A workspace a signed-in user opened: a thread's sandbox, a sandbox, or the folder."""

    #: What the browser names it by: a thread id, a sandbox id, or ``local``.
    @property
    def id(self) -> str: ...

    async def dataplane(self) -> Dataplane:
        """Its dataplane, with a token fresh enough for one call or one WebSocket's
        handshake (renewed by the server as needed; never by the browser)."""
        ...

    async def renewed(self) -> Dataplane:
        """Its dataplane with a new token, after the dataplane refused the last one (it
        expired or was revoked early)."""
        ...
