"""What a container provider makes of a dataplane that answers its status reads slowly
or with nonsense (one its sandbox's commands took over, say): the read ends in time,
and the sandbox is checked as if unanswered; never an exception or a wait without end
for the caller (the reaper, a resume)."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from sandlot.protocol.sessions import Template
from sandlot.protocol.states import SandboxState
from sandlot.providers.base import SandboxActivity, SandboxSpec
from sandlot.providers.socketrelay import Upstream
from tests.dataplane.conftest import Keys
from tests.providers.dockerharness import make_provider
from tests.providers.peers import trickling


def upstream_at(path: Path) -> Upstream:
    return Upstream(os.open(path, os.O_PATH))


@pytest.mark.parametrize(
    "answer",
    [
        None,
        json.dumps({"last_event_sequence": None, "running_execs": []}).encode(),
        json.dumps(["not", "an", "object"]).encode(),
        json.dumps({"last_event_sequence": 3, "running_execs": 1}).encode(),
    ],
    ids=["trickle", "nulls", "list", "sound"],
)
async def test_a_status_read_ends_in_time_whatever_the_dataplane_says(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, answer: bytes | None
) -> None:
    monkeypatch.setattr("sandlot.providers.inbox.STATUS_SECONDS", 1.0)
    monkeypatch.setattr("sandlot.providers.inbox.ACTIVITY_SECONDS", 1.0)
    nowhere = SimpleNamespace(url="unix:///nonexistent.sock")
    provider = make_provider(nowhere, "img", tmp_path / "data", Keys())  # type: ignore[arg-type]
    unanswered: list[str] = []

    async def checked(sandbox_id: str, box: object) -> None:
        unanswered.append(sandbox_id)

    monkeypatch.setattr(provider, "_unanswered", checked)
    sock = tmp_path / "dp.sock"
    async with trickling(answer, uds=sock):
        spec = SandboxSpec("sb_odd", 1, Template(name="t", image="host"))
        box = provider._new_box(spec, SandboxState.ACTIVE)
        box.upstream = upstream_at(sock)
        provider._sandboxes["sb_odd"] = box
        try:
            async with asyncio.timeout(30):
                status = await provider.status("sb_odd")
                activity = await provider.activity("sb_odd")
        finally:
            await box.upstream.close()
    assert status.state is SandboxState.ACTIVE
    if answer is not None and b'"running_execs": 1' in answer:
        assert (status.last_event_sequence, unanswered) == (3, [])
        assert activity.running_execs == 1
    else:
        assert (status.last_event_sequence, unanswered) == (0, ["sb_odd"])
        assert activity == SandboxActivity()
