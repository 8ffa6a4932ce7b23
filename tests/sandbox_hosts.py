"""``sandlot host`` processes on loopback, for the fleet tests (tests/broker/test_hosts.py)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
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
        store: str | None,
        broker_url: str,
        capacity: int,
        config: str | None = None,
        mode: str | None = None,
        key: str | None = None,
    ) -> None:
        """``store``: the brokers' database; None with ``key``: the host registers through
        the broker at ``broker_url`` with that host key (``--broker``, ``--key-file``)."""
        self.data_dir = data_dir
        self.store = store
        self.key_file: Path | None = None
        if key is not None:
            self.key_file = data_dir.parent / f"{data_dir.name}-host-key"
            self.key_file.write_text(key + "\n")
            self.key_file.chmod(0o600)
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
        self.log = data_dir.parent / f"{data_dir.name}.log"

    def argv(self) -> list[str]:
        argv = [
            sys.executable,
            "-m",
            "sandlot.cli.main",
            "host",
            *(
                ["--broker", self.broker_url, "--key-file", str(self.key_file)]
                if self.key_file is not None
                else ["--store", str(self.store), "--broker-url", self.broker_url]
            ),
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
        # Its output goes to a file, not a pipe: the sandboxes it starts outlive a kill -9
        # and would hold a pipe open.
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("ab") as out:
            start = out.tell()
            self.proc = subprocess.Popen(self.argv(), stdout=out, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not self.host_id:
            said = self.log.read_bytes()[start:]
            m = re.search(rb"sandlot host (\S+) listening on", said)
            if m:
                self.host_id = m.group(1).decode()
            elif self.proc.poll() is not None:
                break
            else:
                time.sleep(0.05)
        if not self.host_id:
            self.stop()
            raise RuntimeError(f"host did not start:\n{self.output}")
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200:
                    return self
            time.sleep(0.05)
        raise RuntimeError(f"host never became ready:\n{self.output[-4000:]}")

    @property
    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

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

    def kill9(self) -> None:
        assert self.proc is not None
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

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

    def restart(self) -> SandlotHost:
        self.stop()
        self.host_id = ""
        return self.start()

    def cleanup(self) -> None:
        """After stop: remove every sandbox it left."""
        remove_sandboxes(self.data_dir, self.mode)
