"""``SandlotBackend.from_run()``: one deepagents graph, built once, serving every thread.

The backend resolves the sandbox from the LangGraph run's config on every call: the
grant of ``configurable.sandbox`` first (bootstrap mode), else ``configurable.thread_id``.
"""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest
from deepagents import create_deep_agent
from langchain_core.messages import AIMessage

from sandlot.integrations.deepagents import SandlotBackend, graph_factory
from sandlot.protocol.errors import SessionNotFound
from sandlot.sdk import Sandlot
from tests.integrations.test_deepagents_agent import ScriptedModel, call, tool_outputs
from tests.servers import SandlotServer

pytestmark = pytest.mark.timeout(120)


def writes(*files: tuple[str, str]) -> list[AIMessage]:
    """Scripted turns: for each run, one write then "done"."""
    out: list[AIMessage] = []
    for n, (path, content) in enumerate(files):
        out += [call("write_file", n, file_path=path, content=content), AIMessage(content="done")]
    return out


def run(agent: Any, **configurable: Any) -> dict[str, Any]:
    result: dict[str, Any] = agent.invoke(
        {"messages": [{"role": "user", "content": "go"}]}, config={"configurable": configurable}
    )
    return result


def test_one_graph_serves_each_thread_its_own_sandbox(
    server: SandlotServer, agent_key: str, human_key: str
) -> None:
    backend = SandlotBackend.from_run(url=server.url, api_key=agent_key)
    human = Sandlot(server.url, human_key)
    script = writes(("/workspace/a.txt", "for a\n"), ("/workspace/b.txt", "for b\n"))
    agent = create_deep_agent(model=ScriptedModel(messages=iter(script)), backend=backend)
    try:
        run(agent, thread_id="thr_run_a")
        run(agent, thread_id="thr_run_b")
        a, b = human.ensure("thr_run_a"), human.ensure("thr_run_b")
        assert a.id != b.id
        assert a.read_text("/workspace/a.txt") == "for a\n"
        assert b.read_text("/workspace/b.txt") == "for b\n"
        assert not a.exists("/workspace/b.txt") and not b.exists("/workspace/a.txt")
    finally:
        backend.close()
        human.close()


def held(client: Sandlot) -> list[Any]:
    """The threads whose leases ``client`` holds (heartbeats, refreshes)."""
    return [(lease.grant.scope or {}).get("id") for lease in client._leases.values()]


def test_threads_are_let_go_beyond_the_limit_or_once_idle_and_taken_up_again(
    server: SandlotServer, agent_key: str, human_key: str
) -> None:
    # Every thread's lease was held (heartbeats) for the process's life, those past the
    # limit included: none of their sandboxes ever went idle.
    backend = SandlotBackend.from_run(
        url=server.url, api_key=agent_key, max_threads=1, idle_seconds=1.0
    )
    script = writes(
        ("/workspace/a.txt", "a\n"), ("/workspace/b.txt", "b\n"), ("/workspace/c.txt", "c\n")
    )
    agent = create_deep_agent(model=ScriptedModel(messages=iter(script)), backend=backend)
    runs = backend._resolve.__self__  # type: ignore[attr-defined]
    human = Sandlot(server.url, human_key)
    try:
        run(agent, thread_id="thr_idle_a")
        client = runs._clients[None]
        assert held(client) == ["thr_idle_a"]
        run(agent, thread_id="thr_idle_b")  # past the limit of 1: a is let go
        assert held(client) == ["thr_idle_b"]
        deadline = time.monotonic() + 20
        while client._leases:  # b, once no call used it for a second
            assert time.monotonic() < deadline
            time.sleep(0.1)
        run(agent, thread_id="thr_idle_a")  # taken up again: the same sandbox
        a = human.ensure("thr_idle_a")
        assert a.read_text("/workspace/a.txt") == "a\n"
        assert a.read_text("/workspace/c.txt") == "c\n"
    finally:
        backend.close()
        human.close()


def test_a_bootstrap_grant_takes_precedence_over_the_thread(
    server: SandlotServer, agent_key: str, human_key: str
) -> None:
    resp = httpx.post(
        f"{server.url}/v1/sandbox/sessions",
        json={"thread_id": "thr_run_boot", "mode": "ensure"},
        headers={"Authorization": f"Bearer {agent_key}"},
    )
    resp.raise_for_status()
    backend = SandlotBackend.from_run(url=server.url, api_key=agent_key)
    human = Sandlot(server.url, human_key)
    agent = create_deep_agent(
        model=ScriptedModel(messages=iter(writes(("/workspace/boot.txt", "boot\n")))),
        backend=backend,
    )
    try:
        run(agent, thread_id="thr_run_other", sandbox=resp.json())
        assert human.ensure("thr_run_boot").read_text("/workspace/boot.txt") == "boot\n"
        # The thread named beside the grant got no sandbox.
        with pytest.raises(SessionNotFound):
            human.ensure("thr_run_other", mode="attach_only")
    finally:
        backend.close()
        human.close()


def test_outside_a_run_it_says_so(server: SandlotServer, agent_key: str) -> None:
    backend = SandlotBackend.from_run(url=server.url, api_key=agent_key)
    try:
        with pytest.raises(RuntimeError, match="outside a LangGraph run"):
            backend.read("/workspace/x")
        with pytest.raises(RuntimeError, match="outside a LangGraph run"):
            backend.execute("true")
        agent = create_deep_agent(
            model=ScriptedModel(messages=iter([call("ls", 1, path="/workspace"), AIMessage("ok")])),
            backend=backend,
        )
        # A run without a thread: the set-up mistake surfaces, whatever the tool layer does.
        try:
            out = tool_outputs(run(agent))
        except RuntimeError as exc:
            assert "neither configurable.sandbox nor configurable.thread_id" in str(exc)
        else:
            assert "neither configurable.sandbox nor configurable.thread_id" in out["ls"]
    finally:
        backend.close()


def test_a_graph_factory_builds_each_run_on_its_sandbox(
    server: SandlotServer, agent_key: str, human_key: str
) -> None:
    script = iter(writes(("/workspace/f.txt", "from the factory\n")))
    built: list[SandlotBackend] = []

    def build(backend: SandlotBackend) -> Any:
        built.append(backend)
        return create_deep_agent(model=ScriptedModel(messages=script), backend=backend)

    make_graph = graph_factory(build, url=server.url, api_key=agent_key)
    human = Sandlot(server.url, human_key)
    try:
        config = {"configurable": {"thread_id": "thr_factory"}}
        make_graph(config).invoke({"messages": [{"role": "user", "content": "go"}]}, config)
        sandbox = human.ensure("thr_factory")
        assert built[0].id == sandbox.id
        assert sandbox.read_text("/workspace/f.txt") == "from the factory\n"
        # The same thread again: the same sandbox; a bootstrap grant wins over the thread.
        assert make_graph(config) is not None and built[1].id == sandbox.id
        other = human.ensure("thr_factory_boot")
        boot = {"configurable": {"thread_id": "thr_factory", "sandbox": other.grant.raw}}
        make_graph(boot)
        assert built[2].id == other.id
    finally:
        make_graph.close()
        human.close()
