"""Glob patterns: the segment matcher against the regex it replaced, its bounds, the walk
in helper processes, and the server's answers to hostile patterns."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from sandlot.dataplane.services import globworker
from sandlot.dataplane.services.fsops import FileOps, iso
from sandlot.dataplane.services.globbing import MAX_ALTERNATIVES, GlobPattern, expand_braces
from sandlot.dataplane.services.paths import PathResolver
from sandlot.protocol.errors import ProviderUnavailable
from sandlot.runtime.base import Mount
from tests.dataplane.conftest import Server, start_server

# --- the previous matcher: one regex per pattern (exponential on nested ``**``) ----------


def _old_translate(pattern: str) -> str:
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


def old_match(pattern: str, rel_path: str, *, anchored: bool) -> bool:
    pattern = pattern.strip()
    names_only = "/" not in pattern and not anchored
    body = "|".join(f"(?:{_old_translate(a)})" for a in expand_braces(pattern))
    subject = rel_path.rsplit("/", 1)[-1] if names_only else rel_path
    return re.match(f"(?:{body})\\Z", subject, re.DOTALL) is not None


# Segments and names built so that the old regex meant what glob means (it read a
# class holding "/" or starting "!]" differently): on these, both must agree.
SEGMENTS = [
    "**", "*", "a*", "*.py", "?", ".a", ".*", "a?b", "[ab]", "[!a]*", "b", "{a,b}",
    "a{,.x}", "*a*b*", "x[a-c]y", "??*", "*[.]*", "[^b]", "[a-]", "{*.py,b/*}", "***",
    "**a", "a**", "*?", "[]a]", "{a,{b,.b}}*", "a.b", "",
]  # fmt: skip
NAMES = [
    "a", "b", ".a", "ab", "a.py", ".py", "axb", "xby", "abab", "c", "aab", "xay", "a-",
    "ba.py", "b.x", "]", "a.b", ".b", "ba", "x-y", "aa.py", "xcy", "-",
]  # fmt: skip


@pytest.mark.parametrize("seed", range(4))
def test_same_answers_as_the_previous_regex(seed: int) -> None:
    rnd = random.Random(seed)
    compared = 0
    for _ in range(1500):
        pattern = "/".join(rnd.choice(SEGMENTS) for _ in range(rnd.randint(1, 4)))
        anchored = rnd.random() < 0.5
        glob = GlobPattern(pattern, anchored=anchored)
        for _ in range(12):
            parts = [rnd.choice(NAMES) for _ in range(rnd.randint(1, 5))]
            rel = "/".join(parts)
            expected = old_match(pattern, rel, anchored=anchored)
            assert glob.match(rel, parts[-1]) == expected, (pattern, anchored, rel)
            compared += 1
    assert compared == 18_000


@pytest.mark.parametrize(
    ("pattern", "path", "expected"),
    [
        ("**/*.py", "a.py", True),
        ("**/*.py", "x/y/a.py", True),
        ("**/*.py", "x/.y/a.py", False),  # ** never enters a dot-directory
        ("**/*.py", ".a.py", False),  # * never matches a leading dot
        ("**/.*.py", "x/.a.py", True),
        ("x/**", "x", False),  # a trailing ** is one name or more
        ("x/**", "x/y/z", True),
        ("**/**/**/z", "z", True),
        ("[!a]?", "ba", True),
        ("[!a]?", "/b", False),
        ("a[a-c]b", "abb", True),
        ("a[a-c]b", "adb", False),
        ("{a,b}/*.{py,txt}", "b/c.txt", True),
        ("?", ".", False),
        ("*a*b*c", "xaxbxc", True),
        ("*a*b*c", "xaxcxb", False),
    ],
)
def test_semantics(pattern: str, path: str, expected: bool) -> None:
    assert GlobPattern(pattern, anchored=True).match(path, path.rsplit("/", 1)[-1]) is expected


PATHOLOGICAL = [
    ("**/" * 20 + "*.txt", "/".join(f"d{i}" for i in range(60)), False),
    ("**/" * 1300 + "*.txt", "/".join(f"d{i}" for i in range(60)) + "/x.txt", True),
    ("**/d1/**/d1/" * 100 + "*", "/".join(["d1"] * 60), False),
    ("*a" * 1000 + "b", "a" * 255, False),
    ("*a" * 100 + "b", "a" * 200 + "b", True),
    ("?*" * 500 + "x", "y" * 255, False),
]


def test_pathological_patterns_take_time_linear_in_their_input() -> None:
    """Each took minutes (or forever) with the regex. Matched in a child process: a
    regression holds the interpreter lock, which no in-process timeout can interrupt."""
    program = (
        "import json, sys, time\n"
        "from sandlot.dataplane.services.globbing import GlobPattern\n"
        "out = []\n"
        "for pattern, path in json.load(sys.stdin):\n"
        "    t = time.perf_counter()\n"
        "    ok = GlobPattern(pattern, anchored=True).match(path, path.rsplit('/', 1)[-1])\n"
        "    out.append([ok, time.perf_counter() - t])\n"
        "print(json.dumps(out))\n"
    )
    cases = json.dumps([[pattern, path] for pattern, path, _ in PATHOLOGICAL])
    done = subprocess.run(
        [sys.executable, "-c", program], input=cases, capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0, done.stderr
    for (pattern, _, expected), (got, took) in zip(
        PATHOLOGICAL, json.loads(done.stdout), strict=True
    ):
        assert got is expected, pattern[:40]
        assert took < 2, (pattern[:40], took)


def test_brace_expansion_is_bounded() -> None:
    assert len(expand_braces("{a,b}" * 8)) == MAX_ALTERNATIVES
    bombs = ["{a,b}" * 40, "{" + ",".join("x" * 300) + "}", "{" * 2000 + "}" * 2000]
    for bomb in bombs:
        started = time.perf_counter()
        with pytest.raises(ValueError):
            GlobPattern(bomb)
        assert time.perf_counter() - started < 2
    with pytest.raises(ValueError, match="range"):
        GlobPattern("[z-a]")


def test_helper_timestamps_read_as_the_server_writes_them() -> None:
    for ts in (0.0, 1.5, 1_700_000_000.123456, time.time()):
        assert globworker._iso(ts) == iso(ts)


# --- the walk in helper processes ---------------------------------------------------------


@pytest.fixture
def files(tmp_path: Path) -> Iterator[FileOps]:
    with PathResolver([Mount("/workspace", tmp_path, True)]) as resolver:
        yield FileOps(resolver, 1 << 20, 1 << 20, 1000, 1000)


def tree(root: Path, dirs: int, per_dir: int) -> None:
    for d in range(dirs):
        sub = root / f"d{d}"
        sub.mkdir()
        for f in range(per_dir):
            (sub / f"f{f}.txt").touch()


def test_walk_stops_at_its_allowance_or_its_deadline(files: FileOps, tmp_path: Path) -> None:
    tree(tmp_path, 10, 100)
    files.max_glob_results = 10_000
    assert len(files.glob("**/*.txt", "/workspace")["matches"]) == 1000
    files.max_glob_visits = 300
    out = files.glob("**/*.txt", "/workspace")
    assert out["truncated"] and len(out["matches"]) < 300
    files.max_glob_visits = 1 << 20
    files.glob_deadline_seconds = 0.0
    out = files.glob("**/*.txt", "/workspace")
    assert out["truncated"] and len(out["matches"]) < 1000


def test_walk_prunes_and_stops_at_its_depth(files: FileOps, tmp_path: Path) -> None:
    deep = tmp_path.joinpath(*[f"d{i}" for i in range(globworker.MAX_DEPTH + 20)])
    deep.mkdir(parents=True)
    (deep / "x.txt").touch()
    (tmp_path / "d0" / "x.txt").touch()
    out = files.glob("**/x.txt", "/workspace")
    assert out["truncated"] and [m["path"] for m in out["matches"]] == ["/workspace/d0/x.txt"]
    # Without **, the walk goes no deeper than the pattern: nothing is truncated.
    out = files.glob("*/d1/*/d3", "/workspace", relative=True, include_dirs=True)
    assert not out["truncated"]
    assert [m["path"] for m in out["matches"]] == ["/workspace/d0/d1/d2/d3"]


def test_symlinks_are_neither_followed_nor_listed(files: FileOps, tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "a.txt").touch()
    os.symlink("real", tmp_path / "link")
    os.symlink("real/a.txt", tmp_path / "b.txt")
    out = files.glob("**", "/workspace", relative=True, include_dirs=True)
    assert [m["path"] for m in out["matches"]] == ["/workspace/real", "/workspace/real/a.txt"]


def test_a_helper_that_dies_is_replaced(files: FileOps, tmp_path: Path) -> None:
    tree(tmp_path, 2, 3)
    assert len(files.glob("**/*.txt", "/workspace")["matches"]) == 6
    pool = globworker._pool
    with pool._cond:
        idle = list(pool._idle)
    # Killed while idle, as a command of a container's sandbox may (same user): not
    # collected, as nothing waits for it.
    for w in idle:
        os.kill(w.proc.pid, 9)
    time.sleep(0.2)
    # Found dead when taken: the request goes to a fresh helper, and the dead one is
    # collected.
    answers = [len(files.glob("**/*.txt", "/workspace")["matches"]) for _ in range(3)]
    assert answers == [6, 6, 6]
    assert all(w.proc.returncode == -9 for w in idle)


# --- the server's answers ---------------------------------------------------------------


@pytest.fixture
def bounded(tmp_path: Path) -> Iterator[Server]:
    yield from start_server(tmp_path, max_glob_visits=200)


@pytest.mark.parametrize("route", ["/fs/glob", "/glob"])
def test_hostile_patterns_get_clear_answers(bounded: Server, route: str) -> None:
    tree(bounded.workspace, 5, 100)
    with httpx.Client(headers=bounded.headers(), timeout=30) as c:
        for pattern in ["{a,b}" * 40, "{" * 3000 + "}" * 1000, "[z-a]*"]:
            r = c.post(bounded.url(route), json={"pattern": pattern, "path": "/workspace"})
            assert r.status_code == 400, r.text
            assert r.json()["error"]["code"] == "INVALID_REQUEST"
        r = c.post(bounded.url(route), json={"pattern": "**/*.txt"})
        assert r.status_code == 200, r.text
        assert r.json()["truncated"] is True  # 500 files, 200 entries allowed


def test_a_helper_starts_below_the_servers_priority_and_off_the_working_directory(
    files: FileOps, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The server runs where a module the helper imports was written (a container's
    # dataplane runs in /workspace): the helper does not import it.
    (tmp_path / "json").mkdir()
    (tmp_path / "json" / "__init__.py").write_text("raise SystemExit('planted')\n")
    monkeypatch.chdir(tmp_path)
    pool = globworker._pool
    with pool._cond:
        idle = list(pool._idle)
    for w in idle:  # the next glob starts a helper here
        w.kill()
    found = files.glob("*/*.py", "/workspace")["matches"]
    assert [m["path"] for m in found] == ["/workspace/json/__init__.py"]
    with pool._cond:
        helpers = [w.proc.pid for w in pool._idle if w not in idle]
    assert helpers
    ours = os.getpriority(os.PRIO_PROCESS, 0)
    for pid in helpers:
        assert os.getpriority(os.PRIO_PROCESS, pid) == min(19, ours + globworker.NICE)


def test_an_answer_past_its_bound_is_refused_and_its_helper_replaced(
    files: FileOps, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tree(tmp_path, 2, 3)
    monkeypatch.setattr(globworker, "MAX_ANSWER_BYTES", 64)
    with pytest.raises(ProviderUnavailable, match="too large"):
        files.glob("**/*.txt", "/workspace")
    monkeypatch.undo()
    assert len(files.glob("**/*.txt", "/workspace")["matches"]) == 6
