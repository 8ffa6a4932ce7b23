"""The LangSmith-compatible surface of PROTOCOL.md 3.9 (dataplane part).

Same services, LangSmith's shapes: ``POST /execute`` answers
``{stdout, stderr, exit_code}``, ``/upload`` takes the multipart field
``file``, ``/download`` streams (Range, HEAD), ``/glob`` and ``/grep`` take
the 3.6 bodies. ``/execute/ws`` lives in :mod:`sandlot.dataplane.http.websockets`;
the routes themselves in :data:`sandlot.dataplane.http.app.ROUTES`.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from sandlot.dataplane.http.routes import run_exec
from sandlot.dataplane.http.web import authorize, endpoint, json_response, parse_json
from sandlot.protocol.common import Capability
from sandlot.protocol.dataplane import (
    ExecRequest,
    GlobRequest,
    GlobResponse,
    LangSmithExecuteResponse,
)


@endpoint(ok=LangSmithExecuteResponse, body=ExecRequest)
async def execute(request: Request) -> Response:
    """Run a command to completion (LangSmith)."""
    result = await run_exec(request)
    return json_response(
        LangSmithExecuteResponse(
            stdout=result.stdout,
            stderr=result.stderr,
            exit_code=result.exit_code,
            command_id=result.command_id,
            timed_out=result.timed_out,
        )
    )


@endpoint(ok=GlobResponse, body=GlobRequest)
async def glob(request: Request) -> Response:
    """Files matching a glob pattern, relative to the path (LangSmith)."""
    entry, _ = await authorize(request, Capability.FS_READ)
    sandbox = entry.ready()
    body = await parse_json(request, GlobRequest)

    def run() -> bytes:
        return sandbox.files.glob_json(
            body.pattern,
            body.path,
            relative=True,
            include_dirs=True,
            limit=body.limit,
            size_bytes=True,
        )

    return Response(await sandbox.executor.heavy(run), media_type="application/json")
