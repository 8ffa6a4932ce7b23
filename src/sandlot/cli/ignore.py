"""``.gitignore`` rules as git reads them, matched in time linear in the path.

A ``.gitignore`` comes with the tree being synced, so its patterns are input like
any other: they are compiled to the same segment automaton as the dataplane's
globs (:class:`~sandlot.dataplane.services.globbing.GlobPattern`), which never backtracks,
rather than to regular expressions (``*a*a*a*a*a*a*b`` against a long name took
seconds that way, and doubled with every ``*a``).

Git's rules (gitignore(5)): blank lines and ``#`` comments are skipped, trailing
spaces dropped unless escaped; ``!`` re-includes; a trailing ``/`` matches
directories only; a pattern with a ``/`` before its end is relative to the
directory of its ``.gitignore``, one without matches a name at any depth; ``*``
and ``?`` match a leading dot; ``**/``, ``/**/`` and ``/**`` span directories; the
last matching line wins, and a deeper ``.gitignore`` overrides a shallower one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from sandlot.dataplane.services.globbing import GlobPattern


@dataclass(frozen=True)
class IgnoreRule:
    pattern: GlobPattern
    negate: bool
    dir_only: bool

    def matches(self, rel: str, is_dir: bool) -> bool:
        if self.dir_only and not is_dir:
            return False
        return self.pattern.match(rel, rel.rsplit("/", 1)[-1])


def _strip_trailing_spaces(line: str) -> str:
    end = len(line)
    while end > 0 and line[end - 1] == " ":
        if end >= 2 and line[end - 2] == "\\":
            # "\ " keeps that space (and the backslash escaping it is read by the matcher).
            break
        end -= 1
    return line[:end]


def parse_rule(line: str) -> IgnoreRule | None:
    """One line of a ``.gitignore``; ``None`` for blanks, comments and patterns git
    would never match (an invalid character range)."""
    line = _strip_trailing_spaces(line.rstrip("\r"))
    if not line or line.startswith("#"):
        return None
    negate = line.startswith("!")
    if negate:
        line = line[1:]
    dir_only = line.endswith("/")
    line = line.rstrip("/")
    if not line:
        return None
    anchored = "/" in line
    line = line.lstrip("/")
    if not line:
        return None
    try:
        pattern = GlobPattern(line, anchored=anchored, gitignore=True)
    except ValueError:
        return None
    return IgnoreRule(pattern, negate, dir_only)


@dataclass(frozen=True)
class IgnoreFile:
    """The rules of one ``.gitignore``, for paths relative to its directory."""

    rules: tuple[IgnoreRule, ...]

    @classmethod
    def parse(cls, text: str) -> IgnoreFile:
        rules = (parse_rule(line) for line in text.split("\n"))
        return cls(tuple(rule for rule in rules if rule is not None))

    @classmethod
    def load(cls, directory: str | Path) -> IgnoreFile | None:
        try:
            with open(os.path.join(directory, ".gitignore"), errors="replace") as f:
                return cls.parse(f.read())
        except OSError:
            return None

    def decide(self, rel: str, is_dir: bool) -> bool | None:
        """``True``: ignored, ``False``: re-included, ``None``: no line matches."""
        for rule in reversed(self.rules):
            if rule.matches(rel, is_dir):
                return not rule.negate
        return None
