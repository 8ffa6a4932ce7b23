"""Credential headers masked in the ``websockets`` library's debug dump of a handshake.

At DEBUG, ``websockets`` logs every header of a handshake it sends or receives
(``> Authorization: Bearer …``, ``< cookie: …``), one record per header, with the
arguments ``(name, value)``. :class:`CredentialHeaders` rewrites the
value of the credential headers to ``[redacted]``, whoever configured the logging: the
gateway's WebSocket client logs through a logger carrying it, and the local folder's
dataplane, served by uvicorn in the web server's process, adds it to ``uvicorn.error``
(where uvicorn's WebSocket server logs), so the dataplane token the web server sends it
never reaches a log line.
"""

from __future__ import annotations

import logging

#: The headers whose values are masked.
CREDENTIAL_HEADERS = frozenset({"authorization", "cookie", "x-api-key", "proxy-authorization"})


class CredentialHeaders(logging.Filter):
    """Masks the value of a credential header in a handshake dump's record."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if (
            isinstance(args, tuple)
            and len(args) == 2
            and str(args[0]).lower() in CREDENTIAL_HEADERS
        ):
            record.args = (args[0], "[redacted]")
        return True


#: The one instance (``Logger.addFilter`` adds an instance once).
MASK = CredentialHeaders()
