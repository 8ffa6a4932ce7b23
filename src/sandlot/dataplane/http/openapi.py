"""The dataplane's OpenAPI document (PROTOCOL.md section 3), drawn from its route table.

It is served at ``{http_base_url}/openapi.json``; its paths are relative to that
base URL, as clients append them. Each operation is what its endpoint declared
with :func:`~sandlot.dataplane.http.web.endpoint`: the summary is the endpoint's
docstring, bodies and answers are the wire models of :mod:`sandlot.protocol.dataplane`.
The WebSocket routes (``/exec/ws``, ``/execute/ws``, ``/shell/ws``, ``/events/ws``)
are not in it: OpenAPI cannot describe them.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel
from starlette.routing import BaseRoute, Route

from sandlot import __version__
from sandlot.dataplane.http.web import Answer, Operation, operation_of
from sandlot.protocol.openapi import error_responses, json_body, json_content

_PARAM = re.compile(r"{([^}:]+)(?::[^}]*)?}")
_DESCRIPTIONS = {200: "OK", 201: "Created", 204: "No content"}


def _response(status: int, answer: Answer) -> dict[str, Any]:
    if isinstance(answer, dict):
        return answer
    return {"description": _DESCRIPTIONS.get(status, "OK"), "content": json_content(answer)}


def _operation(path: str, op: Operation) -> dict[str, Any]:
    out: dict[str, Any] = {
        "summary": op.summary,
        "responses": {str(s): _response(s, a) for s, a in sorted(op.responses.items())},
    }
    if not op.public:
        out["responses"].update(error_responses())
    params = [
        {"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
        for name in _PARAM.findall(path)
    ]
    params += [
        {"name": p.name, "in": p.where, "required": p.required, "schema": p.schema}
        for p in op.params
    ]
    if params:
        out["parameters"] = params
    if isinstance(op.body, dict):
        out["requestBody"] = op.body
    elif isinstance(op.body, type) and issubclass(op.body, BaseModel):
        out.update(json_body(op.body))
    return out


def paths(routes: Sequence[BaseRoute]) -> dict[str, dict[str, Any]]:
    """The ``paths`` of the document: every HTTP route whose endpoint declared itself."""
    found: dict[str, dict[str, Any]] = {}
    for route in routes:
        if not isinstance(route, Route):
            continue  # WebSockets
        op = operation_of(route.endpoint)
        if op is None:
            continue
        for method in sorted(route.methods or ()):
            if method == "HEAD" and not op.head:
                continue
            found.setdefault(route.path, {})[method.lower()] = _operation(route.path, op)
    return found


_cache: dict[int, dict[str, Any]] = {}


def document(routes: Sequence[BaseRoute]) -> dict[str, Any]:
    """The document for ``routes`` (built once per route table)."""
    key = id(routes)
    if key not in _cache:
        _cache[key] = {
            "openapi": "3.1.0",
            "info": {
                "title": "sandlot dataplane",
                "version": __version__,
                "description": "One sandbox's dataplane (PROTOCOL.md section 3). Every "
                "operation but the version takes the sandbox token as "
                "'Authorization: Bearer'.",
            },
            "paths": paths(routes),
        }
    return _cache[key]


__all__ = ["document", "paths"]
