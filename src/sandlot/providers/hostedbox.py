"""One hosted box's dataplane, as the broker's relay reaches it.

A hosted sandbox service (LangSmith sandboxes) serves each box at its own
``dataplane_url`` with the surface of PROTOCOL.md 3.9: ``POST /execute``,
``WS /execute/ws``, ``POST /upload`` (multipart ``file``), ``GET /download``, and,
where present, ``POST /glob`` and ``POST /grep``. Every call carries the provider's
key as ``X-Api-Key``; :class:`Box` is the only holder of that key the relay uses, and
nothing it raises carries it: the box's own error bodies are reduced to their code
and message, and a refusal of the key (401/403 from the box) is the provider's
failure (503), never the caller's.

Calls without a multipart body (``/execute``, ``/download`` read whole, ``HEAD``,
``/glob``, ``/grep``) go over the SDK's keep-alive HTTP/1.1 pool
(:class:`~sandlot.sdk._async._wire.AsyncWire`), one send per request, when the box is
given one; uploads and streamed downloads over an httpx client of their own
(``transfers``): a transfer lasts as long as its client takes to read or send it, and
however many are held open they never take the connections of the other calls. Waiting
for a free connection of that pool is bounded: past it the call is a retryable 503.

Nothing is held whole that need not be: a file read whole is read only as far as its
limit (:meth:`Box.download`), and an upload is passed on as it arrives, wrapped in the
multipart framing the box's ``/upload`` takes (:meth:`Box.upload`).

The WebSocket to ``/execute/ws`` carries the key in a header, so it follows no
redirect: an answer that redirects fails the call (a redirect to another host would
otherwise receive the key).

Paths are the box's own: the relay resolves a relative path against the box's
workspace (:attr:`Box.workspace`) and passes only absolute, normalised paths, each
quoted for the shell (:func:`q`), to the commands it runs there.
"""

from __future__ import annotations

import functools
import json
import posixpath
import secrets
import shlex
from collections.abc import AsyncIterator, Mapping
from typing import Any
from urllib.parse import urlencode

import httpx
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import InvalidStatus

from sandlot.protocol.errors import (
    FileNotFound,
    InvalidRequest,
    PayloadTooLarge,
    ProviderUnavailable,
    RequestTimeout,
    SandlotError,
    TransportError,
    exception_for,
)
from sandlot.sdk._async._wire import AsyncWire
from sandlot.sdk.transport import Deadline, Response

MAX_FRAME_BYTES = 16 << 20
#: A streamed transfer's timeouts: the box's silence (not the client's pace: the body is
#: read only as the client takes it), and the wait for a free connection of the pool.
STREAM_TIMEOUT = httpx.Timeout(120.0, connect=10.0, pool=10.0)
#: What is read of an error answer (its code and message are all that is kept).
MAX_ERROR_BODY = 64 << 10


@functools.lru_cache(maxsize=64)
def _timeout(read: float | None) -> httpx.Timeout:
    """The box call's timeouts (built once per value: not on every call). Waiting for a
    free connection is bounded apart: a full pool is a retryable 503, not a hang."""
    return httpx.Timeout(read, connect=10.0, pool=10.0)


def q(value: str) -> str:
    """``value`` as one shell word."""
    return shlex.quote(value)


class Box:
    """A box's dataplane (``url``, e.g. ``https://…/v1``) reached with the provider's key."""

    def __init__(
        self,
        url: str,
        key: str,
        client: httpx.AsyncClient,
        *,
        workspace: str = "/workspace",
        wire: AsyncWire | None = None,
        transfers: httpx.AsyncClient | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self._key = key
        self._headers = {"X-Api-Key": key}
        self._wire_headers = [("X-Api-Key", key), ("Accept", "*/*")]
        self.client = client
        #: The keep-alive HTTP/1.1 pool of the calls without a multipart body (one send
        #: per request, a fraction of httpx's client code); httpx for uploads and streams.
        self.wire = wire
        #: Streamed uploads and downloads (by default the same client as the rest).
        self.transfers = transfers or client
        self.workspace = workspace
        #: Whether the box serves ``/glob`` and ``/grep`` (None: not asked yet).
        self.has_search: bool | None = None

    def __repr__(self) -> str:  # never the key
        return f"Box({self.url!r})"

    @property
    def headers(self) -> dict[str, str]:
        return {"X-Api-Key": self._key}

    def resolve(self, path: str) -> str:
        """An absolute, normalised path in the box (relative: from its workspace)."""
        if "\x00" in path or len(path) > 4096:
            raise InvalidRequest("invalid path")
        joined = path if path.startswith("/") else posixpath.join(self.workspace, path)
        norm = posixpath.normpath(joined)
        return "/" + norm.lstrip("/")

    # --- HTTP -----------------------------------------------------------------------------

    async def request(
        self,
        method: str,
        route: str,
        *,
        params: Mapping[str, str] | None = None,
        json_body: Any = None,
        files: Any = None,
        headers: Mapping[str, str] | None = None,
        timeout: float | None = 60.0,
    ) -> httpx.Response | Response:
        if self.wire is not None and files is None:
            return await self._wire_request(method, route, params, json_body, headers, timeout)
        try:
            resp = await self.client.request(
                method,
                f"{self.url}{route}",
                params=params,
                json=json_body,
                files=files,
                headers={**self._headers, **headers} if headers else self._headers,
                timeout=_timeout(timeout),
            )
        except httpx.TransportError as exc:
            raise _unreachable(exc) from exc
        if resp.status_code >= 400:
            raise box_error(resp.status_code, resp.content)
        return resp

    async def _wire_request(
        self,
        method: str,
        route: str,
        params: Mapping[str, str] | None,
        json_body: Any,
        headers: Mapping[str, str] | None,
        timeout: float | None,
    ) -> Response:
        assert self.wire is not None
        url = f"{self.url}{route}"
        if params:
            url = f"{url}?{urlencode(params)}"
        head = list(self._wire_headers)
        if headers:
            head += headers.items()
        body = None
        if json_body is not None:
            body = json.dumps(json_body, separators=(",", ":")).encode()
            head.append(("Content-Type", "application/json"))
        try:
            resp = await self.wire.request(
                method, url, headers=head, body=body, deadline=Deadline(timeout)
            )
        except RequestTimeout as exc:
            raise ProviderUnavailable("the hosted box did not answer in time") from exc
        except TransportError as exc:
            raise ProviderUnavailable("the hosted box is unreachable") from exc
        if resp.status_code >= 400:
            raise box_error(resp.status_code, resp.content)
        return resp

    async def stream(
        self, method: str, route: str, *, params: Mapping[str, str], headers: Mapping[str, str]
    ) -> httpx.Response:
        """A streamed response (the caller closes it) over the transfers' pool; errors
        raised as for :meth:`request`."""
        req = self.transfers.build_request(
            method,
            f"{self.url}{route}",
            params=params,
            headers={**self.headers, **headers},
            timeout=STREAM_TIMEOUT,
        )
        try:
            resp = await self.transfers.send(req, stream=True)
        except httpx.TransportError as exc:
            raise _unreachable(exc) from exc
        if resp.status_code >= 400:
            try:
                body = await _head_of(resp.aiter_bytes())
            finally:
                await resp.aclose()
            raise box_error(resp.status_code, body)
        return resp

    async def execute(
        self,
        command: str,
        *,
        timeout: float | None = 60.0,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        shell: str = "/bin/bash",
        command_id: str | None = None,
    ) -> dict[str, Any]:
        """``POST /execute``: ``{stdout, stderr, exit_code, …}`` (``command_id``: what a
        later ``reconnect`` on ``/execute/ws`` names it by)."""
        body: dict[str, Any] = {"command": command, "shell": shell}
        if command_id is not None:
            body["command_id"] = command_id
        if timeout is not None:
            body["timeout"] = timeout
        if env:
            body["env"] = dict(env)
        if cwd is not None:
            body["cwd"] = cwd
        wait = None if timeout is None else timeout + 30.0
        resp = await self.request("POST", "/execute", json_body=body, timeout=wait)
        doc = resp.json()
        if not isinstance(doc, dict):
            raise ProviderUnavailable("the hosted box answered an unexpected body")
        return doc

    async def run(self, command: str, *, timeout: float = 120.0) -> dict[str, Any]:
        """A helper command of the relay's own (fs operations), no environment of the caller."""
        return await self.execute(command, timeout=timeout, cwd=self.workspace)

    async def download(self, path: str, limit: int) -> bytes:
        """The file at ``path`` whole; 413 once it is known to be larger than ``limit``
        (from its length, or as it arrives: never more than ``limit`` bytes are read)."""
        if self.wire is None:
            resp = await self.stream("GET", "/download", params={"path": path}, headers={})
            try:
                return await _capped(resp.headers.get("content-length"), resp.aiter_bytes(), limit)
            except httpx.TransportError as exc:
                raise _unreachable(exc) from exc
            finally:
                await resp.aclose()
        url = f"{self.url}/download?{urlencode({'path': path})}"
        try:
            async with self.wire.stream(
                "GET", url, headers=self._wire_headers, deadline=Deadline(120.0)
            ) as answer:
                if answer.status_code >= 400:
                    body = await _head_of(answer.aiter_bytes())
                    raise box_error(answer.status_code, body)
                length = answer.headers.get("content-length")
                return await _capped(length, answer.aiter_bytes(), limit)
        except RequestTimeout as exc:
            raise ProviderUnavailable("the hosted box did not answer in time") from exc
        except TransportError as exc:
            raise ProviderUnavailable("the hosted box is unreachable") from exc

    async def exists(self, path: str) -> bool:
        """Whether ``path`` is a file in the box (``HEAD /download``)."""
        try:
            await self.request("HEAD", "/download", params={"path": path}, timeout=30.0)
        except FileNotFound:
            return False
        return True

    async def upload(
        self, path: str, data: bytes | AsyncIterator[bytes], size: int | None = None
    ) -> None:
        """``POST /upload`` of ``data`` as the multipart field ``file``, passed on as it
        comes (``size``: its length when known, so the box is told the body's length)."""
        boundary = secrets.token_hex(16)
        name = _form_quote(posixpath.basename(path) or "file")
        head = (
            f"--{boundary}\r\n"
            f'Content-Disposition: form-data; name="file"; filename="{name}"\r\n'
            "Content-Type: application/octet-stream\r\n\r\n"
        ).encode()
        tail = f"\r\n--{boundary}--\r\n".encode()
        if isinstance(data, bytes):
            size = len(data)
        headers = {**self._headers, "Content-Type": f"multipart/form-data; boundary={boundary}"}
        if size is not None:
            headers["Content-Length"] = str(len(head) + size + len(tail))

        async def body() -> AsyncIterator[bytes]:
            yield head
            if isinstance(data, bytes):
                yield data
            else:
                async for chunk in data:
                    yield chunk
            yield tail

        try:
            resp = await self.transfers.request(
                "POST",
                f"{self.url}/upload",
                params={"path": path},
                content=body(),
                headers=headers,
                timeout=STREAM_TIMEOUT,
            )
        except httpx.TransportError as exc:
            raise _unreachable(exc) from exc
        if resp.status_code >= 400:
            raise box_error(resp.status_code, resp.content[:MAX_ERROR_BODY])

    # --- WebSocket ----------------------------------------------------------------------

    async def execute_ws(self) -> ClientConnection:
        """A connection to the box's ``/execute/ws`` (a redirect is refused, not followed)."""
        ws_url = "ws" + self.url[4:] if self.url.startswith("http") else self.url
        try:
            return await _NoRedirects(
                f"{ws_url}/execute/ws",
                additional_headers=self.headers,
                compression=None,
                max_size=MAX_FRAME_BYTES,
                ping_interval=20,
                open_timeout=10,
                user_agent_header=None,
            )
        except InvalidStatus as exc:
            if 300 <= exc.response.status_code < 400:
                raise ProviderUnavailable(
                    "the hosted box's /execute/ws answered a redirect, which is not followed"
                ) from None
            raise ProviderUnavailable("the hosted box's /execute/ws is unreachable") from exc
        except Exception as exc:
            raise ProviderUnavailable("the hosted box's /execute/ws is unreachable") from exc


class _NoRedirects(connect):
    """websockets' ``connect`` that follows no redirect: the request carries the key,
    which must reach the box's own address only."""

    def process_redirect(self, exc: Exception) -> Exception | str:
        return exc


def _unreachable(exc: httpx.TransportError) -> ProviderUnavailable:
    if isinstance(exc, httpx.PoolTimeout):
        return ProviderUnavailable(
            "every connection to the hosted service is busy; retry shortly", retry_after=1.0
        )
    return ProviderUnavailable("the hosted box is unreachable")


async def _head_of(chunks: AsyncIterator[bytes]) -> bytes:
    """The start of an error answer (what :func:`box_error` reads of it), not all of it."""
    body = bytearray()
    async for chunk in chunks:
        body += chunk
        if len(body) >= MAX_ERROR_BODY:
            break
    return bytes(body[:MAX_ERROR_BODY])


async def _capped(length: str | None, chunks: AsyncIterator[bytes], limit: int) -> bytes:
    too_large = PayloadTooLarge(
        f"file larger than {limit} bytes: too large for the relay to read whole",
        metadata={"limit": limit},
    )
    if length is not None and length.isdigit() and int(length) > limit:
        raise too_large
    data = bytearray()
    async for chunk in chunks:
        data += chunk
        if len(data) > limit:
            raise too_large
    return bytes(data)


def _form_quote(name: str) -> str:
    """A file name as a multipart parameter value (as browsers and httpx write it)."""
    out = name.replace("\\", "\\\\").replace('"', "%22")
    return "".join(c if ord(c) >= 0x20 or c == "\x1b" else f"%{ord(c):02X}" for c in out)


def box_error(status: int, body: bytes) -> SandlotError:
    """What a box's error answer means to the relay's caller."""
    if status in (401, 403):
        return ProviderUnavailable("the hosted sandbox service refused the provider's key")
    code, message = "", ""
    try:
        doc = json.loads(body)
        err = doc.get("error") if isinstance(doc, dict) else None
        if isinstance(err, dict):
            code, message = str(err.get("code") or ""), str(err.get("message") or "")
        elif isinstance(doc, dict) and isinstance(doc.get("detail"), str):
            message = doc["detail"]
    except ValueError:
        pass
    if status == 404 and code in ("", "NOT_FOUND", "FILE_NOT_FOUND"):
        return FileNotFound(message[:300] or "no such file")
    if status >= 500:
        return ProviderUnavailable(f"the hosted box failed ({status})")
    cls = exception_for(code, status)
    return cls(message[:300] or f"the hosted box answered {status}")


__all__ = ["Box", "box_error", "q"]
