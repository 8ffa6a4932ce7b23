"""Nested, huge and malformed JSON on every broker route that may take a body: never a 5xx.

The routes are enumerated from the broker's app itself, so a new route is fuzzed
without anyone listing it here. Each hostile body (tests/jsonbodies.py) goes to
each route of a real ``sandlot serve``, as an admin (so admin routes reach their
body too), with the ids of objects that exist (so a route gets past its lookup).
Routes that read a JSON body (those whose OpenAPI operation has one) must refuse
deep bodies with 400 INVALID_REQUEST and oversized ones with 413
PAYLOAD_TOO_LARGE, in the error envelope.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.routing import APIRoute

from sandlot.broker.app import create_app
from sandlot.broker.core import Broker
from sandlot.broker.settings import load_settings
from tests.broker.fakes import FakeProvider
from tests.figures import RecordProperty, report
from tests.fuzzing import unexpected_logs
from tests.jsonbodies import HUGE, REFUSED_DEPTH, deep_bodies, malformed_bodies
from tests.pg import on_store
from tests.servers import running

BODY_METHODS = {"POST", "PUT", "PATCH", "DELETE"}
THREAD = "thr_jsonfuzz"
# Bodies a lenient route takes as a request (only unknown fields) create sandboxes:
# the quota keeps them few.
CONFIG = """
admins = ["root"]

[quotas]
max_live_sandboxes_per_user = 5
negotiation_rate_per_second = 100000
negotiation_burst = 100000
"""


def broker_routes(tmp_path: Path) -> list[tuple[str, str]]:
    """(method, path) of every route of the broker's app that may carry a body."""
    settings = load_settings(environ={}, data_dir=tmp_path / "routes", provider_mode="unisolated")
    app = create_app(Broker(settings, FakeProvider(), run_reaper=False))
    routes = []
    for prefix, route in walk(app.routes):
        if isinstance(route, APIRoute):
            # Every body is read by routes/deps.py (bounded), never by FastAPI itself.
            assert route.body_field is None, f"{route.path} has a FastAPI body parameter"
            routes += [(m, prefix + route.path) for m in sorted(route.methods & BODY_METHODS)]
    assert routes, "no route found: has FastAPI changed how it keeps included routers?"
    return routes


def walk(routes: list[Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Every route, inside included routers too (FastAPI >= 0.165 keeps them nested)."""
    for route in routes:
        inner = getattr(route, "original_router", None)
        if inner is not None:
            context = getattr(route, "include_context", None)
            yield from walk(inner.routes, prefix + getattr(context, "prefix", ""))
        else:
            yield prefix, route


def fill(path: str, ids: dict[str, str], method: str) -> str:
    def one(m: re.Match[str]) -> str:
        # Deletions address objects that do not exist: the fixtures must stay.
        if method == "DELETE":
            return "jsonfuzz-missing"
        name = m.group(1)
        if name == "name":
            for prefix, value in (
                ("/v2/sandboxes/boxes", ids["box"]),
                ("/v1/templates", "default"),
                ("/v1/volumes", "jsonfuzz-vol"),
            ):
                if path.startswith(prefix):
                    return value
        return ids.get(name, "jsonfuzz-x")

    return re.sub(r"\{([a-z_]+)\}", one, path)


@pytest.mark.reliability
@pytest.mark.timeout(300)
@pytest.mark.parametrize("store", ["sqlite", "postgresql"])
def test_hostile_json_on_every_broker_route(
    tmp_path: Path, record_property: RecordProperty, store: str
) -> None:
    routes = broker_routes(tmp_path)
    with_body = set()
    with on_store(CONFIG, store) as config, running(tmp_path / "data", config=config) as srv:
        headers = srv.headers("root")
        doc = httpx.get(f"{srv.url}/openapi.json").json()
        for path, item in doc["paths"].items():
            for method, op in item.items():
                if "requestBody" in op:
                    with_body.add((method.upper(), path))
        grant = httpx.post(
            f"{srv.url}/v1/sandbox/sessions",
            json={"thread_id": THREAD, "mode": "ensure"},
            headers=headers,
            timeout=60,
        ).json()
        box = httpx.post(
            f"{srv.url}/v2/sandboxes/boxes", json={"name": "jsonfuzz-box"}, headers=headers
        ).json()
        ids = {
            "session_id": grant["session_id"],
            "sandbox_id": grant["sandbox"]["id"],
            "box": box["name"],
            "scope_type": "thread",
            "scope_id": THREAD,
            "user_id": "jsonfuzz-peer",
        }
        assert with_body <= set(routes), "the OpenAPI document names a route the app lacks"
        deep = deep_bodies()
        malformed = malformed_bodies()
        statuses: Counter[int] = Counter()
        errors: list[str] = []
        sent = 0
        with httpx.Client(base_url=srv.url, headers=headers, timeout=60) as client:

            def check(method: str, path: str, label: str, body: bytes, want: tuple | None) -> None:
                nonlocal sent
                sent += 1
                try:
                    r = client.request(method, fill(path, ids, method), content=body)
                except httpx.TransportError as exc:
                    # A server that drops the connection instead of answering fails too.
                    statuses[599] += 1
                    errors.append(f"{method} {path} {label}: {type(exc).__name__}")
                    return
                statuses[r.status_code] += 1
                if r.status_code >= 500:
                    errors.append(f"{method} {path} {label}: {r.status_code} {r.text[:200]}")
                elif want is not None:
                    code = r.json().get("error", {}).get("code")
                    if (r.status_code, code) != want:
                        errors.append(f"{method} {path} {label}: {r.status_code} {r.text[:200]}")

            for method, path in routes:
                reads_json = (method, path) in with_body
                for label, depth, body in deep:
                    deep_enough = reads_json and depth >= REFUSED_DEPTH
                    check(
                        method, path, label, body, (400, "INVALID_REQUEST") if deep_enough else None
                    )
                for label, body in malformed:
                    too_big = reads_json and len(body) > HUGE
                    check(
                        method, path, label, body, (413, "PAYLOAD_TOO_LARGE") if too_big else None
                    )
            assert client.get("/healthz").status_code == 200
        logged = unexpected_logs(srv.output)
    server_errors = sum(n for status, n in statuses.items() if status >= 500)
    report(
        record_property,
        f"broker JSON fuzz on {store}: {sent} requests ({len(deep)} nested and "
        f"{len(malformed)} huge or malformed bodies) on {len(routes)} routes, "
        f"{len(with_body)} reading JSON: "
        f"{server_errors} server errors; statuses {dict(sorted(statuses.items()))}",
    )
    assert not errors, "\n".join(errors[:30])
    assert not logged, "\n\n".join(logged[:3])
