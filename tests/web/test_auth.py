"""Browser sign-in against the broker's real key service: cookies, one-time links, CSRF,
origins, WebSockets, and no credential in any body or log line."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from http.cookies import SimpleCookie
from pathlib import Path
from typing import Any

import httpx
import pytest
import websockets
from websockets.asyncio.client import connect

from sandlot.broker.browsersessions import StoredLinks, StoredSessions
from sandlot.broker.keys import KeyService
from sandlot.protocol.common import PrincipalType
from sandlot.web.auth import (
    CSRF_HEADER,
    SECURE_SESSION_COOKIE,
    SESSION_COOKIE,
    BrowserSessions,
    WebAuth,
)
from sandlot.web.session_tokens import SessionTokens
from sandlot.web.settings import ConfigError, WebSettings, WorkspaceMode, load_web_settings
from tests.web.conftest import Clock, assert_not_leaked, make_app, serving

OWN = "http://web.test"


@dataclass
class Web:
    """The app in process, what it answered, and what must never leak."""

    auth: WebAuth
    client: httpx.AsyncClient
    clock: Clock
    keys: KeyService
    #: API keys: in no body and no log line.
    secrets: set[str] = field(default_factory=set)
    #: Session cookie ids: in no body and no log line sandlot writes.
    session_ids: set[str] = field(default_factory=set)
    #: CSRF tokens: given to the page by /api/auth/me, never logged.
    csrf_tokens: set[str] = field(default_factory=set)
    bodies: list[str] = field(default_factory=list)

    def key(self, user: str) -> str:
        raw, _ = self.keys.create(user_id=user, principal_type=PrincipalType.HUMAN)
        self.secrets.add(raw)
        return raw

    async def send(self, method: str, path: str, **kw: Any) -> httpx.Response:
        r = await self.client.request(method, path, **kw)
        # Cookies are sent explicitly in these tests, never from the client's jar.
        self.client.cookies.clear()
        self.bodies.append(r.text)
        return r

    async def sign_in(self, user: str = "ada") -> tuple[str, str]:
        """(session cookie value, CSRF token) of a fresh API-key sign-in."""
        r = await self.send(
            "POST", "/api/auth/login", json={"api_key": self.key(user)}, headers={"Origin": OWN}
        )
        assert r.status_code == 200, r.text
        raw = session_cookie(r)[1].value
        self.session_ids.add(raw)
        self.csrf_tokens.add(r.json()["csrf_token"])
        return raw, r.json()["csrf_token"]


def session_cookie(r: httpx.Response) -> tuple[str, Any]:
    headers = r.headers.get_list("set-cookie")
    assert len(headers) == 1, headers
    cookie: SimpleCookie = SimpleCookie()
    cookie.load(headers[0])
    ((name, morsel),) = cookie.items()
    return name, morsel


def cookie(raw: str, name: str = SESSION_COOKIE) -> dict[str, str]:
    return {"Cookie": f"{name}={raw}"}


def assert_error(r: httpx.Response, status: int, code: str) -> None:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == code
    assert error["request_id"].startswith("req_")
    assert "Traceback" not in r.text


@pytest.fixture(params=["memory", "store"])
async def web(
    request: pytest.FixtureRequest,
    tmp_path: Path,
    keys: KeyService,
    caplog: pytest.LogCaptureFixture,
) -> AsyncIterator[Web]:
    """The app with its sessions and links in its memory (``sandlot web``), or in the
    broker's store (``sandlot serve``)."""
    caplog.set_level(logging.DEBUG)
    clock = Clock()
    settings = WebSettings(data_dir=tmp_path / "web")
    if request.param == "memory":
        auth = WebAuth(settings, keys, clock=clock)
    else:
        sessions = StoredSessions(
            keys.store,
            idle_seconds=settings.session_idle_seconds,
            max_seconds=settings.session_max_seconds,
            max_sessions=settings.max_sessions,
            clock=clock,
        )
        links = StoredLinks(keys.store, ttl_seconds=settings.login_link_ttl_seconds, clock=clock)
        auth = WebAuth(settings, keys, clock=clock, sessions=sessions, links=links)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=make_app(auth)), base_url=OWN
    ) as client:
        w = Web(auth, client, clock, keys)
        yield w
    # No key nor session id in any body, no key, session id or CSRF token in a log line.
    assert_not_leaked(
        caplog.get_records("setup") + caplog.get_records("call"),
        w.bodies,
        credentials=w.secrets,
        session_values=w.session_ids | w.csrf_tokens,
    )
    for raw in w.session_ids:
        assert all(raw not in body for body in w.bodies)


async def test_signing_in_with_a_key_sets_a_strict_http_only_cookie(web: Web) -> None:
    key = web.key("ada")
    r = await web.send("POST", "/api/auth/login", json={"api_key": key}, headers={"Origin": OWN})
    assert r.status_code == 200
    assert r.json()["user"] == "ada" and r.json()["csrf_token"]
    web.csrf_tokens.add(r.json()["csrf_token"])
    assert r.headers["cache-control"] == "no-store"
    name, morsel = session_cookie(r)
    web.session_ids.add(morsel.value)
    assert name == SESSION_COOKIE
    assert morsel["httponly"] is True
    assert morsel["samesite"].lower() == "strict"
    assert morsel["path"] == "/"
    assert not morsel["secure"]  # plain http, no https public URL
    assert int(morsel["max-age"]) == web.auth.settings.session_max_seconds
    assert len(morsel.value) >= 40 and key not in r.headers["set-cookie"]
    me = await web.send("GET", "/api/auth/me", headers=cookie(morsel.value))
    assert me.status_code == 200
    assert me.json() == {
        "user": "ada",
        "csrf_token": r.json()["csrf_token"],
        "expires_at": web.clock.now + web.auth.settings.session_max_seconds,
    }
    # The server holds the key to negotiate with; the browser never sees it.
    session = web.auth.sessions.get(morsel.value)
    assert session is not None and session.credential == key
    assert key not in repr(session) and morsel.value not in repr(session)


async def test_a_form_sign_in_redirects_home(web: Web) -> None:
    r = await web.send(
        "POST",
        "/api/auth/login",
        data={"api_key": web.key("ada")},
        headers={"Origin": OWN},
    )
    assert r.status_code == 303 and r.headers["location"] == "/"
    web.session_ids.add(session_cookie(r)[1].value)


async def test_an_invalid_or_revoked_key_is_401(web: Web) -> None:
    good = web.key("ada")
    for bad in ("sl_000000000000_" + "A" * 43, good[:-1] + ("B" if good[-1] != "B" else "C")):
        r = await web.send(
            "POST", "/api/auth/login", json={"api_key": bad}, headers={"Origin": OWN}
        )
        assert_error(r, 401, "UNAUTHENTICATED")
        assert "set-cookie" not in r.headers
        web.secrets.add(bad)
    r = await web.send("POST", "/api/auth/login", json={}, headers={"Origin": OWN})
    assert_error(r, 401, "UNAUTHENTICATED")
    (info,) = web.keys.list("ada")
    web.keys.revoke(info.id)
    r = await web.send("POST", "/api/auth/login", json={"api_key": good}, headers={"Origin": OWN})
    assert_error(r, 401, "UNAUTHENTICATED")
    r = await web.send("POST", "/api/auth/login", content=b"x" * 20_000, headers={"Origin": OWN})
    assert_error(r, 413, "PAYLOAD_TOO_LARGE")


async def test_secure_cookie_under_https(tmp_path: Path, keys: KeyService) -> None:
    auth = WebAuth(WebSettings(data_dir=tmp_path), keys)
    key, _ = keys.create(user_id="ada", principal_type=PrincipalType.HUMAN)
    transport = httpx.ASGITransport(app=make_app(auth))
    async with httpx.AsyncClient(transport=transport, base_url="https://web.test") as client:
        r = await client.post(
            "/api/auth/login", json={"api_key": key}, headers={"Origin": "https://web.test"}
        )
        assert r.status_code == 200
        name, morsel = session_cookie(r)
        assert name == SECURE_SESSION_COOKIE and morsel["secure"] and morsel["httponly"]
        me = await client.get("/api/auth/me", headers=cookie(morsel.value, name))
        assert me.json()["user"] == "ada"
        # The plain name is not read over TLS (a plain-HTTP page could have planted it).
        assert (await client.get("/api/auth/me", headers=cookie(morsel.value))).status_code == 401
    # Behind a TLS proxy: the public URL decides.
    auth = WebAuth(WebSettings(data_dir=tmp_path, public_url="https://ws.example.com"), keys)
    transport = httpx.ASGITransport(app=make_app(auth))
    async with httpx.AsyncClient(transport=transport, base_url="http://10.0.0.1:8080") as client:
        r = await client.post(
            "/api/auth/login",
            json={"api_key": key},
            headers={"Origin": "https://ws.example.com"},
        )
        assert r.status_code == 200
        assert session_cookie(r)[1]["secure"]


async def test_a_one_time_link_works_once(web: Web) -> None:
    url = web.auth.login_url(OWN, "ada", next_path="/?thread=thr_1")
    token = url.partition("token=")[2]
    r = await web.send("GET", url)
    assert r.status_code == 303
    assert r.headers["location"] == "/?thread=thr_1"
    assert r.headers["referrer-policy"] == "no-referrer"
    name, morsel = session_cookie(r)
    web.session_ids.add(morsel.value)
    assert name == SESSION_COOKIE and morsel["httponly"] and morsel["samesite"] == "strict"
    assert (await web.send("GET", "/api/auth/me", headers=cookie(morsel.value))).json()[
        "user"
    ] == "ada"
    again = await web.send("GET", f"/login?token={token}")
    assert_error(again, 401, "UNAUTHENTICATED")
    assert "set-cookie" not in again.headers


async def test_a_head_request_does_not_spend_a_link(web: Web) -> None:
    url = web.auth.login_url(OWN, "ada")
    r = await web.send("HEAD", url)
    assert r.status_code == 204 and "set-cookie" not in r.headers
    r = await web.send("GET", url)
    assert r.status_code == 303
    web.session_ids.add(session_cookie(r)[1].value)


async def test_an_expired_or_guessed_link_fails(web: Web) -> None:
    url = web.auth.login_url(OWN, "ada")
    web.clock.advance(web.auth.settings.login_link_ttl_seconds + 1)
    assert_error(await web.send("GET", url), 401, "UNAUTHENTICATED")
    # A wrong secret for a real link id fails, and spends the link.
    url = web.auth.login_url(OWN, "ada")
    link_id, _, secret = url.partition("token=")[2].partition(".")
    assert_error(
        await web.send("GET", f"/login?token={link_id}.{secret[::-1]}"), 401, "UNAUTHENTICATED"
    )
    assert_error(await web.send("GET", url), 401, "UNAUTHENTICATED")
    assert_error(await web.send("GET", "/login"), 401, "UNAUTHENTICATED")


async def test_a_key_holder_asks_for_a_link(web: Web) -> None:
    """What ``sandlot open THREAD`` does against a running server."""
    key = web.key("ada")
    r = await web.send(
        "POST",
        "/api/auth/links",
        json={"next": "/?thread=thr_9"},
        headers={"Authorization": f"Bearer {key}"},
    )
    assert r.status_code == 201, r.text
    url = r.json()["url"]
    assert url.startswith(f"{OWN}/login?token=")
    login = await web.send("GET", url)
    assert login.status_code == 303 and login.headers["location"] == "/?thread=thr_9"
    raw = session_cookie(login)[1].value
    web.session_ids.add(raw)
    # The session negotiates with the key that asked for the link.
    session = web.auth.sessions.get(raw)
    assert session is not None and session.user_id == "ada" and session.credential == key
    for bad_next in ("//evil.example/", "https://evil.example/", "/\\evil.example"):
        r = await web.send(
            "POST",
            "/api/auth/links",
            json={"next": bad_next},
            headers={"Authorization": f"Bearer {key}"},
        )
        assert_error(r, 400, "INVALID_REQUEST")
    r = await web.send("POST", "/api/auth/links", headers={"Authorization": "Bearer sl_nope"})
    assert_error(r, 401, "UNAUTHENTICATED")
    # A browser session is no way to make links.
    r = await web.send("POST", "/api/auth/links", headers={**cookie(raw), "Origin": OWN})
    assert_error(r, 403, "FORBIDDEN")


async def test_state_changes_need_the_csrf_token(web: Web) -> None:
    raw, csrf = await web.sign_in()
    own = {**cookie(raw), "Origin": OWN}
    for method in ("POST", "PUT", "PATCH", "DELETE"):
        assert_error(await web.send(method, "/api/file", headers=own), 403, "FORBIDDEN")
        wrong = {**own, CSRF_HEADER: csrf.upper() + "x"}
        assert_error(await web.send(method, "/api/file", headers=wrong), 403, "FORBIDDEN")
        r = await web.send(method, "/api/file", headers={**own, CSRF_HEADER: csrf})
        assert r.status_code == 200 and r.json() == {"changed_by": "ada"}
    # Another session's token is no good either.
    _, other_csrf = await web.sign_in("bob")
    r = await web.send("PUT", "/api/file", headers={**own, CSRF_HEADER: other_csrf})
    assert_error(r, 403, "FORBIDDEN")
    # No session: 401.
    r = await web.send("PUT", "/api/file", headers={"Origin": OWN, CSRF_HEADER: csrf})
    assert_error(r, 401, "UNAUTHENTICATED")


async def test_cross_origin_state_changes_are_refused(web: Web) -> None:
    raw, csrf = await web.sign_in()
    good = {**cookie(raw), CSRF_HEADER: csrf}
    refused = [
        {"Origin": "http://evil.example"},
        {"Origin": "http://web.test.evil.example"},
        {"Origin": "https://web.test"},  # another scheme is another origin
        {"Origin": "http://web.test:8080"},
        {"Origin": "null"},
        {"Referer": "http://evil.example/page"},
        {},  # neither Origin nor Referer
    ]
    for headers in refused:
        r = await web.send("PUT", "/api/file", headers={**good, **headers})
        assert_error(r, 403, "FORBIDDEN")
    assert (
        await web.send("PUT", "/api/file", headers={**good, "Referer": f"{OWN}/files"})
    ).status_code == 200
    assert (
        await web.send("PUT", "/api/file", headers={**good, "Origin": "HTTP://WEB.TEST:80"})
    ).status_code == 200
    # Signing in is state-changing too: another site cannot sign a browser in.
    key = web.key("mallory")
    r = await web.send(
        "POST", "/api/auth/login", data={"api_key": key}, headers={"Origin": "http://evil.example"}
    )
    assert_error(r, 403, "FORBIDDEN")
    assert "set-cookie" not in r.headers
    # A configured origin is allowed.
    web.auth.settings = WebSettings(
        data_dir=web.auth.settings.data_dir, allowed_origins=frozenset({"http://ide.test:3000"})
    )
    r = await web.send("PUT", "/api/file", headers={**good, "Origin": "http://ide.test:3000"})
    assert r.status_code == 200


async def test_a_header_authenticated_request_gets_no_cookie_session(web: Web) -> None:
    raw, _ = await web.sign_in()
    # No CSRF token is asked of it, and the cookie beside it is ignored.
    r = await web.send("PUT", "/api/file", headers={**cookie(raw), "Authorization": "Bearer x"})
    assert_error(r, 401, "UNAUTHENTICATED")


async def test_logout_ends_the_session(web: Web) -> None:
    raw, csrf = await web.sign_in()
    r = await web.send("POST", "/api/auth/logout", headers={**cookie(raw), "Origin": OWN})
    assert_error(r, 403, "FORBIDDEN")
    r = await web.send(
        "POST", "/api/auth/logout", headers={**cookie(raw), "Origin": OWN, CSRF_HEADER: csrf}
    )
    assert r.status_code == 200
    name, morsel = session_cookie(r)
    assert name == SESSION_COOKIE and morsel.value == "" and int(morsel["max-age"]) == 0
    assert_error(await web.send("GET", "/api/auth/me", headers=cookie(raw)), 401, "UNAUTHENTICATED")
    assert web.auth.sessions.delete(raw) is False  # ended, not only refused


async def test_sessions_end_when_idle_at_their_end_or_when_the_key_is_revoked(web: Web) -> None:
    settings = web.auth.settings
    raw, _ = await web.sign_in()
    web.clock.advance(settings.session_idle_seconds - 1)
    assert (await web.send("GET", "/api/auth/me", headers=cookie(raw))).status_code == 200
    web.clock.advance(settings.session_idle_seconds)
    assert_error(await web.send("GET", "/api/auth/me", headers=cookie(raw)), 401, "UNAUTHENTICATED")

    raw, _ = await web.sign_in()
    used = 0.0
    while used < settings.session_max_seconds:
        web.clock.advance(settings.session_idle_seconds / 2)
        used += settings.session_idle_seconds / 2
        r = await web.send("GET", "/api/auth/me", headers=cookie(raw))
    assert_error(r, 401, "UNAUTHENTICATED")

    raw, _ = await web.sign_in("carol")
    (info,) = web.keys.list("carol")
    web.keys.revoke(info.id)
    # Used all along, the session still has its key checked every RECHECK_SECONDS.
    web.clock.advance(web.auth.RECHECK_SECONDS / 2)
    assert (await web.send("GET", "/api/auth/me", headers=cookie(raw))).status_code == 200
    web.clock.advance(web.auth.RECHECK_SECONDS / 2)
    assert_error(await web.send("GET", "/api/auth/me", headers=cookie(raw)), 401, "UNAUTHENTICATED")
    web.clock.advance(-web.auth.RECHECK_SECONDS)
    assert web.auth.sessions.get(raw) is None  # ended, not only refused


async def test_websockets_need_an_own_origin_and_a_session(
    tmp_path: Path, keys: KeyService, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    auth = WebAuth(WebSettings(data_dir=tmp_path), keys)
    key, _ = keys.create(user_id="ada", principal_type=PrincipalType.HUMAN)
    tokens = SessionTokens.from_settings(auth.settings)
    session_id = tokens.issue(
        provider="shell", exec_id="exe_1", kind="pty", user="ada", workspace="thr_1"
    )
    secret = auth.settings.secret_path.read_bytes()
    bodies: list[str] = []
    async with serving(make_app(auth)) as base, httpx.AsyncClient(base_url=base) as client:
        r = await client.post("/api/auth/login", json={"api_key": key}, headers={"Origin": base})
        assert r.status_code == 200
        bodies.append(r.text)
        raw = session_cookie(r)[1].value
        ws_url = base.replace("http", "ws") + f"/ws/pty?session_id={session_id}"

        refusals = [
            ("http://evil.example", cookie(raw), 403),
            ("http://localhost:1", cookie(raw), 403),
            (None, cookie(raw), 403),
            (base, {}, 401),
            (base, cookie("not-a-session"), 401),
        ]
        for origin, headers, status in refusals:
            with pytest.raises(websockets.InvalidStatus) as caught:
                async with connect(ws_url, origin=origin, additional_headers=headers):
                    pass
            response = caught.value.response
            assert response.status_code == status
            body = (response.body or b"").decode()
            bodies.append(body)
            code = "FORBIDDEN" if status == 403 else "UNAUTHENTICATED"
            assert json.loads(body)["error"]["code"] == code

        async with connect(ws_url, origin=base, additional_headers=cookie(raw)) as ws:
            assert await ws.recv() == '{"type":"session","user":"ada"}'
    assert any("refused WebSocket" in rec.getMessage() for rec in caplog.records)
    assert_not_leaked(
        caplog.records,
        bodies,
        credentials=[key, secret.hex(), secret.decode("latin-1")],
        session_values=[raw],
    )
    # The terminal session id travels in the query string (boring-ui's protocol), so
    # a server's access log shows it; it is no credential (see test_session_tokens).
    assert all(session_id not in body for body in bodies)


async def test_one_user_signing_in_again_and_again_ends_only_their_own_sessions(
    tmp_path: Path, keys: KeyService
) -> None:
    auth = WebAuth(WebSettings(data_dir=tmp_path, max_sessions=150), keys)
    sessions = auth.sessions
    assert isinstance(sessions, BrowserSessions)
    others = [sessions.create(f"user{i}", credential=None)[0] for i in range(20)]
    mallory = [sessions.create("mallory", credential=None)[0] for _ in range(500)]
    assert all(sessions.get(raw) is not None for raw in others)
    live = [raw for raw in mallory if sessions.get(raw) is not None]
    assert live == mallory[-sessions.MAX_PER_USER :]
    assert len(sessions) == 20 + sessions.MAX_PER_USER
    # Beyond the global cap, the least recently used go first: mallory's, once the
    # others have been used again.
    assert all(sessions.get(raw) is not None for raw in others)
    newcomers = [sessions.create(f"new{i}", credential=None)[0] for i in range(40)]
    assert len(sessions) == 150
    assert all(sessions.get(raw) is not None for raw in newcomers)
    assert all(sessions.get(raw) is not None for raw in others)
    assert sum(sessions.get(raw) is not None for raw in mallory) == 150 - 40 - 20


def test_web_settings_from_the_environment(tmp_path: Path) -> None:
    settings = load_web_settings(
        environ={
            "SANDLOT_WORKSPACE_MODE": "local",
            "SANDLOT_DATA_DIR": str(tmp_path),
            "SANDLOT_PUBLIC_URL": "https://WS.example.com:443/base",
            "SANDLOT_WEB_COOKIE_SECURE": "false",
            "SANDLOT_WEB_ALLOWED_ORIGINS": "http://ide.test:3000/, https://other.test",
            "SANDLOT_WEB_SESSION_IDLE_SECONDS": "600",
            "SANDLOT_WEB_LOGIN_LINK_TTL": "120",
        }
    )
    assert settings.mode is WorkspaceMode.LOCAL
    assert settings.data_dir == tmp_path
    assert settings.public_origin == "https://ws.example.com"
    assert settings.cookie_secure is False
    assert settings.allowed_origins == {"http://ide.test:3000", "https://other.test"}
    assert (settings.session_idle_seconds, settings.login_link_ttl_seconds) == (600, 120)
    assert load_web_settings(environ={}).mode is WorkspaceMode.SANDBOX
    assert load_web_settings(environ={}).cookie_secure is None
    for bad in (
        {"SANDLOT_WORKSPACE_MODE": "docker"},
        {"SANDLOT_WEB_COOKIE_SECURE": "maybe"},
        {"SANDLOT_WEB_ALLOWED_ORIGINS": "ide.test"},
        {"SANDLOT_PUBLIC_URL": "ftp://x"},
        {"SANDLOT_WEB_SESSION_IDLE_SECONDS": "soon"},
        {"SANDLOT_WEB_SESSION_IDLE_SECONDS": "999999999"},
    ):
        with pytest.raises(ConfigError):
            load_web_settings(environ=bad)
