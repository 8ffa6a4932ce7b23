"""Glob patterns with the semantics deepagents 0.7 expects (PROTOCOL.md 3.6).

``**`` spans directories, ``*``/``?`` stay within one name, ``[...]`` classes
and ``{a,b}`` alternatives work, a pattern without ``/`` matches file names at
any depth, and names starting with a dot match only when the pattern spells
the dot (a ``*`` never matches a leading ``.``, ``**`` never enters a dot-dir).

Patterns come from users, so matching must never take time out of proportion
to its input. A pattern is not one regular expression (``**/`` nested twenty
times made one whose backtracking took minutes, under the interpreter lock):

- braces are expanded up front, within a bound on alternatives and characters;
- each alternative is a list of path segments, ``**`` or a one-name matcher;
  a path is matched segment by segment by a set of positions in those lists
  (a non-backtracking automaton), so its cost is the number of positions times
  the number of segments, whatever the ``**``;
- within one name, ``*`` splits the segment into fixed-width pieces, each found
  leftmost (a search without quantifiers, so no backtracking), which is exact for
  globs.

:meth:`GlobPattern.step` advances the positions by one name, so a walk carries
them down the tree and skips every directory below which nothing can match.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

#: At most this many alternatives after brace expansion (beyond: 400 INVALID_REQUEST).
MAX_ALTERNATIVES = 256
#: At most this many characters of expansion work (all intermediate strings together).
MAX_EXPANSION_CHARS = 1 << 20
#: At most this many segments in all alternatives together.
MAX_SEGMENTS = 8192


def expand_braces(pattern: str) -> list[str]:
    """``a{b,c}d`` → ``[abd, acd]`` (nested braces expand from the innermost).

    Raises ``ValueError`` beyond :data:`MAX_ALTERNATIVES` alternatives or
    :data:`MAX_EXPANSION_CHARS` characters of work, so a ``{a,b}{a,b}…`` bomb is
    refused before it takes memory or time.
    """
    out = [pattern]
    done: list[str] = []
    work = 0
    while out:
        pat = out.pop()
        work += len(pat)
        if work > MAX_EXPANSION_CHARS:
            raise ValueError("pattern too complex (brace expansion)")
        close = pat.find("}")
        open_ = pat.rfind("{", 0, close) if close >= 0 else -1
        if close < 0 or open_ < 0:
            done.append(pat)
        else:
            head, body, tail = pat[:open_], pat[open_ + 1 : close], pat[close + 1 :]
            alts = body.split(",")
            if len(out) + len(done) + len(alts) > MAX_ALTERNATIVES:
                raise ValueError("too many brace alternatives")
            out.extend(head + alt + tail for alt in alts)
    return done


# --- one name ----------------------------------------------------------------------------

_STAR = "*"
_SEP = "/"
_GLOBSTAR = "**"


@dataclass(frozen=True)
class _Atom:
    """A one-character token: ``regex`` matches exactly one character (no quantifier)."""

    regex: str
    literal: str | None = None  # the character itself, for plain characters
    wild: bool = False  # ``?``


def _class_regex(body: str, negate: bool) -> str:
    """``[...]`` body → a regex class; each member escaped (no regex syntax leaks in)."""
    parts: list[str] = []
    i, n = 0, len(body)
    while i < n:
        c = body[i]
        if i + 2 < n and body[i + 1] == "-":
            hi = body[i + 2]
            if ord(hi) < ord(c):
                raise ValueError(f"invalid character range {c}-{hi} in pattern")
            parts.append(f"{re.escape(c)}-{re.escape(hi)}")
            i += 3
        else:
            parts.append(re.escape(c))
            i += 1
    # Matched against names only, which never hold "/".
    return f"[^/{''.join(parts)}]" if negate else f"[{''.join(parts)}]"


def _tokens(pattern: str, *, escapes: bool = False) -> list[str | _Atom]:
    """The pattern as ``/``, ``**`` (a whole segment), ``*`` runs and one-character atoms;
    with ``escapes``, ``\\x`` is the character ``x`` itself."""
    out: list[str | _Atom] = []
    i, n = 0, len(pattern)
    seg_start = True
    while i < n:
        c = pattern[i]
        if escapes and c == "\\" and i + 1 < n:
            out.append(_Atom(re.escape(pattern[i + 1]), literal=pattern[i + 1]))
            seg_start = False
            i += 2
            continue
        if c == "*":
            j = i
            while j < n and pattern[j] == "*":
                j += 1
            whole = seg_start and j - i == 2 and (j == n or pattern[j] == "/")
            out.append(_GLOBSTAR if whole else _STAR)
            i = j
            seg_start = False
            continue
        if c == "/":
            out.append(_SEP)
            seg_start = True
            i += 1
            continue
        seg_start = False
        if c == "?":
            out.append(_Atom("[^/]", wild=True))
        elif c == "[":
            j = i + 1
            if j < n and pattern[j] in "!^":
                j += 1
            if j < n and pattern[j] == "]":
                j += 1
            while j < n and pattern[j] != "]":
                j += 1
            if j >= n:
                out.append(_Atom(re.escape(c), literal=c))
            else:
                body = pattern[i + 1 : j]
                negate = body[:1] in ("!", "^")
                out.append(_Atom(_class_regex(body[1:] if negate else body, negate)))
                i = j
        else:
            out.append(_Atom(re.escape(c), literal=c))
        i += 1
    return out


class _Piece:
    """A fixed-width run of atoms: a literal string, or a regex without quantifiers."""

    __slots__ = ("literal", "regex", "width")

    def __init__(self, atoms: list[_Atom]) -> None:
        self.width = len(atoms)
        if all(a.literal is not None for a in atoms):
            self.literal: str | None = "".join(a.literal or "" for a in atoms)
            self.regex: re.Pattern[str] | None = None
        else:
            self.literal = None
            self.regex = re.compile("".join(a.regex for a in atoms), re.DOTALL)

    def at(self, name: str, pos: int) -> bool:
        """Whether the piece matches ``name`` starting exactly at ``pos``."""
        if self.literal is not None:
            return name.startswith(self.literal, pos)
        assert self.regex is not None
        return self.regex.match(name, pos) is not None

    def find(self, name: str, pos: int) -> int:
        """The leftmost position ≥ ``pos`` where the piece matches, or -1."""
        if self.literal is not None:
            return name.find(self.literal, pos)
        assert self.regex is not None
        m = self.regex.search(name, pos)
        return -1 if m is None else m.start()


class NameMatcher:
    """One segment of a pattern (no ``/``, not ``**``) matched against one name.

    ``*`` runs split the segment into fixed-width pieces: the first must match at
    the start, the last at the end, and the ones between are each taken at their
    leftmost place after the previous one (greedy leftmost is exact when every piece
    has a fixed width). Time: at most the name's length times the segment's.
    """

    __slots__ = ("head", "literal", "middle", "no_dot", "tail")

    def __init__(self, tokens: tuple[str | _Atom, ...], *, dotglob: bool = False) -> None:
        first = tokens[0] if tokens else None
        #: A leading ``*`` or ``?`` never matches a leading dot (unless ``dotglob``).
        self.no_dot = not dotglob and (
            first in (_STAR, _GLOBSTAR) or (isinstance(first, _Atom) and first.wild)
        )
        pieces: list[list[_Atom]] = [[]]
        for tok in tokens:
            if isinstance(tok, _Atom):
                pieces[-1].append(tok)
            else:
                pieces.append([])
        self.head = _Piece(pieces[0])
        self.tail = _Piece(pieces[-1]) if len(pieces) > 1 else None
        self.middle = [_Piece(p) for p in pieces[1:-1] if p]
        #: The one name matched, for a segment without wildcards.
        self.literal = self.head.literal if self.tail is None else None

    def match(self, name: str) -> bool:
        if self.no_dot and name.startswith("."):
            return False
        head = self.head
        if self.tail is None:
            return len(name) == head.width and head.at(name, 0)
        tail = self.tail
        end = len(name) - tail.width
        if end < head.width or not head.at(name, 0) or not tail.at(name, end):
            return False
        pos = head.width
        for piece in self.middle:
            found = piece.find(name, pos)
            if found < 0 or found + piece.width > end:
                return False
            pos = found + piece.width
        return True


# --- whole paths -------------------------------------------------------------------------

#: A set of positions in :attr:`GlobPattern.nodes` (see :meth:`GlobPattern.step`).
States = frozenset[int]
#: Plans kept per pattern (one per set of positions met; a walk meets few), and
#: answers kept per plan.
_MAX_PLANS = 4096
_MAX_ANSWERS = 1024


def _segments(alt: str, *, escapes: bool) -> list[tuple[str | _Atom, ...] | None]:
    """One alternative as segments: ``None`` is ``**/`` (zero or more non-dot names)."""
    segs: list[list[str | _Atom]] = [[]]
    for tok in _tokens(alt, escapes=escapes):
        if tok == _SEP:
            segs.append([])
        else:
            segs[-1].append(tok)
    out: list[tuple[str | _Atom, ...] | None] = []
    for i, seg in enumerate(segs):
        if seg == [_GLOBSTAR]:
            if i == len(segs) - 1:
                # A trailing ``**``: one or more non-dot names, i.e. ``*`` then ``**/``.
                out.append((_STAR,))
            if not out or out[-1] is not None:
                out.append(None)  # a run of ``**/`` is one
        else:
            out.append(tuple(seg))
    return out


class GlobPattern:
    """A compiled pattern matched against paths relative to the search base.

    The alternatives' segments sit end to end in :attr:`nodes`, each alternative
    closed by an accepting ``True``; a match in progress is the set of positions
    reached (:meth:`start`, :meth:`step`, :meth:`accepts`).

    ``gitignore=True`` reads the pattern as a ``.gitignore`` line's (already stripped of
    its ``!``, its trailing ``/`` and its anchoring ``/``): no braces, ``\\`` escapes,
    and wildcards and ``**`` that match names starting with a dot.
    """

    def __init__(self, pattern: str, *, anchored: bool = False, gitignore: bool = False) -> None:
        if not gitignore:
            pattern = pattern.strip()
        #: A pattern without ``/`` matches names at any depth, unless it was split off
        #: a longer pattern (``/a/b/*.py`` matches only files directly in ``/a/b``).
        self.names_only = "/" not in pattern and not anchored
        #: Whether ``*``, ``?`` and ``**`` match names that start with a dot.
        self.dotglob = gitignore
        alts = [pattern] if gitignore else list(dict.fromkeys(expand_braces(pattern)))
        # Identical segments of different alternatives share one matcher (matched once).
        interned: dict[tuple[str | _Atom, ...], NameMatcher] = {}
        nodes: list[NameMatcher | bool | None] = []
        starts: list[int] = []
        for alt in alts:
            starts.append(len(nodes))
            for seg in _segments(alt, escapes=gitignore):
                if seg is None:
                    nodes.append(None)
                    continue
                matcher = interned.get(seg)
                if matcher is None:
                    matcher = interned[seg] = NameMatcher(seg, dotglob=gitignore)
                nodes.append(matcher)
            nodes.append(True)
            if len(nodes) > MAX_SEGMENTS:
                raise ValueError("pattern too complex (too many path segments)")
        self.nodes = nodes
        self.closure = [self._close(i) for i in range(len(nodes))]
        self._start: States = frozenset(i for s in starts for i in self.closure[s])
        self._plans: dict[States, _Plan] = {}
        self._accepting = frozenset(i for i, node in enumerate(nodes) if node is True)
        #: Whether the walk must enter dot-directories (the pattern spells a leading dot).
        self.enters_hidden = any(
            seg.startswith(".") for a in alts for seg in a.split("/")[:-1] if seg not in (".", "..")
        )
        self.matches_hidden_names = any(a.split("/")[-1].startswith(".") for a in alts)

    def _close(self, i: int) -> tuple[int, ...]:
        """``i`` and, past each ``**/`` (which may match nothing), what follows it."""
        out = [i]
        while self.nodes[i] is None:
            i += 1
            out.append(i)
        return tuple(out)

    def start(self) -> States:
        """The positions before any name."""
        return self._start

    def step(self, states: States, name: str) -> States:
        """The positions after one more name (empty: nothing below can match)."""
        plan = self._plans.get(states)
        if plan is None:
            if len(self._plans) >= _MAX_PLANS:
                self._plans.clear()
            plan = self._plans[states] = _Plan(self, states)
        return plan.step(name)

    def accepts(self, states: States) -> bool:
        return not states.isdisjoint(self._accepting)

    def match(self, rel_path: str, name: str) -> bool:
        if self.names_only:
            return self.accepts(self.step(self._start, name))
        states = self._start
        for part in rel_path.split("/"):
            states = self.step(states, part)
            if not states:
                return False
        return self.accepts(states)


class _Plan:
    """How to step from one set of positions: names without wildcards looked up in
    one dict, the ``**/`` positions taken together, each other distinct segment matched
    once; the union for each combination of those outcomes is kept (most names of a
    walk share one)."""

    __slots__ = ("answers", "dotglob", "exact", "globstar", "wild")

    def __init__(self, pattern: GlobPattern, states: States) -> None:
        self.dotglob = pattern.dotglob
        exact: dict[str, set[int]] = {}
        globstar: set[int] = set()
        wild: dict[int, tuple[NameMatcher, set[int]]] = {}
        for i in states:
            node = pattern.nodes[i]
            if node is None:
                globstar.update(pattern.closure[i])
            elif isinstance(node, NameMatcher):
                targets = pattern.closure[i + 1]
                if node.literal is not None:
                    exact.setdefault(node.literal, set()).update(targets)
                else:
                    wild.setdefault(id(node), (node, set()))[1].update(targets)
        self.exact = {k: frozenset(v) for k, v in exact.items()}
        self.globstar = frozenset(globstar)
        self.wild = [(m, frozenset(t)) for m, t in wild.values()]
        self.answers: dict[tuple[str | None, bool, tuple[int, ...]], States] = {}

    def step(self, name: str) -> States:
        hit = name if name in self.exact else None
        dot = not self.dotglob and name.startswith(".")
        matched = tuple(k for k, (m, _) in enumerate(self.wild) if m.match(name))
        key = (hit, dot, matched)
        out = self.answers.get(key)
        if out is None:
            union: set[int] = set(self.exact[hit]) if hit is not None else set()
            if not dot:
                union.update(self.globstar)
            for k in matched:
                union.update(self.wild[k][1])
            if len(self.answers) >= _MAX_ANSWERS:
                self.answers.clear()
            out = self.answers[key] = frozenset(union)
        return out


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
