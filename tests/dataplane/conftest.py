"""A real dataplane on 127.0.0.1:0 (uvicorn in a thread), tokens signed with a test key.

Every test that takes the ``server`` fixture (or ``client``) runs twice: ``[local]``
against a dataplane in the test's process, ``[docker]`` against the dataplane in a
sandbox's container, reached through the docker provider's relay
(:mod:`tests.dataplane.dockerbox`). A test that reaches into the dataplane's process
(its host object, its runtime, its event loop) is marked ``local_only`` with the reason.

A test marked ``engine`` also runs ``[podman]``: the same provider against Podman's
Docker-compatible socket (tests/podmanengine.py). The dataplane in the container is the
same code whichever engine started it, so only the tests whose outcome depends on the
container itself run a third time: processes, signals and timeouts in its pid namespace
under its init, PTYs on its ``/dev/pts``, files on its workspace volume as the host and
the sandbox's user both see them, inotify on that volume, and the read-only trust mount
rewritten from the host. Protocol, auth, limits and fuzzing tests do not.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import jwt
import pytest
import uvicorn
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from jwt.algorithms import OKPAlgorithm

from sandlot.dataplane.http.host import DataplaneHost
from sandlot.dataplane.services import native
from sandlot.dataplane.services.auth import TokenVerifier
from sandlot.dataplane.settings import DataplaneSettings
from sandlot.protocol.sessions import Template
from sandlot.protocol.states import SandboxState
from sandlot.protocol.tokens import RevokedToken
from sandlot.runtime.direct import DirectRuntime
from tests.servers import free_port

ISSUER = "https://broker.test"
ALL_CAPS = ["fs_read", "fs_write", "exec", "shell", "shell_observe"]


class Keys:
    def __init__(self) -> None:
        self.private = Ed25519PrivateKey.generate()
        self.kid = "k_test"
        self.fetches = 0

    def jwks(self) -> dict[str, Any]:
        jwk = json.loads(OKPAlgorithm.to_jwk(self.private.public_key()))
        return {"keys": [{**jwk, "kid": self.kid, "alg": "EdDSA", "use": "sig"}]}

    def claims(self, sandbox_id: str, **over: Any) -> dict[str, Any]:
        now = int(time.time())
        claims = {
            "iss": ISSUER,
            "aud": "sandlot-dataplane",
            "typ": "sandbox+jwt",
            "sub": "prn_agent",
            "act": {"type": "agent", "id": "agent-1"},
            "sid": "ssn_1",
            "sandbox_id": sandbox_id,
            "scope": "thread:thr_1",
            "caps": ALL_CAPS,
            "gen": 1,
            "iat": now,
            "nbf": now,
            "exp": now + 900,
            "jti": f"tok_{time.monotonic_ns()}",
        }
        claims.update(over)
        return claims

    def token(self, sandbox_id: str, **over: Any) -> str:
        return jwt.encode(
            self.claims(sandbox_id, **over),
            self.private,
            algorithm="EdDSA",
            headers={"kid": self.kid},
        )


class RootedRuntime(DirectRuntime):
    """A direct runtime whose file operations act as an unprivileged user."""

    def __init__(self, *args: Any, fs_ids: tuple[int, int] | None = None, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self._fs_ids = fs_ids

    @property
    def fs_ids(self) -> tuple[int, int] | None:
        return self._fs_ids


@dataclass
class Server:
    base: str
    ws_base: str
    host: DataplaneHost
    loop: asyncio.AbstractEventLoop
    keys: Keys
    sandbox_id: str
    workspace: Path
    root: Path
    runtime: RootedRuntime
    extra: dict[str, Any] = field(default_factory=dict)
    #: ``local`` (in this process), ``docker`` or ``podman`` (in a container of that
    #: engine: no ``host``, ``loop``, ``runtime`` or ``root`` here; ``workspace`` is its
    #: volume as the host sees it).
    kind: str = "local"
    #: The docker and podman variants' :class:`~tests.dataplane.dockerbox.Boxes`.
    boxes: Any = None

    def revoke(self, tokens: list[RevokedToken]) -> None:
        """Revoke ``tokens`` as the broker does: the host told directly (local), or the
        provider's trust directory rewritten and the dataplane told to re-read it (docker)."""
        if self.boxes is not None:
            self.boxes.revoke(self.sandbox_id, tokens)
        else:
            self.call(self.host.revoke, tokens)

    def last_sequence(self) -> int:
        """The sandbox's last event sequence, as its dataplane reports it to the provider
        (through the relay: the relay's own log, which its clients read)."""
        hosted = self.extra.get("hosted")
        if hosted is not None:
            return int(hosted.events.last_sequence)
        if self.boxes is not None:
            return int(self.boxes.last_sequence(self.sandbox_id))
        return int(self.call(lambda: self.host.status(self.sandbox_id)[1]))

    def url(self, path: str, sandbox_id: str | None = None) -> str:
        return f"{self.base}/{sandbox_id or self.sandbox_id}/v1{path}"

    def ws_url(self, path: str, sandbox_id: str | None = None) -> str:
        return f"{self.ws_base}/{sandbox_id or self.sandbox_id}/v1{path}"

    def token(self, **over: Any) -> str:
        return self.keys.token(self.sandbox_id, **over)

    def headers(self, **over: Any) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token(**over)}"}

    def call(self, fn: Any, *args: Any) -> Any:
        """Run ``fn(*args)`` on the server's loop (host methods are loop-bound)."""

        async def run() -> Any:
            out = fn(*args)
            if asyncio.iscoroutine(out):
                out = await out
            return out

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(10)


def start_server(
    tmp_path: Path,
    *,
    fs_ids: tuple[int, int] | None = None,
    api_key_resolver: Any = None,
    **settings: Any,
) -> Iterator[Server]:
    keys = Keys()

    async def jwks() -> dict[str, Any]:
        keys.fetches += 1
        return keys.jwks()

    verifier = TokenVerifier(jwks, issuer=ISSUER, refetch_interval=0.2)
    opts = {"watch_debounce_ms": 20, **settings}
    host = DataplaneHost(
        verifier=verifier, settings=DataplaneSettings(**opts), api_key_resolver=api_key_resolver
    )
    root = tmp_path / "root"
    workspace = root / "workspace"
    tmp = root / "tmp"
    workspace.mkdir(parents=True)
    tmp.mkdir()
    if fs_ids is not None:
        import os

        os.chown(workspace, *fs_ids)
        os.chown(tmp, *fs_ids)
    template = Template(
        name="default",
        image="host",
        shells={"default": ["/bin/bash", "--norc", "--noprofile", "-i"], "sh": ["/bin/sh"]},
    )
    runtime = RootedRuntime("sb_test", 1, template, workspace, tmp=tmp, fs_ids=fs_ids)
    port = free_port()
    config = uvicorn.Config(
        host.app,
        host="127.0.0.1",
        port=port,
        log_level="warning",
        lifespan="off",
        ws_ping_interval=None,
    )
    server = uvicorn.Server(config)
    loop_box: dict[str, asyncio.AbstractEventLoop] = {}

    def run() -> None:
        loop = asyncio.new_event_loop()
        loop_box["loop"] = loop
        asyncio.set_event_loop(loop)

        async def main() -> None:
            host.register("sb_test", 1, SandboxState.ACTIVE, runtime)
            await server.serve()
            await host.close()
            # Whatever the server left behind (tasks of sockets cut mid-way) ends here.
            current = asyncio.current_task()
            rest = [t for t in asyncio.all_tasks() if t is not current]
            for t in rest:
                t.cancel()
            await asyncio.gather(*rest, return_exceptions=True)

        loop.run_until_complete(main())
        loop.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    deadline = time.time() + 10
    while not server.started:
        if time.time() > deadline:
            raise RuntimeError("server did not start")
        time.sleep(0.01)
    srv = Server(
        base=f"http://127.0.0.1:{port}",
        ws_base=f"ws://127.0.0.1:{port}",
        host=host,
        loop=loop_box["loop"],
        keys=keys,
        sandbox_id="sb_test",
        workspace=workspace,
        root=root,
        runtime=runtime,
    )
    try:
        yield srv
    finally:
        server.should_exit = True
        thread.join(10)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "server" not in metafunc.fixturenames:
        return
    kinds = ["local"]
    if metafunc.definition.get_closest_marker("local_only") is None:
        kinds.append("docker")
        if metafunc.definition.get_closest_marker("engine") is not None:
            kinds.append("podman")
    metafunc.parametrize("server", kinds, indirect=True)


@pytest.fixture(scope="session")
def docker_boxes(request: pytest.FixtureRequest) -> Iterator[Any]:
    from tests.dataplane.dockerbox import boxes

    engine = request.getfixturevalue("docker_engine")
    image = request.getfixturevalue("docker_image")
    with boxes(engine, image) as found:
        yield found


@pytest.fixture(scope="session")
def podman_boxes(request: pytest.FixtureRequest) -> Iterator[Any]:
    from tests.dataplane.dockerbox import boxes

    engine = request.getfixturevalue("podman_engine")
    image = request.getfixturevalue("podman_image")
    with boxes(engine, image) as found:
        yield found


@pytest.fixture
def server(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Server]:
    kind = getattr(request, "param", "local")
    if kind == "local":
        yield from start_server(tmp_path)
        return
    found = request.getfixturevalue(f"{kind}_boxes")
    sandbox_id = found.take()
    try:
        base = f"{found.harness.base}/dp"
        yield Server(
            base=base,
            ws_base="ws" + base[4:],
            host=None,  # type: ignore[arg-type]
            loop=None,  # type: ignore[arg-type]
            keys=found.harness.keys,
            sandbox_id=sandbox_id,
            workspace=found.workspace(sandbox_id),
            root=None,  # type: ignore[arg-type]
            runtime=None,  # type: ignore[arg-type]
            kind=kind,
            boxes=found,
        )
    finally:
        found.release(sandbox_id)


@pytest.fixture
def client(server: Server) -> Iterator[httpx.Client]:
    with httpx.Client(headers=server.headers(), timeout=20) as c:
        yield c


@pytest.fixture(scope="session")
def lib() -> native.Native:
    """The dataplane's C library (CI builds it: its absence is a failure, not a skip)."""
    found = native.library()
    assert found is not None, "the C library is not built (see the warning above)"
    return found
