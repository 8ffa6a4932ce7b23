"""The WebSocket protocol the servers run: uvicorn's ``websockets-sansio`` (its ``auto``
choice), with a refused handshake counted as complete once its answer is sent.

The web app refuses a WebSocket handshake (a foreign or missing ``Origin``, no session)
with an HTTP answer carrying the error envelope, through the ASGI denial-response
extension (``websocket.http.response.start`` and ``…body``). uvicorn's implementation
writes that answer and closes the connection, but leaves its handshake marked
incomplete: when the app then returns, it logs ``ERROR ASGI callable returned without
completing handshake.`` for every refusal, so anyone could fill the server's log with
errors. Its ``websocket.close`` before ``accept`` (a bare 403) does mark the handshake
complete; the denial answer is marked the same way here, once its last body part is sent.
"""

from __future__ import annotations

from uvicorn._types import ASGISendEvent
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol


class WebSocketProtocol(WebSocketsSansIOProtocol):
    """uvicorn's ``websockets-sansio`` protocol; a denial answer sent completes the
    handshake (see the module's docstring)."""

    async def send(self, message: ASGISendEvent) -> None:
        await super().send(message)
        if message["type"] == "websocket.http.response.body" and not message.get("more_body"):
            self.handshake_complete = True


__all__ = ["WebSocketProtocol"]
