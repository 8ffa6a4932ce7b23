"""The in-process search of small trees gives exactly what ripgrep gives on the same tree."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest

from sandlot.dataplane.services import grep as grep_mod
from sandlot.dataplane.services.paths import PathResolver
from sandlot.protocol.sessions import Template
from sandlot.runtime.base import Mount
from sandlot.runtime.direct import DirectRuntime


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    root = tmp_path / "ws"
    (root / "src" / "pkg").mkdir(parents=True)
    (root / ".git").mkdir()
    (root / ".hidden").mkdir()
    (root / "src" / "a.py").write_text("import os\nneedle = 1\n\nprint(needle)  # needle twice\n")
    (root / "src" / "pkg" / "b.txt").write_text("no match here\nsecond needle\r\nthird\n")
    (root / "src" / "pkg" / "last.py").write_text("needle at the end, no newline")
    (root / "src" / "pkg" / "uni.py").write_text("héllo needle ünïcode\n")
    (root / "src" / "bad.bin").write_bytes(b"needle\x00binary")
    (root / "src" / "latin1.txt").write_bytes(b"caf\xe9 needle\n")
    (root / "src" / "long.txt").write_text("x" * 9000 + " needle\n")
    (root / ".git" / "config").write_text("needle in git\n")
    (root / ".hidden" / "h.py").write_text("hidden needle\n")
    (root / "src" / "empty.py").write_text("")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.py").write_text("needle outside\n")
    os.symlink(outside, root / "src" / "link_dir")
    os.symlink(outside / "secret.py", root / "src" / "link_file.py")
    os.mkfifo(root / "src" / "fifo.py")
    return root


_opened: list[PathResolver] = []


def request_close(resolver: PathResolver) -> None:
    """Close ``resolver`` (its mount's directory) when the test ends."""
    _opened.append(resolver)


@pytest.fixture(autouse=True)
def _close_resolvers() -> Any:
    yield
    while _opened:
        _opened.pop().close()


def _ripgrep(resolver: PathResolver, root: Path, path: str, args: list[str], cap: int) -> Any:
    """ripgrep's answer, as ``/fs/grep`` runs it (through a plain-process runtime)."""
    runtime = DirectRuntime("sb_small", 1, Template(name="t", image="host"), root)

    async def run() -> Any:
        with resolver.resolve(path) as res:
            target = grep_mod._Target.of(res)
        return await grep_mod._ripgrep(runtime, target, args, cap, 30.0, None)

    return asyncio.run(run())


def _both(root: Path, path: str, pattern: str, glob: str | None, cap: int = 1000) -> Any:
    flags = ["--fixed-strings"] + ([f"--glob={glob}"] if glob else [])
    with PathResolver([Mount("/workspace", root, True)]) as resolver:
        slow = _ripgrep(resolver, root, path, [*flags, "-e", pattern], cap)
        with resolver.resolve(path) as res:
            fast = grep_mod._search_small(res, pattern.encode(), glob, cap)
    assert fast is not None

    def key(m: dict[str, Any]) -> tuple[str, int]:
        return (m["path"], m["line"])

    return sorted(slow["matches"], key=key), sorted(fast["matches"], key=key), slow, fast


@pytest.mark.parametrize(
    ("path", "pattern", "glob"),
    [
        ("/workspace", "needle", None),
        ("/workspace", "needle", "*.py"),
        ("/workspace", "needle", "[ab].*"),
        ("/workspace/src", "needle", "?.txt"),
        ("/workspace/src/a.py", "needle", None),
        ("/workspace", "ünï", None),
        ("/workspace", "nothing matches this", None),
        ("/workspace", "e", None),
    ],
)
def test_same_matches_as_ripgrep(tree: Path, path: str, pattern: str, glob: str | None) -> None:
    slow, fast, _, _ = _both(tree, path, pattern, glob)
    assert fast == slow
    for m in fast:
        assert "outside" not in m["text"] and "/.git/" not in m["path"]


def test_truncation_matches_ripgrep(tree: Path) -> None:
    _, fast, slow_raw, fast_raw = _both(tree, "/workspace", "e", None, cap=3)
    assert fast_raw["truncated"] is slow_raw["truncated"] is True
    assert len(fast) == len(slow_raw["matches"]) == 3


def test_large_trees_and_binary_files_go_to_ripgrep(tree: Path, monkeypatch: Any) -> None:
    resolver = PathResolver([Mount("/workspace", tree, True)])
    request_close(resolver)
    with resolver.resolve("/workspace/src/bad.bin") as res:
        assert grep_mod._search_small(res, b"needle", None, 10) is None
    monkeypatch.setattr(grep_mod, "SMALL_TREE_FILES", 3)
    with resolver.resolve("/workspace") as res:
        assert grep_mod._search_small(res, b"needle", None, 10) is None
    (tree / "src" / "utf16.txt").write_bytes("needle".encode("utf-16"))
    monkeypatch.setattr(grep_mod, "SMALL_TREE_FILES", 256)
    with resolver.resolve("/workspace") as res:
        assert grep_mod._search_small(res, b"needle", None, 10) is None


def test_a_large_tree_is_told_apart_without_reading_a_file(tree: Path, monkeypatch: Any) -> None:
    # Counting directory entries decides; no file is opened before handing over to ripgrep.
    def never(*_: Any) -> None:
        raise AssertionError("a file was read")

    resolver = PathResolver([Mount("/workspace", tree, True)])
    request_close(resolver)
    with monkeypatch.context() as m, resolver.resolve("/workspace") as res:
        m.setattr(grep_mod, "_read_small", never)
        m.setattr(grep_mod, "SMALL_TREE_FILES", 8)  # the tree holds 9 regular files
        fds = len(os.listdir("/proc/self/fd"))
        assert grep_mod._search_small(res, b"needle", None, 10) is None
        # Stopping the count early leaves no directory open.
        assert len(os.listdir("/proc/self/fd")) == fds
    monkeypatch.setattr(grep_mod, "SMALL_TREE_FILES", 9)
    with resolver.resolve("/workspace") as res:
        assert grep_mod._search_small(res, b"needle", None, 10) is not None


@pytest.mark.parametrize(
    ("glob", "simple"),
    [
        (None, True),
        ("*.py", True),
        ("src/*.py", False),
        ("*.{py,txt}", False),
        ("!x", False),
        ("[ab].*", True),
        ("[]a]x", True),
        ("a[", False),  # ripgrep: unclosed character class (400); fnmatch: a literal "["
        ("[z-a]", False),  # ripgrep: invalid range (400)
    ],
)
def test_only_globs_with_a_plain_meaning_take_the_fast_path(glob: str | None, simple: bool) -> None:
    assert grep_mod._simple_glob(glob) is simple
