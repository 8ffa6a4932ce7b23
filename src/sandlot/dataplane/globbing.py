"""Glob patterns with the semantics deepagents 0.7 expects (PROTOCOL.md 3.6).

``**`` spans directories, ``*``/``?`` stay within one name, ``[...]`` classes
and ``{a,b}`` alternatives work, a pattern without ``/`` matches file names at
any depth, and names starting with a dot match only when the pattern spells
the dot (a ``*`` never matches a leading ``.``, ``**`` never enters a dot-dir).
"""

from __future__ import annotations

import re

_MAX_ALTERNATIVES = 256


def expand_braces(pattern: str) -> list[str]:
    """``a{b,c}d`` → ``[abd, acd]`` (nested braces expand from the innermost)."""
    out = [pattern]
    done: list[str] = []
    while out:
        pat = out.pop()
        close = pat.find("}")
        open_ = pat.rfind("{", 0, close) if close >= 0 else -1
        if close < 0 or open_ < 0:
            done.append(pat)
        else:
            head, body, tail = pat[:open_], pat[open_ + 1 : close], pat[close + 1 :]
            out.extend(head + alt + tail for alt in body.split(","))
        if len(out) + len(done) > _MAX_ALTERNATIVES:
            raise ValueError("too many brace alternatives")
    return done


def _translate(pattern: str) -> str:
    out: list[str] = []
    i, n = 0, len(pattern)
    seg_start = True
    while i < n:
        c = pattern[i]
        if c == "*":
            if pattern.startswith("**", i) and seg_start:
                j = i + 2
                if j < n and pattern[j] == "/":
                    out.append(r"(?:(?!\.)[^/]*/)*")
                    i = j + 1
                    continue
                if j == n:
                    out.append(r"(?!\.)[^/]*(?:/(?!\.)[^/]*)*")
                    i = j
                    continue
            while i < n and pattern[i] == "*":
                i += 1
            out.append(r"(?!\.)[^/]*" if seg_start else r"[^/]*")
            seg_start = False
            continue
        if c == "?":
            out.append(r"(?!\.)[^/]" if seg_start else r"[^/]")
        elif c == "[":
            j = i + 1
            if j < n and pattern[j] in "!^":
                j += 1
            if j < n and pattern[j] == "]":
                j += 1
            while j < n and pattern[j] != "]":
                j += 1
            if j >= n:
                out.append(re.escape(c))
            else:
                body = pattern[i + 1 : j]
                negate = body[:1] in ("!", "^")
                if negate:
                    body = body[1:]
                body = body.replace("\\", "\\\\")
                out.append(f"[{'^/' if negate else ''}{body}]")
                i = j
        elif c == "/":
            out.append("/")
            seg_start = True
            i += 1
            continue
        else:
            out.append(re.escape(c))
        seg_start = False
        i += 1
    return "".join(out)


class GlobPattern:
    """A compiled pattern matched against paths relative to the search base."""

    def __init__(self, pattern: str, *, anchored: bool = False) -> None:
        pattern = pattern.strip()
        #: A pattern without ``/`` matches names at any depth, unless it was split off
        #: a longer pattern (``/a/b/*.py`` matches only files directly in ``/a/b``).
        self.names_only = "/" not in pattern and not anchored
        alts = expand_braces(pattern)
        body = "|".join(f"(?:{_translate(a)})" for a in alts)
        self._re = re.compile(f"(?:{body})\\Z", re.DOTALL)
        #: Whether the walk must enter dot-directories (the pattern spells a leading dot).
        self.enters_hidden = any(
            seg.startswith(".") for a in alts for seg in a.split("/")[:-1] if seg not in (".", "..")
        )
        self.matches_hidden_names = any(a.split("/")[-1].startswith(".") for a in alts)

    def match(self, rel_path: str, name: str) -> bool:
        return self._re.match(name if self.names_only else rel_path) is not None


def split_base(pattern: str) -> tuple[str, str]:
    """Split the literal leading directories off a pattern.

    ``/a/b/**/*.py`` → ``("/a/b", "**/*.py")``.
    """
    parts = pattern.split("/")
    literal: list[str] = []
    for idx, part in enumerate(parts[:-1]):
        if any(ch in part for ch in "*?[{"):
            return "/".join(literal) or ("/" if pattern.startswith("/") else ""), "/".join(
                parts[idx:]
            )
        literal.append(part)
    base = "/".join(literal)
    if pattern.startswith("/") and not base:
        base = "/"
    return base, parts[-1]
