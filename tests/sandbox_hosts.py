"""``sandlot host`` processes on loopback, for the fleet tests (tests/broker/test_hosts.py)."""

from __future__ import annotations

import contextlib
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from tests.servers import free_port, isolation_mode, remove_sandboxes


class SandlotHost:
    """One ``sandlot host`` process, on a port kept across restarts."""

    def __init__(
        self,
        data_dir: Path,
        *,
        store: str,
        broker_url: str,
        capacity: int,
        config: str | None = None,
        mode: str | None = None,
    ) -> None:
        self.data_dir = data_dir
        self.store = store
        self.broker_url = broker_url
        self.capacity = capacity
        self.config_path: Path | None = None
        if config is not None:
            self.config_path = data_dir.parent / f"{data_dir.name}-config.toml"
            self.config_path.write_text(config)
        self.mode = mode or isolation_mode()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.host_id = ""
        self.proc: subprocess.Popen[bytes] | None = None
        self.output: list[str] = []
        self._reader: threading.Thread | None = None

    def argv(self) -> list[str]:
        argv = [
            sys.executable,
            "-m",
            "sandlot.cli.main",
            "host",
            "--store",
            self.store,
            "--broker-url",
            self.broker_url,
            "--listen",
            f"127.0.0.1:{self.port}",
            "--capacity",
            str(self.capacity),
            "--data-dir",
            str(self.data_dir),
        ]
        if self.mode == "unisolated":
            argv.append("--unisolated")
        if self.config_path is not None:
            argv += ["--config", str(self.config_path)]
        return argv

    def start(self, timeout: float = 60.0) -> SandlotHost:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            self.argv(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env
        )
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        buf = b""
        while time.monotonic() < deadline and not self.host_id:
            ready, _, _ = select.select([fd], [], [], 0.1)
            if ready:
                chunk = os.read(fd, 65536)
                if not chunk:
                    break
                buf += chunk
                m = re.search(rb"sandlot host (\S+) listening on", buf)
                if m:
                    self.host_id = m.group(1).decode()
            elif self.proc.poll() is not None:
                break
        self.output.append(buf.decode(errors="replace"))
        if not self.host_id:
            self.stop()
            raise RuntimeError(f"host did not start:\n{buf.decode(errors='replace')}")
        self._reader = threading.Thread(target=self._read, args=(fd,), daemon=True)
        self._reader.start()
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200:
                    return self
            time.sleep(0.05)
        raise RuntimeError(f"host never became ready:\n{''.join(self.output)[-4000:]}")

    def _read(self, fd: int) -> None:
        try:
            while chunk := os.read(fd, 65536):
                self.output.append(chunk.decode(errors="replace"))
        except OSError:
            return

    @property
    def credential(self) -> str:
        return (self.data_dir / "host-credential").read_text().strip()

    def provider_ids(self) -> set[str]:
        """The sandboxes its provider runs, asked through its provider API."""
        r = httpx.get(
            f"{self.url}/internal/provider/sandboxes",
            headers={"x-sandlot-provider-secret": self.credential},
            timeout=10,
        )
        r.raise_for_status()
        return set(r.json()["ids"])

    def _reap(self) -> None:
        if self._reader is not None:
            self._reader.join(10)
            self._reader = None
        if self.proc is not None and self.proc.stdout is not None:
            self.proc.stdout.close()

    def kill9(self) -> None:
        assert self.proc is not None
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self._reap()

    def stop(self, timeout: float = 20.0) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._reap()

    def restart(self) -> SandlotHost:
        self.stop()
        self.host_id = ""
        return self.start()

    def cleanup(self) -> None:
        """After stop: remove every sandbox it left."""
        remove_sandboxes(self.data_dir, self.mode)
