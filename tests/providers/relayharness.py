"""The dataplane suite's server (``tests/dataplane/conftest.py``) with the broker's relay in
front: the dataplane serves its LangSmith-compatible surface as the hosted box, reached
with an API key; the relay (:class:`~sandlot.providers.hostedrelay.HostedRelay`, on a
port of its own) verifies the suite's tokens and calls that box. The suite's tests then
address the relay exactly as they address a dataplane."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from sandlot.dataplane.services.auth import AuthContext, TokenVerifier
from sandlot.protocol.common import Actor, ActorType, Capability
from sandlot.protocol.sessions import Template
from sandlot.protocol.states import SandboxState
from sandlot.providers.hostedbox import Box
from sandlot.providers.hostedrelay import HostedRelay
from sandlot.providers.hostedstate import Hosted
from tests.dataplane.conftest import ISSUER, Server, start_server
from tests.servers import free_port

#: The provider's key at the box (the dataplane accepts it on its compatible surface).
BOX_KEY = "box-key-never-shown-to-clients"


def relayed(tmp_path: Path, **settings: Any) -> Iterator[Server]:
    async def resolver(api_key: str, sandbox_id: str) -> AuthContext | None:
        if api_key != BOX_KEY:
            return None
        return AuthContext(
            principal_id="prn_provider",
            actor=Actor(type=ActorType.AGENT, id="relay"),
            caps=frozenset(Capability),
            sandbox_id=sandbox_id,
            generation=1,
        )

    for box_server in start_server(tmp_path, api_key_resolver=resolver, **settings):
        yield from _in_front(box_server)


def _in_front(box_server: Server) -> Iterator[Server]:
    """The relay in front of ``box_server``."""
    keys = box_server.keys

    async def jwks() -> dict[str, Any]:
        return keys.jwks()

    template = Template(
        name="default",
        image="host",
        shells={"default": ["/bin/bash", "--norc", "--noprofile", "-i"], "sh": ["/bin/sh"]},
    )
    hosted = Hosted(box_server.sandbox_id, 1, template)
    relay = HostedRelay(lambda sid: _lookup(hosted, sid), TokenVerifier(jwks, issuer=ISSUER))
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(
            relay,
            host="127.0.0.1",
            port=port,
            log_level="warning",
            lifespan="off",
            ws_ping_interval=None,
        )
    )

    def run() -> None:
        async def main() -> None:
            async with httpx.AsyncClient(timeout=60) as client:
                hosted.box = Box(
                    box_server.url("", hosted.sandbox_id),
                    BOX_KEY,
                    client,
                    workspace="/workspace",
                )
                hosted.state = SandboxState.ACTIVE
                await server.serve()

        asyncio.run(main())

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    deadline = time.time() + 10
    while not server.started:
        if time.time() > deadline:
            raise RuntimeError("the relay did not start")
        time.sleep(0.01)
    try:
        yield replace(
            box_server,
            base=f"http://127.0.0.1:{port}",
            ws_base=f"ws://127.0.0.1:{port}",
            extra={"box": box_server, "hosted": hosted},
        )
    finally:
        server.should_exit = True
        thread.join(10)


def _lookup(hosted: Hosted, sandbox_id: str) -> Hosted:
    from sandlot.protocol.errors import SandboxNotFound

    if sandbox_id != hosted.sandbox_id:
        raise SandboxNotFound(f"no sandbox {sandbox_id}")
    return hosted
