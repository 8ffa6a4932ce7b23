"""Real servers on loopback, for end-to-end tests and the benchmarks: ``sandlot serve``
(:class:`SandlotServer`) and ``langgraph dev`` serving ``examples/langgraph``
(:class:`LangGraphDev`)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
#: The example ``langgraph dev`` serves (graph, auth handler, sandlot's app).
LANGGRAPH_EXAMPLE = ROOT / "examples" / "langgraph"
#: The LangGraph server's own virtualenv (``scripts/_env.sh`` makes it: langgraph-api
#: pins versions the rest of the suite cannot share).
LANGGRAPH_VENV = Path(os.environ.get("SANDLOT_LANGGRAPH_VENV", ROOT / ".venv-langgraph"))
#: The example's users and their bearer tokens (``EXAMPLE_USERS``).
LANGGRAPH_USERS = {"alice": "alice-token", "bob": "bob-token"}


def isolation_mode() -> str:
    """``isolated`` where it can run (root, as in CI), else ``unisolated``."""
    forced = os.environ.get("SANDLOT_TEST_MODE")
    if forced:
        return forced
    return "isolated" if os.geteuid() == 0 else "unisolated"


def free_port() -> int:
    """A loopback port free right now (for a server whose port must be known first)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class SandlotServer:
    def __init__(
        self,
        data_dir: Path,
        *,
        workers: int = 1,
        config: str | None = None,
        env: dict[str, str] | None = None,
        mode: str | None = None,
    ) -> None:
        self.data_dir = data_dir
        self.workers = workers
        self.config_path: Path | None = None
        if config is not None:
            self.config_path = data_dir.parent / f"{data_dir.name}-config.toml"
            self.config_path.write_text(config)
        self.env = env or {}
        self.mode = mode or isolation_mode()
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""
        self.output: list[str] = []
        self.port = 0
        self._reader: threading.Thread | None = None

    def argv(self) -> list[str]:
        argv = [
            sys.executable,
            "-m",
            "sandlot.cli.main",
            "serve",
            "--port",
            str(self.port),
            "--data-dir",
            str(self.data_dir),
            "--workers",
            str(self.workers),
        ]
        if self.mode == "unisolated":
            argv.append("--unisolated")
        if self.config_path is not None:
            argv += ["--config", str(self.config_path)]
        return argv

    def command(self, argv: list[str]) -> list[str]:
        """How ``argv`` (the server, or a command on its data) is run: as is here; in a
        network namespace for multi-host tests (``tests/multihost.py``)."""
        return argv

    def start(self, timeout: float = 30.0) -> SandlotServer:
        env = {**os.environ, **self.env, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            self.command(self.argv()), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env
        )
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        buf = b""
        while time.monotonic() < deadline:
            ready, _, _ = select.select([fd], [], [], 0.1)
            if ready:
                chunk = os.read(fd, 65536)
                if not chunk:
                    break
                buf += chunk
                m = re.search(rb"sandlot listening on (\S+)", buf)
                if m and (self.workers == 1 or b"workers:" in buf):
                    self.url = m.group(1).decode()
                    self.port = int(self.url.rsplit(":", 1)[1])
                    break
            elif self.proc.poll() is not None:
                break
        if not self.url:
            self.stop()
            raise RuntimeError(f"server did not start:\n{buf.decode(errors='replace')}")
        # From here on the output is read as it comes: a pipe nobody reads fills up
        # (64 KiB) and then blocks the server at its next log line.
        self.output.append(buf.decode(errors="replace"))
        self._reader = threading.Thread(target=self._read_output, args=(fd,), daemon=True)
        self._reader.start()
        self._wait_ready(deadline)
        return self

    def _read_output(self, fd: int) -> None:
        try:
            while chunk := os.read(fd, 65536):
                self.output.append(chunk.decode(errors="replace"))
        except OSError:
            return

    def _wait_ready(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        # What the server said, for the failure to be understood (readiness waits for the
        # re-adoption of every sandbox a previous server left).
        last = ""
        with contextlib.suppress(httpx.HTTPError):
            last = httpx.get(f"{self.url}/readyz", timeout=2).text
        said = "".join(self.output)[-4000:]
        raise RuntimeError(f"server never became ready: /readyz {last}\n{said}")

    def key(self, user: str, actor: str = "human", principal: str | None = None) -> str:
        argv = [
            sys.executable,
            "-m",
            "sandlot.cli.main",
            "keys",
            "create",
            "--user",
            user,
            "--actor",
            actor,
            "--data-dir",
            str(self.data_dir),
            "--json",
        ]
        if principal:
            argv += ["--principal", principal]
        if self.config_path is not None:
            argv += ["--config", str(self.config_path)]
        out = subprocess.run(self.command(argv), capture_output=True, check=True, timeout=60)
        return str(json.loads(out.stdout)["key"])

    def headers(self, user: str, actor: str = "human") -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key(user, actor)}"}

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._reader is not None:
            self._reader.join(10)
            self._reader = None
        elif self.proc.stdout is not None:
            with contextlib.suppress(Exception):
                rest = self.proc.stdout.read()
                if rest:
                    self.output.append(rest.decode(errors="replace"))
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        return self.proc.returncode

    def cleanup(self) -> None:
        """After stop: remove every sandbox the server left (they survive restarts by design)."""
        remove_sandboxes(self.data_dir, self.mode)

    def kill9(self) -> None:
        """Kill the whole process group of the server (and its workers) as a crash would."""
        assert self.proc is not None
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        if self._reader is not None:
            self._reader.join(10)
            self._reader = None
        if self.proc.stdout is not None:
            self.proc.stdout.close()

    def restart(self, **env: str) -> SandlotServer:
        self.stop()
        self.env = {k: v for k, v in {**self.env, **env}.items() if v}
        # A restart re-adopts every sandbox and its kept processes before it is ready.
        return self.start(timeout=60.0)


def remove_sandboxes(data_dir: Path, mode: str) -> None:
    """Remove every sandbox a stopped server left in ``data_dir`` (its processes too)."""
    import asyncio

    from sandlot.runtime.local import LocalRuntimeManager, RuntimeSettings

    manager = LocalRuntimeManager(
        RuntimeSettings(
            run_dir=data_dir / "run",
            workspaces_dir=data_dir / "workspaces",
            volumes_dir=data_dir / "volumes",
            mode=mode,  # type: ignore[arg-type]
        )
    )
    if (data_dir / "run").exists():
        asyncio.run(manager.cleanup_leftovers(keep=set()))


@contextlib.contextmanager
def running(data_dir: Path, **kw: Any) -> Iterator[SandlotServer]:
    server = SandlotServer(data_dir, **kw).start()
    try:
        yield server
    finally:
        server.stop()
        server.cleanup()


class LangGraphDev:
    """``langgraph dev`` on loopback, serving a copy of the example made in ``workdir``.

    ``users`` maps a user to its bearer token, ``permissions`` a user to the LangGraph
    permissions the example's auth gives it (``sandlot:agent``…); ``script`` (the
    scripted model's replies, ``EXAMPLE_SCRIPT``) lets the example's agent run without
    a model; ``env`` adds to the server's environment (e.g. ``SANDLOT_CONFIG``).
    """

    def __init__(
        self,
        workdir: Path,
        data_dir: Path,
        *,
        users: Mapping[str, str] = LANGGRAPH_USERS,
        permissions: Mapping[str, list[str]] | None = None,
        script: list[dict[str, Any]] | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.workdir = workdir
        shutil.copytree(LANGGRAPH_EXAMPLE, workdir, dirs_exist_ok=True)
        self.users = dict(users)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        granted = permissions or {}
        self.env = {
            **os.environ,
            "EXAMPLE_USERS": ",".join(
                f"{token}:{user}" + (f"/{'+'.join(granted[user])}" if granted.get(user) else "")
                for user, token in self.users.items()
            ),
            "SANDLOT_DATA_DIR": str(data_dir),
            "SANDLOT_PROVIDER_MODE": isolation_mode(),
            "LANGSMITH_TRACING": "false",
            "LANGGRAPH_CLI_NO_ANALYTICS": "1",
            **(env or {}),
        }
        if script is not None:
            path = workdir / "script.json"
            path.write_text(json.dumps(script))
            self.env["EXAMPLE_SCRIPT"] = str(path)
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = workdir / "langgraph.log"

    @property
    def data_dir(self) -> Path:
        return Path(self.env["SANDLOT_DATA_DIR"])

    def server_argv(self) -> list[str]:
        """How the server starts: ``langgraph dev`` (its development settings)."""
        binary = LANGGRAPH_VENV / "bin" / "langgraph"
        if not binary.exists():
            raise RuntimeError(f"{binary} is missing: ./scripts/test makes it")
        argv = [str(binary), "dev", "--no-browser", "--no-reload", "--allow-blocking"]
        return [*argv, "--host", "127.0.0.1", "--port", str(self.port)]

    def start(self, timeout: float = 120.0) -> LangGraphDev:
        argv = self.server_argv()
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                argv, cwd=self.workdir, env=self.env, stdout=log, stderr=subprocess.STDOUT
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"langgraph dev exited:\n{self.log.read_text()[-4000:]}")
            try:
                if httpx.get(f"{self.url}/ok", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"langgraph dev did not start:\n{self.log.read_text()[-4000:]}")

    def headers(self, user: str) -> dict[str, str]:
        """A LangGraph user's credentials (the example's auth handler takes a bearer)."""
        return {"Authorization": f"Bearer {self.users[user]}"}

    def key(self, user: str, actor: str = "human") -> str:
        """A sandlot API key, made on the server's data directory as an operator would."""
        argv = [sys.executable, "-m", "sandlot.cli.main", "keys", "create", "--user", user]
        argv += ["--actor", actor, "--data-dir", str(self.data_dir), "--json"]
        if "SANDLOT_CONFIG" in self.env:
            argv += ["--config", self.env["SANDLOT_CONFIG"]]
        out = subprocess.run(argv, capture_output=True, check=True, timeout=60)
        return str(json.loads(out.stdout)["key"])

    def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def cleanup(self) -> None:
        """After stop: remove every sandbox the server's sandlot left."""
        remove_sandboxes(self.data_dir, self.env["SANDLOT_PROVIDER_MODE"])
