"""A real deepagents agent on a sandlot sandbox, watched by a human on the same thread.

The model is scripted (no network): a ``GenericFakeChatModel`` whose messages
carry tool calls, as deepagents' own tests do.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from deepagents import create_deep_agent
from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage, ToolMessage

from sandlot.integrations.deepagents import SandlotBackend
from sandlot.sdk import Event, Sandlot
from tests.servers import SandlotServer

pytestmark = pytest.mark.timeout(90)


class ScriptedModel(GenericFakeChatModel):
    """Answers with the scripted messages in order; tools are "bound" by ignoring them."""

    def bind_tools(self, tools: Any, **kwargs: Any) -> ScriptedModel:  # type: ignore[override]
        return self


def call(name: str, n: int, **args: Any) -> AIMessage:
    return AIMessage(content="", tool_calls=[{"name": name, "args": args, "id": f"call_{n}"}])


SOURCE = "def greet():\n    return 'hi'\n"


def script() -> list[AIMessage]:
    return [
        call("write_file", 1, file_path="/workspace/app.py", content=SOURCE),
        call(
            "edit_file", 2, file_path="/workspace/app.py", old_string="'hi'", new_string="'hello'"
        ),
        call("read_file", 3, file_path="/workspace/app.py"),
        call("grep", 4, pattern="hello", path="/workspace", output_mode="content"),
        call("glob", 5, pattern="*.py", path="/workspace"),
        call("execute", 6, command="cd /workspace && python3 -c 'import app; print(app.greet())'"),
        AIMessage(content="done"),
    ]


def tool_outputs(result: dict[str, Any]) -> dict[str, str]:
    return {
        m.name: str(m.content) for m in result["messages"] if isinstance(m, ToolMessage) and m.name
    }


def test_agent_and_human_share_the_sandbox(
    server: SandlotServer, agent_key: str, human_key: str
) -> None:
    backend = SandlotBackend.for_thread("thr_agent", url=server.url, api_key=agent_key)
    human = Sandlot(server.url, human_key)
    try:
        sandbox = human.ensure("thr_agent")
        assert sandbox.id == backend.id
        agent = create_deep_agent(model=ScriptedModel(messages=iter(script())), backend=backend)
        result = agent.invoke({"messages": [{"role": "user", "content": "write a greeter"}]})
        out = tool_outputs(result)
        assert "hello" in out["read_file"]
        assert "/workspace/app.py" in out["grep"]
        assert "/workspace/app.py" in out["glob"]
        assert "hello" in out["execute"]
        assert result["messages"][-1].content == "done"

        # The human sees the agent's file and its events, with the agent as actor.
        assert sandbox.read_text("/workspace/app.py") == "def greet():\n    return 'hello'\n"
        seen: list[Event] = []
        with sandbox.events(after=0, timeout=10) as events:
            for event in events:
                seen.append(event)
                kinds = {(e.kind, (e.actor or {}).get("type")) for e in seen}
                if {("fs", "agent"), ("exec", "agent")} <= kinds and any(
                    e.details.get("exec", {}).get("exit_code") == 0 for e in seen
                ):
                    break
        fs = [e for e in seen if e.kind == "fs" and (e.actor or {}).get("type") == "agent"]
        assert any(e.details["fs"]["path"] == "/workspace/app.py" for e in fs)
        execs = [e for e in seen if e.kind == "exec" and (e.actor or {}).get("type") == "agent"]
        assert {e.event_type for e in execs} >= {"exec.started", "exec.exited"}
    finally:
        backend.close()
        human.close()


async def test_agent_async(server: SandlotServer, agent_key: str) -> None:
    backend = SandlotBackend.for_thread("thr_agent_async", url=server.url, api_key=agent_key)
    try:
        agent = create_deep_agent(model=ScriptedModel(messages=iter(script())), backend=backend)
        result = await agent.ainvoke({"messages": [{"role": "user", "content": "go"}]})
        out = tool_outputs(result)
        assert "hello" in out["read_file"]
        assert "hello" in out["execute"]
    finally:
        backend.close()


def test_backend_from_a_bootstrap_grant(server: SandlotServer, agent_key: str) -> None:
    # The grant a run is handed in config["configurable"]["sandbox"] (PROTOCOL.md 2.10).
    resp = httpx.post(
        f"{server.url}/v1/sandbox/sessions",
        json={"thread_id": "thr_boot", "mode": "ensure"},
        headers={"Authorization": f"Bearer {agent_key}"},
    )
    resp.raise_for_status()
    backend = SandlotBackend(resp.json())
    try:
        assert backend.id == resp.json()["sandbox"]["id"]
        assert backend.write("/workspace/b.txt", "boot\n").error is None
        read = backend.read("/workspace/b.txt")
        assert read.file_data is not None and read.file_data["content"] == "boot"
        assert backend.execute("cat /workspace/b.txt").output == "boot\n"
        missing = backend.download_files(["/workspace/nope", "/workspace/b.txt"])
        assert [r.error for r in missing] == ["file_not_found", None]
    finally:
        backend.close()
