"""The LangSmith-compatible surface of PROTOCOL.md 3.9 (dataplane part).

Same services, LangSmith's shapes: ``POST /execute`` answers
``{stdout, stderr, exit_code}``, ``/upload`` takes the multipart field
``file``, ``/download`` streams (Range, HEAD), ``/glob`` and ``/grep`` take
the 3.6 bodies. ``/execute/ws`` lives in :mod:`sandlot.dataplane.websockets`.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from sandlot.dataplane.routes import run_exec
from sandlot.dataplane.transfer import download, upload
from sandlot.dataplane.web import Api, endpoint, json_response, parse_json
from sandlot.protocol.common import Capability
from sandlot.protocol.dataplane import GlobRequest


def build_langsmith_routes(api: Api, fs_routes: dict[str, Route]) -> list[Route]:
    @endpoint
    async def execute(request: Request) -> Response:
        result = await run_exec(api, request)
        return json_response(
            {
                "stdout": result["stdout"],
                "stderr": result["stderr"],
                "exit_code": result["exit_code"],
                "command_id": result["command_id"],
                "timed_out": result["timed_out"],
            }
        )

    @endpoint
    async def upload_route(request: Request) -> Response:
        return await upload(api, request)

    @endpoint
    async def download_route(request: Request) -> Response:
        return await download(api, request)

    @endpoint
    async def glob(request: Request) -> Response:
        entry, _ = await api.auth(request, Capability.FS_READ)
        _, _, executor, files = entry.ready()
        body = await parse_json(request, GlobRequest)

        def run() -> bytes:
            return files.glob_json(
                body.pattern,
                body.path,
                relative=True,
                include_dirs=True,
                limit=body.limit,
                size_bytes=True,
            )

        return Response(await executor.heavy(run), media_type="application/json")

    return [
        Route("/execute", execute, methods=["POST"]),
        Route("/upload", upload_route, methods=["POST", "PUT"]),
        Route("/download", download_route, methods=["GET", "HEAD"]),
        Route("/glob", glob, methods=["POST"]),
        Route("/grep", fs_routes["/fs/grep"].endpoint, methods=["POST"]),
    ]
