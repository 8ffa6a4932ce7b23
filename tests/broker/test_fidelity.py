"""The broker as the design documents say, against a real ``sandlot serve``.

- An error never names another user's resources (a 403 on a session of theirs
  used to name their scope).
- LangSmith boxes: an unknown template is an error, never the default instead;
  box answers say their ``template_name``.
- ``mode`` is required in a negotiation (MVP).
- ``actor.id`` of a negotiation is the token's ``act.id`` and the audit's actor,
  within what the key may claim.
- ``sandlot_errors_total`` counts the errors answered, by code.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from typing import Any

import httpx
import jwt
import pytest

from tests.servers import SandlotServer, running

CONFIG = """
admins = ["root"]
"""


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SandlotServer]:
    with running(tmp_path_factory.mktemp("fidelity") / "data", config=CONFIG) as server:
        yield server


def post(srv: SandlotServer, path: str, body: Any, headers: dict[str, str]) -> httpx.Response:
    return httpx.post(f"{srv.url}{path}", json=body, headers=headers, timeout=60)


def claims(token: str) -> dict[str, Any]:
    return dict(jwt.decode(token, options={"verify_signature": False}))


def error(r: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err: dict[str, Any] = r.json()["error"]
    assert err["code"] == code, r.text
    return err


def test_errors_never_name_another_users_resources(srv: SandlotServer) -> None:
    alice = srv.headers("alice")
    bob = srv.headers("bob")
    r = post(
        srv, "/v1/sandbox/sessions", {"thread_id": "thr_alice_secret", "mode": "ensure"}, alice
    )
    assert r.status_code == 200, r.text
    grant = r.json()
    sid = grant["session_id"]
    # What bob must never learn from an error: alice's scope, sandbox and user id.
    secrets = ("thr_alice_secret", grant["sandbox"]["id"], "alice")
    answers = [
        httpx.get(f"{srv.url}/v1/sandbox/sessions/{sid}", headers=bob),
        httpx.get(f"{srv.url}/v1/sandbox/sessions/{sid}/events", headers=bob),
        post(srv, f"/v1/sandbox/sessions/{sid}/refresh", {}, bob),
        post(srv, f"/v1/sandbox/sessions/{sid}/heartbeat", {}, bob),
        httpx.delete(f"{srv.url}/v1/sandbox/sessions/{sid}", headers=bob),
        httpx.delete(f"{srv.url}/v1/sandbox/sessions/{sid}?terminate=true", headers=bob),
        post(srv, "/sandbox/release", {"session_id": sid}, bob),
        # Naming the scope itself: the answer says no more than bob sent.
        post(srv, "/v1/sandbox/sessions", {"thread_id": "thr_alice_secret", "mode": "get"}, bob),
        httpx.get(f"{srv.url}/v1/sandbox/scopes/thread/thr_alice_secret/members", headers=bob),
        post(
            srv,
            "/v1/sandbox/sessions",
            {"thread_id": "thr_b", "mode": "ensure", "sandbox_hint": grant["sandbox"]["id"]},
            bob,
        ),
    ]
    for r in answers:
        assert 400 <= r.status_code < 500, r.text
        err = r.json()["error"]
        named = [s for s in secrets if s in str(err.get("metadata")) or s in err["message"]]
        # The sandbox hint is bob's own input, echoed: it is no finding of his.
        if "sandbox_hint" in err.get("metadata", {}):
            named = [s for s in named if s != grant["sandbox"]["id"]]
        assert not named, f"{r.request.method} {r.request.url.path}: {r.text}"
    assert error(answers[0], 403, "FORBIDDEN")["metadata"] == {}


def test_unknown_box_template_is_an_error(srv: SandlotServer) -> None:
    carol = srv.headers("carol")
    for field in ("template_name", "snapshot", "snapshot_name", "snapshot_id"):
        r = post(srv, "/v2/sandboxes/boxes", {field: "no-such-template"}, carol)
        err = error(r, 404, "NOT_FOUND")
        assert "no-such-template" in err["message"]
    r = post(srv, "/v2/sandboxes/boxes", {"template_name": "default", "snapshot": "other"}, carol)
    error(r, 400, "INVALID_REQUEST")
    r = post(srv, "/v2/sandboxes/boxes", {"name": "fid-box", "template_name": "default"}, carol)
    assert r.status_code == 200, r.text
    assert r.json()["template_name"] == "default"
    got = httpx.get(f"{srv.url}/v2/sandboxes/boxes/fid-box", headers=carol).json()
    assert got["template_name"] == "default"
    boxes = httpx.get(f"{srv.url}/v2/sandboxes/boxes", headers=carol).json()["sandboxes"]
    # The refused requests created nothing.
    assert [(b["name"], b["template_name"]) for b in boxes] == [("fid-box", "default")]


def test_mode_is_required(srv: SandlotServer) -> None:
    dave = srv.headers("dave")
    for body in ({"thread_id": "thr_nomode"}, {"scope": {"type": "thread", "id": "thr_nomode"}}):
        err = error(post(srv, "/v1/sandbox/sessions", body, dave), 400, "INVALID_REQUEST")
        assert "mode" in err["message"]
    assert httpx.get(f"{srv.url}/v1/sandboxes", headers=dave).json()["items"] == []


def audit_rows(srv: SandlotServer, actor: str) -> list[dict[str, Any]]:
    r = httpx.get(f"{srv.url}/v1/audit", params={"actor": actor}, headers=srv.headers("root"))
    assert r.status_code == 200, r.text
    items: list[dict[str, Any]] = r.json()["items"]
    return items


def test_actor_id_is_the_tokens_and_the_audits(srv: SandlotServer) -> None:
    agent = srv.headers("erin", "agent")
    scope = {"type": "thread", "id": "thr_agents"}
    grants = {}
    for name in ("researcher", "writer"):
        r = post(
            srv,
            "/v1/sandbox/sessions",
            {"scope": scope, "mode": "ensure", "actor": {"type": "agent", "id": name}},
            agent,
        )
        assert r.status_code == 200, r.text
        grants[name] = r.json()
        c = claims(grants[name]["token"])
        # The act claim names the agent; the subject stays the key's principal.
        assert c["act"] == {"type": "agent", "id": name} and c["sub"] == "agent:erin"
    for name in ("researcher", "writer"):
        rows = [r for r in audit_rows(srv, name) if r["action"] == "session.ensure"]
        assert rows, f"no audit row for {name}"
        assert all(r["actor"] == {"type": "agent", "id": name} for r in rows)
        assert all(r["principal_id"] == "agent:erin" for r in rows)
    # Refresh keeps the actor that attached last (leases are per key's principal).
    sid = grants["writer"]["session_id"]
    r = post(srv, f"/v1/sandbox/sessions/{sid}/refresh", {}, agent)
    assert claims(r.json()["token"])["act"] == {"type": "agent", "id": "writer"}
    assert any(r["action"] == "session.refresh" for r in audit_rows(srv, "writer"))
    # The dataplane sees the agent too: it records who ran a command.
    grant = grants["writer"]
    dp = grant["dataplane"]["http_base_url"]
    token = {"Authorization": f"Bearer {grant['token']}"}
    deadline = time.monotonic() + 60
    while (
        r := httpx.post(f"{dp}/exec", json={"command": "true"}, headers=token)
    ).status_code == 423:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert r.status_code == 200, r.text
    execs = httpx.get(f"{dp}/execs", headers=token).json()["execs"]
    assert execs and execs[-1]["actor"] == {"type": "agent", "id": "writer"}
    # Without actor: the key's principal, as before.
    r = post(srv, "/v1/sandbox/sessions", {"scope": scope, "mode": "ensure"}, agent)
    assert claims(r.json()["token"])["act"] == {"type": "agent", "id": "agent:erin"}


def test_actor_claims_a_key_may_not_make(srv: SandlotServer) -> None:
    human = srv.headers("frank")
    body: dict[str, Any] = {"thread_id": "thr_frank", "mode": "ensure"}
    # A human key is not an agent, nor another human.
    for actor in ({"type": "agent", "id": "bot"}, {"type": "human", "id": "grace"}):
        error(post(srv, "/v1/sandbox/sessions", {**body, "actor": actor}, human), 403, "FORBIDDEN")
    # It may name itself, by principal or user id.
    for own in ("human:frank", "frank"):
        r = post(
            srv, "/v1/sandbox/sessions", {**body, "actor": {"type": "human", "id": own}}, human
        )
        assert r.status_code == 200, r.text
        assert claims(r.json()["token"])["act"] == {"type": "human", "id": own}
    # An agent key is never a human; a service acting for a user stays an agent.
    agent = srv.headers("frank", "agent")
    r = post(
        srv, "/v1/sandbox/sessions", {**body, "actor": {"type": "human", "id": "frank"}}, agent
    )
    error(r, 403, "FORBIDDEN")
    service = {**srv.headers("platform", "service"), "X-Sandlot-On-Behalf-Of": "frank"}
    r = post(
        srv, "/v1/sandbox/sessions", {**body, "actor": {"type": "agent", "id": "planner"}}, service
    )
    assert r.status_code == 200, r.text
    assert claims(r.json()["token"])["act"] == {"type": "agent", "id": "planner"}
    r = post(
        srv, "/v1/sandbox/sessions", {**body, "actor": {"type": "human", "id": "frank"}}, service
    )
    error(r, 403, "FORBIDDEN")


def errors_total(srv: SandlotServer) -> dict[str, float]:
    text = httpx.get(f"{srv.url}/metrics").text
    return {
        m.group(1): float(m.group(2))
        for m in re.finditer(r'^sandlot_errors_total\{code="([A-Z_]+)"\} (\S+)$', text, re.M)
    }


def test_errors_are_counted_by_code(srv: SandlotServer) -> None:
    before = errors_total(srv)
    heidi = srv.headers("heidi")
    httpx.get(f"{srv.url}/v1/sandboxes", headers={"Authorization": "Bearer nope"})
    httpx.get(f"{srv.url}/v1/sandboxes", headers={"Authorization": "Bearer nope"})
    httpx.get(f"{srv.url}/v1/sandboxes/sb_missing", headers=heidi)
    httpx.post(f"{srv.url}/v1/sandbox/sessions", content=b"[" * 5000, headers=heidi)
    httpx.get(f"{srv.url}/v1/no-such-route", headers=heidi)
    after = errors_total(srv)

    def grew(code: str) -> float:
        return after.get(code, 0.0) - before.get(code, 0.0)

    assert grew("UNAUTHENTICATED") == 2
    assert grew("SANDBOX_NOT_FOUND") == 1
    assert grew("INVALID_REQUEST") == 1
    assert grew("NOT_FOUND") == 1
