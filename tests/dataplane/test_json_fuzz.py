"""Nested, huge and malformed JSON on every dataplane route that may take a body: never a 5xx.

The routes are enumerated from the dataplane's app (a new route is fuzzed without
being listed here); the routes that read JSON are those whose operation in the
dataplane's OpenAPI document has a JSON body, and they must refuse deep bodies with
400 INVALID_REQUEST and bodies over their limit with 413 PAYLOAD_TOO_LARGE.
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from starlette.routing import Mount, Route

from tests.dataplane.conftest import Server
from tests.figures import RecordProperty, report
from tests.jsonbodies import HUGE, REFUSED_DEPTH, deep_bodies, malformed_bodies

BODY_METHODS = {"POST", "PUT", "PATCH", "DELETE"}


def walk(routes: list[Any], prefix: str = "") -> Iterator[tuple[str, Route]]:
    for route in routes:
        if isinstance(route, Mount):
            yield from walk(route.routes, prefix + route.path)
        elif isinstance(route, Route):
            yield prefix, route


def dataplane_routes(server: Server) -> list[tuple[str, str]]:
    """(method, path under the sandbox's base URL) of every route that may carry a body."""
    out = []
    for prefix, route in walk(server.host.app.routes):
        if not prefix.startswith("/{sandbox_id}/v1"):
            continue
        sub = prefix.removeprefix("/{sandbox_id}/v1") + route.path
        out += [(m, sub) for m in sorted((route.methods or set()) & BODY_METHODS)]
    assert out, "no sandbox route found"
    return out


@pytest.mark.reliability
@pytest.mark.timeout(300)
@pytest.mark.local_only("walks the in-process host's route table")
def test_hostile_json_on_every_dataplane_route(
    server: Server,
    client: httpx.Client,
    record_property: RecordProperty,
    caplog: pytest.LogCaptureFixture,
) -> None:
    (server.workspace / "a.txt").write_text("hello\n")
    routes = dataplane_routes(server)
    doc = client.get(server.url("/openapi.json")).json()
    reads_json = {
        (method.upper(), path)
        for path, item in doc["paths"].items()
        for method, op in item.items()
        if "application/json" in op.get("requestBody", {}).get("content", {})
    }
    assert reads_json <= set(routes), "the OpenAPI document names a route the app lacks"
    deep = deep_bodies()
    malformed = malformed_bodies()
    statuses: Counter[int] = Counter()
    errors: list[str] = []
    sent = 0

    def check(method: str, path: str, label: str, body: bytes, want: set[Any] | None) -> None:
        nonlocal sent
        sent += 1
        url = server.url(re.sub(r"\{[a-z_]+\}", "jsonfuzz-x", path))
        params = {"path": "/workspace/jsonfuzz-missing"} if method == "DELETE" else None
        try:
            r = client.request(
                method,
                url,
                content=body,
                params=params,
                headers={"Content-Type": "application/json"},
            )
        except httpx.TransportError as exc:
            statuses[599] += 1
            errors.append(f"{method} {path} {label}: {type(exc).__name__}")
            return
        statuses[r.status_code] += 1
        if r.status_code >= 500:
            errors.append(f"{method} {path} {label}: {r.status_code} {r.text[:200]}")
        elif want is not None:
            code = r.json().get("error", {}).get("code")
            # A route naming an object looks it up first: the placeholder is unknown.
            if (r.status_code, code) not in want and not ("{" in path and r.status_code == 404):
                errors.append(f"{method} {path} {label}: {r.status_code} {r.text[:200]}")

    with caplog.at_level(logging.ERROR, logger="sandlot"):
        for method, path in routes:
            parses = (method, path) in reads_json
            for label, depth, body in deep:
                refused = parses and depth >= REFUSED_DEPTH
                check(method, path, label, body, {(400, "INVALID_REQUEST")} if refused else None)
            for label, body in malformed:
                # Writes take more than 2 MiB: there, a huge body is only malformed.
                big = {(413, "PAYLOAD_TOO_LARGE"), (400, "INVALID_REQUEST")}
                check(method, path, label, body, big if parses and len(body) > HUGE else None)
    assert client.get(server.url("/fs/read"), params={"path": "a.txt"}).status_code == 200
    unexpected = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    server_errors = sum(n for status, n in statuses.items() if status >= 500)
    report(
        record_property,
        f"dataplane JSON fuzz: {sent} requests ({len(deep)} nested and {len(malformed)} huge "
        f"or malformed bodies) on {len(routes)} routes, {len(reads_json)} reading JSON: "
        f"{server_errors} server errors; statuses {dict(sorted(statuses.items()))}",
    )
    assert not errors, "\n".join(errors[:30])
    assert not unexpected, "\n".join(unexpected[:5])
