"""A deepagents agent whose files and commands live in its thread's sandlot sandbox.

The model is ``EXAMPLE_MODEL`` (``provider:model``, e.g. ``anthropic:claude-sonnet-4-5``
with ``ANTHROPIC_API_KEY`` set), or, with ``EXAMPLE_SCRIPT`` naming a JSON file of
replies, a scripted model that needs no network (the example's test uses it).
"""

from __future__ import annotations

import json
import os
from typing import Any

from deepagents import create_deep_agent
from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage

from sandlot.integrations.deepagents import SandlotBackend


class ScriptedModel(GenericFakeChatModel):
    """Answers with scripted messages in order; tools are "bound" by ignoring them."""

    def bind_tools(self, tools: Any, **kwargs: Any) -> ScriptedModel:  # type: ignore[override]
        return self


def _model() -> Any:
    script = os.environ.get("EXAMPLE_SCRIPT")
    if script:
        with open(script) as f:
            replies = [AIMessage(**reply) for reply in json.load(f)]
        return ScriptedModel(messages=iter(replies))
    from langchain.chat_models import init_chat_model

    return init_chat_model(os.environ.get("EXAMPLE_MODEL", "anthropic:claude-sonnet-4-5"))


# One graph for every thread: each call of the backend resolves the run's sandbox (the
# thread's, ensured as the run's LangGraph user; or a grant in configurable.sandbox).
agent = create_deep_agent(
    model=_model(),
    backend=SandlotBackend.from_run(),
    system_prompt="You work in a sandbox shared with a human; files live under /workspace.",
)
