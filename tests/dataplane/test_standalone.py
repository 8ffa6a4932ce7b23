"""A dataplane running inside a remote container: one sandbox, direct execution."""

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


def test_standalone_serves_one_sandbox(tmp_path: Path) -> None:
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
        assert httpx.get(f"{base}/healthz").json()["api_version"] == "1"
        r = httpx.post(f"{base}/v1/exec", headers=h, json={"command": "echo $PWD"})
        assert r.status_code == 200 and r.json()["stdout"].strip() == str(tmp_path)
        r = httpx.get(f"{base}/sb_box/v1/fs/list", headers=h, params={"path": "/workspace"})
        assert r.status_code == 200
        other = {"Authorization": f"Bearer {keys.token('sb_other')}"}
        assert httpx.get(f"{base}/v1/fs/list", headers=other).status_code == 403
    finally:
        server.should_exit = True
        thread.join(10)
