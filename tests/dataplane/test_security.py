"""Path escapes through every file endpoint, token attacks, revocation."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import json
import os
import tarfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jwt
import pytest
import websockets

from tests.dataplane.conftest import Server, start_server
from tests.figures import RecordProperty, report

SECRET = "TOP-SECRET-SENTINEL"
NOBODY = (65534, 65534)


@pytest.fixture
def confined(tmp_path: Path) -> Iterator[Server]:
    if os.geteuid() != 0:
        pytest.skip("acting as another uid needs root (CI runs as root)")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "sentinel").write_text(SECRET)
    os.chmod(outside / "sentinel", 0o600)
    gen = start_server(tmp_path, fs_ids=NOBODY)
    srv = next(gen)
    srv.extra["outside"] = outside
    ws = srv.workspace
    os.symlink(str(outside), ws / "out_abs")
    os.symlink("../../outside/sentinel", ws / "out_rel")
    os.symlink("/proc/self/root" + str(outside), ws / "out_proc")
    os.symlink("/proc/self/cwd", ws / "out_cwd")
    os.symlink("loop2", ws / "loop1")
    os.symlink("loop1", ws / "loop2")
    os.link(outside / "sentinel", ws / "hardlink")
    os.mkfifo(ws / "fifo")
    os.chown(ws / "fifo", *NOBODY)
    os.symlink("/workspace/inside.txt", ws / "ok_abs")
    (ws / "inside.txt").write_text("inside")
    os.chown(ws / "inside.txt", *NOBODY)
    try:
        yield srv
    finally:
        gen.close()


ESCAPES = [
    "../../outside/sentinel",
    "/workspace/../../outside/sentinel",
    "../" * 20 + "etc/passwd",
    "%2e%2e/%2e%2e/outside/sentinel",
    "/etc/passwd",
    "/etc/shadow",
    "/proc/self/environ",
    "/proc/self/root/etc/passwd",
    "out_abs/sentinel",
    "out_rel",
    "out_proc/sentinel",
    "out_cwd/etc/passwd",
    "loop1",
    "hardlink",
    "fifo",
    "a\x00b",
    "x" * 300,
    "/".join(["d"] * 3000),
]


def _check_one(r: httpx.Response) -> None:
    assert r.status_code < 500, (r.status_code, r.text)
    assert SECRET not in r.text
    assert "root:x:0:0" not in r.text


@pytest.mark.reliability
def test_escape_corpus_every_endpoint(confined: Server, record_property: RecordProperty) -> None:
    srv = confined
    outside: Path = srv.extra["outside"]
    requests = 0

    def _check(r: httpx.Response) -> None:
        nonlocal requests
        requests += 1
        _check_one(r)

    with httpx.Client(headers=srv.headers(), timeout=10) as c:
        # The hard link is readable only with the sandbox user's rights: denied.
        r = c.get(srv.url("/fs/read"), params={"path": "hardlink"})
        assert r.status_code == 403 and r.json()["error"]["code"] == "PERMISSION_DENIED"
        # Symlinks inside the sandbox view keep working.
        assert c.get(srv.url("/fs/read"), params={"path": "ok_abs"}).json()["content"] == "inside"
        for p in ESCAPES:
            for r in (
                c.get(srv.url("/fs/read"), params={"path": p}),
                c.get(srv.url("/fs/stat"), params={"path": p}),
                c.get(srv.url("/fs/list"), params={"path": p}),
                c.get(srv.url("/files/download"), params={"path": p}),
                c.head(srv.url("/files/download"), params={"path": p}),
                c.get(srv.url("/download"), params={"path": p}),
                c.get(srv.url("/files/archive"), params={"path": p}),
                c.post(srv.url("/fs/grep"), json={"pattern": "SECRET", "path": p}),
                c.post(srv.url("/fs/glob"), json={"pattern": "**/*", "path": p}),
                c.post(srv.url("/fs/glob"), json={"pattern": p + "/*"}),
                c.put(srv.url("/fs/write"), json={"path": p + "/new", "content": "x"}),
                c.put(srv.url("/fs/write"), json={"path": p, "content": "pwned"}),
                c.post(
                    srv.url("/fs/edit"), json={"path": p, "old_string": "SECRET", "new_string": "x"}
                ),
                c.post(srv.url("/files/upload"), params={"path": p}, content=b"pwned"),
                c.post(srv.url("/upload"), params={"path": p}, files={"file": ("f", b"pwned")}),
                c.post(srv.url("/fs/mkdir"), json={"path": p + "/dir"}),
                c.post(srv.url("/fs/move"), json={"src": "inside.txt", "dst": p + "/moved"}),
                c.post(srv.url("/fs/move"), json={"src": p, "dst": "stolen"}),
            ):
                _check(r)
            if p not in ("out_rel", "hardlink", "fifo", "loop1"):
                _check(c.delete(srv.url("/fs"), params={"path": p + "/sentinel"}))
        # Archive members trying to climb out.
        for name, kind in (
            ("../evil", tarfile.REGTYPE),
            ("/abs", tarfile.REGTYPE),
            ("lnk", tarfile.SYMTYPE),
            ("hl", tarfile.LNKTYPE),
        ):
            buf = io.BytesIO()
            with tarfile.open(fileobj=buf, mode="w") as tar:
                info = tarfile.TarInfo(name)
                info.type = kind
                if kind == tarfile.SYMTYPE:
                    info.linkname = "../../outside/sentinel"
                elif kind == tarfile.LNKTYPE:
                    info.linkname = "/etc/passwd"
                info.size = 0 if kind != tarfile.REGTYPE else 5
                tar.addfile(info, io.BytesIO(b"pwned") if kind == tarfile.REGTYPE else None)
            r = c.post(srv.url("/files/archive"), params={"path": "x"}, content=buf.getvalue())
            assert r.status_code == 400, r.text
        r = c.post(srv.url("/files/archive"), params={"path": "out_abs"}, content=buf.getvalue())
        _check(r)
    assert (outside / "sentinel").read_text() == SECRET
    assert sorted(os.listdir(outside)) == ["sentinel"]
    assert not (srv.root.parent / "evil").exists()
    report(
        record_property,
        f"{len(ESCAPES)} escape paths and 4 hostile archive members through every file "
        f"endpoint ({requests} requests): 0 escapes, 0 server errors",
    )


def test_files_created_as_sandbox_user(confined: Server) -> None:
    srv = confined
    with httpx.Client(headers=srv.headers(), timeout=10) as c:
        assert (
            c.put(srv.url("/fs/write"), json={"path": "d/new.txt", "content": "x"}).status_code
            == 201
        )
        st = (srv.workspace / "d" / "new.txt").stat()
        assert (st.st_uid, st.st_gid) == NOBODY
        assert (srv.workspace / "d").stat().st_uid == NOBODY[0]
        os.chmod(srv.workspace / "d", 0o555)
        r = c.put(srv.url("/fs/write"), json={"path": "d/other.txt", "content": "x"})
        assert r.status_code == 403 and r.json()["error"]["code"] == "PERMISSION_DENIED"


def test_reads_and_searches_are_the_sandbox_users(confined: Server) -> None:
    """Inline operations (stat, read, list, a small grep) check permissions as the sandbox
    user, and the server's own identity is back after each."""
    from sandlot.dataplane.services import native

    assert native.library() is not None  # the small grep below is the C one
    srv = confined
    (srv.workspace / "g").mkdir()
    os.chown(srv.workspace / "g", *NOBODY)
    (srv.workspace / "g" / "open.txt").write_text("needle one\n")
    (srv.workspace / "g" / "root-only.txt").write_text("needle two\n")
    os.chmod(srv.workspace / "g" / "root-only.txt", 0o600)
    with httpx.Client(headers=srv.headers(), timeout=10) as c:
        for _ in range(3):
            r = c.post(srv.url("/fs/grep"), json={"pattern": "needle", "path": "g"})
            assert r.status_code == 200, r.text
            assert [m["path"] for m in r.json()["matches"]] == ["/workspace/g/open.txt"]
            r = c.get(srv.url("/fs/read"), params={"path": "g/root-only.txt"})
            assert r.status_code == 403, r.text
            assert c.get(srv.url("/fs/read"), params={"path": "g/open.txt"}).status_code == 200
            assert c.get(srv.url("/fs/list"), params={"path": "g"}).status_code == 200
        # The grep cache's copy of the tree (read as the sandbox user) follows permissions.
        for mode, found in ((0o644, ["open", "root-only"]), (0o600, ["open"])):
            os.chmod(srv.workspace / "g" / "root-only.txt", mode)
            r = c.post(srv.url("/fs/grep"), json={"pattern": "needle", "path": "g"})
            assert [m["path"] for m in r.json()["matches"]] == [
                f"/workspace/g/{name}.txt" for name in found
            ]
    # The server's event loop thread is itself again: it reads what only root may.
    own = srv.call(lambda: (srv.workspace / "g" / "root-only.txt").read_text())
    assert own == "needle two\n"


@pytest.mark.reliability
def test_symlink_swap_race(confined: Server, record_property: RecordProperty) -> None:
    """A thread flips a directory and a symlink out while reads and writes run."""
    srv = confined
    outside: Path = srv.extra["outside"]
    target = srv.workspace / "swap"
    stop = threading.Event()

    flips = [0]

    def flipper() -> None:
        import shutil

        real = srv.workspace / "swap_real"
        real.mkdir()
        (real / "sentinel").write_text("inside")
        os.chown(real, *NOBODY)
        os.chown(real / "sentinel", *NOBODY)
        tmp = str(target) + ".tmp"
        while not stop.is_set():
            try:
                # A write may have created "swap" as a real directory meanwhile.
                if target.is_dir() and not target.is_symlink():
                    shutil.rmtree(target)
                os.symlink(str(outside), tmp)
                os.replace(tmp, target)  # now escaping
                os.symlink("swap_real", tmp)
                os.replace(tmp, target)  # now inside
                flips[0] += 1
            except OSError:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)

    t = threading.Thread(target=flipper)
    t.start()
    try:
        with httpx.Client(headers=srv.headers(), timeout=10) as c:
            ok = 0
            for i in range(150):
                for r in (
                    c.get(srv.url("/fs/read"), params={"path": "swap/sentinel"}),
                    c.put(srv.url("/fs/write"), json={"path": "swap/sentinel", "content": f"w{i}"}),
                    c.get(srv.url("/files/download"), params={"path": "swap/sentinel"}),
                ):
                    _check_one(r)
                    ok += r.status_code < 300
            # Some operations landed inside and succeeded: safety is not "refuse everything".
            assert ok > 0
    finally:
        stop.set()
        t.join()
    assert flips[0] > 100, "the race was not exercised"
    assert (outside / "sentinel").read_text() == SECRET
    assert sorted(os.listdir(outside)) == ["sentinel"]
    report(
        record_property,
        f"symlink-swap race: 450 reads and writes while the path flipped {flips[0]} times "
        f"between inside and outside ({ok} succeeded inside): 0 escapes, 0 server errors",
    )


# --- tokens ----------------------------------------------------------------------------


def _attacks(srv: Server) -> list[tuple[str, dict[str, str], set[int]]]:
    keys = srv.keys
    good = srv.token()
    head, payload, sig = good.split(".")
    claims = keys.claims(srv.sandbox_id)
    pub = keys.private.public_key()
    from cryptography.hazmat.primitives import serialization

    pem = pub.public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    none_tok = (
        base64.urlsafe_b64encode(b'{"alg":"none","typ":"JWT","kid":"k_test"}').rstrip(b"=").decode()
        + "."
        + base64.urlsafe_b64encode(json.dumps(claims).encode()).rstrip(b"=").decode()
        + "."
    )
    import hashlib
    import hmac

    h = base64.urlsafe_b64encode(b'{"alg":"HS256","kid":"k_test"}').rstrip(b"=")
    p = base64.urlsafe_b64encode(json.dumps(claims).encode()).rstrip(b"=")
    mac = base64.urlsafe_b64encode(hmac.new(pem, h + b"." + p, hashlib.sha256).digest()).rstrip(
        b"="
    )
    hs_tok = (h + b"." + p + b"." + mac).decode()
    edited = json.loads(base64.urlsafe_b64decode(payload + "=="))
    edited["caps"] = ["fs_read", "fs_write", "exec", "shell"]
    edited_tok = (
        head
        + "."
        + base64.urlsafe_b64encode(json.dumps(edited).encode()).rstrip(b"=").decode()
        + "."
        + sig
    )
    other = jwt.encode(
        claims,
        __import__(
            "cryptography.hazmat.primitives.asymmetric.ed25519", fromlist=["x"]
        ).Ed25519PrivateKey.generate(),
        algorithm="EdDSA",
        headers={"kid": "k_unknown"},
    )
    now = int(time.time())
    bearer = lambda t: {"Authorization": f"Bearer {t}"}  # noqa: E731
    return [
        ("missing", {}, {401}),
        ("garbage", bearer("garbage"), {401}),
        ("alg none", bearer(none_tok), {401}),
        ("hs256 with public key", bearer(hs_tok), {401}),
        ("unknown kid", bearer(other), {401}),
        ("expired", bearer(srv.token(exp=now - 120, iat=now - 1000, nbf=now - 1000)), {401}),
        ("future nbf", bearer(srv.token(nbf=now + 600)), {401}),
        ("wrong iss", bearer(srv.token(iss="https://evil")), {401}),
        ("wrong aud", bearer(srv.token(aud="other")), {401}),
        ("wrong typ", bearer(srv.token(typ="JWT")), {401}),
        ("other sandbox", bearer(srv.keys.token("sb_other")), {403}),
        ("capability escalation", bearer(srv.token(caps=["fs_read"])), {403}),
        ("edited payload", bearer(edited_tok), {401}),
        ("wrong generation", bearer(srv.token(gen=2)), {401}),
        ("oversized", bearer("eyJ" + "a" * 20000 + ".b.c"), {401}),
        ("api key without resolver", {"X-Api-Key": "sl_abc_def"}, {401}),
    ]


@pytest.mark.reliability
def test_token_attacks(server: Server, record_property: RecordProperty) -> None:
    attacks = _attacks(server)
    for name, headers, expected in attacks:
        r = httpx.post(server.url("/exec"), headers=headers, json={"command": "true"})
        assert r.status_code in expected, (name, r.status_code, r.text)
        assert r.json()["error"]["code"] in (
            "UNAUTHENTICATED",
            "TOKEN_EXPIRED",
            "FORBIDDEN",
            "CAPABILITY_DENIED",
        )
        assert r.headers["x-request-id"]
    report(
        record_property,
        f"dataplane: {len(attacks)} token attacks ({', '.join(a[0] for a in attacks)}) "
        "all rejected with 401/403 and the error envelope",
    )


@pytest.mark.engine
@pytest.mark.reliability
def test_revocation_closes_socket_within_a_second(
    server: Server, record_property: RecordProperty
) -> None:
    from sandlot.protocol.tokens import RevokedToken

    jti = "tok_revoked"
    token = server.token(jti=jti)

    async def run() -> float:
        async with websockets.connect(server.ws_url("/shell/ws?session=rv")) as ws:
            await ws.send(json.dumps({"type": "auth", "token": token}))
            assert json.loads(await ws.recv())["type"] == "auth_ok"
            t0 = time.monotonic()
            await asyncio.to_thread(server.revoke, [RevokedToken(jti, time.time() + 900)])
            with pytest.raises(websockets.ConnectionClosed) as info:
                while True:
                    await asyncio.wait_for(ws.recv(), 2)
            assert info.value.rcvd is not None and info.value.rcvd.code == 4401
            return time.monotonic() - t0

    took = asyncio.run(run())
    assert took < 1.0
    r = httpx.get(server.url("/fs/list"), headers={"Authorization": f"Bearer {token}"})
    assert r.status_code == 401
    report(
        record_property,
        f"revoked token: open socket closed (4401) {took * 1000:.0f} ms after revocation, "
        "new requests 401",
    )


def test_ws_auth_failures(server: Server) -> None:
    async def code(url: str, frame: Any = None, headers: Any = None) -> int:
        async with websockets.connect(url, additional_headers=headers) as ws:
            if frame is not None:
                await ws.send(json.dumps(frame))
            with pytest.raises(websockets.ConnectionClosed) as info:
                while True:
                    await asyncio.wait_for(ws.recv(), 5)
            assert info.value.rcvd is not None
            return info.value.rcvd.code

    async def run() -> None:
        assert await code(server.ws_url("/exec/ws"), {"type": "auth", "token": "bad"}) == 4401
        assert await code(server.ws_url("/exec/ws"), {"type": "start", "command": "true"}) == 4401
        low = server.token(caps=["shell_observe"])
        assert await code(server.ws_url("/exec/ws"), {"type": "auth", "token": low}) == 4403
        assert (
            await code(
                server.ws_url("/shell/ws?session=nope&create=false"), headers=server.headers()
            )
            == 4404
        )
        assert await code(server.ws_url("/exec/ws", "sb_missing"), headers=server.headers()) == 4404

    asyncio.run(run())


@pytest.mark.local_only("registers a provisioning sandbox on the in-process host")
def test_starting_sandbox_is_423(server: Server) -> None:
    from sandlot.protocol.states import SandboxState

    server.call(server.host.register, "sb_new", 1, SandboxState.PROVISIONING, None)
    r = httpx.get(
        server.url("/fs/list", "sb_new"),
        headers={"Authorization": f"Bearer {server.keys.token('sb_new')}"},
    )
    assert (
        r.status_code == 423
        and r.headers["retry-after"]
        and r.json()["error"]["code"] == "SANDBOX_STARTING"
    )
    seq = server.call(server.host.set_state, "sb_new", SandboxState.ACTIVE)
    assert server.call(server.host.status, "sb_new") == (SandboxState.ACTIVE, seq)
    server.call(server.host.unregister, "sb_new")


def test_key_rotation_and_rate_limited_refetch(server: Server) -> None:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    ok = httpx.get(server.url("/fs/list"), headers=server.headers())
    assert ok.status_code == 200
    fetches = server.keys.fetches
    # Forged kids in a burst cost at most one JWKS fetch.
    forged = jwt.encode(
        server.keys.claims(server.sandbox_id),
        Ed25519PrivateKey.generate(),
        algorithm="EdDSA",
        headers={"kid": "k_forged"},
    )
    began = time.monotonic()
    for _ in range(5):
        r = httpx.get(server.url("/fs/list"), headers={"Authorization": f"Bearer {forged}"})
        assert r.status_code == 401
    # At most one fetch per refetch interval (0.2 s here) however long the burst took.
    allowed = 1 + int((time.monotonic() - began) / 0.2)
    assert server.keys.fetches - fetches <= allowed
    # The broker rotates: a token under the new kid verifies once the JWKS is re-read.
    server.keys.private = Ed25519PrivateKey.generate()
    server.keys.kid = "k_new"
    time.sleep(0.25)
    r = httpx.get(server.url("/fs/list"), headers=server.headers())
    assert r.status_code == 200, r.text


def test_api_key_resolver(tmp_path: Path) -> None:
    from sandlot.dataplane.services.auth import AuthContext
    from sandlot.protocol.common import Actor, Capability

    async def resolver(key: str, sandbox_id: str) -> AuthContext | None:
        if key != "sl_goodkey_secret" or sandbox_id != "sb_test":
            return None
        return AuthContext(
            principal_id="prn_h",
            actor=Actor(type="human", id="h"),  # type: ignore[arg-type]
            caps=frozenset({Capability.FS_READ}),
            sandbox_id=sandbox_id,
        )

    gen = start_server(tmp_path, api_key_resolver=resolver)
    srv = next(gen)
    try:
        good = {"X-Api-Key": "sl_goodkey_secret"}
        assert httpx.get(srv.url("/fs/list"), headers=good).status_code == 200
        r = httpx.post(srv.url("/execute"), headers=good, json={"command": "true"})
        assert r.status_code == 403 and r.json()["error"]["code"] == "CAPABILITY_DENIED"
        bad = httpx.get(srv.url("/fs/list"), headers={"X-Api-Key": "sl_bad_key"})
        assert bad.status_code == 401
        # A sandbox token in X-Api-Key works as well.
        assert httpx.get(srv.url("/fs/list"), headers={"X-Api-Key": srv.token()}).status_code == 200
    finally:
        gen.close()


def test_a_key_cut_off_one_sandbox_still_reaches_the_others(tmp_path: Path) -> None:
    # A member removed from a shared scope: his key is revoked on the scope's sandbox
    # alone, for a while, and the longer of two revocations of one id holds.
    from sandlot.dataplane.services.auth import AuthContext
    from sandlot.protocol.common import Actor, Capability
    from sandlot.protocol.tokens import RevokedToken, on_sandbox

    async def resolver(key: str, sandbox_id: str) -> AuthContext | None:
        return AuthContext(
            principal_id="prn_b",
            actor=Actor(type="human", id="b"),  # type: ignore[arg-type]
            caps=frozenset({Capability.FS_READ}),
            sandbox_id=sandbox_id,
            jti="key:k_bob",
        )

    gen = start_server(tmp_path, api_key_resolver=resolver)
    srv = next(gen)
    try:
        rt = type(srv.runtime)("sb_two", 1, srv.runtime.template, srv.workspace)
        srv.call(
            srv.host.register, "sb_two", 1, __import__("sandlot").protocol.SandboxState.ACTIVE, rt
        )
        key = {"X-Api-Key": "sl_bob_secret"}

        def status(sandbox_id: str) -> int:
            return httpx.get(srv.url("/fs/list", sandbox_id), headers=key).status_code

        assert (status("sb_test"), status("sb_two")) == (200, 200)
        now = time.time()
        srv.revoke([RevokedToken(on_sandbox("key:k_bob", "sb_test"), now + 30)])
        assert (status("sb_test"), status("sb_two")) == (401, 200)
        # A shorter revocation of the same id does not shorten it.
        srv.revoke([RevokedToken(on_sandbox("key:k_bob", "sb_test"), now - 100)])
        assert status("sb_test") == 401
        # A cut over (past the leeway too) refuses nothing.
        srv.revoke([RevokedToken(on_sandbox("key:k_bob", "sb_two"), now - 31)])
        assert status("sb_two") == 200
    finally:
        gen.close()


def test_socket_closed_when_token_expires(server: Server) -> None:
    now = int(time.time())
    # Expired 29.5 s ago: still within the 30 s leeway for half a second.
    token = server.token(exp=now - 29, iat=now - 100, nbf=now - 100)

    async def run() -> int:
        async with websockets.connect(
            server.ws_url("/events/ws"), additional_headers={"Authorization": f"Bearer {token}"}
        ) as ws:
            with pytest.raises(websockets.ConnectionClosed) as info:
                while True:
                    await asyncio.wait_for(ws.recv(), 5)
            assert info.value.rcvd is not None
            return info.value.rcvd.code

    assert asyncio.run(run()) == 4401


def test_read_only_mount_refuses_every_write(tmp_path: Path) -> None:
    from sandlot.runtime.base import Mount
    from tests.dataplane.conftest import RootedRuntime

    image = tmp_path / "image"
    (image / "etc").mkdir(parents=True)
    (image / "etc" / "conf").write_text("orig")

    class ImageRuntime(RootedRuntime):
        def mounts(self) -> list[Mount]:
            return [*super().mounts(), Mount("/", image, False)]

    gen = start_server(tmp_path)
    srv = next(gen)
    try:
        rt = ImageRuntime("sb_ro", 1, srv.runtime.template, srv.workspace)
        srv.call(
            srv.host.register, "sb_ro", 1, __import__("sandlot").protocol.SandboxState.ACTIVE, rt
        )
        h = {"Authorization": f"Bearer {srv.keys.token('sb_ro')}"}
        u = lambda p: srv.url(p, "sb_ro")  # noqa: E731
        with httpx.Client(headers=h) as c:
            assert c.get(u("/fs/read"), params={"path": "/etc/conf"}).json()["content"] == "orig"
            for r in (
                c.put(u("/fs/write"), json={"path": "/etc/conf", "content": "x"}),
                c.put(u("/fs/write"), json={"path": "/etc/new/x", "content": "x"}),
                c.post(
                    u("/fs/edit"),
                    json={"path": "/etc/conf", "old_string": "orig", "new_string": "x"},
                ),
                c.delete(u("/fs"), params={"path": "/etc/conf"}),
                c.post(u("/fs/mkdir"), json={"path": "/etc/d"}),
                c.post(u("/fs/move"), json={"src": "/etc/conf", "dst": "/workspace/c"}),
                c.post(u("/files/upload"), params={"path": "/etc/up"}, content=b"x"),
            ):
                assert r.status_code == 403, r.text
                assert r.json()["error"]["code"] == "PERMISSION_DENIED"
            # The workspace mount (longest prefix) stays writable.
            assert (
                c.put(u("/fs/write"), json={"path": "/workspace/ok", "content": "x"}).status_code
                == 201
            )
        assert (image / "etc" / "conf").read_text() == "orig"
        assert sorted(os.listdir(image / "etc")) == ["conf"]
    finally:
        gen.close()


def test_grep_and_glob_work_as_the_sandbox_user(confined: Server) -> None:
    with httpx.Client(headers=confined.headers(), timeout=10) as c:
        gr = c.post(confined.url("/fs/grep"), json={"pattern": "inside", "path": "/workspace"})
        assert gr.status_code == 200, gr.text
        assert [m["path"] for m in gr.json()["matches"]] == ["/workspace/inside.txt"]
        g = c.post(confined.url("/fs/glob"), json={"pattern": "*.txt"})
        assert [m["path"] for m in g.json()["matches"]] == ["/workspace/inside.txt"]


def test_revocation_ends_event_streams(server: Server) -> None:
    from sandlot.protocol.tokens import RevokedToken

    token = server.token(jti="tok_sse")
    done = threading.Event()
    elapsed: list[float] = []

    def reader() -> None:
        with httpx.stream(
            "GET", server.url("/events"), headers={"Authorization": f"Bearer {token}"}, timeout=10
        ) as r:
            assert r.status_code == 200
            done.set()
            for _ in r.iter_lines():
                pass
        elapsed.append(time.monotonic())

    t = threading.Thread(target=reader)
    t.start()
    assert done.wait(5)
    t0 = time.monotonic()
    server.revoke([RevokedToken("tok_sse", time.time() + 900)])
    t.join(5)
    assert elapsed and elapsed[0] - t0 < 1.0
