"""The workspace page: the single-page app built from ``frontend/`` (docs/WORKSPACE.md).

``GET /`` answers ``static/index.html`` with a strict Content-Security-Policy; the page's
script, styles and fonts are answered under ``/assets/NAME``. The built files ship in the
package (``src/sandlot/web/static/``, committed, checked against the sources by
``scripts/test``), so serving needs no Node.

The policy allows nothing but this origin: no inline script, no ``eval``, no request to
another host. The editor and the terminal add ``<style>`` elements of their own at run time;
those carry a nonce made afresh for each answer of ``/``, which the page reads from its
``<meta name="csp-nonce">`` (``__CSP_NONCE__`` in the built file). Assets are kept in memory,
with their gzip form. ``app.js`` and ``app.css`` keep their names between builds and are
revalidated by etag; the chunks the page loads later (``chunk-HASH.js``: the editor, its
language modes) are named by their content, so a browser keeps them without asking again.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import secrets
from dataclasses import dataclass
from pathlib import Path

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

STATIC = Path(__file__).parent / "static"
NONCE_MARK = b"__CSP_NONCE__"
TYPES = {
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".html": "text/html; charset=utf-8",
    ".txt": "text/plain; charset=utf-8",
    ".woff2": "font/woff2",
    ".svg": "image/svg+xml",
    ".json": "application/json",
}
COMMON_HEADERS = {
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cross-Origin-Opener-Policy": "same-origin",
    "Cross-Origin-Resource-Policy": "same-origin",
}


def content_security_policy(nonce: str) -> str:
    """The page's policy: this origin only; run-time ``<style>`` elements by nonce."""
    return (
        "default-src 'self'; script-src 'self'; "
        f"style-src 'self' 'nonce-{nonce}'; connect-src 'self'; "
        "img-src 'self' data: blob:; font-src 'self'; object-src 'none'; "
        "base-uri 'none'; frame-ancestors 'none'; form-action 'self'"
    )


#: The prefix of the built files named by their content (esbuild's ``chunkNames``).
CHUNK_PREFIX = "chunk-"
#: How a chunk is cached: a new build makes new names, never new bytes under an old one.
CHUNK_CACHE = "public, max-age=31536000, immutable"


@dataclass(frozen=True)
class Asset:
    body: bytes
    gzipped: bytes
    media_type: str
    etag: str


@functools.cache
def _load(directory: Path) -> dict[str, Asset]:
    """The built files of ``directory``, read and compressed once per process."""
    assets: dict[str, Asset] = {}
    if not directory.is_dir():
        return assets
    for path in sorted(directory.iterdir()):
        if not path.is_file() or path.name == "index.html":
            continue
        body = path.read_bytes()
        assets[path.name] = Asset(
            body=body,
            gzipped=gzip.compress(body, 9, mtime=0),
            media_type=TYPES.get(path.suffix, "application/octet-stream"),
            etag='"' + hashlib.sha256(body).hexdigest()[:32] + '"',
        )
    return assets


MISSING = b"""<!doctype html><html><head><meta charset="utf-8"><title>sandlot</title></head>
<body><p>This copy of sandlot was installed without its workspace page
(src/sandlot/web/static/). The API under /api and /ws works.</p></body></html>
"""


class Page:
    """The page's routes over the built files in ``directory``."""

    def __init__(self, directory: Path = STATIC) -> None:
        index = directory / "index.html"
        self.index = index.read_bytes() if index.is_file() else None
        self.assets = _load(directory)

    def routes(self) -> list[BaseRoute]:
        return [
            Route("/", self.page, methods=["GET", "HEAD"]),
            Route("/assets/{name}", self.asset, methods=["GET", "HEAD"]),
            Route("/favicon.ico", self.favicon, methods=["GET", "HEAD"]),
        ]

    async def favicon(self, request: Request) -> Response:
        """No icon (the page names none: ``data:,``); browsers still ask for one when they
        show something else of this origin, such as a JSON error. Said without an error."""
        return Response(
            status_code=204, headers={**COMMON_HEADERS, "Cache-Control": "max-age=86400"}
        )

    async def page(self, request: Request) -> Response:
        nonce = secrets.token_urlsafe(18)
        headers = {
            **COMMON_HEADERS,
            "Content-Security-Policy": content_security_policy(nonce),
            "Cache-Control": "no-store",
        }
        if self.index is None:
            return Response(MISSING, media_type="text/html", headers=headers)
        body = self.index.replace(NONCE_MARK, nonce.encode())
        return Response(body, media_type="text/html; charset=utf-8", headers=headers)

    async def asset(self, request: Request) -> Response:
        found = self.assets.get(request.path_params["name"])
        if found is None:
            return Response(
                b"not found", status_code=404, media_type="text/plain", headers=COMMON_HEADERS
            )
        named_by_content = request.path_params["name"].startswith(CHUNK_PREFIX)
        headers = {
            **COMMON_HEADERS,
            "ETag": found.etag,
            "Cache-Control": CHUNK_CACHE if named_by_content else "no-cache",
            "Vary": "Accept-Encoding",
        }
        if found.etag in request.headers.get("if-none-match", ""):
            return Response(status_code=304, headers=headers)
        if "gzip" in request.headers.get("accept-encoding", ""):
            headers["Content-Encoding"] = "gzip"
            return Response(found.gzipped, media_type=found.media_type, headers=headers)
        return Response(found.body, media_type=found.media_type, headers=headers)


__all__ = ["Page", "content_security_policy"]
