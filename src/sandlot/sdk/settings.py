"""The SDK's one frozen settings object: which broker a client talks to, with which key.

Precedence, highest first: the client's arguments (``Sandlot(url, api_key)``, and the same
for ``AsyncSandlot``) > the environment > a server hosting sandlot in this very process
(:func:`register_in_process`: a LangGraph server serving
:mod:`sandlot.integrations.langgraph`, so its graphs need no configuration). An empty
value counts as none. There is no config file (the ``sandlot`` command's
``config.toml`` is the CLI's own, :mod:`sandlot.cli.settings`).

Environment variables:

- ``SANDLOT_URL``: the broker's URL.
- ``SANDLOT_API_KEY``: the API key the client authenticates with.

Nothing else in the SDK reads the environment.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class ClientSettings:
    """Where a client finds the broker (``url``, without a trailing slash) and its key."""

    url: str
    api_key: str


_in_process: ClientSettings | None = None


def register_in_process(settings: ClientSettings | None) -> None:
    """Make ``settings`` the default of clients created in this process (``None``: forget).

    A server hosting the broker calls it with its own URL and a service key it made for
    code it runs (a LangGraph server's graphs); the key lives in memory only.
    """
    global _in_process
    _in_process = settings


def in_process() -> ClientSettings | None:
    """What :func:`register_in_process` registered, if anything."""
    return _in_process


def load_settings(
    url: str | None = None,
    api_key: str | None = None,
    *,
    environ: Mapping[str, str] | None = None,
) -> ClientSettings:
    """The arguments, else ``SANDLOT_URL`` / ``SANDLOT_API_KEY``, else the in-process
    server's; raises ``ValueError`` naming what is missing."""
    env = os.environ if environ is None else environ
    url = url or env.get("SANDLOT_URL")
    api_key = api_key or env.get("SANDLOT_API_KEY")
    hosted = _in_process
    if hosted is not None and not url and not api_key:
        return hosted
    if not url:
        raise ValueError("no broker URL: pass url= or set SANDLOT_URL")
    if not api_key:
        raise ValueError("no API key: pass api_key= or set SANDLOT_API_KEY")
    return ClientSettings(url=url.rstrip("/"), api_key=api_key)
