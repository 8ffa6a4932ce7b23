"""The workspace's files, as boring-ui and sandlot's richer routes see them.

Every operation is a few dataplane calls (:class:`~sandlot.web.calls.DataplaneCalls`,
PROTOCOL.md 3.6): it takes a browser's paths (relative to the workspace root, checked by
:mod:`sandlot.web.paths`) and answers plain data in the shapes the routes return. Nothing
here knows of HTTP requests.

- **Tree**: ``/fs/list`` with ``depth`` (1 by default), sorted directories first, then by
  name case-insensitively (the name itself breaking ties); deeper levels nest as
  ``children``. Bounded: at most ``tree_max_nodes`` entries (shallowest kept), the
  dataplane's own cap, and ``tree_seconds``; past a bound the answer is the partial
  listing with ``"truncated": true`` (after a timeout: the directory's own entries only).
- **Search** (boring-ui's): a case-insensitive ``fnmatch`` of the pattern on the names of
  files and directories, 11 levels deep as boring-ui's, results in path order.
- **Grep**: the dataplane's ``/fs/grep`` (ripgrep), fixed string unless ``regex``.
- **Versioned reads and writes**: the dataplane's etag (a hash of the content); a write
  with an etag that is no longer the file's is refused (``PRECONDITION_FAILED``, answered
  412 by the routes) and changes nothing.

A path the dataplane answers with that lies outside ``/workspace`` (a symlink in the
workspace leading elsewhere in the sandbox) is withheld: its read is refused, its
listing and search entries dropped.
"""

from __future__ import annotations

import asyncio
import base64
import fnmatch
from collections.abc import Iterable
from typing import Any

from sandlot.protocol.errors import Forbidden, InvalidRequest, ProviderUnavailable
from sandlot.web import paths
from sandlot.web.calls import DataplaneCalls
from sandlot.web.settings import WebSettings

#: Levels boring-ui's search descends (its recursion stops below depth 10).
SEARCH_DEPTH = 11
#: The largest file read whole (the dataplane's ``/fs/read`` limit is its own).
READ_LINES = 1 << 30


def outside() -> Forbidden:
    return Forbidden("the path leads outside the workspace", metadata={"reason": "outside"})


def sort_key(entry: dict[str, Any]) -> tuple[bool, str, str]:
    """Directories first, then names case-insensitively."""
    name: str = entry["name"]
    return (not entry["is_dir"], name.lower(), name)


def _depth_of(path: str) -> int:
    return path.count("/")


class WorkspaceFiles:
    """File operations on one workspace for one browser request."""

    def __init__(self, calls: DataplaneCalls, settings: WebSettings) -> None:
        self.calls = calls
        self.settings = settings

    # --- listing ------------------------------------------------------------------------

    async def _list(self, path: str, depth: int) -> tuple[list[dict[str, Any]], bool]:
        """(entries with browser paths, truncated) under the browser's ``path``.

        A directory reached through a symlink is listed under the name it was asked by.
        """
        base = paths.normalized(path)
        listing = await self.calls.json(
            "GET", "/fs/list", params={"path": paths.to_sandbox(path), "depth": depth}
        )
        found: list[tuple[str, dict[str, Any]]] = []
        for raw in listing.get("entries", []):
            rel = paths.to_browser(str(raw.get("path", "")))
            if rel is not None and rel != ".":
                found.append((rel, raw))
        # Where the dataplane found the directory (its symlinks resolved): the parent of
        # its shallowest entries.
        resolved = paths.parent_of(min((r for r, _ in found), key=_depth_of)) if found else ""
        resolved = resolved or "."
        entries: list[dict[str, Any]] = []
        for rel, raw in found:
            if resolved != base:
                inner = rel if resolved == "." else rel[len(resolved) + 1 :]
                rel = paths.join(base, inner)
            entry: dict[str, Any] = {
                "name": paths.name_of(rel),
                "path": rel,
                "is_dir": bool(raw.get("is_dir")),
            }
            if not entry["is_dir"]:
                entry["size"] = int(raw.get("size") or 0)
            entries.append(entry)
        return entries, bool(listing.get("truncated"))

    async def _bounded_list(self, path: str, depth: int) -> tuple[list[dict[str, Any]], bool]:
        """:meth:`_list`, within ``tree_seconds``; past it, the first level only (truncated)."""
        try:
            async with asyncio.timeout(self.settings.tree_seconds):
                return await self._list(path, depth)
        except TimeoutError:
            if depth == 1:
                raise ProviderUnavailable(
                    "listing the directory took too long", metadata={"reason": "timeout"}
                ) from None
        entries, _ = await self._list(path, 1)
        return entries, True

    async def tree(self, path: str, depth: int = 1) -> dict[str, Any]:
        """``GET /api/tree``: ``{"entries", "path"}`` (+ ``"truncated": true`` when partial)."""
        if not 1 <= depth <= self.settings.tree_max_depth:
            raise InvalidRequest(f"depth must be between 1 and {self.settings.tree_max_depth}")
        base = paths.normalized(path)
        entries, truncated = await self._bounded_list(path, depth)
        limit = self.settings.tree_max_nodes
        if len(entries) > limit:
            entries.sort(key=lambda e: (_depth_of(e["path"]), *sort_key(e)))
            entries = entries[:limit]
            truncated = True
        answer: dict[str, Any] = {"entries": _nest(entries, base, depth), "path": path}
        if truncated:
            answer["truncated"] = True
        return answer

    async def search(self, pattern: str, path: str = ".") -> dict[str, Any]:
        """``GET /api/search``: names matching a glob, case-insensitively."""
        if not pattern or len(pattern) > 256:
            raise InvalidRequest("q must be a glob pattern of 1 to 256 characters")
        entries, truncated = await self._bounded_list(path, SEARCH_DEPTH)
        wanted = pattern.lower()
        results = [
            {"name": e["name"], "path": e["path"], "dir": paths.parent_of(e["path"])}
            for e in entries
            if fnmatch.fnmatchcase(e["name"].lower(), wanted)
        ]
        results.sort(key=lambda r: [(c.lower(), c) for c in r["path"].split("/")])
        if len(results) > self.settings.max_search_results:
            results = results[: self.settings.max_search_results]
            truncated = True
        answer: dict[str, Any] = {"results": results, "pattern": pattern, "path": path}
        if truncated:
            answer["truncated"] = True
        return answer

    async def grep(
        self,
        query: str,
        path: str = ".",
        *,
        glob: str | None = None,
        regex: bool = False,
        ignore_case: bool = False,
    ) -> dict[str, Any]:
        """``GET /api/v1/grep``: lines containing ``query`` (or matching it, with ``regex``)."""
        if not query or len(query) > 1024:
            raise InvalidRequest("q must be 1 to 1024 characters")
        body: dict[str, Any] = {
            "pattern": query,
            "path": paths.to_sandbox(path),
            "regex": regex,
            "ignore_case": ignore_case,
        }
        if glob:
            body["glob"] = glob
        found = await self.calls.json("POST", "/fs/grep", body=body, idempotent=True)
        matches = []
        for m in found.get("matches", []):
            rel = paths.to_browser(str(m.get("path", "")))
            if rel is None:
                continue
            matches.append({"path": rel, "line": int(m.get("line") or 0), "text": m.get("text")})
        truncated = bool(found.get("truncated"))
        if len(matches) > self.settings.max_search_results:
            matches = matches[: self.settings.max_search_results]
            truncated = True
        return {"matches": matches, "truncated": truncated, "query": query, "path": path}

    # --- reading and writing ------------------------------------------------------------

    async def stat(self, path: str) -> dict[str, Any]:
        """The dataplane's ``/fs/stat`` of a browser path (its own path checked)."""
        info: dict[str, Any] = await self.calls.json(
            "GET", "/fs/stat", params={"path": paths.to_sandbox(path)}
        )
        if paths.to_browser(str(info.get("path", ""))) is None:
            raise outside()
        return info

    async def read(self, path: str) -> dict[str, Any]:
        """The whole file: ``{"path", "content", "encoding", "etag", "size"}``."""
        paths.parts_of(path)
        found = await self.calls.json(
            "GET", "/fs/read", params={"path": paths.to_sandbox(path), "limit": READ_LINES}
        )
        if paths.to_browser(str(found.get("path", ""))) is None:
            raise outside()
        return {
            "path": path,
            "content": found.get("content", ""),
            "encoding": found.get("encoding", "utf-8"),
            "etag": found.get("etag"),
            "size": found.get("size"),
        }

    async def read_text(self, path: str) -> dict[str, Any]:
        """``GET /api/file``: ``{"content", "path"}``; a file that is not UTF-8 is shown with
        replacement characters and ``"binary": true``."""
        found = await self.read(path)
        answer: dict[str, Any] = {"content": found["content"], "path": path}
        if found["encoding"] == "base64":
            answer["content"] = base64.b64decode(found["content"]).decode("utf-8", "replace")
            answer["binary"] = True
        return answer

    async def write(
        self,
        path: str,
        content: str,
        *,
        encoding: str = "utf-8",
        if_match: str | None = None,
        if_none_match: str | None = None,
    ) -> dict[str, Any]:
        """Write the whole file: ``{"path", "etag", "created"}``."""
        if not paths.parts_of(path):
            raise InvalidRequest("the workspace root is a directory")
        body: dict[str, Any] = {"path": paths.to_sandbox(path), "content": content}
        if encoding != "utf-8":
            body["encoding"] = encoding
        if if_match is not None:
            body["if_match"] = if_match
        if if_none_match is not None:
            body["if_none_match"] = if_none_match
        written = await self.calls.json("PUT", "/fs/write", body=body)
        return {
            "path": path,
            "etag": written.get("etag"),
            "created": bool(written.get("created")),
        }

    async def delete(self, path: str) -> dict[str, Any]:
        """``DELETE /api/file``: a file, or a directory with what it holds."""
        if not paths.parts_of(path):
            raise InvalidRequest("the workspace root cannot be deleted")
        await self.calls.json(
            "DELETE", "/fs", params={"path": paths.to_sandbox(path), "recursive": "true"}
        )
        return {"success": True, "path": path}

    async def rename(self, old_path: str, new_path: str) -> dict[str, Any]:
        """``POST /api/file/rename``; the new name taken already is 409."""
        if not paths.parts_of(old_path) or not paths.parts_of(new_path):
            raise InvalidRequest("the workspace root cannot be renamed")
        await self._move(old_path, new_path)
        return {"success": True, "old_path": old_path, "new_path": new_path}

    async def move(self, src_path: str, dest_dir: str) -> dict[str, Any]:
        """``POST /api/file/move``: into ``dest_dir`` under the same name."""
        parts = paths.parts_of(src_path)
        if not parts:
            raise InvalidRequest("the workspace root cannot be moved")
        target = await self.stat(dest_dir)
        if target.get("type") != "directory":
            raise InvalidRequest("the destination is not a directory")
        dest_path = paths.join(paths.normalized(dest_dir), parts[-1])
        await self._move(src_path, dest_path)
        return {"success": True, "old_path": src_path, "dest_path": dest_path}

    async def _move(self, src: str, dst: str) -> None:
        body = {"src": paths.to_sandbox(src), "dst": paths.to_sandbox(dst), "overwrite": False}
        await self.calls.json("POST", "/fs/move", body=body)


def _nest(entries: Iterable[dict[str, Any]], base: str, depth: int) -> list[dict[str, Any]]:
    """Entries below ``base`` as a sorted tree: with ``depth`` over 1, each directory above
    the last level listed holds its ``children``."""
    by_parent: dict[str, list[dict[str, Any]]] = {}
    for entry in entries:
        parent = paths.parent_of(entry["path"]) or "."
        by_parent.setdefault(parent, []).append(entry)

    def level(directory: str, remaining: int) -> list[dict[str, Any]]:
        children = sorted(by_parent.get(directory, []), key=sort_key)
        if remaining > 1:
            for child in children:
                if child["is_dir"]:
                    child["children"] = level(child["path"], remaining - 1)
        return children

    return level(base, depth)
