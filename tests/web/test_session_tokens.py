"""Terminal session ids: issued, verified, and refused the same way whatever is wrong."""

from __future__ import annotations

import logging
import os
import stat
import threading
from pathlib import Path

import jwt
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from sandlot.protocol.errors import SessionNotFound
from sandlot.web.session_tokens import (
    AUDIENCE,
    InvalidSessionId,
    SessionKind,
    SessionTokens,
    load_or_create_secret,
)
from sandlot.web.settings import ConfigError, WebSettings, load_web_settings
from tests.web.conftest import Clock

SECRET = b"s" * 16 + os.urandom(16)
ISSUED = {
    "provider": "shell",
    "exec_id": "exe_1",
    "kind": "pty",
    "user": "ada",
    "workspace": "thr_1",
}


def tokens(clock: Clock, secret: bytes = SECRET, ttl: int = 1800) -> SessionTokens:
    return SessionTokens(secret, ttl_seconds=ttl, clock=clock)


def test_an_issued_id_verifies_with_its_claims() -> None:
    clock = Clock()
    tt = tokens(clock)
    claims = tt.verify(tt.issue(**ISSUED), user="ada", workspace="thr_1")
    assert claims.provider == "shell"
    assert claims.exec_id == "exe_1"
    assert claims.kind is SessionKind.PTY
    assert (claims.user, claims.workspace) == ("ada", "thr_1")
    assert claims.issued_at == int(clock.now)
    assert claims.expires_at == int(clock.now) + 1800
    clock.advance(1799)
    assert tt.verify(tt.issue(**ISSUED), user="ada", workspace="thr_1", kind="pty").exec_id


def _hand_signed(claims: dict[str, object], key: object = SECRET, alg: str = "HS256") -> str:
    return jwt.encode(claims, key, algorithm=alg)


def test_every_bad_id_fails_the_same_way(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    tt = tokens(clock)
    good = tt.issue(**ISSUED)
    now = int(clock.now)
    payload = {
        "aud": AUDIENCE,
        "sub": "ada",
        "workspace": "thr_1",
        "provider": "shell",
        "exec": "exe_1",
        "kind": "pty",
        "iat": now,
        "exp": now + 600,
    }
    assert tt.verify(_hand_signed(payload), user="ada", workspace="thr_1").exec_id == "exe_1"
    head, _, sig = good.split(".")
    edited = jwt.encode({**payload, "sub": "eve"}, b"x" * 32, algorithm="HS256").split(".")[1]
    expired = tokens(Clock(clock.now - 1801)).issue(**ISSUED)
    ed25519 = Ed25519PrivateKey.generate()

    cases: dict[str, tuple[str, dict[str, str]]] = {
        "forged (another key)": (tokens(clock, os.urandom(32)).issue(**ISSUED), {}),
        "expired": (expired, {}),
        "wrong audience": (_hand_signed({**payload, "aud": "sandlot-dataplane"}), {}),
        "no audience": (_hand_signed({k: v for k, v in payload.items() if k != "aud"}), {}),
        "no expiry": (_hand_signed({k: v for k, v in payload.items() if k != "exp"}), {}),
        "unknown kind": (_hand_signed({**payload, "kind": "root"}), {}),
        "exec not text": (_hand_signed({**payload, "exec": 7}), {}),
        "issued in the future": (
            _hand_signed({**payload, "iat": now + 3600, "exp": now + 4000}),
            {},
        ),
        "edited payload": (f"{head}.{edited}.{sig}", {}),
        "alg none": (_hand_signed(payload, None, "none"), {}),
        "EdDSA": (_hand_signed(payload, ed25519, "EdDSA"), {}),
        "malformed": ("not-a-token", {}),
        "empty": ("", {}),
        "oversized": (good + "A" * 4096, {}),
        "wrong user": (good, {"user": "eve"}),
        "wrong workspace": (good, {"workspace": "thr_2"}),
        "wrong kind": (good, {"kind": "stream"}),
        "wrong provider": (good, {"provider": "claude"}),
    }
    messages = set()
    with caplog.at_level(logging.DEBUG, logger="sandlot.web.session_tokens"):
        for name, (token, override) in cases.items():
            kw: dict[str, str] = {"user": "ada", "workspace": "thr_1", **override}
            with pytest.raises(InvalidSessionId) as caught:
                tt.verify(token, **kw)
            assert type(caught.value) is InvalidSessionId, name
            assert isinstance(caught.value, SessionNotFound)
            assert caught.value.status == 404 and caught.value.code == "SESSION_NOT_FOUND"
            assert caught.value.__cause__ is None and caught.value.__suppress_context__, name
            wire = caught.value.to_wire("req_1")
            messages.add((str(caught.value), wire["error"]["message"], wire["error"]["code"]))
    # One message for all, saying nothing of why.
    assert messages == {("session not found", "session not found", "SESSION_NOT_FOUND")}
    # The reasons went to the debug log, one line each, without the ids.
    reasons = [r.getMessage() for r in caplog.records if r.name == "sandlot.web.session_tokens"]
    assert len(reasons) == len(cases)
    assert any("expired" in r for r in reasons)
    assert any("bad signature" in r for r in reasons)
    assert any("wrong audience" in r for r in reasons)
    assert any("another user" in r for r in reasons)
    for token, _ in cases.values():
        if token:
            assert all(token not in r and sig not in r for r in reasons)


def test_lifetime_must_be_15_to_60_minutes(tmp_path: Path) -> None:
    for ttl in (899, 3601, 0):
        with pytest.raises(ConfigError):
            SessionTokens(SECRET, ttl_seconds=ttl)
        with pytest.raises(ConfigError):
            WebSettings(data_dir=tmp_path, session_token_ttl_seconds=ttl)
        with pytest.raises(ConfigError):
            load_web_settings(environ={"SANDLOT_WEB_SESSION_TOKEN_TTL": str(ttl)})
    clock = Clock()
    for ttl in (900, 3600):
        tt = tokens(clock, ttl=ttl)
        assert tt.verify(tt.issue(**ISSUED), user="ada", workspace="thr_1").expires_at == (
            int(clock.now) + ttl
        )
    assert load_web_settings(environ={}).session_token_ttl_seconds == 1800
    settings = load_web_settings(environ={"SANDLOT_WEB_SESSION_TOKEN_TTL": "2400"})
    assert settings.session_token_ttl_seconds == 2400


def test_the_data_dir_key_persists_with_mode_0600(tmp_path: Path) -> None:
    settings = WebSettings(data_dir=tmp_path / "data")
    first = SessionTokens.from_settings(settings)
    path = settings.secret_path
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    key = path.read_bytes()
    assert len(key) >= 32
    token = first.issue(**ISSUED)
    # A restarted server: same key, and what the first one issued still verifies.
    second = SessionTokens.from_settings(settings)
    assert path.read_bytes() == key
    assert second.verify(token, user="ada", workspace="thr_1").exec_id == "exe_1"
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary left
    # Another data directory is another key.
    other = SessionTokens.from_settings(WebSettings(data_dir=tmp_path / "other"))
    with pytest.raises(InvalidSessionId):
        other.verify(token, user="ada", workspace="thr_1")


def test_concurrent_starts_share_one_key(tmp_path: Path) -> None:
    path = tmp_path / "data" / "web-session.key"
    barrier = threading.Barrier(8)
    keys: list[bytes] = []

    def start() -> None:
        barrier.wait()
        keys.append(load_or_create_secret(path))

    threads = [threading.Thread(target=start) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(keys) == 8 and len(set(keys)) == 1
    assert keys[0] == path.read_bytes()
    assert [p.name for p in path.parent.iterdir()] == [path.name]


def test_a_key_file_others_can_read_or_a_symlink_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "web-session.key"
    load_or_create_secret(path)
    path.chmod(0o644)
    with pytest.raises(ConfigError, match="readable by others"):
        load_or_create_secret(path)
    path.chmod(0o600)
    link = tmp_path / "link.key"
    link.symlink_to(path)
    with pytest.raises(ConfigError):
        load_or_create_secret(link)
    short = tmp_path / "short.key"
    short.write_bytes(b"abc")
    short.chmod(0o600)
    with pytest.raises(ConfigError, match="fewer than"):
        load_or_create_secret(short)


def test_session_token_secret_from_the_environment(tmp_path: Path) -> None:
    secret = "e" * 40
    env = {"SESSION_TOKEN_SECRET": secret, "SANDLOT_DATA_DIR": str(tmp_path / "data")}
    settings = load_web_settings(environ=env)
    assert secret not in repr(settings)
    a = SessionTokens.from_settings(settings)
    b = SessionTokens.from_settings(load_web_settings(environ=env))
    assert b.verify(a.issue(**ISSUED), user="ada", workspace="thr_1").exec_id == "exe_1"
    assert not (tmp_path / "data").exists()  # no key file when the secret is given
    assert secret not in repr(a)
    with pytest.raises(ConfigError, match="at least 32 bytes") as caught:
        load_web_settings(environ={"SESSION_TOKEN_SECRET": "short"})
    assert "short" not in str(caught.value)
