"""The servers the benchmarks measure: ``sandlot serve`` as users run it, and a stripped one.

- :class:`Served`: a real ``sandlot serve`` subprocess (``tests/servers.py``):
  isolated sandboxes when run as root (else unisolated, and the tables say so),
  the broker in the same process, the shipped ``default`` template (its shell
  profile ``/bin/bash -l``, its disk), file watching on: the dataplane's
  defaults. Its config only raises the per-user limits (live sandboxes,
  negotiations per second) so that thousands of requests in a row are not
  throttled; the code path is the shipped one. Sandboxes come from ``ensure``
  through the SDK, whose client keeps their tokens fresh.
- :class:`Standalone`: the *stripped* configuration the figures were once taken
  in: the dataplane alone (uvicorn, ``create_standalone_app``), the direct
  (unisolated) runtime, file watching off, ``/bin/sh`` shells, a token signed by
  the benchmark. Shown as a second, labelled column, never instead.

Both hand out :class:`Endpoint`: one sandbox's dataplane as a client reaches it
(the SDK's :class:`~sandlot.sdk.Sandbox`, a stock httpx client, a raw socket
client, WebSocket URLs and the workspace's path on this host).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.servers import SandlotServer  # noqa: E402

#: Only limits are raised; everything else is the shipped configuration.
CONFIG = """
[quotas]
max_live_sandboxes_per_user = 100000
negotiation_rate_per_second = 1000000
negotiation_burst = 1000000
"""

#: The stripped configuration, as labelled in the tables.
STRIPPED_WHAT = "standalone dataplane, unisolated, no watcher"
STRIPPED = f"stripped: {STRIPPED_WHAT}"


class GrantAuth(httpx.Auth):
    """The current token of an SDK sandbox (kept fresh by its client) on every request."""

    def __init__(self, sandbox: Any) -> None:
        self.sandbox = sandbox

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        request.headers["Authorization"] = f"Bearer {self.sandbox.grant.token}"
        yield request


class RawHttp:
    """A minimal keep-alive HTTP/1.1 client (TCP_NODELAY): the server's own latency,
    with next to nothing of a client library's own cost per request."""

    #: Reconnect before a request after this long unused (uvicorn closes idle
    #: keep-alive connections after 5 s), so no sample pays for a connection.
    IDLE = 4.0

    def __init__(self, base: str, token: Callable[[], str]) -> None:
        url = urlsplit(base)
        self.prefix = url.path.rstrip("/")
        self.address = (url.hostname, url.port)
        self.token = token
        self.sock = self._connect()
        self.used = time.monotonic()

    def _connect(self) -> socket.socket:
        sock = socket.create_connection(self.address)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def request(self, method: str, path: str, body: bytes = b"") -> bytes:
        if time.monotonic() - self.used > self.IDLE:
            self.sock.close()
            self.sock = self._connect()
        head = (
            f"{method} {self.prefix}{path} HTTP/1.1\r\nHost: x\r\n"
            f"Authorization: Bearer {self.token()}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        self.sock.sendall(head.encode() + body)
        buf = b""
        while b"\r\n\r\n" not in buf:
            chunk = self.sock.recv(1 << 20)
            if not chunk:
                raise ConnectionError("raw client: the server closed the connection")
            buf += chunk
        header, _, rest = buf.partition(b"\r\n\r\n")
        if not header.startswith(b"HTTP/1.1 2"):
            raise RuntimeError(f"raw client: {header[:80]!r}")
        length = 0
        for line in header.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":")[1])
        while len(rest) < length:
            chunk = self.sock.recv(1 << 20)
            if not chunk:
                raise ConnectionError("raw client: the server closed the connection")
            rest += chunk
        self.used = time.monotonic()
        return rest

    def close(self) -> None:
        self.sock.close()


@dataclass
class Endpoint:
    """One sandbox's dataplane as a client reaches it."""

    #: The SDK's client of the sandbox (``sandlot.sdk.Sandbox``).
    sandbox: Any
    #: The process serving it (for its memory).
    pid: int
    #: ``/workspace`` of the sandbox, on this host.
    workspace: Path
    #: The program of the ``default`` shell profile.
    shell: list[str]
    clients: list[Any] = field(default_factory=list)

    @property
    def base(self) -> str:
        return str(self.sandbox.grant.http_base_url)

    @property
    def ws_base(self) -> str:
        return str(self.sandbox.grant.ws_base_url)

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.sandbox.grant.token}"}

    def httpx(self, **kw: Any) -> httpx.Client:
        """A stock httpx client (keep-alive) with the sandbox's current token."""
        client = httpx.Client(auth=GrantAuth(self.sandbox), **kw)
        self.clients.append(client)
        return client

    def async_httpx(self, **kw: Any) -> httpx.AsyncClient:
        client = httpx.AsyncClient(auth=GrantAuth(self.sandbox), **kw)
        self.clients.append(client)
        return client

    def raw(self) -> RawHttp:
        raw = RawHttp(self.base, lambda: str(self.sandbox.grant.token))
        self.clients.append(raw)
        return raw

    def close(self) -> None:
        for client in self.clients:
            if isinstance(client, httpx.Client | RawHttp):
                client.close()
        self.clients.clear()


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


class Served:
    """``sandlot serve`` in a subprocess, and sandboxes from it through the SDK."""

    def __init__(self, root: Path, *, config: str = "", env: dict[str, str] | None = None) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.server = SandlotServer(root / "served", config=CONFIG + config, env=env)
        self.client: Any = None
        self.key = ""

    @property
    def mode(self) -> str:
        return self.server.mode

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def pid(self) -> int:
        assert self.server.proc is not None
        return self.server.proc.pid

    def start(self) -> Served:
        from sandlot.sdk import Sandlot

        if threading.current_thread() is threading.main_thread():
            # A benchmark stopped with SIGTERM still stops its servers and removes their
            # sandboxes (the `finally` blocks run).
            signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        self.server.start(timeout=120)
        self.key = self.server.key("bench")
        self.client = Sandlot(self.server.url, self.key)
        return self

    def default_shell(self) -> list[str]:
        r = httpx.get(
            f"{self.url}/v1/templates/default",
            headers={"Authorization": f"Bearer {self.key}"},
            timeout=30,
        )
        r.raise_for_status()
        return list(r.json().get("shells", {}).get("default") or ["/bin/sh"])

    def ensure(self, thread: str = "bench") -> Endpoint:
        """The thread's sandbox, active, as users get it (``Sandlot.ensure``)."""
        sandbox = self.client.ensure(thread)
        return Endpoint(sandbox, self.pid, self.workspace_of(sandbox), self.default_shell())

    def workspace_of(self, sandbox: Any) -> Path:
        """Where the sandbox's ``/workspace`` is on this host: the runtime's record of it
        (``run/<id>/state.json``), checked with a file written in the sandbox."""
        marker = f".bench-{uuid.uuid4().hex}"
        sandbox.write(f"/workspace/{marker}", "")
        try:
            state = self.server.data_dir / "run" / sandbox.id / "state.json"
            candidates = [Path(json.loads(state.read_text())["workspace"])]
        except (OSError, ValueError, KeyError):
            candidates = []
        candidates.append(self.server.data_dir / "workspaces" / sandbox.id)
        try:
            for ws in candidates:
                if (ws / marker).exists():
                    return ws
        finally:
            sandbox.delete(f"/workspace/{marker}")
        raise RuntimeError(f"workspace of {sandbox.id} not found (tried {candidates})")

    def release(self, endpoint: Endpoint) -> None:
        """Terminate an endpoint's sandbox (so that many first shells leave nothing behind)."""
        endpoint.close()
        self.client.release(endpoint.sandbox.grant.session_id, terminate=True)

    def stop(self) -> None:
        if self.client is not None:
            self.client.close()
        self.server.stop()
        self.server.cleanup()


def serve_standalone(workspace: str) -> None:
    """The stripped dataplane (``python bench/served.py --serve WORKSPACE``)."""
    import jwt
    import uvicorn
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from jwt.algorithms import OKPAlgorithm

    from sandlot.dataplane.http.host import create_standalone_app
    from sandlot.dataplane.services.auth import TokenVerifier
    from sandlot.dataplane.settings import DataplaneSettings
    from sandlot.protocol.sessions import Template
    from sandlot.runtime.direct import DirectRuntime

    key = Ed25519PrivateKey.generate()
    jwk = {**json.loads(OKPAlgorithm.to_jwk(key.public_key())), "kid": "k1", "alg": "EdDSA"}

    async def jwks() -> dict[str, Any]:
        return {"keys": [jwk]}

    now = int(time.time())
    token = jwt.encode(
        {
            "iss": "bench", "aud": "sandlot-dataplane", "typ": "sandbox+jwt", "sub": "p",
            "act": {"type": "agent", "id": "a"}, "sid": "s", "sandbox_id": "sb_bench",
            "scope": "thread:t", "caps": ["fs_read", "fs_write", "exec", "shell"], "gen": 1,
            "iat": now, "nbf": now, "exp": now + 3 * 3600, "jti": "j1",
        },
        key, algorithm="EdDSA", headers={"kid": "k1"},
    )  # fmt: skip
    template = Template(name="t", image="host", shells={"default": ["/bin/sh"]})
    runtime = DirectRuntime("sb_bench", 1, template, Path(workspace))
    app = create_standalone_app(
        runtime,
        verifier=TokenVerifier(jwks, issuer="bench"),
        settings=DataplaneSettings.from_env(watch_fs=False, max_shells=200),
    )
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    print(json.dumps({"port": port, "token": token}), flush=True)
    config = uvicorn.Config(app, log_level="warning", ws_per_message_deflate=False)
    uvicorn.Server(config).run(sockets=[sock])


class Standalone:
    """The stripped dataplane (see the module docstring) in a subprocess."""

    def __init__(self, workspace: Path, *, spare_shells: bool = True) -> None:
        self.workspace = workspace
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--serve", str(workspace)],
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "SANDLOT_DP_SPARE_SHELLS": "1" if spare_shells else "0"},
        )
        assert self.proc.stdout is not None
        info = json.loads(self.proc.stdout.readline())
        self.port: int = info["port"]
        self.token: str = info["token"]
        self.base = f"http://127.0.0.1:{self.port}/v1"
        self.wait_ready()

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        with httpx.Client() as c:
            while True:
                try:
                    c.get(f"{self.base}/healthz").raise_for_status()
                    return
                except httpx.TransportError:
                    if self.proc.poll() is not None or time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def endpoint(self) -> Endpoint:
        """The SDK's client for this dataplane (a grant in hand, the sandbox active)."""
        from sandlot.sdk import Sandbox

        sb = Sandbox(
            {"sandbox_id": "sb_bench", "http_url": self.base, "token": self.token},
            keepalive=None,
        )
        sb.grant.state = "active"
        return Endpoint(sb, self.pid, self.workspace, ["/bin/sh"])

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


def metric_sums(url: str, family: str, labels: dict[str, str]) -> tuple[float, float]:
    """(sum of seconds, count) of a histogram family on ``/metrics``, for one label set."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    want = [f'{k}="{v}"' for k, v in labels.items()]
    total = count = 0.0
    for line in text.splitlines():
        m = re.match(rf"{family}_(sum|count)\{{([^}}]*)\}} (\S+)", line)
        if m and all(w in m.group(2) for w in want):
            if m.group(1) == "sum":
                total += float(m.group(3))
            else:
                count += float(m.group(3))
    return total, count


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--serve", help="run the stripped dataplane on this workspace")
    args = ap.parse_args()
    if args.serve:
        serve_standalone(args.serve)
        return
    # A smoke test: both servers, one call each.
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        served = Served(Path(tmp)).start()
        ws = Path(tmp) / "ws"
        ws.mkdir()
        stripped = Standalone(ws)
        try:
            for name, ep in (
                (f"sandlot serve ({served.mode})", served.ensure()),
                (STRIPPED, stripped.endpoint()),
            ):
                ep.sandbox.write("hello.txt", "hi")
                got = ep.httpx().get(f"{ep.base}/fs/read", params={"path": "hello.txt"}).json()
                raw = json.loads(ep.raw().request("GET", "/fs/read?path=hello.txt"))
                assert got["content"] == raw["content"] == "hi"
                print(f"{name}: workspace {ep.workspace}, shell {ep.shell}, pid {ep.pid}")
                ep.close()
        finally:
            stripped.stop()
            served.stop()


if __name__ == "__main__":
    main()
