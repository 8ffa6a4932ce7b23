"""schemathesis against the broker's OpenAPI document, served by a real ``sandlot serve``.

Every operation is fuzzed as a user, with generated path parameters (mostly
unknown ids: 404s, 400s) and with the ids of objects that exist (a session, a
sandbox, a box, a volume, a shared scope), so success responses are checked
against the document too; the operations only an admin may use are fuzzed as an
admin as well. Operations that delete run last, so they do not take the objects
away from the others.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import httpx
import pytest

from tests.figures import FULL, RecordProperty, report
from tests.fuzzing import Fuzzer, unexpected_logs
from tests.pg import on_store
from tests.servers import running

#: Cases per operation: with generated path parameters, and with those of existing objects.
EXAMPLES, KNOWN_EXAMPLES = (200, 100) if FULL else (14, 10)
TARGET = 10_000 if FULL else 1_500

THREAD = "thr_fuzz"
CONFIG = """
admins = ["root"]
"""
#: Fuzzed as an admin too. Not ``POST /v1/pools``: an admin's pool of up to 1000 ready
#: sandboxes is honoured, and would be provisioned on this machine.
ADMIN_OPERATIONS = {
    "POST /v1/templates",
    "DELETE /v1/templates/{name}",
    "GET /v1/pools/{name}",
    "DELETE /v1/pools/{name}",
    "GET /v1/sandboxes",
    "GET /v1/audit",
}


def existing_objects(base: str, headers: dict[str, str]) -> dict[str, dict[str, str]]:
    """Objects of the caller the fuzzer may address, as path parameters by path prefix."""

    def post(path: str, body: dict[str, str]) -> dict[str, str]:
        r = httpx.post(f"{base}{path}", json=body, headers=headers, timeout=60)
        assert r.status_code in (200, 201), r.text
        return dict(r.json())

    grant = post("/v1/sandbox/sessions", {"thread_id": THREAD, "mode": "ensure"})
    sandbox = post("/v1/sandboxes", {"name": "fuzz-sandbox"})
    post("/v2/sandboxes/boxes", {"name": "fuzz-box"})
    post("/v1/volumes", {"name": "fuzz-volume"})
    post(f"/v1/sandbox/scopes/thread/{THREAD}/members", {"user_id": "fuzz-peer"})
    ids = {
        "session_id": grant["session_id"],
        "sandbox_id": sandbox["id"],
        "scope_type": "thread",
        "scope_id": THREAD,
        "user_id": "fuzz-peer",
    }
    return {
        "/v1/sandbox": ids,
        "/v1/templates": {"name": "default"},
        "/v1/volumes": {"name": "fuzz-volume"},
        "/v2/sandboxes/boxes": {"name": "fuzz-box"},
    }


def known_parameters(path: str, objects: dict[str, dict[str, str]]) -> dict[str, str] | None:
    names = re.findall(r"{(\w+)}", path)
    for prefix, values in objects.items():
        if names and path.startswith(prefix) and all(n in values for n in names):
            return {n: values[n] for n in names}
    return None


@pytest.mark.reliability
@pytest.mark.timeout(1800 if FULL else 300)
@pytest.mark.parametrize("store", ["sqlite", "postgresql"])
def test_broker_openapi_document(
    tmp_path: Path, record_property: RecordProperty, store: str
) -> None:
    with on_store(CONFIG, store) as config, running(tmp_path / "data", config=config) as server:
        user = {"Authorization": f"Bearer {server.key('fuzz')}"}
        admin = {"Authorization": f"Bearer {server.key('root')}"}
        fuzzer = Fuzzer.load(f"{server.url}/openapi.json", server.url, user)
        objects = existing_objects(server.url, user)
        started = time.monotonic()
        plan = [(user, op) for op in fuzzer.operations()]
        plan += [(admin, op) for _, op in plan if op.label in ADMIN_OPERATIONS]
        assert len(plan) == len({op.label for _, op in plan}) + len(ADMIN_OPERATIONS)
        for headers, operation in sorted(plan, key=lambda p: p[1].method.upper() == "DELETE"):
            fuzzer.headers = headers
            fuzzer.cover(operation)
            fuzzer.fuzz(operation, EXAMPLES)
            known = known_parameters(operation.path, objects)
            if known is not None:
                fuzzer.fuzz(operation, KNOWN_EXAMPLES, path_parameters=known)
        took = time.monotonic() - started
    print(fuzzer.table())
    assert not fuzzer.failures, "\n\n".join(fuzzer.failures)
    assert fuzzer.server_errors == fuzzer.violations == 0
    assert not unexpected_logs(server.output), "\n\n".join(unexpected_logs(server.output))
    assert fuzzer.cases >= TARGET, fuzzer.figure()
    report(record_property, f"broker on {store}: {fuzzer.figure()} ({took:.0f} s)")


#: Values no generated case sends: a NUL (PostgreSQL's text cannot hold one), integers
#: past 32 and 64 bits, a negative one, bytes that are not UTF-8.
HOSTILE = ["a%00b", "%00", "2147483648", "9223372036854775808", "-1", "%C0%AF", "%ED%A0%80"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("store", ["sqlite", "postgresql"])
def test_hostile_parameters_are_a_client_error_on_either_store(tmp_path: Path, store: str) -> None:
    """Every operation of the document, as an admin, with each hostile value in every
    path and query parameter: never a server error, and the same answer on both stores
    for a NUL (400 INVALID_REQUEST: it is in no id or name)."""
    with on_store(CONFIG, store) as config, running(tmp_path / "data", config=config) as server:
        admin = {"Authorization": f"Bearer {server.key('root')}"}
        document = httpx.get(f"{server.url}/openapi.json", timeout=30).json()
        answers: dict[str, int] = {}
        with httpx.Client(base_url=server.url, headers=admin, timeout=30) as client:
            for path, operations in document["paths"].items():
                for method, operation in operations.items():
                    query = [
                        p["name"] for p in operation.get("parameters", []) if p["in"] == "query"
                    ]
                    if "{" not in path and not query:
                        continue
                    for value in HOSTILE:
                        url = re.sub(r"{[^}]+}", value, path)
                        if query:
                            url += "?" + "&".join(f"{name}={value}" for name in query)
                        r = client.request(method.upper(), url, json={})
                        answers[f"{method.upper()} {url}"] = r.status_code
                        assert r.status_code < 500, (method, url, r.text)
                        if "%00" in value:
                            assert r.status_code == 400, (method, url, r.text)
                            assert r.json()["error"]["code"] == "INVALID_REQUEST", r.text
            # A NUL in a body's string is refused alike; the text "\\u0000" is text.
            for metadata, status in (
                ({"a": "b\x00"}, 400),
                ({"a\x00": "b"}, 400),
                ({"a": "\\u0000"}, 200),
            ):
                r = client.post(
                    "/v1/sandbox/sessions",
                    json={"thread_id": "thr_nul", "mode": "ensure", "metadata": metadata},
                )
                assert r.status_code == status, (metadata, r.text)
            r = client.post("/v1/hosts/keys", json={"name": "h\x00"})
            assert r.status_code == 400, r.text
            assert r.json()["error"]["message"] == "a string in the body holds a NUL byte"
            # Past 32 bits is a cursor like any other; past 63 it is refused.
            assert client.get("/v1/audit", params={"after": 2**31}).json()["items"] == []
            assert client.get("/v1/audit", params={"after": 2**63}).status_code == 400
    assert len(answers) > 150, len(answers)
    assert not unexpected_logs(server.output), "\n\n".join(unexpected_logs(server.output))
