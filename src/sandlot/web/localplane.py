"""The local folder's dataplane: the dataplane's own code, served inside the web server.

In ``local`` mode the workspace is a folder of this machine. The web server serves it the
way it serves a sandbox, through a dataplane: :func:`~sandlot.dataplane.http.host.
create_standalone_app` over a :class:`~sandlot.runtime.direct.DirectRuntime` that mounts
the folder at ``/workspace`` (file operations are confined to it by the dataplane's own
path resolution; commands and shells are plain processes of this machine's user, with no
isolation). It listens on a loopback port chosen by the kernel, in this process (a
uvicorn server task), and the web server reaches it through its gateway like any other
upstream.

Its tokens are the dataplane's usual EdDSA tokens (PROTOCOL.md section 4), signed with a
key made when the web server starts and kept only in memory (:class:`LocalSigner`); the
dataplane checks them with its usual :class:`~sandlot.dataplane.services.auth.
TokenVerifier`, against that key alone. They name the signed-in user as a ``human``
actor, so the folder's event log says who changed what. No log line shows one: uvicorn's
debug dump of a WebSocket handshake's headers has them masked
(:mod:`~sandlot.web.redaction`).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import json
import logging
import secrets
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jwt
import uvicorn
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from jwt.algorithms import OKPAlgorithm

from sandlot.dataplane.http.host import create_standalone_app
from sandlot.dataplane.services.auth import TokenVerifier
from sandlot.dataplane.settings import DataplaneSettings
from sandlot.protocol.common import Capability
from sandlot.protocol.errors import ProviderUnavailable
from sandlot.protocol.sessions import Template
from sandlot.protocol.tokens import TOKEN_ALGORITHM, TOKEN_AUDIENCE, TOKEN_TYPE
from sandlot.runtime.direct import DirectRuntime
from sandlot.web.allowlist import Upstream
from sandlot.web.redaction import MASK
from sandlot.web.workspace import Dataplane

log = logging.getLogger("sandlot.web.local")

#: The local folder's sandbox id (its dataplane serves this one sandbox).
SANDBOX_ID = "sb_local"
ISSUER = "sandlot-web-local"
#: Lifetime of a token (the dataplane's default, PROTOCOL.md section 4).
TOKEN_TTL_SECONDS = 900
#: What a signed-in user may do in the folder: everything, it is theirs.
CAPABILITIES = (
    Capability.FS_READ,
    Capability.FS_WRITE,
    Capability.EXEC,
    Capability.SHELL,
    Capability.SHELL_OBSERVE,
)


@dataclass(frozen=True)
class MintedToken:
    token: str = field(repr=False)
    expires_at: float


class LocalSigner:
    """Signs the local dataplane's tokens with a key that lives only in this process."""

    def __init__(
        self,
        *,
        sandbox_id: str = SANDBOX_ID,
        ttl_seconds: int = TOKEN_TTL_SECONDS,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.sandbox_id = sandbox_id
        self.ttl_seconds = ttl_seconds
        self._clock = clock
        self._key = Ed25519PrivateKey.generate()
        self._kid = f"web_{secrets.token_hex(8)}"
        public = json.loads(OKPAlgorithm.to_jwk(self._key.public_key()))
        self._jwks = {"keys": [{**public, "kid": self._kid, "alg": TOKEN_ALGORITHM, "use": "sig"}]}

    async def jwks(self) -> dict[str, Any]:
        return self._jwks

    def verifier(self) -> TokenVerifier:
        return TokenVerifier(self.jwks, issuer=ISSUER)

    def mint(self, user_id: str) -> MintedToken:
        now = int(self._clock())
        claims = {
            "iss": ISSUER,
            "aud": TOKEN_AUDIENCE,
            "typ": TOKEN_TYPE,
            "sub": user_id,
            "act": {"type": "human", "id": user_id},
            "sid": "ssn_local",
            "sandbox_id": self.sandbox_id,
            "scope": "workspace:local",
            "caps": [c.value for c in CAPABILITIES],
            "gen": 1,
            "iat": now,
            "nbf": now,
            "exp": now + self.ttl_seconds,
            "jti": f"jti_{secrets.token_hex(12)}",
        }
        token = jwt.encode(claims, self._key, algorithm=TOKEN_ALGORITHM, headers={"kid": self._kid})
        return MintedToken(token, float(now + self.ttl_seconds))


class LocalState(enum.StrEnum):
    """The local dataplane's lifecycle: ``stopped → starting → running → stopping →
    stopped``; ``failed`` when it could not start or stopped on its own."""

    STOPPED = "stopped"
    STARTING = "starting"
    RUNNING = "running"
    STOPPING = "stopping"
    FAILED = "failed"


_MOVES = {
    LocalState.STOPPED: {LocalState.STARTING},
    LocalState.STARTING: {LocalState.RUNNING, LocalState.FAILED},
    LocalState.RUNNING: {LocalState.STOPPING, LocalState.FAILED},
    LocalState.STOPPING: {LocalState.STOPPED},
    LocalState.FAILED: {LocalState.STOPPING, LocalState.STOPPED},
}


class _Server(uvicorn.Server):
    """uvicorn inside another server's process: the signals stay the outer server's."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def default_shells() -> dict[str, list[str]]:
    """The folder's shell profiles: bash when the machine has it, else sh."""
    bash = Path("/bin/bash")
    first = [str(bash), "-l"] if bash.exists() else ["/bin/sh"]
    return {"default": first, "sh": ["/bin/sh"]}


class LocalDataplane:
    """The dataplane of one folder, on ``127.0.0.1`` at a port the kernel picks.

    The port is bound at construction (so the gateway's allowlist can name it before
    anything is served); :meth:`start` serves it, :meth:`stop` ends it. :meth:`dataplane`
    gives the coordinates and a token for one user.
    """

    #: A token is minted again when less than this share of its lifetime is left.
    RENEW_FRACTION = 1 / 3

    def __init__(
        self,
        root: Path,
        *,
        settings: DataplaneSettings | None = None,
        signer: LocalSigner | None = None,
    ) -> None:
        root = root.resolve()
        if not root.is_dir():
            raise ValueError(f"{root} is not a directory")
        self.root = root
        self.signer = signer or LocalSigner()
        self._settings = settings
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.set_inheritable(False)
        self.port: int = self._sock.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}"
        self._state = LocalState.STOPPED
        self._server: _Server | None = None
        self._task: asyncio.Task[None] | None = None
        self._tokens: dict[str, MintedToken] = {}

    @property
    def state(self) -> LocalState:
        if self._state is LocalState.RUNNING and self._task is not None and self._task.done():
            self._state = LocalState.FAILED
        return self._state

    def _move(self, to: LocalState) -> None:
        if to not in _MOVES[self._state]:
            raise RuntimeError(f"local dataplane cannot go from {self._state} to {to}")
        self._state = to

    def upstream(self) -> Upstream:
        """What the gateway may reach: this dataplane's ``/v1/`` routes."""
        return Upstream("local", self.base_url, ("/v1/",))

    async def start(self, timeout: float = 10.0) -> None:
        if self._sock.fileno() == -1:
            raise RuntimeError("a stopped local dataplane does not start again (its port is gone)")
        self._move(LocalState.STARTING)
        template = Template(name="local", image="host", shells=default_shells())
        runtime = DirectRuntime(SANDBOX_ID, 1, template, self.root)
        settings = self._settings or DataplaneSettings.from_env()
        app = create_standalone_app(runtime, verifier=self.signer.verifier(), settings=settings)
        config = uvicorn.Config(
            app,
            log_config=None,
            access_log=False,
            lifespan="on",
            ws_per_message_deflate=False,
            timeout_graceful_shutdown=2,
        )
        self._sock.listen(1024)
        # uvicorn's WebSocket server dumps each handshake's headers to ``uvicorn.error``
        # at DEBUG, the gateway's ``Authorization: Bearer <token>`` among them.
        logging.getLogger("uvicorn.error").addFilter(MASK)
        self._server = server = _Server(config)
        self._task = asyncio.get_running_loop().create_task(
            server.serve(sockets=[self._sock]), name="sandlot-web-local-dataplane"
        )
        deadline = time.monotonic() + timeout
        while not server.started:
            if self._task.done() or time.monotonic() > deadline:
                self._move(LocalState.FAILED)
                with contextlib.suppress(BaseException):
                    await asyncio.wait_for(self._task, 1)
                raise ProviderUnavailable("the local folder's dataplane did not start")
            await asyncio.sleep(0.01)
        self._move(LocalState.RUNNING)
        log.info("local folder %s served on %s (no isolation)", self.root, self.base_url)

    async def stop(self) -> None:
        if self._state is LocalState.STOPPED:
            self._sock.close()
            return
        self._move(LocalState.STOPPING)
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(self._task, 10)
        self._sock.close()
        self._tokens.clear()
        self._move(LocalState.STOPPED)

    def dataplane(self, user_id: str, *, fresh: bool = False) -> Dataplane:
        """The folder's dataplane with a token for ``user_id`` (reused while enough of its
        lifetime is left; ``fresh`` mints a new one)."""
        if self.state is not LocalState.RUNNING:
            raise ProviderUnavailable(
                "the local folder's dataplane is not running",
                metadata={"state": self.state.value},
            )
        minted = self._tokens.get(user_id)
        left = self.signer.ttl_seconds * self.RENEW_FRACTION
        if fresh or minted is None or minted.expires_at - time.time() < left:
            minted = self.signer.mint(user_id)
            self._tokens[user_id] = minted
        return Dataplane(
            sandbox_id=SANDBOX_ID,
            http_base_url=f"{self.base_url}/v1",
            ws_base_url=f"ws://127.0.0.1:{self.port}/v1",
            token=minted.token,
            capabilities=frozenset(c.value for c in CAPABILITIES),
        )
