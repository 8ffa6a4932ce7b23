"""Terminal session ids: the opaque, signed ``session_id`` of ``/ws/pty`` and ``/ws/claude-stream``.

boring-ui's page keeps a terminal's ``session_id`` and sends it back to reattach. Here
that id is an HS256 JWT naming the dataplane exec (or shell) it stands for, its kind
and provider, and who may use it in which workspace; so the server keeps no table of
ids, and a restarted server (or another one sharing ``SESSION_TOKEN_SECRET``) still
recognizes the ids it issued. The claims are signed, not encrypted: they carry ids the
page already knows, never a credential. The page treats the id as opaque.

Every failure (forged, expired, issued for another audience, user, workspace, kind or
provider, malformed) raises the one :class:`InvalidSessionId`, whose message never
says why: a route answers ``session_not_found`` whatever went wrong, and the reason
goes to the debug log, without the id.

The signing key is ``SESSION_TOKEN_SECRET`` when set; ``sandlot serve`` otherwise sets
it to a random key made once per broker store (shared by its replicas); else it is a
random key created once in the data directory (:func:`load_or_create_secret`).
"""

from __future__ import annotations

import contextlib
import enum
import logging
import os
import secrets
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jwt

from sandlot.protocol.errors import SessionNotFound
from sandlot.web.settings import (
    MAX_SESSION_TOKEN_TTL,
    MIN_SECRET_BYTES,
    MIN_SESSION_TOKEN_TTL,
    ConfigError,
    WebSettings,
)

log = logging.getLogger(__name__)

AUDIENCE = "sandlot-web-session"
ALGORITHM = "HS256"
#: Longer ids are refused before any parsing.
MAX_SESSION_ID_CHARS = 2048
#: Clock skew tolerated on ``iat`` (ids are verified by the server that issued them,
#: or by a sibling sharing its secret).
LEEWAY_SECONDS = 30


class SessionKind(enum.StrEnum):
    PTY = "pty"
    STREAM = "stream"


class InvalidSessionId(SessionNotFound):
    """A session id that cannot be used here, for whatever reason (never said)."""

    def __init__(self) -> None:
        super().__init__("session not found")


@dataclass(frozen=True)
class Claims:
    """What a verified session id says."""

    #: boring-ui's provider (``shell``, ``claude``, …).
    provider: str
    #: The dataplane exec or shell the terminal is attached to.
    exec_id: str
    kind: SessionKind
    user: str
    #: The thread or sandbox id, or the local folder's id.
    workspace: str
    issued_at: int
    expires_at: int


class _Refused(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _text(claims: dict[str, Any], name: str) -> str:
    value = claims.get(name)
    if not isinstance(value, str) or not value:
        raise _Refused(f"claim {name} missing or not text")
    return value


def _number(claims: dict[str, Any], name: str) -> int:
    value = claims.get(name)
    if not isinstance(value, int) or isinstance(value, bool):
        raise _Refused(f"claim {name} missing or not a number")
    return value


class SessionTokens:
    """Issues and verifies terminal session ids with one HMAC key."""

    def __init__(
        self,
        secret: bytes,
        *,
        ttl_seconds: int = 1800,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if len(secret) < MIN_SECRET_BYTES:
            raise ConfigError(f"the session id key must be at least {MIN_SECRET_BYTES} bytes")
        if not MIN_SESSION_TOKEN_TTL <= ttl_seconds <= MAX_SESSION_TOKEN_TTL:
            raise ConfigError(
                f"session id lifetime must be {MIN_SESSION_TOKEN_TTL}-{MAX_SESSION_TOKEN_TTL} "
                f"seconds (15-60 minutes), not {ttl_seconds}"
            )
        self._secret = secret
        self.ttl_seconds = ttl_seconds
        self._clock = clock

    def __repr__(self) -> str:
        return f"SessionTokens(ttl_seconds={self.ttl_seconds})"

    @classmethod
    def from_settings(
        cls, settings: WebSettings, *, clock: Callable[[], float] = time.time
    ) -> SessionTokens:
        if settings.session_token_secret is not None:
            secret = settings.session_token_secret.encode()
        else:
            secret = load_or_create_secret(settings.secret_path)
        return cls(secret, ttl_seconds=settings.session_token_ttl_seconds, clock=clock)

    def issue(
        self,
        *,
        provider: str,
        exec_id: str,
        kind: SessionKind | str,
        user: str,
        workspace: str,
    ) -> str:
        """A new session id for ``user``'s terminal ``exec_id`` in ``workspace``."""
        for name, value in (
            ("provider", provider),
            ("exec_id", exec_id),
            ("user", user),
            ("workspace", workspace),
        ):
            if not isinstance(value, str) or not value:
                raise ValueError(f"{name} must be a non-empty string")
        now = int(self._clock())
        payload = {
            "aud": AUDIENCE,
            "sub": user,
            "workspace": workspace,
            "provider": provider,
            "exec": exec_id,
            "kind": SessionKind(kind).value,
            "iat": now,
            "exp": now + self.ttl_seconds,
        }
        return jwt.encode(payload, self._secret, algorithm=ALGORITHM)

    def verify(
        self,
        token: str,
        *,
        user: str,
        workspace: str,
        kind: SessionKind | str | None = None,
        provider: str | None = None,
    ) -> Claims:
        """The claims of ``token`` if it is valid for ``user`` in ``workspace`` (and, when
        given, of that ``kind`` and ``provider``); else :class:`InvalidSessionId`."""
        try:
            claims = self._decode(token)
            if claims.user != user:
                raise _Refused("issued to another user")
            if claims.workspace != workspace:
                raise _Refused("issued for another workspace")
            if kind is not None and claims.kind != kind:
                raise _Refused("issued for another kind of session")
            if provider is not None and claims.provider != provider:
                raise _Refused("issued for another provider")
        except _Refused as exc:
            log.debug("session id refused: %s", exc.reason)
            raise InvalidSessionId() from None
        return claims

    def _decode(self, token: str) -> Claims:
        if not isinstance(token, str) or not token or len(token) > MAX_SESSION_ID_CHARS:
            raise _Refused("empty, too long or not text")
        try:
            raw: dict[str, Any] = jwt.decode(
                token,
                self._secret,
                algorithms=[ALGORITHM],
                audience=AUDIENCE,
                # Expiry is checked below against this object's clock.
                options={
                    "require": ["aud", "sub", "iat", "exp"],
                    "verify_exp": False,
                    "verify_iat": False,
                    "verify_nbf": False,
                },
            )
        except jwt.InvalidSignatureError:
            raise _Refused("bad signature") from None
        except jwt.InvalidAudienceError:
            raise _Refused("wrong audience") from None
        except jwt.MissingRequiredClaimError as exc:
            raise _Refused(f"missing claim {exc.claim}") from None
        except jwt.InvalidAlgorithmError:
            raise _Refused("algorithm not accepted") from None
        except jwt.PyJWTError as exc:
            raise _Refused(f"malformed ({type(exc).__name__})") from None
        issued_at, expires_at = _number(raw, "iat"), _number(raw, "exp")
        now = self._clock()
        if expires_at <= now:
            raise _Refused("expired")
        if issued_at > now + LEEWAY_SECONDS:
            raise _Refused("issued in the future")
        try:
            kind = SessionKind(_text(raw, "kind"))
        except ValueError:
            raise _Refused("unknown kind") from None
        return Claims(
            provider=_text(raw, "provider"),
            exec_id=_text(raw, "exec"),
            kind=kind,
            user=_text(raw, "sub"),
            workspace=_text(raw, "workspace"),
            issued_at=issued_at,
            expires_at=expires_at,
        )


def load_or_create_secret(path: Path) -> bytes:
    """The key stored at ``path``, created there first if absent.

    Created with mode 0600 in a temporary file then hard-linked into place, so a
    reader never sees a partial key and, of several processes starting at once, the
    first link wins and every process uses that key. An existing file is refused if
    it is not a regular file of this user unreadable by others, or too short.
    """
    try:
        return _read_secret(path)
    except FileNotFoundError:
        pass
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        try:
            os.fchmod(fd, 0o600)
            os.write(fd, secrets.token_bytes(MIN_SECRET_BYTES))
            os.fsync(fd)
        finally:
            os.close(fd)
        # Another process may have created it first: then everyone uses theirs.
        with contextlib.suppress(FileExistsError):
            os.link(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    _fsync_dir(path.parent)
    return _read_secret(path)


def _read_secret(path: Path) -> bytes:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ConfigError(f"{path} is not a regular file")
        if info.st_uid != os.geteuid():
            raise ConfigError(f"{path} belongs to another user")
        if info.st_mode & 0o077:
            raise ConfigError(f"{path} is readable by others: chmod 600 it, or delete it")
        secret = os.read(fd, 4096)
    finally:
        os.close(fd)
    if len(secret) < MIN_SECRET_BYTES:
        raise ConfigError(f"{path} holds fewer than {MIN_SECRET_BYTES} bytes: delete it")
    return secret


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
