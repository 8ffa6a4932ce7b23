"""The docker provider's contract on a private Docker Engine and on a private Podman's
Docker-compatible socket (each test runs ``[docker]`` and ``[podman]``): a sandbox is a
container whose own dataplane verifies the broker's tokens; limits, no network, an
unprivileged user, suspend as pause, re-adoption after a restart, cleanup of
leftovers."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shlex
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import httpx
import jwt
import pytest

from sandlot.protocol.errors import InvalidRequest, QuotaExceeded, SandboxNotFound
from sandlot.protocol.sessions import Template
from sandlot.protocol.states import SandboxState
from sandlot.protocol.tokens import RevokedToken
from sandlot.providers.base import AdoptionRecord, SandboxSpec
from sandlot.providers.docker import DockerProvider
from sandlot.runtime.disk import detach_loop, loops_backed_by
from tests.dataplane.conftest import Keys
from tests.dockerengine import ULIMITS, Engine
from tests.providers.dockerharness import make_provider, serving
from tests.providers.outlive import no_command_stops_the_dataplane, orphans_are_collected

# The first test of a session builds the image (and, once per machine, its base).
FORK_UNTIL_REFUSED = """python3 -c '
import os, signal
pids = []
try:
    for _ in range(200):
        pid = os.fork()
        if pid == 0:
            signal.pause()
            os._exit(0)
        pids.append(pid)
except OSError:
    print("refused")
print(len(pids))
for pid in pids:
    os.kill(pid, 9)
    os.waitpid(pid, 0)
'"""

pytestmark = [pytest.mark.isolation, pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(autouse=True)
def no_disk_left(tmp_path: Path) -> Iterator[None]:
    """Whatever a test leaves (it failed before deleting its sandbox), no workspace disk
    of its provider stays attached to a loop device of the machine."""
    yield
    for device in loops_backed_by(tmp_path):
        detach_loop(device)


async def test_a_sandbox_is_a_locked_down_container(
    engine: Engine, image: str, tmp_path: Path
) -> None:
    async with serving(engine, image, tmp_path) as h:
        await h.create("sb_box", memory_mb=256, pids=128, cpu=0.5)
        c = h.container("sb_box")
        host = c.attrs["HostConfig"]
        assert c.labels["sandlot.sandbox"] == "sb_box" and c.labels["sandlot.generation"] == "1"
        assert host["NetworkMode"] == "none"
        assert host["Memory"] == 256 << 20 and host["MemorySwap"] == 256 << 20
        assert host["PidsLimit"] == 128 and host["NanoCpus"] == 500_000_000
        # A container left under a sandbox's name (a crash between create and start) is
        # replaced by the sandbox's own.
        name = f"sandlot-{h.provider.instance[:8]}-sb_left"
        left = engine.client.containers.create(
            image, ["true"], name=name, network_mode="none", ulimits=ULIMITS
        )
        await h.create("sb_left")
        assert h.container("sb_left").name == name and h.container("sb_left").id != left.id
        assert host["ReadonlyRootfs"] is True
        assert "no-new-privileges" in host["SecurityOpt"] and not host.get("CapAdd")
        # Podman's inspect lists what "ALL" dropped, one by one; inside, none is left either way.
        assert host["CapDrop"] == ["ALL"] or {"CHOWN", "KILL", "SETUID"} <= set(host["CapDrop"])
        assert c.attrs["Config"]["User"] == "1000:1000"
        mounts = {m["Destination"]: m for m in c.attrs["Mounts"]}
        assert mounts["/workspace"]["Type"] == "volume"
        assert mounts["/run/sandlot-trust"]["RW"] is False

        async with h.sandbox("sb_box") as sb:
            probe = (
                "id -u; grep -E '^(CapEff|CapBnd|NoNewPrivs)' /proc/self/status; "
                "cat /proc/net/dev | tail -n +3 | cut -d: -f1; "
                "touch /etc/x 2>&1 || echo ro; ulimit -n; ulimit -u; echo $HOME; pwd"
            )
            out = (await sb.run(probe)).stdout.split()
            zero = "0000000000000000"
            assert out[:7] == ["1000", "CapEff:", zero, "CapBnd:", zero, "NoNewPrivs:", "1"]
            assert out[7] == "lo"  # the only interface
            assert "ro" in out and out[-4:] == ["16384", "32768", "/workspace", "/workspace"]
            net = await sb.run(
                'python3 -c "import socket; s=socket.socket(); s.settimeout(2); '
                "s.connect(('1.1.1.1', 80))\"",
                check=False,
            )
            assert net.exit_code != 0 and "unreachable" in net.stderr.lower()
            await sb.write("/workspace/notes.txt", "kept\n")
            assert (await sb.run("cat /workspace/notes.txt")).stdout == "kept\n"
            # The dataplane's socket cannot be removed, nor another put beside it.
            sock = await sb.run("rm -f /run/sandlot/dp.sock; touch /run/sandlot/x", check=False)
            assert sock.exit_code != 0 and sock.stderr.count("Permission denied") == 2
            assert (await sb.run("ls /run/sandlot")).stdout == "dp.sock\n"


#: What a command plants where a Python started in the workspace would import it from.
PLANTED = "import os\nopen('/tmp/planted-by-' + str(os.getpid()), 'w').close()\n"


#: A command that tries to trace every glob helper of its sandbox's dataplane.
TRACE_GLOB_HELPERS = """
import ctypes, glob, os
libc = ctypes.CDLL(None, use_errno=True)
libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
helpers = []
for d in glob.glob("/proc/[0-9]*"):
    try:
        if b"globworker" in open(d + "/cmdline", "rb").read():
            helpers.append(int(d[6:]))
    except OSError:
        pass
print("helpers", len(helpers))
for pid in helpers:
    if libc.ptrace(16, pid, None, None) == 0:  # PTRACE_ATTACH
        print("attached", pid)
"""


async def test_no_command_can_put_code_on_the_dataplanes_import_path(
    engine: Engine, image: str, tmp_path: Path
) -> None:
    # The dataplane imports some modules on first use (websockets at the first
    # WebSocket); run from /workspace with ``-m``, Python looked for them there first.
    async with serving(engine, image, tmp_path) as h:
        await h.create("sb_path")
        command = h.container("sb_path").attrs["Config"]["Cmd"]
        assert command[:5] == ["python3", "-s", "-P", "-m", "sandlot.dataplane"]
        async with h.sandbox("sb_path") as sb:
            for module in ("websockets", "prometheus_client", "httpx", "h11", "wsproto"):
                await sb.write(f"/workspace/{module}/__init__.py", PLANTED)
            site = "/workspace/.local/lib/python3.11/site-packages"
            await sb.write(f"{site}/planted.pth", PLANTED.replace("\n", "; ", 1))
            cmd = await sb.stream("echo streamed")
            assert (await cmd.wait()).stdout == "streamed\n"
            # The glob helpers it starts (one more for each glob running at once) too.
            await sb.write("/workspace/json/__init__.py", PLANTED)
            globs = [sb.glob("*/__init__.py") for _ in range(4)]
            for found in await asyncio.gather(*globs):
                assert "json/__init__.py" in str(found)
            assert "planted" not in (await sb.run("ls /tmp")).stdout
            await sb.run("rm -r /workspace/json")
            # Nor can a command trace a helper (of its uid) to make it answer otherwise.
            traced = await sb.run(f"python3 -s -c {shlex.quote(TRACE_GLOB_HELPERS)}")
            assert traced.stdout.startswith("helpers ") and "attached" not in traced.stdout
            assert int(traced.stdout.split()[1]) >= 1, traced.stdout
            # What was planted works, for a Python started there by a command.
            await sb.run("cd /workspace && python3 -c 'import websockets'")
            planted = (await sb.run("ls /tmp")).stdout.split()
            assert len(planted) == 1 and planted[0].startswith("planted-by-")
            assert planted != ["planted-by-1"]


async def raw_request(base: str, request: str) -> bytes:
    """``request`` sent as is (no client library resolves its dot segments), and the
    start of the answer."""
    url = httpx.URL(base)
    reader, writer = await asyncio.open_connection(url.host, url.port)
    try:
        writer.write(request.encode())
        async with asyncio.timeout(30):
            return await reader.readuntil(b"\r\n\r\n")
    finally:
        writer.close()


async def test_the_relay_passes_on_no_path_outside_the_sandboxs_api(
    engine: Engine, image: str, tmp_path: Path
) -> None:
    async with serving(engine, image, tmp_path) as h:
        await h.create("sb_rel")
        auth = h.headers("sb_rel")["Authorization"]
        for path in (
            "/v1/%2e%2e/%2e%2e/__control/status",
            "/v1/%2E%2E/%2E%2E/metrics",
            "/v1/./../../__control/reload",
            "/v1/%00",
            "/v1/x%0Dy",
        ):
            for token in ("", f"Authorization: {auth}\r\n"):
                head = await raw_request(
                    h.base, f"GET /dp/sb_rel{path} HTTP/1.1\r\nHost: x\r\n{token}\r\n"
                )
                assert head.startswith(b"HTTP/1.1 400 "), (path, head)
        # An encoded ? is part of the path, not the start of a query.
        async with httpx.AsyncClient(timeout=30) as client:
            r = await client.get(
                f"{h.base}/dp/sb_rel/v1/fs/read%3Fpath=x", headers={"Authorization": auth}
            )
            assert r.status_code == 404
        # An event stream asked for with a body (in pieces) ends with its client.
        for _ in range(3):
            _, writer = await asyncio.open_connection(
                httpx.URL(h.base).host, httpx.URL(h.base).port
            )
            writer.write(
                f"GET /dp/sb_rel/v1/events HTTP/1.1\r\nHost: x\r\nAuthorization: {auth}\r\n"
                "Transfer-Encoding: chunked\r\n\r\n1\r\na\r\n".encode()
            )
            await writer.drain()
            await asyncio.sleep(0.2)
            writer.write(b"0\r\n\r\n")
            await writer.drain()
            await asyncio.sleep(0.5)
            writer.close()
        async with asyncio.timeout(20):
            while (await h.provider.activity("sb_rel")).attached_clients:
                await asyncio.sleep(0.1)


async def test_memory_and_pids_limits_are_enforced(
    engine: Engine, image: str, tmp_path: Path
) -> None:
    async with serving(engine, image, tmp_path) as h:
        await h.create("sb_lim", memory_mb=96, pids=64)
        async with h.sandbox("sb_lim") as sb:
            hog = await sb.run("python3 -c 'b = bytearray(400 << 20); print(len(b))'", check=False)
            assert hog.exit_code == 137 and hog.stdout == ""  # SIGKILL by the OOM killer
            bomb = await sb.run(FORK_UNTIL_REFUSED)
            refused, forked = bomb.stdout.split()
            assert refused == "refused" and 0 < int(forked) < 64
            # The dataplane outlived both, in the same container.
            assert (await sb.run("echo alive")).stdout == "alive\n"


async def test_no_command_can_stop_the_dataplane_and_orphans_are_collected(
    engine: Engine, image: str, tmp_path: Path
) -> None:
    async with serving(engine, image, tmp_path) as h:
        await h.create("sb_init", pids=64)

        async def state() -> SandboxState:
            return (await h.provider.status("sb_init")).state

        async with h.sandbox("sb_init") as sb:
            await no_command_stops_the_dataplane(sb, state)
            assert h.container("sb_init").status == "running"
            # Three times the container's pids in orphans.
            await orphans_are_collected(sb, batches=5)


async def test_a_workspace_holds_what_its_template_says_and_no_more(
    engine: Engine, image: str, tmp_path: Path
) -> None:
    async with serving(engine, image, tmp_path) as h:
        assert h.provider.disks.available
        await h.create("sb_disk", disk_mb=16)
        disk = h.provider.disks.image("sb_disk")
        assert loops_backed_by(disk)
        async with h.sandbox("sb_disk") as sb:
            full = await sb.run(
                "dd if=/dev/zero of=/workspace/big bs=1M count=40 2>&1; "
                "df -m /workspace | tail -1; ls -A /workspace",
                check=False,
            )
            assert "No space left on device" in full.stdout
            total, used = (int(n) for n in full.stdout.splitlines()[-2].split()[1:3])
            assert 12 <= total <= 16 and used >= total - 1
            assert full.stdout.splitlines()[-1] == "big"  # the workspace, nothing else
            # Watched as a local sandbox's disk is: the event log says it filled, and a
            # write through the API is the typed error.
            with pytest.raises(QuotaExceeded):
                await sb.write("/workspace/more.txt", "x" * (4 << 20))
            async with sb.events(after=0, timeout=20) as events:
                async for event in events:
                    if event.event_type == "service.disk_full":
                        assert event.details["service"]["name"] == "disk"
                        break
            # Freed, the room is there again; the sandbox user owns the workspace.
            await sb.run("rm /workspace/big && echo kept > /workspace/notes.txt")
            assert (await sb.run("stat -c %u:%g /workspace")).stdout == "1000:1000\n"
        # Nothing of it written on the host's filesystem but in its image.
        assert disk.stat().st_blocks * 512 < 20 << 20
        await h.provider.suspend("sb_disk")
        await h.provider.resume("sb_disk")
        async with h.sandbox("sb_disk") as sb:
            assert (await sb.run("cat /workspace/notes.txt")).stdout == "kept\n"
        await h.provider.delete("sb_disk")
        assert not disk.exists() and not loops_backed_by(disk)
        assert not engine.client.volumes.list(filters={"label": "sandlot.sandbox=sb_disk"})

        # A disk left by a crash before its container existed goes with the leftovers.
        await asyncio.to_thread(h.provider.disks.attach, "sb_gone", 8)
        assert "sb_gone" in await h.provider.cleanup_leftovers(keep=set())
        gone = h.provider.disks.image("sb_gone")
        assert not gone.exists() and not loops_backed_by(gone)


async def test_tokens_are_verified_inside_the_sandbox(
    engine: Engine, image: str, tmp_path: Path
) -> None:
    async with serving(engine, image, tmp_path) as h:
        await h.create("sb_tok")
        async with httpx.AsyncClient(timeout=20) as c:
            url = h.url("sb_tok", "/exec")
            body = {"command": "echo ok"}
            assert (await c.post(url, json=body, headers=h.headers("sb_tok"))).status_code == 200
            other = await c.post(url, json=body, headers=h.headers("sb_other"))
            assert other.status_code == 403
            forged = jwt.encode(h.keys.claims("sb_tok"), Keys().private, algorithm="EdDSA",
                                headers={"kid": h.keys.kid})  # fmt: skip
            bad = await c.post(url, json=body, headers={"Authorization": f"Bearer {forged}"})
            assert bad.status_code == 401
            gen2 = await c.post(url, json=body, headers=h.headers("sb_tok", gen=2))
            assert gen2.status_code == 401
            none = await c.post(url, json=body)
            assert none.status_code == 401
            # The relay forwards the sandbox's /v1 only, never the control routes.
            ctl = await c.post(f"{h.base}/dp/sb_tok/__control/reload")
            assert ctl.status_code == 404

            # Revocation reaches the dataplane in the container within a second.
            token = h.keys.token("sb_tok")
            auth = {"Authorization": f"Bearer {token}"}
            assert (await c.post(url, json=body, headers=auth)).status_code == 200
            jti = jwt.decode(token, options={"verify_signature": False})["jti"]
            started = time.monotonic()
            await h.provider.revoke("sb_tok", [RevokedToken(jti, time.time() + 900)])
            assert (await c.post(url, json=body, headers=auth)).status_code == 401
            assert time.monotonic() - started < 1.0

            # A rotated key reaches the container without a restart.
            h.keys.private = Keys().private
            h.keys.kid = "k_rotated"
            await asyncio.sleep(0.5)
            rotated = await c.post(url, json=body, headers=h.headers("sb_tok"))
            assert rotated.status_code == 200


async def test_suspend_pauses_and_resume_unpauses(
    engine: Engine, image: str, tmp_path: Path
) -> None:
    async with serving(engine, image, tmp_path) as h:
        await h.create("sb_nap")
        async with h.sandbox("sb_nap") as sb:
            cmd = await sb.stream("for i in 1 2 3 4 5 6; do echo tick $i; sleep 0.2; done")
            assert (await h.provider.suspend("sb_nap")).state is SandboxState.SUSPENDED
            assert h.container("sb_nap").status == "paused"
            async with httpx.AsyncClient(timeout=10) as c:
                r = await c.post(h.url("sb_nap", "/exec"), json={"command": "true"},
                                 headers=h.headers("sb_nap"))  # fmt: skip
                assert r.status_code == 423 and r.json()["error"]["code"] == "SANDBOX_STARTING"
            assert (await h.provider.resume("sb_nap")).state is SandboxState.ACTIVE
            result = await cmd.wait()
            assert result.stdout.split("\n")[:6] == [f"tick {i}" for i in range(1, 7)]


async def test_readoption_after_a_restart_and_cleanup_of_leftovers(
    engine: Engine, image: str, tmp_path: Path
) -> None:
    keys = Keys()
    async with serving(engine, image, tmp_path, keys) as h:
        await h.create("sb_keep")
        await h.create("sb_orphan")
        await h.create("sb_paused")
        async with h.sandbox("sb_keep") as sb:
            await sb.write("/workspace/state.txt", "before\n")
            await sb.stream("sleep 2; echo finished")
            (before,) = await sb.list_execs()
        await h.provider.suspend("sb_paused")
    # The server stopped: its containers run on. A new one re-adopts the bound ones.
    template = Template(name="t", image="host")
    records = [
        AdoptionRecord("sb_keep", 1, template, SandboxState.ACTIVE),
        AdoptionRecord("sb_paused", 1, template, SandboxState.SUSPENDED),
        AdoptionRecord("sb_gone", 1, template, SandboxState.ACTIVE),
    ]
    async with serving(engine, image, tmp_path, keys) as h:
        lost = await h.provider.load_state(records)
        assert lost == ["sb_gone"]
        assert (await h.provider.status("sb_keep")).state is SandboxState.ACTIVE
        assert (await h.provider.status("sb_paused")).state is SandboxState.SUSPENDED
        with pytest.raises(SandboxNotFound):
            await h.provider.status("sb_orphan")
        labels = {c.labels["sandlot.sandbox"] for c in engine.client.containers.list(
            all=True, filters={"label": f"sandlot.instance={h.provider.instance}"})}  # fmt: skip
        assert labels == {"sb_keep", "sb_paused"}
        volumes = {v.name for v in engine.client.volumes.list()}
        assert not any("sb_orphan" in v for v in volumes)
        assert not (tmp_path / "docker" / "sb_orphan").exists()
        assert await h.provider.list_sandboxes() == {"sb_keep", "sb_paused"}
        async with h.sandbox("sb_keep") as sb:
            assert await sb.read_text("/workspace/state.txt") == "before\n"
            # The command started before the restart is still the dataplane's.
            snap = await sb.get_exec(before.exec_id)
            assert snap.command == before.command
        await h.provider.resume("sb_paused")
        async with h.sandbox("sb_paused") as sb:
            assert (await sb.run("echo back")).stdout == "back\n"
        for sid in ("sb_keep", "sb_paused"):
            await h.provider.delete(sid)
            await h.provider.delete(sid)  # idempotent
        assert not engine.client.containers.list(
            all=True, filters={"label": f"sandlot.instance={h.provider.instance}"}
        )
        assert not any(
            v.name.startswith(f"sandlot-{h.provider.instance[:8]}")
            for v in engine.client.volumes.list()
        )


async def test_a_socket_put_in_the_dataplanes_place_is_not_readopted(
    engine: Engine, image: str, tmp_path: Path
) -> None:
    # A server of the sandbox's own uid leaves the socket's directory to the sandbox: a
    # command could move the dataplane's socket aside and listen in its place, and a
    # restarted server sent it every client's requests (tokens included).
    keys = Keys()
    async with serving(engine, image, tmp_path, keys) as h:
        await h.create("sb_mitm")
    run = tmp_path / "docker" / "sb_mitm" / "run"
    (sock_path,) = [p for p in run.iterdir() if p.is_socket()]
    sock_path.rename(run / ".moved")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as impostor:
        impostor.bind(str(sock_path))
        impostor.listen(8)
        impostor.settimeout(0.2)
        record = AdoptionRecord("sb_mitm", 1, Template(name="t", image="host"), SandboxState.ACTIVE)
        async with serving(engine, image, tmp_path, keys) as h:
            assert await h.provider.load_state([record]) == ["sb_mitm"]
            received = b""
            while True:
                try:
                    conn, _ = impostor.accept()
                except TimeoutError:
                    break
                with conn:
                    conn.settimeout(1.0)
                    with contextlib.suppress(TimeoutError):
                        received += conn.recv(65536)
            assert received == b""  # looked at, never sent a request


#: What a command tries on its dataplane's socket: a connection, and a way round.
REACH_SOCKET = """python3 -c '
import os, socket
s = socket.socket(socket.AF_UNIX)
try:
    s.connect("/run/sandlot/dp.sock")
    print("connected")
except PermissionError:
    print("refused")
for attempt in (lambda: os.chmod("/run/sandlot/dp.sock", 0o777),
                lambda: os.rename("/run/sandlot/dp.sock", "/run/sandlot/x")):
    try:
        attempt()
        print("changed")
    except PermissionError:
        print("refused")
'"""


async def test_no_command_can_connect_to_its_dataplanes_socket(
    engine: Engine, image: str, tmp_path: Path
) -> None:
    # Commands called their own dataplane's control routes (its status and figures, a
    # re-read of its trust files) and could fill its log with refused requests.
    keys = Keys()
    async with serving(engine, image, tmp_path, keys) as h:
        await h.create("sb_sealed")
        async with h.sandbox("sb_sealed") as sb:
            assert (await sb.run(REACH_SOCKET)).stdout == "refused\nrefused\nrefused\n"
            assert (await sb.run("echo served")).stdout == "served\n"
        # A socket an older version left to the sandbox is sealed as it is re-adopted.
        sock = tmp_path / "docker" / "sb_sealed" / "run" / "dp.sock"
        os.chown(sock, 1000, 1000)
        sock.chmod(0o777)
    record = AdoptionRecord("sb_sealed", 1, Template(name="t", image="host"), SandboxState.ACTIVE)
    async with serving(engine, image, tmp_path, keys) as h:
        assert await h.provider.load_state([record]) == []
        assert (sock.stat().st_uid, sock.stat().st_mode & 0o777) == (0, 0o600)
        async with h.sandbox("sb_sealed") as sb:
            assert (await sb.run(REACH_SOCKET)).stdout == "refused\nrefused\nrefused\n"
        await h.provider.delete("sb_sealed")


async def test_a_sandbox_the_engine_cannot_start_fails_with_the_reason(
    engine: Engine, image: str, tmp_path: Path
) -> None:
    # No kernel lets a process open 2**31 - 1 files (fs.nr_open stops below): the runtime
    # refuses the limit whoever asks, as Podman's own default is refused on hosts whose
    # hard limit is lower.
    impossible = {"nofile": 2**31 - 1}
    async with serving(engine, image, tmp_path, ulimits=impossible) as h:
        for sid, template in (
            ("sb_noimg", Template(name="t", image="sandlot-no-such-image:1")),
            ("sb_nofile", Template(name="t", image="host")),
        ):
            await h.provider.create(SandboxSpec(sid, 1, template))
            async with asyncio.timeout(30):
                while (st := await h.provider.status(sid)).state is SandboxState.PROVISIONING:
                    await asyncio.sleep(0.02)
            assert st.state is SandboxState.FAILED
            assert h.changes and h.changes[-1] == (sid, st)
            await h.provider.delete(sid)
            assert await h.provider.list_sandboxes() == set()
        assert "sandlot-no-such-image:1" in h.changes[0][1].reason  # type: ignore[operator]
        assert h.changes[0][1].reason.startswith("IMAGE: ")  # type: ignore[union-attr]
        assert "not found" in h.changes[0][1].reason  # type: ignore[operator]
        assert "lower the provider's ulimits" in h.changes[-1][1].reason  # type: ignore[operator]


def test_ulimits_are_checked_when_the_provider_is_configured(tmp_path: Path) -> None:
    keys, nowhere = Keys(), SimpleNamespace(url="unix:///nonexistent.sock")
    bad_tables = [{"nofile": [10, 5]}, {"nofile": "many"}, {"nproc": [1, 2, 3]}, {"files": 9}]
    for bad in [*bad_tables, ["nofile"]]:
        with pytest.raises(InvalidRequest, match="ulimit"):
            make_provider(nowhere, "img", tmp_path, keys, ulimits=bad)  # type: ignore[arg-type]
    provider = make_provider(nowhere, "img", tmp_path, keys, ulimits={"nofile": [64, 128]})  # type: ignore[arg-type]
    assert provider.ulimits == [("nofile", (64, 128))]
    provider = make_provider(nowhere, "img", tmp_path, keys)  # type: ignore[arg-type]
    assert provider.ulimits == [("nofile", (16384, 16384)), ("nproc", (32768, 32768))]


def test_the_log_key_is_checked_when_the_provider_is_configured(tmp_path: Path) -> None:
    keys, nowhere = Keys(), SimpleNamespace(url="unix:///nonexistent.sock")
    for bad in ["json-file", {"driver": ""}, {"driver": "local", "options": "max-size=1m"},
                {"driver": "local", "size": "1m"}]:  # fmt: skip
        with pytest.raises(InvalidRequest, match="log"):
            make_provider(nowhere, "img", tmp_path, keys, log=bad)  # type: ignore[arg-type]
    provider = make_provider(nowhere, "img", tmp_path, keys)  # type: ignore[arg-type]
    assert provider.log_config == {
        "Type": "json-file", "Config": {"max-size": "1m", "max-file": "2"}
    }  # fmt: skip
    # A driver of the operator's choice comes with its own options, or none.
    provider = make_provider(nowhere, "img", tmp_path, keys, log={"driver": "journald"})  # type: ignore[arg-type]
    assert provider.log_config == {"Type": "journald", "Config": {}}


#: Garbage sent to the dataplane's socket from inside: each connection is a warning of
#: the dataplane's, written by the engine to a file on its host.
LOG_FLOOD = """python3 -c '
import socket
for _ in range(40000):
    s = socket.socket(socket.AF_UNIX)
    s.connect("/run/sandlot/dp.sock")
    s.sendall(b"GARBAGE\\r\\n\\r\\n")
    s.recv(100)
    s.close()
print("sent")
'"""


async def test_no_command_can_fill_the_host_through_the_dataplanes_log(
    engine: Engine, image: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 40,000 warnings are some 4 MB of log on the engine's host (Docker's json-file, 3.4
    # MB for Podman's k8s-file) without a bound; with it, at most 2 MiB stay. A root
    # server seals the socket (no command connects to it); one of the sandbox's own uid
    # cannot, and the bound is what holds then.
    monkeypatch.setattr(DockerProvider, "_seal_run_dir", lambda self, sandbox_id: None)
    async with serving(engine, image, tmp_path) as h:
        await h.create("sb_log")
        container = h.container("sb_log")
        async with h.sandbox("sb_log") as sb:
            assert (await sb.run(LOG_FLOOD)).stdout == "sent\n"
            assert (await sb.run("echo alive")).stdout == "alive\n"
        logs = Path(container.attrs["LogPath"]).parent
        kept = sum(f.stat().st_size for f in logs.iterdir() if "log" in f.name)
        assert 0 < kept <= (2 << 20) + 4096
        assert b"Invalid HTTP request" in container.logs(tail=5)
        await h.provider.delete("sb_log")


async def test_a_container_that_dies_fails_its_sandbox_at_once(
    engine: Engine, image: str, tmp_path: Path
) -> None:
    async with serving(engine, image, tmp_path) as h:
        await h.create("sb_die")
        h.changes.clear()
        h.container("sb_die").kill()
        # Told by the engine's events, not found out at the next status call.
        async with asyncio.timeout(20):
            while not any(s.state is SandboxState.FAILED for _, s in h.changes):
                await asyncio.sleep(0.02)
        sid, status = h.changes[-1]
        assert sid == "sb_die" and "exit code 137" in (status.reason or "")
        assert (status.reason or "").startswith("EXITED: ")
        async with httpx.AsyncClient(timeout=10) as c:
            r = await c.post(h.url("sb_die", "/exec"), json={"command": "true"},
                             headers=h.headers("sb_die"))  # fmt: skip
            assert r.status_code == 503 and "exit code 137" in r.text
        await h.provider.delete("sb_die")


async def test_a_lost_die_event_costs_a_sweep_not_a_sandbox_left_active(
    engine: Engine, image: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # No engine event reaches the provider (as when Podman's events log is truncated
    # under a follower): the sweep finds the stopped container all the same.
    monkeypatch.setattr(DockerProvider, "_watch_engine", lambda self: None)
    async with serving(engine, image, tmp_path, sweep_seconds=0.2) as h:
        await h.create("sb_lost")
        await h.create("sb_paused")
        await h.provider.suspend("sb_paused")
        h.changes.clear()
        h.container("sb_lost").kill()
        async with asyncio.timeout(20):
            while not any(s.state is SandboxState.FAILED for _, s in h.changes):
                await asyncio.sleep(0.02)
        await asyncio.sleep(0.5)  # more sweeps: the paused sandbox stays suspended
        assert [(sid, s.state) for sid, s in h.changes] == [("sb_lost", SandboxState.FAILED)]
        assert "exit code 137" in (h.changes[0][1].reason or "")
        assert (await h.provider.status("sb_paused")).state is SandboxState.SUSPENDED
        await h.provider.delete("sb_lost")
        await h.provider.delete("sb_paused")


async def test_activity_counts_running_commands_and_attached_clients(
    engine: Engine, image: str, tmp_path: Path
) -> None:
    async with serving(engine, image, tmp_path) as h:
        await h.create("sb_busy")
        idle = await h.provider.activity("sb_busy")
        assert not idle.busy
        async with h.sandbox("sb_busy") as sb:
            cmd = await sb.stream("sleep 30")
            async with asyncio.timeout(10):  # the command starts as the stream opens
                while (busy := await h.provider.activity("sb_busy")).running_execs == 0:
                    await asyncio.sleep(0.02)
            assert busy.running_execs == 1 and busy.attached_clients >= 1
            assert busy.last_active_at is not None
            await cmd.signal("SIGKILL")
        await h.provider.suspend("sb_busy")
        assert not (await h.provider.activity("sb_busy")).busy
        await h.provider.delete("sb_busy")


async def test_the_event_log_is_held_while_the_container_starts(
    engine: Engine, image: str, tmp_path: Path
) -> None:
    async with serving(engine, image, tmp_path) as h:
        spec = SandboxSpec("sb_early", 1, Template(name="t", image="host"))
        await h.provider.create(spec)
        async with httpx.AsyncClient(timeout=60) as c:
            r = await c.post(h.url("sb_early", "/exec"), json={"command": "true"},
                             headers=h.headers("sb_early"))  # fmt: skip
            assert r.status_code == 423
            # The log answers once the dataplane is up, its activation first.
            async with c.stream("GET", h.url("sb_early", "/events?after=0"),
                                headers=h.headers("sb_early")) as resp:  # fmt: skip
                assert resp.status_code == 200
                async for line in resp.aiter_lines():
                    if line.startswith("data: "):
                        phase = json.loads(line[6:])["details"]["phase"]
                        assert phase["to"] == "active"
                        break
        async with h.sandbox("sb_early") as sb:
            assert (await sb.run("echo up")).stdout == "up\n"
        await h.provider.delete("sb_early")
