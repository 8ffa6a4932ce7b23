"""The ``langsmith`` provider end to end: a first ``sandlot serve`` makes its sandboxes as
boxes of a second one's LangSmith-compatible surface and serves them through its relay;
clients use the first one's SDK and CLI exactly as with ``local``."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import websockets

from sandlot.protocol.errors import CapabilityDenied, Forbidden, NotSupported, Unauthenticated
from sandlot.sdk import AsyncSandlot
from tests.providers.langsmithharness import Pair, pair

pytestmark = [pytest.mark.isolation, pytest.mark.slow, pytest.mark.timeout(300)]

SANDLOT = [sys.executable, "-m", "sandlot.cli.main"]

#: Prints ``N`` numbered lines, a few at a time, then exits 5.
PRODUCER = (
    "for i in $(seq 1 {n}); do echo line-$i; if [ $((i % 50)) = 0 ]; then sleep 0.02; fi; done;"
    " exit 5"
)


async def http_call(method: str, url: str, **kw: object) -> httpx.Response:
    async with httpx.AsyncClient(timeout=30) as http:
        return await http.request(method, url, **kw)  # type: ignore[arg-type]


def _jwt_payload(token: str) -> dict[str, object]:
    body = token.split(".")[1]
    return dict(json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))))


def _box_named_for(p: Pair, sandbox_id: str) -> list[dict[str, object]]:
    tail = sandbox_id.replace("_", "-")
    return [b for b in p.boxes() if str(b["name"]).endswith(tail)]


async def test_a_thread_is_a_hosted_box_reached_through_the_relay(tmp_path: Path) -> None:
    with pair(tmp_path) as p:
        key = p.broker.key("alice", "agent")
        seen: list[str] = []  # every answer a client of the broker sees
        client = AsyncSandlot(p.broker.url, key, auto_refresh=False)
        try:
            caps = ["fs_read", "fs_write", "exec", "shell", "shell_observe"]
            sb = await client.ensure("thr_hosted", capabilities=caps)
            seen.append(json.dumps(sb.grant.raw))
            assert sb.grant.raw["sandbox"]["provider"] == "langsmith"
            assert sb.grant.http_base_url == f"{p.broker.url}/dp/{sb.id}/v1"
            (box,) = _box_named_for(p, sb.id)
            assert box["status"] == "ready"

            # One-shot exec (a list is quoted, never re-split), stdin, cwd, env.
            r = await sb.exec("echo out; echo err >&2; exit 3")
            assert (r.stdout, r.stderr, r.exit_code) == ("out\n", "err\n", 3)
            r = await sb.exec(["printf", "%s|", "a b", "$HOME", "'q'"])
            assert r.stdout == "a b|$HOME|'q'|"
            r = await sb.exec("cat; pwd; echo $X", env={"X": "y"}, stdin="fed\n")
            assert r.stdout == "fed\n/workspace\ny\n"

            # Files: write, read (lines and etags), conditional writes, edit.
            etag = await sb.write("notes/a.txt", "one\ntwo\nthree\n")
            page = await sb.read("/workspace/notes/a.txt", offset=1, limit=1)
            assert (page.content, page.total_lines, page.next_offset) == ("two\n", 3, 2)
            assert page.etag == etag
            with pytest.raises(Exception) as stale:
                await sb.write("notes/a.txt", "x", if_match="0" * 32)
            assert "PRECONDITION_FAILED" in repr(stale.value) or "changed" in str(stale.value)
            edited = await sb.edit("notes/a.txt", "two", "TWO")
            assert edited.occurrences == 1
            assert await sb.read_text("notes/a.txt") == "one\nTWO\nthree\n"
            # What a command wrote is what the API reads, and the reverse.
            assert (await sb.exec("cat notes/a.txt")).stdout == "one\nTWO\nthree\n"
            await sb.exec("mkdir -p src/pkg && printf 'def f():\\n    return 42\\n' > src/pkg/m.py")
            names = {e.path for e in await sb.ls("/workspace")}
            assert {"/workspace/notes", "/workspace/src"} <= names
            deep = {e.path for e in await sb.ls("/workspace", depth=3)}
            assert "/workspace/src/pkg/m.py" in deep
            assert [e.path for e in await sb.glob("**/*.py")] == ["/workspace/src/pkg/m.py"]
            hits = await sb.grep("return 42")
            assert [(h.path, h.line) for h in hits] == [("/workspace/src/pkg/m.py", 2)]
            stat = await sb.stat("src/pkg/m.py")
            assert stat.size == len("def f():\n    return 42\n")
            await sb.mkdir("made/deeper")
            await sb.move("notes/a.txt", "made/deeper/b.txt")
            assert not await sb.exists("notes/a.txt")
            await sb.delete("made", recursive=True)
            assert not await sb.exists("made/deeper/b.txt")
            # A path that looks like an option, or holds shell syntax, is only a name.
            await sb.write("-rf $(touch pwned); x", "odd\n")
            assert await sb.read_text("-rf $(touch pwned); x") == "odd\n"
            assert not await sb.exists("pwned")

            # Upload and download, streamed, with a range.
            blob = os.urandom(300_000)
            await sb.upload("bin/blob", blob)
            assert await sb.download("bin/blob") == blob
            r2 = await http_call(
                "GET",
                f"{sb.grant.http_base_url}/files/download",
                params={"path": "bin/blob"},
                headers={"Authorization": f"Bearer {sb.grant.token}", "Range": "bytes=10-19"},
            )
            assert r2.status_code == 206 and r2.content == blob[10:20]
            seen.append(r2.text[:0])

            # Streaming exec: the client's socket is cut mid-stream; it reattaches with
            # its offsets and loses nothing.
            n = 4000
            expected = "".join(f"line-{i}\n" for i in range(1, n + 1)).encode()
            cmd = await sb.stream(PRODUCER.format(n=n))
            got = bytearray()
            cut = False
            async with asyncio.timeout(120):
                async for chunk in cmd:
                    if chunk.stream != "stdout":
                        continue
                    assert chunk.offset == len(got)
                    got += chunk.data.encode()
                    if not cut and len(got) > len(expected) // 3:
                        cut = True
                        await cmd._ws.close()
            assert cmd.exit_code == 5 and cmd.reconnects >= 1
            assert hashlib.sha256(got).digest() == hashlib.sha256(expected).digest()
            snapshot = await sb.get_exec(cmd.exec_id or "")
            assert snapshot.state == "exited" and snapshot.exit_code == 5

            # A shared shell: two clients see the same bytes.
            async with (
                await sb.shell("main") as driver,
                await sb.shell("main", role="observer") as observer,
            ):
                await driver.send("echo shell-$((6*7)); tty\n")
                typed = await driver.read_until("/dev/pts/", timeout=30)
                watched = await observer.read_until("/dev/pts/", timeout=30)
                assert "shell-42" in typed and "shell-42" in watched
            assert [s.name for s in await sb.list_shells()] == ["main"]

            # The relay's event log saw the API's changes and the commands.
            async with httpx.AsyncClient() as http:
                events = await _events(http, sb.grant.http_base_url, sb.grant.token)
            kinds = {e["event_type"] for e in events}
            assert {"exec.started", "exec.exited", "fs.modified"} <= kinds
            seen.extend(json.dumps(e) for e in events)

            # What has no counterpart on a box says so (501 with the envelope).
            with pytest.raises(NotSupported):
                await sb.download_archive("/workspace")

            # The CLI, through the same relay.
            env = _cli_env(p, key, tmp_path)
            out = subprocess.run(
                [*SANDLOT, "exec", "thr_hosted", "--", "echo via-cli; exit 4"],
                env=env, capture_output=True, text=True, timeout=60,
            )  # fmt: skip
            assert out.returncode == 4 and out.stdout == "via-cli\n", out.stderr
            seen.append(out.stdout + out.stderr)

            # Terminating the thread's session deletes the box at the service.
            assert sb.grant.session_id is not None
            await client.release(sb.grant.session_id, terminate=True, timeout=60)
            async with asyncio.timeout(30):
                while _box_named_for(p, sb.id):
                    await asyncio.sleep(0.1)
        finally:
            await client.aclose()
        for url in ("/readyz", "/metrics"):
            seen.append((await http_call("GET", f"{p.broker.url}{url}")).text)
        seen.append(json.dumps(_jwt_payload(sb.grant.token)))
        seen.append(sb.grant.token)
    # The provider's key reached no client and no log line of the broker.
    logs = "".join(p.broker.output)
    assert p.service_key not in logs
    for text in seen:
        assert p.service_key not in text


async def _events(http: httpx.AsyncClient, base: str, token: str) -> list[dict[str, object]]:
    """The log up to the sequence a snapshot reports (read first: no race)."""
    headers = {"Authorization": f"Bearer {token}"}
    execs = (await http.get(f"{base}/execs", headers=headers)).json()["execs"]
    last = max(int(e["last_event_sequence"]) for e in execs)
    events: list[dict[str, object]] = []
    async with http.stream("GET", f"{base}/events", headers=headers, timeout=10) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
                if int(str(events[-1]["sequence"])) >= last:
                    break
    assert [e["sequence"] for e in events] == list(range(1, last + 1))
    return events


def _cli_env(p: Pair, key: str, tmp_path: Path) -> dict[str, str]:
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    return {
        **os.environ,
        "SANDLOT_URL": p.broker.url,
        "SANDLOT_API_KEY": key,
        "HOME": str(home),
        "XDG_CACHE_HOME": str(home / ".cache"),
        "XDG_CONFIG_HOME": str(home / ".config"),
    }


async def test_the_relay_checks_every_token_itself(tmp_path: Path) -> None:
    with pair(tmp_path) as p:
        client = AsyncSandlot(p.broker.url, p.broker.key("alice", "agent"), auto_refresh=False)
        try:
            a = await client.ensure("thr_a")
            b = await client.ensure("thr_b")
            reader = await client.ensure("thr_a", capabilities=["fs_read"])
            assert reader.id == a.id
            async with httpx.AsyncClient(timeout=30) as http:
                # A's token on B's relay: refused there, never passed to the box.
                r = await http.post(
                    f"{b.grant.http_base_url}/exec",
                    json={"command": "touch /workspace/by-a"},
                    headers={"Authorization": f"Bearer {a.grant.token}"},
                )
                assert r.status_code == 403 and r.json()["error"]["code"] == "FORBIDDEN"
                # The service's own key is no credential at the relay.
                r = await http.post(
                    f"{a.grant.http_base_url}/exec",
                    json={"command": "true"},
                    headers={"X-Api-Key": p.service_key},
                )
                assert r.status_code == 401
                r = await http.get(f"{a.grant.http_base_url}/fs/list")
                assert r.status_code == 401
            assert not await b.exists("by-a")
            # A token without the capability.
            with pytest.raises(CapabilityDenied):
                await reader.exec("true")
            assert (await reader.ls("/workspace")) == []
            with pytest.raises((Forbidden, CapabilityDenied)):
                await reader.write("x", "y")
            # The WebSocket of another sandbox's token closes with 4403.
            url = f"{b.grant.ws_base_url}/exec/ws"
            async with websockets.connect(
                url, additional_headers={"Authorization": f"Bearer {a.grant.token}"}
            ) as ws:
                with pytest.raises(websockets.ConnectionClosed):
                    await ws.recv()
                    await ws.recv()
                assert ws.close_code == 4403
            # A revoked token (its session released) is refused within a second, and its
            # open socket closed.
            token = a.grant.token
            cmd = await a.stream("sleep 30")
            assert a.grant.session_id is not None
            await client.release(a.grant.session_id, terminate=False)
            async with asyncio.timeout(5):
                while True:
                    r = await http_call(
                        "GET",
                        f"{a.grant.http_base_url}/fs/list",
                        headers={"Authorization": f"Bearer {token}"},
                    )
                    if r.status_code == 401:
                        break
                    await asyncio.sleep(0.1)
            with pytest.raises(Unauthenticated):
                async with asyncio.timeout(10):
                    async for _ in cmd:
                        pass
        finally:
            await client.aclose()


async def test_provider_preference_chooses_and_a_template_pin_wins(tmp_path: Path) -> None:
    with pair(tmp_path, with_local=True) as p:
        client = AsyncSandlot(p.broker.url, p.broker.key("alice", "agent"), auto_refresh=False)
        try:
            plain = await client.ensure("thr_auto")
            assert plain.grant.raw["sandbox"]["provider"] == "local"
            assert plain.grant.raw["binding"]["provider"] == "local"
            hosted = await client.ensure("thr_pref", provider_preference="hosted")
            assert hosted.grant.raw["binding"]["provider"] == "hosted"
            assert _box_named_for(p, hosted.id)
            assert (await hosted.exec("echo hosted")).stdout == "hosted\n"
            pinned = await client.ensure(
                "thr_pin", template="hosted-only", provider_preference="local"
            )
            assert pinned.grant.raw["binding"]["provider"] == "hosted"
            assert _box_named_for(p, pinned.id)
            assert not _box_named_for(p, plain.id)
            assert (await plain.exec("echo local")).stdout == "local\n"
            r = await http_call(
                "POST",
                f"{p.broker.url}/v1/sandbox/sessions",
                json={"thread_id": "thr_x", "mode": "ensure", "provider_preference": "elsewhere"},
                headers=p.broker.headers("alice", "agent"),
            )
            assert r.status_code == 400
            assert r.json()["error"]["metadata"]["configured"] == ["hosted", "local"]
            # Both providers report at /readyz.
            ready = (await http_call("GET", f"{p.broker.url}/readyz")).json()
            assert set(ready["provider"]["providers"]) == {"hosted", "local"}
            for sb in (hosted, pinned):
                assert sb.grant.session_id is not None
                await client.release(sb.grant.session_id, terminate=True, timeout=60)
            async with asyncio.timeout(30):
                while _box_named_for(p, hosted.id) or _box_named_for(p, pinned.id):
                    await asyncio.sleep(0.1)
        finally:
            await client.aclose()
