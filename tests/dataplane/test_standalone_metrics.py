"""A standalone dataplane serves its own figures at ``/metrics``."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from sandlot.dataplane.http.host import create_standalone_app
from sandlot.dataplane.services.auth import TokenVerifier
from sandlot.protocol.sessions import Template
from sandlot.runtime.direct import DirectRuntime
from tests.dataplane.conftest import ISSUER, Keys
from tests.dataplane.test_serve_sockets import metric


def test_standalone_metrics(tmp_path: Path) -> None:
    keys = Keys()

    async def jwks() -> dict[str, Any]:
        return keys.jwks()

    runtime = DirectRuntime("sb_box", 1, Template(name="t", image="host"), tmp_path)
    app = create_standalone_app(runtime, verifier=TokenVerifier(jwks, issuer=ISSUER))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
    )
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()
    deadline = time.time() + 10
    while not server.started:
        assert time.time() < deadline
        time.sleep(0.01)
    try:
        h = {"Authorization": f"Bearer {keys.token('sb_box')}"}
        base = f"http://127.0.0.1:{port}"
        for _ in range(2):
            r = httpx.get(f"{base}/v1/fs/list", headers=h, params={"path": "/workspace"})
            assert r.status_code == 200
        r = httpx.get(f"{base}/v1/fs/stat", headers=h, params={"path": "missing"})
        assert r.status_code == 404
        other = {"Authorization": f"Bearer {keys.token('sb_other')}"}
        assert httpx.get(f"{base}/v1/fs/list", headers=other).status_code == 403
        r = httpx.get(f"{base}/metrics")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
        text = r.text
        assert metric(text, "sandlot_dataplane_requests_total", route="/fs/list", status="200") == 2
        assert metric(text, "sandlot_dataplane_requests_total", route="/fs/list", status="403") == 1
        assert (
            metric(text, "sandlot_dataplane_request_duration_seconds_count", route="/fs/list") == 3
        )
        assert metric(text, "sandlot_errors_total", code="FILE_NOT_FOUND") == 1
        assert metric(text, "sandlot_errors_total", code="FORBIDDEN") == 1
        assert metric(text, "sandlot_dataplane_sandboxes") == 1
        assert metric(text, "sandlot_dataplane_websockets", route="/exec/ws") == 0
    finally:
        server.should_exit = True
        thread.join(10)
