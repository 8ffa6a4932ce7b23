"""jupyter_server as a peer measured side by side: started by the benchmark itself on loopback.

:class:`JupyterServer` runs ``jupyter_server`` in a subprocess (``--allow-root``,
token auth with a generated token, no browser, a free port, a root directory
given by the caller, its own config/runtime/data directories) and stops it and
everything it started at the end. Terminals run the program given (the
benchmarks give the served ``default`` profile's, ``/bin/bash -l``) with an empty
home, as a sandbox's shell has.

``nodelay=True`` starts it with ``TCP_NODELAY`` forced on every socket it
serves. Stock tornado leaves Nagle's algorithm on for WebSockets, so small
frames sent back to back wait for the client's delayed ACK (about 40 ms); a
client cannot change that from its side. Measuring both shows how much of the
stock figure is that stall.

Run ``python bench/jupyter_peer.py`` for a short smoke test of every operation.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


class JupyterServer:
    def __init__(
        self, root: Path, *, nodelay: bool = False, shell: str | list[str] = "/bin/sh"
    ) -> None:
        self.root = Path(root)
        self.nodelay = nodelay
        self.shell = [shell] if isinstance(shell, str) else list(shell)
        self.token = secrets.token_hex(24)
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self._dir = Path(tempfile.mkdtemp(prefix="sandlot-jupyter-peer-"))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"token {self.token}"}

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def launch(self) -> JupyterServer:
        """Start the process; :meth:`wait_ready` waits for it to answer."""
        self.port = free_port()
        config = {
            "ServerApp": {
                "ip": "127.0.0.1",
                "port": self.port,
                "port_retries": 0,
                "open_browser": False,
                "allow_root": True,
                "root_dir": str(self.root),
                "terminado_settings": {"shell_command": self.shell},
                "log_level": "WARN",
            },
            "IdentityProvider": {"token": self.token},
        }
        (self._dir / "home").mkdir(exist_ok=True)
        cfg = self._dir / "jupyter_server_config.json"
        cfg.write_text(json.dumps(config))
        env = {
            **os.environ,
            "JUPYTER_CONFIG_DIR": str(self._dir / "config"),
            "JUPYTER_RUNTIME_DIR": str(self._dir / "runtime"),
            "JUPYTER_DATA_DIR": str(self._dir / "data"),
            "JUPYTER_PLATFORM_DIRS": "1",
            "SHELL": self.shell[0],
            # An empty home: a login shell reads the system's profile only, as in a
            # sandbox (this host's root profile runs pyenv hooks at every prompt).
            "HOME": str(self._dir / "home"),
        }
        argv = [sys.executable, __file__, "--launch"]
        if self.nodelay:
            argv.append("--nodelay")
        argv += [f"--config={cfg}", "--allow-root", "--no-browser"]
        self._log = open(self._dir / "server.log", "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            argv,
            env=env,
            cwd=self.root,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        return self

    def wait_ready(self, timeout: float = 90.0) -> JupyterServer:
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        with httpx.Client(headers=self.headers) as c:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"jupyter_server exited: {self.log_tail()}")
                with contextlib.suppress(httpx.TransportError):
                    if c.get(f"{self.url}/api/status", timeout=2).status_code == 200:
                        return self
                if time.monotonic() > deadline:
                    raise RuntimeError(f"jupyter_server not ready: {self.log_tail()}")
                time.sleep(0.1)

    def start(self) -> JupyterServer:
        return self.launch().wait_ready()

    def log_tail(self) -> str:
        with contextlib.suppress(OSError):
            return (self._dir / "server.log").read_text(errors="replace")[-2000:]
        return ""

    def stop(self) -> None:
        """Stop the server (it shuts its kernels and terminals down), then its session."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        if self.proc is not None:
            # Whatever it started and left behind (kernels, terminal shells) is in its session.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        if getattr(self, "_log", None) is not None:
            self._log.close()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> JupyterServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- HTTP ---------------------------------------------------------------------------

    def client(self) -> httpx.Client:
        """A keep-alive client with the token (the same client class the dataplane gets)."""
        return httpx.Client(base_url=self.url, headers=self.headers)

    def async_client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.url, headers=self.headers)

    # --- kernels ------------------------------------------------------------------------

    def start_kernel(self, c: httpx.Client, name: str = "python3") -> Kernel:
        r = c.post("/api/kernels", json={"name": name}, timeout=60)
        r.raise_for_status()
        kernel = Kernel(self, r.json()["id"])
        deadline = time.monotonic() + 60
        while True:
            try:
                kernel.execute("import subprocess", timeout=10)
                return kernel
            except TimeoutError:
                if time.monotonic() > deadline:
                    raise

    # --- terminals ----------------------------------------------------------------------

    async def new_terminal(self, ac: httpx.AsyncClient) -> str:
        r = await ac.post("/api/terminals")
        r.raise_for_status()
        return str(r.json()["name"])

    async def delete_terminal(self, ac: httpx.AsyncClient, name: str) -> None:
        await ac.delete(f"/api/terminals/{name}")

    async def terminal_socket(self, name: str) -> Any:
        import websockets

        return await websockets.connect(
            f"{self.ws_url}/terminals/websocket/{name}",
            additional_headers=self.headers,
            compression=None,
            max_size=None,
        )


async def read_until(ws: Any, needle: str, timeout: float = 10.0) -> str:
    """Terminal messages (``["stdout", text]``) until ``needle`` was printed."""
    import asyncio

    seen = ""
    async with asyncio.timeout(timeout):
        while needle not in seen:
            msg = json.loads(await ws.recv())
            if msg[0] == "stdout":
                seen += msg[1]
    return seen


class Kernel:
    """One kernel and one channels WebSocket (JSON messages, as jupyter_client sends them)."""

    def __init__(self, server: JupyterServer, kernel_id: str) -> None:
        from websockets.sync.client import connect

        self.server = server
        self.kernel_id = kernel_id
        self.session = uuid.uuid4().hex
        self._stack = contextlib.ExitStack()
        self.ws = self._stack.enter_context(
            connect(
                f"{server.ws_url}/api/kernels/{kernel_id}/channels?session_id={self.session}",
                additional_headers=server.headers,
                compression=None,
                max_size=None,
            )
        )

    def execute(self, code: str, timeout: float = 30.0) -> None:
        """Send ``execute_request``; return at ``execute_reply`` and ``status: idle``."""
        msg_id = uuid.uuid4().hex
        self.ws.send(
            json.dumps(
                {
                    "header": {
                        "msg_id": msg_id,
                        "msg_type": "execute_request",
                        "username": "bench",
                        "session": self.session,
                        "date": "",
                        "version": "5.3",
                    },
                    "parent_header": {},
                    "metadata": {},
                    "content": {
                        "code": code,
                        "silent": False,
                        "store_history": False,
                        "user_expressions": {},
                        "allow_stdin": False,
                        "stop_on_error": True,
                    },
                    "buffers": [],
                    "channel": "shell",
                }
            )
        )
        replied = idle = False
        deadline = time.monotonic() + timeout
        while not (replied and idle):
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("no execute_reply")
            msg = json.loads(self.ws.recv(left))
            if msg.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            kind = msg["header"]["msg_type"]
            if kind == "execute_reply":
                if msg["content"].get("status") != "ok":
                    raise RuntimeError(f"kernel error: {msg['content']}")
                replied = True
            elif kind == "status" and msg["content"].get("execution_state") == "idle":
                idle = True

    def close(self, c: httpx.Client) -> None:
        with contextlib.suppress(Exception):
            self._stack.close()
        with contextlib.suppress(httpx.HTTPError):
            c.delete(f"/api/kernels/{self.kernel_id}", timeout=30)


def _launch(argv: list[str]) -> None:
    """The server process: stock jupyter_server, or with TCP_NODELAY forced on."""
    if "--nodelay" in argv:
        argv = [a for a in argv if a != "--nodelay"]
        import tornado.httpserver
        import tornado.iostream

        set_nodelay = tornado.iostream.IOStream.set_nodelay

        def always(self: Any, value: bool) -> None:
            set_nodelay(self, True)

        tornado.iostream.IOStream.set_nodelay = always  # type: ignore[method-assign]
        handle_stream = tornado.httpserver.HTTPServer.handle_stream

        def handle(self: Any, stream: Any, address: Any) -> None:
            stream.set_nodelay(True)
            handle_stream(self, stream, address)

        tornado.httpserver.HTTPServer.handle_stream = handle  # type: ignore[method-assign]
    from jupyter_server.serverapp import ServerApp

    ServerApp.launch_instance(argv=argv)


def _smoke() -> None:
    import asyncio
    import statistics

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "a.txt").write_text("x" * 4096)
        (root / "d").mkdir()
        for i in range(1000):
            (root / "d" / f"f{i}").write_text("x")
        for nodelay in (False, True):
            with JupyterServer(root, nodelay=nodelay) as srv, srv.client() as c:
                t = []
                for _ in range(20):
                    t0 = time.perf_counter()
                    c.get("/api/contents/a.txt", params={"type": "file", "format": "text"})
                    t.append(time.perf_counter() - t0)
                print(f"nodelay={nodelay} read 4 KiB {statistics.median(t) * 1000:.2f} ms")
                t0 = time.perf_counter()
                r = c.get("/api/contents/d")
                took = (time.perf_counter() - t0) * 1000
                print(f"  list 1000 {took:.1f} ms", len(r.json()["content"]))
                k = srv.start_kernel(c)
                t = []
                for _ in range(20):
                    t0 = time.perf_counter()
                    k.execute("subprocess.run(['true'])")
                    t.append(time.perf_counter() - t0)
                print(f"  kernel exec {statistics.median(t) * 1000:.2f} ms")
                k.close(c)

                async def term() -> None:
                    async with srv.async_client() as ac:
                        t0 = time.perf_counter()
                        name = await srv.new_terminal(ac)
                        ws = await srv.terminal_socket(name)
                        await read_until(ws, "# ")
                        print(f"  terminal open {(time.perf_counter() - t0) * 1000:.1f} ms")
                        await ws.send(json.dumps(["stdin", "stty raw -echo; cat\r"]))
                        await asyncio.sleep(0.3)
                        t = []
                        for _ in range(20):
                            t0 = time.perf_counter()
                            await ws.send(json.dumps(["stdin", "x"]))
                            await read_until(ws, "x")
                            t.append(time.perf_counter() - t0)
                        print(f"  terminal echo {statistics.median(t) * 1000:.2f} ms")
                        await ws.close()
                        await srv.delete_terminal(ac, name)

                asyncio.run(term())


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--launch":
        _launch(sys.argv[2:])
    else:
        _smoke()
