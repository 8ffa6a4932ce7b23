"""The workspace's git state, as boring-ui shows it: status, diff, a file at ``HEAD``.

``git`` runs where the workspace is (inside the sandbox, or as the local user in local
mode) through the dataplane's ``POST /exec``, always as an argument list, never a shell
string: a path reaches git as one argument after ``--`` with ``--literal-pathspecs`` (no
pathspec magic), or inside a ``HEAD:./path`` object name. git reads the worktree by its
own rules (it never follows a symlink there, nor a path beyond one); a file's current
content for sandlot's own diff is read through the dataplane's confined file operations,
never by git. The working directory is the
workspace root; git's optional locks are off (a status never blocks the agent's own git)
and it never prompts. Outside a repository the answers say ``is_repo: false``; a
workspace without git says ``available: false`` too.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any

from sandlot.protocol.errors import InvalidRequest, ProviderUnavailable
from sandlot.web import paths
from sandlot.web.activity import OWN_COMMANDS
from sandlot.web.calls import DataplaneCalls

#: Seconds one git command may run.
GIT_TIMEOUT = 20.0
GIT_ENV = {"GIT_OPTIONAL_LOCKS": "0", "GIT_TERMINAL_PROMPT": "0", "GIT_PAGER": "cat"}
#: Exit status of a command the sandbox does not have.
NOT_FOUND = 127
#: Porcelain ``XY`` pairs of unmerged paths.
_CONFLICTS = {"DD", "AU", "UD", "UA", "DU", "AA", "UU"}


@dataclass(frozen=True)
class GitResult:
    exit_code: int | None
    stdout: str
    stderr: str
    truncated: bool


def status_letter(xy: str) -> str:
    """boring-ui's one letter for a porcelain ``XY``: ``U`` untracked, ``C`` conflicted,
    ``A`` added, ``D`` deleted, else ``M``."""
    if xy == "??":
        return "U"
    if xy in _CONFLICTS:
        return "C"
    if "A" in xy:
        return "A"
    if "D" in xy:
        return "D"
    return "M"


class WorkspaceGit:
    """git in one workspace, for one browser request."""

    def __init__(self, calls: DataplaneCalls) -> None:
        self.calls = calls

    async def run(self, *args: str) -> GitResult:
        body = {
            "command": ["git", "--no-pager", "-c", "color.ui=false", *args],
            "cwd": paths.ROOT,
            "env": GIT_ENV,
            "timeout_seconds": GIT_TIMEOUT,
            "command_id": f"{OWN_COMMANDS}{secrets.token_hex(12)}",
        }
        result = await self.calls.json("POST", "/exec", body=body, idempotent=True)
        if result.get("timed_out"):
            raise ProviderUnavailable("git took too long", metadata={"reason": "timeout"})
        return GitResult(
            exit_code=result.get("exit_code"),
            stdout=str(result.get("stdout") or ""),
            stderr=str(result.get("stderr") or ""),
            truncated=bool(result.get("truncated")),
        )

    async def prefix(self) -> str | None:
        """Where the workspace root lies in its repository (``""`` at the top, ``sub/``
        below it), or ``None`` outside a repository; ``ProviderUnavailable`` without git."""
        found = await self.run("rev-parse", "--show-prefix")
        if found.exit_code == NOT_FOUND:
            raise _NoGit
        if found.exit_code != 0:
            return None
        return found.stdout.strip("\n")

    async def status(self) -> dict[str, Any]:
        """``GET /api/git/status``: ``{"is_repo", "available", "files": {path: letter}}``."""
        try:
            prefix = await self.prefix()
        except _NoGit:
            return {"is_repo": False, "available": False, "files": []}
        if prefix is None:
            return {"is_repo": False, "files": []}
        found = await self.run(
            "-c", "core.quotepath=false", "status", "-z", "--no-renames", "--", "."
        )
        if found.exit_code != 0:
            return {"is_repo": False, "files": []}
        files: dict[str, str] = {}
        for record in found.stdout.split("\0"):
            if len(record) < 4:
                continue
            xy, path = record[:2], record[3:]
            if prefix and path.startswith(prefix):
                path = path[len(prefix) :]
            elif prefix:
                continue  # outside the workspace (``--`` ``.`` keeps these out anyway)
            files[path.rstrip("/")] = status_letter(xy)
        return {"is_repo": True, "available": True, "files": files}

    async def diff(self, path: str) -> dict[str, Any]:
        """``GET /api/git/diff``: ``git diff HEAD -- path`` as ``{"diff", "path"}``."""
        rel = paths.normalized(path)
        found = await self.run(
            "--literal-pathspecs", "diff", "--no-ext-diff", "--no-textconv", "HEAD", "--", rel
        )
        if found.exit_code == NOT_FOUND:
            return {"diff": "", "path": path, "error": "git is not available"}
        if found.exit_code != 0:
            return {"diff": "", "path": path, "error": "not a git repository, or no HEAD"}
        return {"diff": found.stdout, "path": path}

    async def show(self, path: str) -> dict[str, Any]:
        """``GET /api/git/show``: the file at ``HEAD`` as ``{"content", "path"}``, or
        ``content: null`` and ``"error": "Not in HEAD"``."""
        rel = paths.normalized(path)
        if rel == ".":
            raise InvalidRequest("name a file")
        found = await self.run("cat-file", "blob", f"HEAD:./{rel}")
        if found.exit_code != 0:
            return {"content": None, "path": path, "error": "Not in HEAD"}
        return {"content": found.stdout, "path": path}

    async def head_content(self, path: str) -> tuple[bool, str | None]:
        """(whether the workspace is in a repository, the file's text at ``HEAD`` or
        ``None`` when it is not there), read from git's objects, never the worktree."""
        rel = paths.normalized(path)
        if rel == ".":
            raise InvalidRequest("name a file")
        try:
            prefix = await self.prefix()
        except _NoGit:
            return False, None
        if prefix is None:
            return False, None
        found = await self.run("cat-file", "blob", f"HEAD:./{rel}")
        return True, found.stdout if found.exit_code == 0 else None


class _NoGit(Exception):
    """The workspace has no git."""
