"""``.gitignore`` handling of ``sandlot sync``, checked against git itself."""

from __future__ import annotations

import shutil
import subprocess
import threading
from pathlib import Path

import pytest

from sandlot.cli.ignore import IgnoreFile, parse_rule
from sandlot.cli.trees import TreeFile, scan

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")

FILES = [
    "a.log",
    ".hidden.log",
    "keep.log",
    "build/out.o",
    "build/keep/me.txt",
    "src/main.py",
    "src/main.pyc",
    "src/__pycache__/main.cpython.pyc",
    "src/deep/er/thing.tmp",
    "src/deep/er/notes.md",
    "docs/a.md",
    "docs/internal/b.md",
    "docs/internal/keep.md",
    "node_modules/x/index.js",
    "lib/node_modules/y/index.js",
    "foo/bar/baz.txt",
    "foo/qux/baz.txt",
    "a/b/c/d.txt",
    "a/x.txt",
    "name with space ",
    "name with space",
    "#notcomment",
    "!bang",
    "[x].txt",
    "x.txt",
    "logs/today/app.log",
    "logs/readme",
    ".config/settings.json",
    "data/raw/one.csv",
    "data/clean/one.csv",
    "sub/.gitignore",
    "sub/only.txt",
    "sub/more/only.txt",
    "sub/more/other.txt",
]

ROOT_IGNORE = r"""
# a comment
*.log
!keep.log
build/
!build/keep/
*.py[cod]
__pycache__/
**/deep/**/*.tmp
/docs/internal/*
!/docs/internal/keep.md
node_modules
foo/**/baz.txt
a/**/d.txt
\#notcomment
\!bang
\[x\].txt
logs/**
!logs/readme
.config
data/*/one.csv
!data/clean/*
[z-a]
"""
# An escaped trailing space is part of the name (written apart: editors strip it).
ROOT_IGNORE += "name with space\\ \n"

SUB_IGNORE = """
only.txt
!more/only.txt
/more/other.txt
"""


def _tree(root: Path) -> None:
    for rel in FILES:
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(rel)
    (root / ".gitignore").write_text(ROOT_IGNORE)
    (root / "sub" / ".gitignore").write_text(SUB_IGNORE)


def _git_files(root: Path) -> set[str]:
    """What git would add: tracked-to-be files, ignored ones left out."""
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    out = subprocess.run(
        ["git", "-C", str(root), "ls-files", "--others", "--exclude-standard", "-z"],
        check=True,
        capture_output=True,
    ).stdout
    return {p for p in out.decode().split("\0") if p}


def test_the_files_sent_are_the_files_git_would_add(tmp_path: Path) -> None:
    _tree(tmp_path)
    ours = {f.rel for f in scan(tmp_path).files}
    shutil.rmtree(tmp_path / ".git", ignore_errors=True)
    expected = _git_files(tmp_path)
    assert ours == expected
    # The interesting decisions, spelled out (a change of git's rules would show here).
    assert "keep.log" in ours and "a.log" not in ours and ".hidden.log" not in ours
    assert "build/keep/me.txt" not in ours  # its directory is excluded: no re-include
    assert "docs/internal/keep.md" in ours and "docs/internal/b.md" not in ours
    assert "sub/more/only.txt" in ours and "sub/only.txt" not in ours
    assert "name with space " not in ours and "name with space" in ours


def test_rules_are_read_as_git_reads_them() -> None:
    assert parse_rule("   ") is None
    assert parse_rule("# comment") is None
    assert parse_rule("/") is None
    assert parse_rule("[z-a]") is None  # git never matches an invalid range
    rule = parse_rule("!/docs/")
    assert rule is not None and rule.negate and rule.dir_only
    spec = IgnoreFile.parse("*.tmp\n!keep.tmp\n")
    assert spec.decide("x/y.tmp", False) is True
    assert spec.decide("x/keep.tmp", False) is False
    assert spec.decide("x/y.txt", False) is None


def test_a_pathological_pattern_takes_time_linear_in_the_name(tmp_path: Path) -> None:
    """``*a*a*…*b`` against a long run of ``a``: a backtracking matcher needs time that
    grows exponentially with the stars (minutes here); the automaton needs a moment."""
    (tmp_path / ".gitignore").write_text("*a" * 12 + "*b\n" + "**/" * 40 + "*a*a*a*a*a*c\n")
    deep = tmp_path.joinpath(*["d"] * 40)
    deep.mkdir(parents=True)
    for i in range(20):
        (deep / ("a" * 200 + str(i))).write_text("x")
    result: list[list[TreeFile]] = []
    worker = threading.Thread(target=lambda: result.append(scan(tmp_path).files), daemon=True)
    worker.start()
    worker.join(timeout=60)  # a hang detector, not a timing: linear finishes in well under 1 s
    assert result, "the .gitignore patterns took over a minute to match 20 names"
    assert len(result[0]) == 21  # the 20 names (no 'b' or 'c' at the end) and .gitignore
