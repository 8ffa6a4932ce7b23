"""The one error tree and the one table mapping wire code ↔ HTTP status ↔ class.

Every server (broker, dataplane) raises these; every client (SDK, CLI) gets
them back from the wire through :func:`error_from_wire`. The tree::

    SandlotError
    ├── InvalidRequest                 400 INVALID_REQUEST
    ├── Unauthenticated                401 UNAUTHENTICATED
    │   └── TokenExpired               401 TOKEN_EXPIRED
    ├── Forbidden                      403 FORBIDDEN
    │   ├── CapabilityDenied           403 CAPABILITY_DENIED
    │   └── PermissionDenied           403 PERMISSION_DENIED (file mode bits inside the sandbox)
    ├── NotFound                       404
    │   ├── SessionNotFound            404 SESSION_NOT_FOUND   (alias BINDING_NOT_FOUND)
    │   ├── SandboxNotFound            404 SANDBOX_NOT_FOUND
    │   ├── ExecNotFound               404 EXEC_NOT_FOUND
    │   ├── FileNotFound               404 FILE_NOT_FOUND
    │   └── ResourceNotFound           404 NOT_FOUND (templates, pools, volumes, keys, routes)
    ├── Conflict                       409
    │   ├── SessionConflict            409 SESSION_CONFLICT    (alias BINDING_CONFLICT)
    │   ├── IdempotencyInFlight        409 IDEMPOTENCY_IN_FLIGHT (retryable)
    │   ├── PreconditionFailed         409 PRECONDITION_FAILED
    │   └── ResourceConflict           409 CONFLICT (a name already taken, a state that forbids it)
    ├── Gone                           410
    │   ├── SessionExpired             410 SESSION_EXPIRED
    │   └── SequenceExpired            410 SEQUENCE_EXPIRED
    ├── PayloadTooLarge                413 PAYLOAD_TOO_LARGE
    ├── IdempotencyKeyReused           422 IDEMPOTENCY_KEY_REUSED
    ├── SandboxStarting                423 SANDBOX_STARTING (retryable, Retry-After)
    ├── RateLimited                    429 RATE_LIMITED (retryable, Retry-After)
    ├── QuotaExceeded                  429 QUOTA_EXCEEDED
    ├── InternalError                  500 INTERNAL
    ├── ProviderUnavailable            503 PROVIDER_UNAVAILABLE (alias BACKEND_UNAVAILABLE)
    ├── CommandExitError               (SDK only: a command exited non-zero; carries its result)
    ├── ProtocolVersionError           (SDK only: the server speaks another major protocol version)
    └── TransportError                 (SDK only: the exchange itself failed; retryable)
        ├── ConnectError               the server could not be reached (also a ConnectionError)
        ├── ConnectionLost             the connection broke mid-exchange (also a ConnectionError)
        ├── SocketClosed               a WebSocket ended early (also a ConnectionError)
        └── RequestTimeout             a deadline passed (also a TimeoutError)

The transport errors are also the builtin exceptions they are, so code written
against ``ConnectionError`` or ``TimeoutError`` keeps working; one ``except
SandlotError`` catches everything the SDK raises.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar


class SandlotError(Exception):
    """Root of every sandlot error, on the server and in the SDK.

    ``code`` is the wire code, ``status`` the HTTP status; ``metadata`` carries
    what a caller needs to act (the denied capability, the current etag, …).
    """

    code: ClassVar[str] = "INTERNAL"
    status: ClassVar[int] = 500
    retryable: ClassVar[bool] = False

    def __init__(
        self,
        message: str = "",
        *,
        metadata: dict[str, Any] | None = None,
        request_id: str | None = None,
        retry_after: float | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message or self.code)
        self.message = message or self.code
        self.metadata: dict[str, Any] = dict(metadata or {})
        self.request_id = request_id
        self.retry_after = retry_after
        # A subclass may be raised under an aliased or more specific code
        # (TOKEN_EXPIRED under Unauthenticated, for example).
        self.wire_code = code or self.code

    def to_wire(self, request_id: str | None = None) -> dict[str, Any]:
        """The error envelope of PROTOCOL.md section 1."""
        return {
            "error": {
                "code": self.wire_code,
                "message": self.message,
                "retryable": self.retryable,
                "request_id": request_id or self.request_id,
                "domain": "sandlot",
                "metadata": self.metadata,
            }
        }

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.wire_code}: {self.message!r})"


class InvalidRequest(SandlotError):
    code, status = "INVALID_REQUEST", 400


class Unauthenticated(SandlotError):
    code, status = "UNAUTHENTICATED", 401


class TokenExpired(Unauthenticated):
    code = "TOKEN_EXPIRED"


class Forbidden(SandlotError):
    code, status = "FORBIDDEN", 403


class CapabilityDenied(Forbidden):
    code = "CAPABILITY_DENIED"


class PermissionDenied(Forbidden):
    code = "PERMISSION_DENIED"


class NotFound(SandlotError):
    code, status = "NOT_FOUND", 404


class SessionNotFound(NotFound):
    code = "SESSION_NOT_FOUND"


class SandboxNotFound(NotFound):
    code = "SANDBOX_NOT_FOUND"


class ExecNotFound(NotFound):
    code = "EXEC_NOT_FOUND"


class FileNotFound(NotFound):
    code = "FILE_NOT_FOUND"


class ResourceNotFound(NotFound):
    code = "NOT_FOUND"


class Conflict(SandlotError):
    code, status = "CONFLICT", 409


class SessionConflict(Conflict):
    code = "SESSION_CONFLICT"


class IdempotencyInFlight(Conflict):
    code, retryable = "IDEMPOTENCY_IN_FLIGHT", True


class PreconditionFailed(Conflict):
    code = "PRECONDITION_FAILED"


class ResourceConflict(Conflict):
    code = "CONFLICT"


class Gone(SandlotError):
    code, status = "GONE", 410


class SessionExpired(Gone):
    code = "SESSION_EXPIRED"


class SequenceExpired(Gone):
    code = "SEQUENCE_EXPIRED"


class PayloadTooLarge(SandlotError):
    code, status = "PAYLOAD_TOO_LARGE", 413


class IdempotencyKeyReused(SandlotError):
    code, status = "IDEMPOTENCY_KEY_REUSED", 422


class SandboxStarting(SandlotError):
    code, status, retryable = "SANDBOX_STARTING", 423, True


class RateLimited(SandlotError):
    code, status, retryable = "RATE_LIMITED", 429, True


class QuotaExceeded(SandlotError):
    code, status = "QUOTA_EXCEEDED", 429


class InternalError(SandlotError):
    code, status = "INTERNAL", 500


class NotSupported(SandlotError):
    """The sandbox's provider cannot do this operation (a hosted box served through the relay)."""

    code, status = "NOT_SUPPORTED", 501


class ProviderUnavailable(SandlotError):
    code, status, retryable = "PROVIDER_UNAVAILABLE", 503, True


class CommandExitError(SandlotError):
    """A command run with ``check=True`` exited non-zero; ``result`` is its full result."""

    code, status = "COMMAND_EXIT", 0

    def __init__(self, result: Any, message: str = "") -> None:
        exit_code = getattr(result, "exit_code", None)
        super().__init__(message or f"command exited with {exit_code}")
        self.result = result
        self.exit_code = exit_code


class ProtocolVersionError(SandlotError):
    """A server's answer carries a ``protocol_version`` of another major version.

    Raised before the answer is used; ``server_version`` and ``client_version``
    say which versions met (also in ``metadata``).
    """

    code, status = "PROTOCOL_VERSION", 0

    def __init__(self, server_version: str, client_version: str, message: str = "") -> None:
        super().__init__(
            message
            or f"the server speaks sandlot protocol {server_version}, this client speaks "
            f"{client_version}: their major versions differ (use a client made for that server)",
            metadata={"server_version": server_version, "client_version": client_version},
        )
        self.server_version = server_version
        self.client_version = client_version


class TransportError(SandlotError):
    """The exchange with a server failed on the way (never sent by a server)."""

    code, status, retryable = "TRANSPORT", 0, True


class ConnectError(TransportError, ConnectionError):
    """The server could not be reached: nothing was sent."""

    code = "CONNECT_FAILED"


class ConnectionLost(TransportError, ConnectionError):
    """The connection broke, or the server spoke broken HTTP, in the middle of an exchange."""

    code = "CONNECTION_LOST"


class SocketClosed(TransportError, ConnectionError):
    """A WebSocket to the dataplane closed or broke before its end.

    ``close_code`` is the close code the server sent (``None`` when the connection
    just broke). Streams and commands reattach by themselves; this reaches
    callers only once their reconnect budget is spent.
    """

    code = "SOCKET_CLOSED"

    def __init__(self, message: str, close_code: int | None = None) -> None:
        super().__init__(message, metadata={"close_code": close_code})
        self.close_code = close_code


class RequestTimeout(TransportError, TimeoutError):
    """A deadline passed before the answer (or the next frame) came."""

    code = "TIMEOUT"


@dataclass(frozen=True)
class ErrorRow:
    code: str
    status: int
    exception: type[SandlotError]
    retryable: bool


def _row(cls: type[SandlotError], code: str | None = None) -> ErrorRow:
    return ErrorRow(code or cls.code, cls.status, cls, cls.retryable)


#: The one table: wire code → (HTTP status, exception class, retryable).
ERROR_TABLE: dict[str, ErrorRow] = {
    row.code: row
    for row in (
        _row(InvalidRequest),
        _row(Unauthenticated),
        _row(TokenExpired),
        _row(Forbidden),
        _row(CapabilityDenied),
        _row(PermissionDenied),
        _row(SessionNotFound),
        _row(SessionNotFound, "BINDING_NOT_FOUND"),
        _row(SandboxNotFound),
        _row(ExecNotFound),
        _row(FileNotFound),
        _row(ResourceNotFound),
        _row(SessionConflict),
        _row(SessionConflict, "BINDING_CONFLICT"),
        _row(IdempotencyInFlight),
        _row(PreconditionFailed),
        _row(ResourceConflict),
        _row(SessionExpired),
        _row(SequenceExpired),
        _row(PayloadTooLarge),
        _row(IdempotencyKeyReused),
        _row(SandboxStarting),
        _row(RateLimited),
        _row(QuotaExceeded),
        _row(InternalError),
        _row(NotSupported),
        _row(ProviderUnavailable),
        _row(ProviderUnavailable, "BACKEND_UNAVAILABLE"),
    )
}

_FALLBACK_BY_STATUS: dict[int, type[SandlotError]] = {
    400: InvalidRequest,
    401: Unauthenticated,
    403: Forbidden,
    404: ResourceNotFound,
    405: InvalidRequest,
    409: ResourceConflict,
    410: Gone,
    413: PayloadTooLarge,
    422: InvalidRequest,
    423: SandboxStarting,
    429: RateLimited,
    501: NotSupported,
    503: ProviderUnavailable,
}


def exception_for(code: str, status: int | None = None) -> type[SandlotError]:
    """The exception class of a wire code (falling back on the HTTP status)."""
    row = ERROR_TABLE.get(code)
    if row is not None:
        return row.exception
    if status is not None:
        return _FALLBACK_BY_STATUS.get(status, InternalError)
    return InternalError


def error_from_wire(body: Any, status: int, *, retry_after: float | None = None) -> SandlotError:
    """Rebuild the typed exception from an error envelope received from a server."""
    err = body.get("error") if isinstance(body, dict) else None
    if not isinstance(err, dict):
        cls = _FALLBACK_BY_STATUS.get(status, InternalError)
        return cls(f"HTTP {status}", retry_after=retry_after)
    code = str(err.get("code") or "")
    cls = exception_for(code, status)
    metadata = err.get("metadata")
    return cls(
        str(err.get("message") or code),
        metadata=metadata if isinstance(metadata, dict) else None,
        request_id=err.get("request_id"),
        retry_after=retry_after,
        code=code or None,
    )
