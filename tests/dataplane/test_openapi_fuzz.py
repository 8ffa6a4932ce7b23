"""schemathesis against the dataplane's OpenAPI document, on a sandbox of a real ``sandlot serve``.

The document is served at the sandbox's ``http_base_url``; every case carries
the session's token. Each operation is fuzzed with generated inputs, and where
it takes an exec id or a path, also with those of an existing command and of
files in the workspace (so success responses are checked too). Operations that
delete run last.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.routing import Route

from sandlot.dataplane.http import openapi
from sandlot.dataplane.http.app import ROUTES
from sandlot.dataplane.http.host import DataplaneHost
from sandlot.dataplane.http.web import operation_of
from sandlot.dataplane.services.auth import TokenVerifier
from tests.figures import FULL, RecordProperty, report
from tests.fuzzing import Fuzzer, unexpected_logs
from tests.servers import running

EXAMPLES, KNOWN_EXAMPLES = (280, 140) if FULL else (10, 8)
TARGET = 10_000 if FULL else 1_000

# A full-size run outlasts the default 15 min token.
CONFIG = """
[policy]
token_ttl_seconds = 7200
"""

FILE = "/workspace/fuzz/notes.txt"
DIRECTORY = "/workspace/fuzz"


def active_grant(base: str, headers: dict[str, str]) -> dict[str, object]:
    r = httpx.post(
        f"{base}/v1/sandbox/sessions",
        json={"thread_id": "thr_fuzz", "mode": "ensure"},
        headers=headers,
    )
    assert r.status_code == 200, r.text
    grant = dict(r.json())
    deadline = time.monotonic() + 30
    while True:
        snap = httpx.get(f"{base}/v1/sandbox/sessions/{grant['session_id']}", headers=headers)
        if snap.json()["binding"]["state"] == "active":
            return grant
        assert time.monotonic() < deadline, snap.text
        time.sleep(0.05)


def bounded_commands(case: Any) -> None:
    """Generated commands are arbitrary programs, and one that never ends (``vi`` waiting
    for its terminal) holds its request for good, as it should: exec has no default
    timeout. Each generated command therefore gets a short one of its own; timeouts that
    are invalid stay as generated."""
    body = case.body
    if case.operation.path not in ("/exec", "/execute") or not isinstance(body, dict):
        return
    given = [k for k in ("timeout_seconds", "timeout") if k in body]
    for key in given:
        value = body[key]
        if isinstance(value, int | float) and not isinstance(value, bool) and 5 < value <= 86400:
            body[key] = 5
    if not given:
        body["timeout_seconds"] = 5


def known_inputs(path: str, exec_id: str) -> tuple[dict[str, str] | None, dict[str, str] | None]:
    """Path parameters and query of existing objects for ``path`` (``None``: nothing fixed)."""
    if "{exec_id}" in path:
        return {"exec_id": exec_id}, None
    if path in ("/fs/list", "/files/archive"):
        return None, {"path": DIRECTORY}
    if path in ("/fs/read", "/fs/stat", "/fs", "/files/download", "/download"):
        return None, {"path": FILE}
    return None, None


@pytest.mark.reliability
@pytest.mark.timeout(1800 if FULL else 300)
def test_dataplane_openapi_document(tmp_path: Path, record_property: RecordProperty) -> None:
    with running(tmp_path / "data", config=CONFIG) as server:
        headers = {"Authorization": f"Bearer {server.key('fuzz')}"}
        grant = active_grant(server.url, headers)
        base = str(grant["dataplane"]["http_base_url"])  # type: ignore[index]
        token = {"Authorization": f"Bearer {grant['token']}"}
        with httpx.Client(base_url=base, headers=token, timeout=60) as dp:
            r = dp.put("/fs/write", json={"path": FILE, "content": "one\ntwo\nthree\n"})
            assert r.status_code == 201, r.text
            r = dp.post("/exec", json={"command": "echo fuzz", "command_id": "fuzz-1"})
            assert r.status_code == 200, r.text
            exec_id = r.json()["exec_id"]
        fuzzer = Fuzzer.load(f"{base}/openapi.json", base, token)
        fuzzer.prepare = bounded_commands
        started = time.monotonic()
        operations = sorted(fuzzer.operations(), key=lambda op: op.method.upper() == "DELETE")
        for operation in operations:
            fuzzer.cover(operation)
            fuzzer.fuzz(operation, EXAMPLES)
            path_parameters, query = known_inputs(operation.path, exec_id)
            if path_parameters is not None or query is not None:
                fuzzer.fuzz(operation, KNOWN_EXAMPLES, path_parameters=path_parameters, query=query)
        took = time.monotonic() - started
    print(fuzzer.table())
    assert not fuzzer.failures, "\n\n".join(fuzzer.failures)
    assert fuzzer.server_errors == fuzzer.violations == 0
    assert not unexpected_logs(server.output), "\n\n".join(unexpected_logs(server.output))
    assert fuzzer.cases >= TARGET, fuzzer.figure()
    report(record_property, f"dataplane: {fuzzer.figure()} ({took:.0f} s)")


def test_document_lists_every_http_route() -> None:
    """The document is drawn from the route table: every HTTP route served is in it, with
    what its endpoint declared (WebSocket routes are not: OpenAPI cannot describe them)."""

    async def jwks() -> dict[str, object]:
        return {"keys": []}

    host = DataplaneHost(verifier=TokenVerifier(jwks, issuer="https://broker.test"))
    mount = next(r for r in host.app.routes if getattr(r, "path", "") == "/{sandbox_id}/v1")
    served: dict[str, set[str]] = {}
    for route in mount.routes:  # type: ignore[attr-defined]
        if isinstance(route, Route):
            assert operation_of(route.endpoint) is not None, f"{route.path} declares nothing"
            served.setdefault(route.path, set()).update(m.lower() for m in route.methods or ())
    document = openapi.document(ROUTES)
    documented = {path: set(ops) for path, ops in document["paths"].items()}
    # Starlette answers HEAD wherever GET is served; the document lists it where it is
    # part of the contract (downloads).
    assert {p: m - {"head"} for p, m in served.items()} == {
        p: m - {"head"} for p, m in documented.items()
    }
    assert {p for p, m in documented.items() if "head" in m} == {"/files/download", "/download"}
    # Bodies and answers are the protocol's models.
    exec_op = document["paths"]["/exec"]["post"]
    assert exec_op["summary"] == "Run a command to completion"
    assert "ExecRequest" in str(exec_op["requestBody"])
    assert "ExecResult" in str(exec_op["responses"]["200"])
    assert {"4XX", "5XX"} <= set(exec_op["responses"])
    assert [p["name"] for p in document["paths"]["/execs/{exec_id}"]["get"]["parameters"]] == [
        "exec_id"
    ]
