"""Sandlot inside a real ``langgraph dev`` serving ``examples/langgraph``: the agent's
sandbox is the thread's, the thread's user joins it from the CLI, another user is
refused, and deleting the thread ends the sandbox (also when sandlot restarted since).

The LangGraph server runs in its own virtualenv (``.venv-langgraph``, made by
``scripts/test``: ``langgraph-api`` pins versions the rest of the suite cannot share);
``tests/servers.py`` starts it.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import httpx2
import pytest
from langgraph_sdk import get_sync_client
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

from tests.servers import LANGGRAPH_USERS, LangGraphDev

pytestmark = pytest.mark.timeout(300)

USERS = {**LANGGRAPH_USERS, "robot": "robot-token"}
#: LangGraph permissions of the users that have some (the example's auth returns them).
PERMISSIONS = {"robot": ["sandlot:agent"]}
SOURCE = "print('hello from the agent')\n"


def call(name: str, n: int, **args: Any) -> dict[str, Any]:
    return {"content": "", "tool_calls": [{"name": name, "args": args, "id": f"call_{n}"}]}


SCRIPT = [
    call("write_file", 1, file_path="/workspace/app.py", content=SOURCE),
    call("execute", 2, command="cd /workspace && python3 app.py"),
    {"content": "done"},
]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LangGraphDev]:
    workdir = tmp_path_factory.mktemp("langgraph")
    dev = LangGraphDev(
        workdir, workdir / "sandlot-data", users=USERS, permissions=PERMISSIONS, script=SCRIPT
    ).start()
    try:
        yield dev
    finally:
        dev.stop()
        dev.cleanup()


def headers(user: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {USERS[user]}"}


def sandlot(server: LangGraphDev, user: str, *args: str, **kw: Any) -> Any:
    """The ``sandlot`` command, authenticating with the user's LangGraph token."""
    env = {
        **os.environ,
        "SANDLOT_URL": server.url,
        "SANDLOT_API_KEY": USERS[user],
        "HOME": str(server.workdir / f"home-{user}"),
        "XDG_CACHE_HOME": str(server.workdir / f"cache-{user}"),
        "XDG_CONFIG_HOME": str(server.workdir / f"config-{user}"),
    }
    argv = [sys.executable, "-m", "sandlot.cli.main", *args]
    return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)


def session(server: LangGraphDev, user: str, thread_id: str) -> httpx.Response:
    return httpx.post(
        f"{server.url}/v1/sandbox/sessions",
        json={"thread_id": thread_id, "mode": "ensure"},
        headers=headers(user),
        timeout=60,
    )


def sandbox_state(server: LangGraphDev, user: str, sandbox_id: str) -> str:
    resp = httpx.get(f"{server.url}/v1/sandboxes/{sandbox_id}", headers=headers(user), timeout=30)
    assert resp.status_code == 200, resp.text
    return str(resp.json()["state"])


def wait_state(server: LangGraphDev, sandbox_id: str, wanted: set[str], within: float) -> str:
    deadline = time.monotonic() + within
    state = ""
    while time.monotonic() < deadline:
        state = sandbox_state(server, "alice", sandbox_id)
        if state in wanted:
            return state
        time.sleep(0.2)
    raise AssertionError(f"sandbox {sandbox_id} still {state} after {within} s")


@pytest.fixture
def lg(server: LangGraphDev) -> Iterator[Any]:
    """The LangGraph SDK's client, as alice."""
    with get_sync_client(url=server.url, api_key=None, headers=headers("alice")) as client:
        yield client


def test_agent_human_and_thread_lifecycle(server: LangGraphDev, lg: Any) -> None:
    thread_id = lg.threads.create()["thread_id"]

    # The human watches the thread's sandbox live, before the agent starts.
    watch = sandlot(server, "alice", "watch", thread_id, "--json", "--from-start")
    lines: list[dict[str, Any]] = []

    def read() -> None:
        assert watch.stdout is not None
        for line in watch.stdout:
            lines.append(json.loads(line))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        result = lg.runs.wait(
            thread_id,
            "agent",
            input={"messages": [{"role": "user", "content": "write app.py and run it"}]},
        )
        assert isinstance(result, dict), result
        outputs = [m for m in result["messages"] if m.get("type") == "tool"]
        assert any("hello from the agent" in str(m["content"]) for m in outputs), outputs

        # The human reads the agent's file through the same LangGraph server.
        cat = sandlot(server, "alice", "exec", thread_id, "--", "cat", "/workspace/app.py")
        out, err = cat.communicate(timeout=60)
        assert cat.returncode == 0, err
        assert out.decode() == SOURCE

        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            commands = [e for e in lines if "python3 app.py" in json.dumps(e)]
            files = [e for e in lines if "/workspace/app.py" in json.dumps(e)]
            if commands and files:
                break
            time.sleep(0.2)
        assert commands, json.dumps(lines, indent=1)
        assert files, lines
        # The agent's command is attributed to an agent acting for alice, not to alice.
        assert any((e.get("actor") or {}).get("type") == "agent" for e in commands), commands
    finally:
        watch.terminate()
        watch.communicate(timeout=10)
        reader.join(timeout=10)

    # Another LangGraph user may not see alice's thread, nor its sandbox.
    refused = session(server, "bob", thread_id)
    assert refused.status_code == 403, refused.text
    assert refused.json()["error"]["code"] == "FORBIDDEN"
    # Nor may a request that says it comes from LangGraph Studio, which LangGraph lets
    # past the auth handler as its Studio user (and ``langgraph dev`` checks nothing of):
    # not even for a thread that user made.
    studio_headers = {"X-Auth-Scheme": "langsmith"}
    made = httpx.post(f"{server.url}/threads", json={}, headers=studio_headers, timeout=60)
    assert made.status_code == 200, made.text
    for thread in (thread_id, made.json()["thread_id"]):
        studio = httpx.post(
            f"{server.url}/v1/sandbox/sessions",
            json={"thread_id": thread, "mode": "ensure"},
            headers=studio_headers,
            timeout=60,
        )
        assert studio.status_code == 403, studio.text
        assert studio.json()["error"]["code"] == "FORBIDDEN"
        assert "Studio" in studio.json()["error"]["message"]
    bob_exec = sandlot(server, "bob", "exec", thread_id, "--", "true")
    _, err = bob_exec.communicate(timeout=60)
    assert bob_exec.returncode != 0
    assert b"FORBIDDEN" in err

    # Deleting the thread ends its sandbox at once (documented: within a second or so).
    sandbox_id = session(server, "alice", thread_id).json()["sandbox"]["id"]
    lg.threads.delete(thread_id)
    wait_state(server, sandbox_id, {"terminating", "terminated"}, within=5)


def test_thread_deleted_while_sandlot_was_down_is_reconciled(server: LangGraphDev, lg: Any) -> None:
    thread_id = lg.threads.create()["thread_id"]
    grant = session(server, "alice", thread_id)
    assert grant.status_code == 200, grant.text
    sandbox_id = grant.json()["sandbox"]["id"]

    # Pruned threads are not deleted through DELETE /threads/{id}: nothing observes them
    # go. The server stops before the reconciling pass comes round, and starts again.
    pruned = httpx.post(
        f"{server.url}/threads/prune",
        json={"thread_ids": [thread_id]},
        headers=headers("alice"),
        timeout=30,
    )
    assert pruned.status_code == 200, pruned.text
    server.stop()
    server.start()
    wait_state(server, sandbox_id, {"terminating", "terminated"}, within=30)


async def test_mcp_beside_langgraphs_own(server: LangGraphDev, lg: Any) -> None:
    # LangGraph's own MCP endpoint stays at /mcp; sandlot's is /sandlot/mcp.
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as plain:
        own = await plain.get("/mcp", headers=headers("alice"))
        assert own.status_code != 404
        anonymous = await plain.post("/sandlot/mcp", json={})
        assert anonymous.status_code == 401

    thread_id = lg.threads.create()["thread_id"]
    key = server.key("alice")
    http = httpx2.AsyncClient(headers={"Authorization": f"Bearer {key}"}, timeout=60)
    url = f"{server.url}/sandlot/mcp"
    async with http, Client(streamable_http_client(url, http_client=http)) as client:
        acquired = await client.call_tool("environment_acquire", {"thread_id": thread_id})
        assert not acquired.is_error, acquired
        assert acquired.structured_content is not None
        session_id = acquired.structured_content["session_id"]
        ran = await client.call_tool(
            "exec", {"session_id": session_id, "command": "echo from-mcp > m.txt; cat m.txt"}
        )
        assert ran.structured_content is not None, ran
        assert ran.structured_content["stdout"] == "from-mcp\n"
        # A thread of another LangGraph user is refused, with the protocol's code.
        with lg_client(server, "bob") as bob:
            bobs = bob.threads.create()["thread_id"]
        refused = await client.call_tool("environment_acquire", {"thread_id": bobs})
        assert refused.is_error
        assert "FORBIDDEN" in str(refused.content[0])
    # What MCP's exec wrote is alice's thread's sandbox: she reads it from the CLI.
    cat = sandlot(server, "alice", "exec", thread_id, "--", "cat", "m.txt")
    out, err = cat.communicate(timeout=60)
    assert cat.returncode == 0, err
    assert out == b"from-mcp\n"


def lg_client(server: LangGraphDev, user: str) -> Any:
    return get_sync_client(url=server.url, api_key=None, headers=headers(user))


def test_a_pending_runs_sandbox_outlives_reconciling_passes(server: LangGraphDev, lg: Any) -> None:
    # A run delayed by a minute is pending: its thread is busy, and its sandbox stays
    # through the reconciling passes (every 10 s) until the run is cancelled.
    thread_id = lg.threads.create()["thread_id"]
    run = lg.runs.create(thread_id, "agent", input={"messages": []}, after_seconds=60)
    scope = {"type": "run", "id": f"{thread_id}/{run['run_id']}"}
    grant = httpx.post(
        f"{server.url}/v1/sandbox/sessions",
        json={"scope": scope, "mode": "ensure"},
        headers=headers("alice"),
        timeout=60,
    )
    assert grant.status_code == 200, grant.text
    sandbox_id = grant.json()["sandbox"]["id"]
    time.sleep(25)
    assert lg.runs.get(thread_id, run["run_id"])["status"] == "pending"
    assert sandbox_state(server, "alice", sandbox_id) == "active"
    lg.runs.cancel(thread_id, run["run_id"])
    wait_state(server, sandbox_id, {"terminating", "terminated"}, within=30)


def test_a_run_scoped_sandbox_ends_with_its_run(server: LangGraphDev, lg: Any) -> None:
    thread_id = lg.threads.create()["thread_id"]
    run = lg.runs.create(thread_id, "agent", input={"messages": []})
    lg.runs.join(thread_id, run["run_id"])
    scope = {"type": "run", "id": f"{thread_id}/{run['run_id']}"}
    grant = httpx.post(
        f"{server.url}/v1/sandbox/sessions",
        json={"scope": scope, "mode": "ensure"},
        headers=headers("alice"),
        timeout=60,
    )
    assert grant.status_code == 200, grant.text
    # The run is over: the reconciling pass (every 10 s) ends its sandbox.
    wait_state(server, grant.json()["sandbox"]["id"], {"terminating", "terminated"}, within=30)

    # A run scope must name its thread, and the thread must be the caller's.
    bad = httpx.post(
        f"{server.url}/v1/sandbox/sessions",
        json={"scope": {"type": "run", "id": run["run_id"]}, "mode": "ensure"},
        headers=headers("alice"),
        timeout=60,
    )
    assert bad.status_code == 400, bad.text
    assert bad.json()["error"]["code"] == "INVALID_REQUEST"
    bobs = httpx.post(
        f"{server.url}/v1/sandbox/sessions",
        json={"scope": scope, "mode": "ensure"},
        headers=headers("bob"),
        timeout=60,
    )
    assert bobs.status_code == 403, bobs.text


def test_a_langgraph_permission_makes_the_user_an_agent(server: LangGraphDev) -> None:
    with lg_client(server, "robot") as robot:
        thread_id = robot.threads.create()["thread_id"]
    grant = session(server, "robot", thread_id)
    assert grant.status_code == 200, grant.text
    payload = grant.json()["token"].split(".")[1]
    claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    assert claims["act"] == {"type": "agent", "id": "langgraph:robot"}
    # Alice, a human, is recorded as one.
    with lg_client(server, "alice") as alice:
        hers = alice.threads.create()["thread_id"]
    payload = session(server, "alice", hers).json()["token"].split(".")[1]
    claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    assert claims["act"] == {"type": "human", "id": "langgraph:alice"}
