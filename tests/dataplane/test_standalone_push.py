"""Revocations pushed to the in-sandbox dataplane (``POST /__control/revoke``): only with
the trust directory's control key, held at once, never undone by a stale trust file; and
the other control routes and ``/metrics`` behind that key once there is one."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import jwt
import pytest
import uvicorn

from sandlot.dataplane.settings import DataplaneSettings
from sandlot.dataplane.standalone import StandaloneDataplane, StandaloneOptions
from tests.dataplane.conftest import ISSUER, Keys

KEY = "a-control-key-of-the-provider"


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[str, Keys, Path]]:
    keys = Keys()
    trust = tmp_path / "trust"
    trust.mkdir()
    (trust / "jwks.json").write_text(json.dumps(keys.jwks()))
    (trust / "revoked.json").write_text(json.dumps({"revoked": []}))
    workspace = tmp_path / "ws"
    workspace.mkdir()
    options = StandaloneOptions(
        sandbox_id="sb_box", generation=1, issuer=ISSUER, workspace=workspace, trust_dir=trust
    )
    app = StandaloneDataplane(options, DataplaneSettings())
    app.reload()
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
        yield f"http://127.0.0.1:{port}", keys, trust
    finally:
        server.should_exit = True
        thread.join(10)


def test_a_pushed_revocation_holds_at_once_and_needs_the_key(
    served: tuple[str, Keys, Path],
) -> None:
    base, keys, trust = served
    token = keys.token("sb_box")
    auth = {"Authorization": f"Bearer {token}"}
    jti = jwt.decode(token, options={"verify_signature": False})["jti"]
    doc = {"revoked": [{"jti": jti, "expires_at": time.time() + 900}]}
    push = f"{base}/__control/revoke"
    exec_ = f"{base}/v1/exec"
    # No key in the trust directory: nothing is accepted, not even an empty key.
    assert httpx.post(push, json=doc, headers={"X-Sandlot-Control": ""}).status_code == 403
    (trust / "control.key").write_text(KEY + "\n")
    for forged in ({}, {"X-Sandlot-Control": "guessed"}, {"X-Sandlot-Control": KEY[:-1]}):
        assert httpx.post(push, json=doc, headers=forged).status_code == 403
    assert httpx.post(exec_, json={"command": "true"}, headers=auth).status_code == 200
    keyed = {"X-Sandlot-Control": KEY}
    bad = httpx.post(push, content=b"{not json", headers=keyed)
    assert bad.status_code == 400 and "error" in bad.json()
    r = httpx.post(push, json=doc, headers=keyed)
    assert r.status_code == 200 and r.json() == {"revoked": 1}
    # The very next request is refused.
    assert httpx.post(exec_, json={"command": "true"}, headers=auth).status_code == 401
    # Re-reading a trust file the kubelet has not updated yet undoes nothing.
    assert httpx.post(f"{base}/__control/reload", headers=keyed).status_code == 200
    assert httpx.post(exec_, json={"command": "true"}, headers=auth).status_code == 401
    fresh = {"Authorization": f"Bearer {keys.token('sb_box')}"}
    assert httpx.post(exec_, json={"command": "true"}, headers=fresh).status_code == 200


def test_with_a_control_key_only_readiness_answers_without_it(
    served: tuple[str, Keys, Path],
) -> None:
    """A pod's address is reachable from the cluster's network: with a control key in the
    trust directory, what the sandbox is doing (its status, its figures) and a reload are
    for the key's holder; whether it is ready is for anyone (a kubelet's probe)."""
    base, keys, trust = served
    guarded = [
        ("GET", "/__control/status"),
        ("POST", "/__control/reload"),
        ("GET", "/metrics"),
    ]
    # No key in the trust directory (docker: reached only through the host's socket).
    for method, path in [*guarded, ("GET", "/__control/ready")]:
        assert httpx.request(method, base + path).status_code == 200, path
    (trust / "control.key").write_text(KEY + "\n")
    for method, path in guarded:
        for forged in ({}, {"X-Sandlot-Control": ""}, {"X-Sandlot-Control": KEY[:-1]}):
            r = httpx.request(method, base + path, headers=forged)
            assert r.status_code == 403, (path, forged, r.text)
            assert "running_execs" not in r.text and "sandlot_" not in r.text
        r = httpx.request(method, base + path, headers={"X-Sandlot-Control": KEY})
        assert r.status_code == 200, (path, r.text)
    r = httpx.get(f"{base}/__control/ready")
    assert r.status_code == 200 and r.json() == {"ready": True}
    # The sandbox's API is the token's business, as ever.
    auth = {"Authorization": f"Bearer {keys.token('sb_box')}"}
    assert httpx.post(f"{base}/v1/exec", json={"command": "true"}, headers=auth).status_code == 200
