"""One browser request's calls to its workspace's dataplane, through the gateway.

:class:`DataplaneCalls` builds each call's URL from the workspace's dataplane (``/fs/read``
under its ``http_base_url``), sends it through the :class:`~sandlot.web.gateway.Gateway`
with the token the server holds and the browser's request id, and parses the JSON answer.
A token the dataplane refuses (expired or revoked early) is renewed once and the call
sent again; refused again, the browser is told the workspace is unavailable, never that
its own sign-in failed.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Mapping
from typing import Any
from urllib.parse import quote, urlencode

from sandlot.protocol.errors import InvalidRequest, ProviderUnavailable, Unauthenticated
from sandlot.web.gateway import Answer, Gateway, UpstreamStream
from sandlot.web.workspace import Dataplane, Workspace


class DataplaneCalls:
    """Calls to ``workspace``'s dataplane for one browser request (``request_id``)."""

    def __init__(self, gateway: Gateway, workspace: Workspace, request_id: str) -> None:
        self.gateway = gateway
        self.workspace = workspace
        self.request_id = request_id

    def url(self, dataplane: Dataplane, path: str, params: Mapping[str, Any] | None) -> str:
        url = dataplane.http_base_url + path
        if params:
            try:
                query = urlencode(
                    {k: v for k, v in params.items() if v is not None}, quote_via=quote
                )
            except UnicodeEncodeError:
                raise InvalidRequest("a parameter is not valid UTF-8") from None
            url += "?" + query
        return url

    async def call(
        self,
        method: str,
        path: str,
        *,
        params: Mapping[str, Any] | None = None,
        body: Any = None,
        idempotent: bool = False,
        max_bytes: int | None = None,
    ) -> Answer:
        """Send a call (``body`` as JSON) and return its whole 2xx answer."""
        headers = {"X-Request-Id": self.request_id}
        content: bytes | None = None
        if body is not None:
            content = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        dataplane = await self.workspace.dataplane()
        for attempt in (1, 2):
            try:
                return await self.gateway.request(
                    method,
                    self.url(dataplane, path, params),
                    token=dataplane.token,
                    headers=headers,
                    content=content,
                    idempotent=idempotent,
                    max_bytes=max_bytes,
                )
            except Unauthenticated:
                if attempt == 2:
                    raise ProviderUnavailable(
                        "the workspace refused this server's credentials",
                        metadata={"reason": "dataplane_auth"},
                    ) from None
                dataplane = await self.workspace.renewed()
        raise AssertionError("unreachable")

    @contextlib.asynccontextmanager
    async def stream(
        self,
        path: str,
        *,
        params: Mapping[str, Any] | None = None,
        accept: str | None = None,
        max_bytes: int | None = None,
        long_lived: bool = False,
    ) -> AsyncIterator[UpstreamStream]:
        """A ``GET`` whose answer's body is read as it arrives (token renewed as in
        :meth:`call`, before the body starts; ``long_lived`` as the gateway's)."""
        headers = {"X-Request-Id": self.request_id}
        if accept:
            headers["Accept"] = accept
        dataplane = await self.workspace.dataplane()
        async with contextlib.AsyncExitStack() as stack:
            for attempt in (1, 2):
                try:
                    answer = await stack.enter_async_context(
                        self.gateway.stream(
                            "GET",
                            self.url(dataplane, path, params),
                            token=dataplane.token,
                            headers=headers,
                            max_bytes=max_bytes,
                            long_lived=long_lived,
                        )
                    )
                    break
                except Unauthenticated:
                    if attempt == 2:
                        raise ProviderUnavailable(
                            "the workspace refused this server's credentials",
                            metadata={"reason": "dataplane_auth"},
                        ) from None
                    dataplane = await self.workspace.renewed()
            yield answer

    async def json(
        self,
        method: str,
        path: str,
        *,
        params: Mapping[str, Any] | None = None,
        body: Any = None,
        idempotent: bool = False,
        max_bytes: int | None = None,
    ) -> Any:
        """:meth:`call`, its answer parsed as JSON."""
        answer = await self.call(
            method,
            path,
            params=params,
            body=body,
            idempotent=idempotent,
            max_bytes=max_bytes,
        )
        try:
            return answer.json()
        except ValueError:
            raise ProviderUnavailable(
                "the workspace answered something unreadable", metadata={"reason": "bad_answer"}
            ) from None
