"""SIGTERM to ``sandlot serve`` while requests are in flight: each gets the error envelope."""

from __future__ import annotations

import json
import select
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from tests.servers import running


class SlowUpload:
    """A request whose body of ``length`` bytes trickles in, on a raw socket, until the
    server answers; then the whole answer as (status, headers, body)."""

    def __init__(self, url: str, target: str, headers: dict[str, str], length: int) -> None:
        parts = urlsplit(url)
        self.sock = socket.create_connection((parts.hostname, parts.port), timeout=30)
        head = [f"POST {target} HTTP/1.1", f"Host: {parts.netloc}", f"Content-Length: {length}"]
        head += [f"{k}: {v}" for k, v in headers.items()]
        self.sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode())
        self.sent = 0
        self.length = length
        self.answer = b""
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        chunk = b"x" * 16384
        while self.sent < self.length - len(chunk):
            readable, _, _ = select.select([self.sock], [], [], 0.05)
            if readable:
                break
            try:
                self.sock.sendall(chunk)
            except OSError:
                break
            self.sent += len(chunk)
        try:
            while data := self.sock.recv(65536):
                self.answer += data
        except OSError:
            pass  # a reset after the answer: what was received is kept

    def result(self, timeout: float) -> tuple[int, dict[str, str], bytes]:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "no answer"
        head, _, body = self.answer.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        assert lines[0].startswith("HTTP/1.1 "), self.answer[:200]
        status = int(lines[0].split()[1])
        headers = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
        if "content-length" in headers:
            body = body[: int(headers["content-length"])]
        self.sock.close()
        return status, headers, body


def envelope(status: int, headers: dict[str, str], body: bytes) -> dict[str, Any]:
    assert status == 503, (status, body[:200])
    assert headers["content-type"] == "application/json", headers
    error: dict[str, Any] = json.loads(body)["error"]
    assert error["code"] == "PROVIDER_UNAVAILABLE" and error["retryable"] is True, error
    assert headers.get("retry-after"), headers
    return error


def test_sigterm_answers_requests_in_flight_with_the_envelope(tmp_path: Path) -> None:
    with running(tmp_path / "d") as srv:
        alice = srv.headers("alice")
        r = httpx.post(
            f"{srv.url}/v1/sandbox/sessions",
            json={"thread_id": "thr_1", "mode": "ensure"},
            headers=alice,
            timeout=30,
        )
        grant = r.json()
        dp = urlsplit(grant["dataplane"]["http_base_url"]).path
        token = {"Authorization": f"Bearer {grant['token']}"}
        deadline = time.monotonic() + 60
        while httpx.get(f"{srv.url}{dp}/fs/stat?path=.", headers=token).status_code == 423:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        # A large upload at the dataplane and a slow JSON body at the broker, both unanswered.
        upload = SlowUpload(
            srv.url,
            f"{dp}/files/upload?path=big.bin",
            {**token, "X-Request-Id": "rq-upload"},
            1 << 30,
        )
        negotiation = SlowUpload(
            srv.url,
            "/v1/sandbox/sessions",
            {**alice, "Content-Type": "application/json"},
            1 << 20,
        )
        while upload.sent < 1 << 20 or negotiation.sent < 1 << 16:
            time.sleep(0.05)
        assert srv.proc is not None
        started = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        error = envelope(*upload.result(30))
        assert error["request_id"] == "rq-upload"
        envelope(*negotiation.result(30))
        # Answered before the server's own deadline for requests in flight (5 s) ran out.
        assert time.monotonic() - started < 10
        assert srv.proc.wait(30) == 0
        output = "".join(srv.output)
        assert "Internal Server Error" not in output and "Traceback" not in output, output
