"""Real ``sandlot serve`` processes on loopback, for end-to-end tests."""

from __future__ import annotations

import contextlib
import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx


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

    def start(self, timeout: float = 30.0) -> SandlotServer:
        env = {**os.environ, **self.env, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            self.argv(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env
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
        out = subprocess.run(argv, capture_output=True, check=True, timeout=60)
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
        import asyncio

        from sandlot.runtime.local import LocalRuntimeManager, RuntimeSettings

        manager = LocalRuntimeManager(
            RuntimeSettings(
                run_dir=self.data_dir / "run",
                workspaces_dir=self.data_dir / "workspaces",
                volumes_dir=self.data_dir / "volumes",
                mode=self.mode,  # type: ignore[arg-type]
            )
        )
        if (self.data_dir / "run").exists():
            asyncio.run(manager.cleanup_leftovers(keep=set()))

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


@contextlib.contextmanager
def running(data_dir: Path, **kw: Any) -> Iterator[SandlotServer]:
    server = SandlotServer(data_dir, **kw).start()
    try:
        yield server
    finally:
        server.stop()
        server.cleanup()
