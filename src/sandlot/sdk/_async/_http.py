"""HTTP calls with typed errors and client-side deadlines, and the SSE reader."""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any
from urllib.parse import quote_plus

from sandlot.protocol.errors import InvalidRequest, RequestTimeout, SandlotError, error_from_wire
from sandlot.sdk._async._wire import CONNECT_TIMEOUT, AsyncStreamedResponse, AsyncWire, Body
from sandlot.sdk.transport import NOT_UTF8, Deadline, Response

#: Answers that would send the client elsewhere.
REDIRECTS = frozenset({301, 302, 303, 307, 308})

#: Seconds between keepalive pings on WebSockets; a ping unanswered for as long
#: again means the connection is dead (a command then resumes on a new one).
KEEPALIVE = 20.0


def raise_for_error(resp: Response) -> None:
    """Turn an error answer into the typed exception of the one error table."""
    if resp.status_code in REDIRECTS:
        # Never followed (the credential would go along): the request named no route the
        # server serves as asked (a release of session "" reached the sessions' list).
        raise InvalidRequest(f"the server answered {resp.status_code}, a redirect (not followed)")
    if resp.status_code < 400:
        return
    try:
        body: Any = resp.json()
    except ValueError:
        body = None
    retry_after: float | None = None
    raw = resp.headers.get("retry-after")
    if raw:
        try:
            retry_after = float(raw)
        except ValueError:
            retry_after = None
    raise error_from_wire(body, resp.status_code, retry_after=retry_after)


def open_timeout(deadline: Deadline, keepalive: float | None = None) -> float:
    """Seconds one connection (a WebSocket's handshake included) may take to open.

    With ``keepalive``, no longer than an open connection may stay silent (two
    intervals): a handshake cut off by the network fails as fast as a dead socket.
    """
    limit = CONNECT_TIMEOUT if keepalive is None else min(CONNECT_TIMEOUT, 2 * keepalive)
    left = deadline.remaining()
    return limit if left is None else min(limit, left)


class AsyncHTTP:
    """One base URL, one credential source, one error table.

    ``auth`` returns the headers of the current credential; ``on_unauthenticated``
    (if given) is awaited once after a 401 to obtain a fresh credential, then
    the request is sent again.
    """

    def __init__(
        self,
        base_url: str,
        auth: Callable[[], dict[str, str]],
        *,
        timeout: float | None,
        wire: AsyncWire | None = None,
        on_unauthenticated: Callable[[], Awaitable[bool]] | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.auth = auth
        self.timeout = timeout
        self.wire = wire or AsyncWire()
        self._owns_wire = wire is None
        self.on_unauthenticated = on_unauthenticated

    def url(self, path: str, params: dict[str, Any] | None = None) -> str:
        """The absolute URL of ``path`` (base URLs are opaque: only appended to)."""
        query = _query(params)
        return self.base_url + path + (f"?{query}" if query else "")

    def deadline(self, timeout: float | None) -> Deadline:
        """The deadline of one call: its own ``timeout``, else the client's default."""
        return Deadline(timeout if timeout is not None else self.timeout)

    async def request(
        self,
        method: str,
        path: str,
        *,
        deadline: Deadline,
        json_body: Any = None,
        params: dict[str, Any] | None = None,
        content: Body = None,
        headers: dict[str, str] | None = None,
    ) -> Response:
        """Send a request; return the answer or raise its typed error."""
        url = self.url(path, params)
        extra = list((headers or {}).items())
        if json_body is not None:
            content = json.dumps(json_body, separators=(",", ":")).encode()
            extra.append(("Content-Type", "application/json"))
        retried = False
        while True:
            try:
                resp = await self.wire.request(
                    method,
                    url,
                    headers=[*self.auth().items(), *extra],
                    body=content,
                    deadline=deadline,
                )
            except TimeoutError as exc:
                raise RequestTimeout(f"{method} {path}: deadline exceeded") from exc
            if resp.status_code == 401 and not retried and self.on_unauthenticated is not None:
                retried = True
                if await self.on_unauthenticated():
                    continue
            raise_for_error(resp)
            return resp

    async def json(self, method: str, path: str, *, deadline: Deadline, **kw: Any) -> Any:
        """Send a request and return its JSON body (``None`` for 204)."""
        resp = await self.request(method, path, deadline=deadline, **kw)
        if resp.status_code == 204 or not resp.content:
            return None
        return resp.json()

    @contextlib.asynccontextmanager
    async def stream(
        self, path: str, *, deadline: Deadline, params: dict[str, Any] | None = None
    ) -> AsyncIterator[AsyncStreamedResponse]:
        """``GET path`` with its answer's body read as it arrives (errors raised first)."""
        url = self.url(path, params)
        retried = False
        while True:
            async with self.wire.stream(
                "GET", url, headers=list(self.auth().items()), deadline=deadline
            ) as resp:
                if resp.status_code == 401 and not retried and self.on_unauthenticated:
                    retried = True
                    await resp.aread()
                    if await self.on_unauthenticated():
                        continue
                if resp.status_code >= 400:
                    raise_for_error(Response(resp.status_code, resp.headers, await resp.aread()))
                yield resp
                return

    async def sse(
        self, path: str, *, deadline: Deadline, params: dict[str, Any] | None = None
    ) -> AsyncGenerator[dict[str, Any], None]:
        """Yield the JSON ``data`` of each Server-Sent Event of ``path``."""
        async with self.stream(path, deadline=deadline, params=params) as resp:
            data: list[str] = []
            event = ""
            async for line in resp.aiter_lines():
                if line:
                    field, _, value = line.partition(":")
                    value = value.removeprefix(" ")
                    if field == "data":
                        data.append(value)
                    elif field == "event":
                        event = value
                    continue
                if data:
                    body = json.loads("\n".join(data))
                    if event == "error" and "sequence" not in body:
                        raise error_from_wire({"error": body}, 410)
                    yield body
                data, event = [], ""

    async def aclose(self) -> None:
        """Close the connection pool if this object made it."""
        if self._owns_wire:
            await self.wire.aclose()


def _query(params: dict[str, Any] | None) -> str:
    """``urlencode`` of the parameters that are not ``None`` (booleans as ``true``/``false``)."""
    if not params:
        return ""
    out: list[str] = []
    for key, value in params.items():
        if value is None:
            continue
        text = ("true" if value else "false") if isinstance(value, bool) else str(value)
        out.append(f"{_quoted(key)}={_quoted(text)}")
    return "&".join(out)


@functools.lru_cache(maxsize=4096)
def _quoted(text: str) -> str:
    """``quote_plus``, kept for the values sent again and again (the paths of files)."""
    try:
        return quote_plus(text)
    except UnicodeEncodeError:
        raise InvalidRequest(NOT_UTF8) from None


__all__ = ["AsyncHTTP", "SandlotError", "open_timeout", "raise_for_error"]
