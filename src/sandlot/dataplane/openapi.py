"""The dataplane's OpenAPI document (PROTOCOL.md section 3).

It is served at ``{http_base_url}/openapi.json``; its paths are relative to that
base URL, as clients append them. Bodies and answers are the wire models of
:mod:`sandlot.protocol.dataplane`. The WebSocket routes (``/exec/ws``,
``/execute/ws``, ``/shell/ws``, ``/events/ws``) are not in it: OpenAPI cannot
describe them.
"""

from __future__ import annotations

import functools
from typing import Any

from pydantic import BaseModel

from sandlot import __version__
from sandlot.protocol.dataplane import (
    ArchiveResponse,
    EditRequest,
    EditResponse,
    ExecList,
    ExecRequest,
    ExecResult,
    ExecSnapshot,
    GlobRequest,
    GlobResponse,
    GrepRequest,
    GrepResponse,
    LangSmithExecuteResponse,
    ListResponse,
    MkdirRequest,
    MoveRequest,
    PathResponse,
    ReadResponse,
    ShellList,
    SignalRequest,
    StatResponse,
    UploadResponse,
    VersionResponse,
    WriteRequest,
    WriteResponse,
)
from sandlot.protocol.openapi import (
    ERROR_RESPONSES,
    Responses,
    event_stream,
    json_body,
    json_content,
)

BINARY = {"type": "string", "format": "binary"}


def _query(name: str, schema: dict[str, Any], *, required: bool = False) -> dict[str, Any]:
    return {"name": name, "in": "query", "required": required, "schema": schema}


def _path(name: str) -> dict[str, Any]:
    return {"name": name, "in": "path", "required": True, "schema": {"type": "string"}}


def _header(name: str) -> dict[str, Any]:
    return {"name": name, "in": "header", "required": False, "schema": {"type": "string"}}


PATH = _query("path", {"type": "string", "minLength": 1}, required=True)
DIR = _query("path", {"type": "string", "default": "/workspace"})


def _ok(model: type[BaseModel], status: int = 200, description: str = "OK") -> Responses:
    return {str(status): {"description": description, "content": json_content(model)}}


def _operation(
    summary: str,
    responses: Responses,
    *,
    parameters: list[dict[str, Any]] | None = None,
    body: dict[str, Any] | None = None,
    public: bool = False,
) -> dict[str, Any]:
    op: dict[str, Any] = {"summary": summary, "responses": {**responses}}
    if not public:
        op["responses"].update(ERROR_RESPONSES)
    if parameters:
        op["parameters"] = parameters
    if body:
        op.update(body)
    return op


UPLOAD_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "application/octet-stream": {"schema": BINARY},
            "multipart/form-data": {
                "schema": {"type": "object", "required": ["file"], "properties": {"file": BINARY}}
            },
        },
    }
}


def _download(summary: str) -> dict[str, Any]:
    return {
        "summary": summary,
        "parameters": [PATH, _header("Range"), _header("If-Range"), _header("If-None-Match")],
        "responses": {
            "200": {"description": "The file", "content": {"application/octet-stream": {}}},
            "206": {
                "description": "The range asked for",
                "content": {"application/octet-stream": {}},
            },
            "304": {"description": "Unchanged since the ETag given in If-None-Match"},
            "416": {"description": "The range lies beyond the end of the file"},
            **ERROR_RESPONSES,
        },
    }


def _paths() -> dict[str, dict[str, Any]]:
    version = _operation("Server version", _ok(VersionResponse), public=True)
    exec_ = _operation("Run a command to completion", _ok(ExecResult), body=json_body(ExecRequest))
    write = _operation(
        "Write a file (conditionally with if_match / if_none_match)",
        {
            **_ok(WriteResponse, description="Overwritten"),
            **_ok(WriteResponse, 201, "Created"),
        },
        body=json_body(WriteRequest),
    )
    upload = _operation(
        "Upload a file (raw body, or the multipart field 'file')",
        _ok(UploadResponse, 201, "Stored"),
        parameters=[PATH],
        body=UPLOAD_BODY,
    )
    glob = _operation(
        "Files matching a glob pattern", _ok(GlobResponse), body=json_body(GlobRequest)
    )
    grep = _operation("Lines matching a pattern", _ok(GrepResponse), body=json_body(GrepRequest))
    return {
        "/healthz": {"get": version},
        "/__meta/version": {"get": version},
        "/exec": {"post": exec_},
        "/execs": {"get": _operation("Commands of the sandbox", _ok(ExecList))},
        "/execs/{exec_id}": {
            "get": _operation(
                "A command's snapshot", _ok(ExecSnapshot), parameters=[_path("exec_id")]
            )
        },
        "/execs/{exec_id}/signal": {
            "post": _operation(
                "Signal a running command",
                _ok(ExecSnapshot),
                parameters=[_path("exec_id")],
                body=json_body(SignalRequest),
            )
        },
        "/shells": {"get": _operation("Shared shells of the sandbox", _ok(ShellList))},
        "/shells/{name}": {
            "delete": _operation(
                "End a shared shell", {"204": {"description": "Ended"}}, parameters=[_path("name")]
            )
        },
        "/fs/list": {
            "get": _operation(
                "Entries of a directory",
                _ok(ListResponse),
                parameters=[DIR, _query("depth", {"type": "integer", "minimum": 1, "maximum": 64})],
            )
        },
        "/fs/read": {
            "get": _operation(
                "Lines of a text file (base64 for binary content)",
                _ok(ReadResponse),
                parameters=[
                    PATH,
                    _query("offset", {"type": "integer", "minimum": 0}),
                    _query("limit", {"type": "integer", "minimum": 1, "maximum": 1 << 30}),
                ],
            )
        },
        "/fs/write": {"put": write, "post": write},
        "/fs/edit": {
            "post": _operation(
                "Replace a string in a file", _ok(EditResponse), body=json_body(EditRequest)
            )
        },
        "/fs/glob": {"post": glob},
        "/fs/grep": {"post": grep},
        "/fs/stat": {
            "get": _operation("A path's type, size and mode", _ok(StatResponse), parameters=[PATH])
        },
        "/fs": {
            "delete": _operation(
                "Delete a file or a directory",
                _ok(PathResponse),
                parameters=[PATH, _query("recursive", {"type": "boolean", "default": True})],
            )
        },
        "/fs/mkdir": {
            "post": _operation(
                "Create a directory",
                {**_ok(PathResponse, description="Existed"), **_ok(PathResponse, 201, "Created")},
                body=json_body(MkdirRequest),
            )
        },
        "/fs/move": {
            "post": _operation("Move or rename", _ok(PathResponse), body=json_body(MoveRequest))
        },
        "/events": {
            "get": _operation(
                "The sandbox's events after the cursor, then live",
                event_stream("Events as Server-Sent Events"),
                parameters=[
                    _query("after", {"type": "integer", "minimum": 0}),
                    _header("Last-Event-ID"),
                ],
            )
        },
        "/files/upload": {"post": upload, "put": upload},
        "/files/download": {
            "get": _download("Download a file (Range supported)"),
            "head": _download("A download's headers"),
        },
        "/files/archive": {
            "post": _operation(
                "Extract a tar (gzip allowed) into a directory",
                _ok(ArchiveResponse),
                parameters=[DIR, _query("delete_missing", {"type": "boolean", "default": False})],
                body={
                    "requestBody": {
                        "required": True,
                        "content": {"application/x-tar": {"schema": BINARY}},
                    }
                },
            ),
            "get": _operation(
                "A directory as a tar",
                {"200": {"description": "The tar", "content": {"application/x-tar": {}}}},
                parameters=[DIR],
            ),
        },
        "/execute": {
            "post": _operation(
                "Run a command to completion (LangSmith)",
                _ok(LangSmithExecuteResponse),
                body=json_body(ExecRequest),
            )
        },
        "/upload": {"post": upload, "put": upload},
        "/download": {
            "get": _download("Download a file (LangSmith)"),
            "head": _download("A download's headers (LangSmith)"),
        },
        "/glob": {"post": glob},
        "/grep": {"post": grep},
    }


@functools.cache
def document() -> dict[str, Any]:
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "sandlot dataplane",
            "version": __version__,
            "description": "One sandbox's dataplane (PROTOCOL.md section 3). Every operation "
            "but the version takes the sandbox token as 'Authorization: Bearer'.",
        },
        "paths": _paths(),
    }


__all__ = ["document"]
