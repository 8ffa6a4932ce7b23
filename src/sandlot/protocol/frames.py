"""WebSocket frames of the dataplane (PROTOCOL.md 3.2, 3.4, 3.7, 3.9).

Client frames are validated with the models below (:func:`parse_client_frame`);
server frames are plain dicts built by the small constructors at the end,
because they sit on the hot path of every byte a command prints.

Output ``data`` is text. Offsets count bytes of the stream as the process
wrote them. Every chunk the server sends starts and ends on a UTF-8 character
boundary, and every byte that is not valid UTF-8 is sent as one ``?``, so that
``offset + len(data.encode("utf-8"))`` is always the offset of the next chunk:
a client resumes exactly where it stopped. A frame that had to replace bytes
says how many in ``replaced``.
"""

# No ``from __future__ import annotations``: pydantic would compile and evaluate each
# field's annotation string when its model is defined (a quarter of the time this
# module takes to import, for every process that imports it).

import sys
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, AliasChoices, Field, TypeAdapter

from sandlot.protocol.common import DEFERRED, WireModel, build_models
from sandlot.protocol.dataplane import Command

MAX_FRAME_TEXT = 1 << 20


def _utf8(text: str) -> str:
    """Text a process can be sent: JSON's ``\\ud800`` escapes decode to lone surrogates,
    which have no UTF-8 form."""
    try:
        text.encode()
    except UnicodeEncodeError:
        raise ValueError("not valid UTF-8 text (a lone surrogate)") from None
    return text


#: Input for a process: text with a UTF-8 form.
InputText = Annotated[str, AfterValidator(_utf8)]


class AuthFrame(WireModel):
    type: Literal["auth"]
    token: str = Field(max_length=16384)


class StartFrame(WireModel):
    type: Literal["start"]
    command: Command
    shell: str = Field(default="/bin/bash", min_length=1, max_length=4096)
    env: dict[str, str] = Field(default_factory=dict)
    cwd: str | None = Field(default=None, max_length=4096)
    pty: bool = False
    cols: int = Field(default=80, ge=1, le=1000)
    rows: int = Field(default=24, ge=1, le=1000)
    timeout_seconds: float | None = Field(
        default=None, gt=0, le=86400, validation_alias=AliasChoices("timeout_seconds", "timeout")
    )
    command_id: str | None = Field(default=None, min_length=1, max_length=200)
    kill_on_disconnect: bool = False
    stdin: InputText | None = None


class AttachFrame(WireModel):
    type: Literal["attach"]
    exec_id: str | None = Field(default=None, max_length=200)
    command_id: str | None = Field(default=None, max_length=200)
    stdout_offset: int = Field(default=0, ge=0)
    stderr_offset: int = Field(default=0, ge=0)
    #: Shells: the single output stream.
    offset: int | None = Field(default=None, ge=0)


class StdinFrame(WireModel):
    type: Literal["stdin", "input"]
    data: InputText = Field(max_length=MAX_FRAME_TEXT)


class CloseStdinFrame(WireModel):
    type: Literal["close_stdin"]


class ResizeFrame(WireModel):
    type: Literal["resize"]
    cols: int = Field(ge=1, le=1000)
    rows: int = Field(ge=1, le=1000)


class SignalFrame(WireModel):
    type: Literal["signal"]
    signal: str = Field(default="SIGINT", min_length=1, max_length=16)


class PingFrame(WireModel):
    type: Literal["ping"]


class CloseFrame(WireModel):
    type: Literal["close"]


# --- LangSmith-compatible /execute/ws -------------------------------------------------


class ExecuteFrame(WireModel):
    type: Literal["execute"]
    command: Command
    shell: str = Field(default="/bin/bash", min_length=1, max_length=4096)
    env: dict[str, str] = Field(default_factory=dict)
    cwd: str | None = Field(default=None, max_length=4096)
    pty: bool = False
    timeout_seconds: float | None = Field(
        default=None, ge=0, le=86400, validation_alias=AliasChoices("timeout_seconds", "timeout")
    )
    command_id: str | None = Field(default=None, min_length=1, max_length=200)
    kill_on_disconnect: bool = False
    #: Close the command's stdin right after it starts.
    close_stdin: bool = False


class KillFrame(WireModel):
    type: Literal["kill"]


class ReconnectFrame(WireModel):
    type: Literal["reconnect"]
    command_id: str = Field(min_length=1, max_length=200)
    stdout_offset: int = Field(default=0, ge=0)
    stderr_offset: int = Field(default=0, ge=0)


ClientFrame = Annotated[
    AuthFrame
    | StartFrame
    | AttachFrame
    | StdinFrame
    | CloseStdinFrame
    | ResizeFrame
    | SignalFrame
    | PingFrame
    | CloseFrame
    | ExecuteFrame
    | KillFrame
    | ReconnectFrame,
    Field(discriminator="type"),
]

#: Built on the first frame (as every wire model is: :data:`~sandlot.protocol.common.DEFERRED`).
_CLIENT_FRAME: TypeAdapter[ClientFrame] = TypeAdapter(ClientFrame, config=DEFERRED)


def build() -> None:
    """Build the frames' validators now (see :func:`~sandlot.protocol.common.build_models`)."""
    build_models(sys.modules[__name__])
    _CLIENT_FRAME.rebuild()


def parse_client_frame(text: str | bytes) -> ClientFrame:
    """Validate one client frame (raises ``pydantic.ValidationError``)."""
    return _CLIENT_FRAME.validate_json(text)


# --- server frames ----------------------------------------------------------------------

Stream = Literal["stdout", "stderr"]


def output_frame(stream: str, data: str, offset: int, replaced: int = 0) -> dict[str, Any]:
    frame: dict[str, Any] = {"type": stream, "data": data, "offset": offset}
    if replaced:
        frame["replaced"] = replaced
    return frame


def gap_frame(stream: str, start: int, end: int) -> dict[str, Any]:
    """Bytes ``[start, end)`` of ``stream`` are no longer held and will never be sent."""
    return {"type": "gap", "stream": stream, "from": start, "to": end}


def error_frame(code: str, message: str, retryable: bool = False) -> dict[str, Any]:
    return {"type": "error", "code": code, "message": message, "retryable": retryable}


def langsmith_error_frame(error_type: str, message: str) -> dict[str, Any]:
    return {"type": "error", "error_type": error_type, "error": message}


AUTH_OK: dict[str, Any] = {"type": "auth_ok"}
PONG: dict[str, Any] = {"type": "pong"}
