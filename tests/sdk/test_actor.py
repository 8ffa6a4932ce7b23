"""An agent framework names its agents through the SDK: ``ensure(actor_id=...)``.

Against a real ``sandlot serve``: two agents of one key in one thread each get a token
acting as themselves, and the commands they run are recorded with their own names.
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

from sandlot.sdk import AsyncSandlot
from sandlot.sdk.types import Actor
from tests.servers import running


def test_each_agent_acts_as_itself(tmp_path: Path) -> None:
    with running(tmp_path / "data") as srv:
        asyncio.run(agents(srv.url, srv.key("erin", "agent")))


async def agents(url: str, key: str) -> None:
    thread = f"thr_{uuid.uuid4().hex[:6]}"
    async with AsyncSandlot(url, key) as client:
        researcher = await client.ensure(thread, actor_id="researcher")
        writer = await client.ensure(thread, actor_id="writer")
        a = await researcher.exec("true")
        b = await writer.exec("true")
        assert a.exec_id is not None and b.exec_id is not None
        assert (await writer.get_exec(a.exec_id)).actor == Actor(type="agent", id="researcher")
        assert (await researcher.get_exec(b.exec_id)).actor == Actor(type="agent", id="writer")
        plain = await client.ensure(thread)
        c = await plain.exec("true")
        assert c.exec_id is not None
        assert (await plain.get_exec(c.exec_id)).actor == Actor(type="agent", id="agent:erin")
        # Token renewals keep each one's actor (a refresh would mint for the last one).
        await researcher._renew_token()
        d = await researcher.exec("true")
        assert d.exec_id is not None
        assert (await researcher.get_exec(d.exec_id)).actor == Actor(type="agent", id="researcher")
