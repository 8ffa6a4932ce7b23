"""The C search of a small tree writes exactly what the Python search writes, byte for byte,
and so does the search of the grep cache's copy of the tree (``sandlot_grep_pack``)."""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from sandlot.dataplane.http.web import dumps
from sandlot.dataplane.services import grep as grep_mod
from sandlot.dataplane.services import grepcache, native
from sandlot.dataplane.services.paths import PathResolver
from sandlot.runtime.base import Mount

FULL = (grep_mod.SMALL_TREE_FILES, grep_mod.SMALL_TREE_BYTES)


_cache: grepcache.GrepCache | None = None
_pool = ThreadPoolExecutor(1, thread_name_prefix="test-pool")


@pytest.fixture(scope="module", autouse=True)
def cache(lib: native.Native) -> Iterator[grepcache.GrepCache]:
    """One cache for the module: a tree's first search copies it, the next ones read it."""
    global _cache
    _cache = grepcache.GrepCache(lib)
    yield _cache
    _cache.close()


#: Searches of a copy that answered (and so were compared with the C walk's answer).
copies_answered = [0]


def both(
    lib: native.Native,
    root: Path,
    pattern: str,
    glob: str | None,
    cap: int = 1000,
    budget: tuple[int, int] = FULL,
    path: str = "/workspace",
) -> tuple[bytes | None, bytes | int]:
    """(the Python answer, None when it hands over to ripgrep; the C answer or status)."""
    with PathResolver([Mount("/workspace", root, True)]) as resolver:
        return _both(resolver, lib, root, pattern, glob, cap, budget, path)


def _both(
    resolver: PathResolver,
    lib: native.Native,
    root: Path,
    pattern: str,
    glob: str | None,
    cap: int,
    budget: tuple[int, int],
    path: str,
) -> tuple[bytes | None, bytes | int]:
    with resolver.resolve(path) as res:
        found = grep_mod._search_small(res, pattern.encode(), glob, cap)
    search = grep_mod._NativeSearch(lib, pattern.encode(), glob and glob.encode(), cap)
    with resolver.resolve(path) as res:
        fast = search.search(res, *budget)
    # The cache's copy: the first search of a tree reads it and has it copied (here right
    # away, on a thread like the file pool's), the next ones read the copy.
    copied = grep_mod._NativeSearch(
        lib, pattern.encode(), glob and glob.encode(), cap, cache=_cache
    )
    assert _cache is not None
    hits = _cache.stats()["hits"]
    with resolver.resolve(path) as res:
        copy = copied.search(res, *budget)
    if _cache.stats()["hits"] == hits and copied.missed is not None:
        key = copied.missed

        def on_pool() -> None:
            assert _cache is not None
            with resolver.resolve(path) as res:
                fd, _ = grep_mod._open_target(res)
                try:
                    _cache.load(key, fd, *FULL)
                finally:
                    os.close(fd)

        _pool.submit(on_pool).result()
        with resolver.resolve(path) as res:
            copy = copied.search(res, *budget)
    if _cache.stats()["hits"] == hits:
        copy = native.USE_PYTHON  # not answered from a copy: nothing to compare
    if isinstance(copy, bytes):
        # A copy is searched whatever the number of files (its bytes are the budget):
        # it answers what a walk with the full budget answers.
        copies_answered[0] += 1
        reference = fast
        if budget != FULL:
            with resolver.resolve(path) as res:
                reference = search.search(res, *FULL)
        assert copy == reference, (root, pattern, glob, cap)
    else:
        # A copy holds the whole tree: an odd name anywhere hands it back, even one a
        # walk stopped at the cap never reached.
        assert copy in (native.TOO_BIG, native.USE_PYTHON)
        if copy == native.TOO_BIG:
            assert fast == native.TOO_BIG or budget != FULL
    return (None if found is None else dumps(found)), fast


LINES = [
    b"plain ascii line with needle",
    b'quotes " and \\ backslashes \\" needle',
    b"tabs\tand\rcarriage\x01control\x1f\x7fdel needle",
    "unicode é 漢字 🙂 \u2028 needle".encode(),
    b"no pattern on this one",
    b"needle needle twice on one line",
    b"",
]

NAMES = ["a.py", "b.txt", "é.py", "漢.txt", 'q"uote.py', "back\\slash.txt", "tab\tname", " sp"]


def random_file(rng: random.Random) -> bytes:
    lines = [rng.choice(LINES) for _ in range(rng.randint(0, 12))]
    roll = rng.random()
    if roll < 0.08:
        lines.insert(rng.randrange(len(lines) + 1), b"bad \xff\xfe utf-8 needle")
    elif roll < 0.12:
        lines.append(b"binary \x00 needle")
    elif roll < 0.16:
        # Long lines: the text is cut at 2,000 characters, multibyte ones around the cut.
        unit = rng.choice(["x", "é", "漢", "🙂"]).encode()
        lines.append(unit * rng.randint(1990, 2010) + b" needle " + unit * 50)
    body = b"\n".join(lines)
    return body + (b"\n" if rng.random() < 0.7 else b"")


def random_tree(rng: random.Random, root: Path, depth: int = 0) -> None:
    root.mkdir(parents=True, exist_ok=True)
    for _ in range(rng.randint(1, 6)):
        name = rng.choice(NAMES) + str(rng.randint(0, 9))
        if os.path.lexists(root / name):
            continue
        roll = rng.random()
        if roll < 0.2 and depth < 3:
            random_tree(rng, root / rng.choice([name, ".git", ".hidden"]), depth + 1)
        elif roll < 0.25:
            os.symlink("/etc/passwd", root / name)
        elif roll < 0.27:
            os.mkfifo(root / name)
        elif roll < 0.29:
            (root / os.fsdecode(b"raw\xffname" + str(rng.randint(0, 9)).encode())).write_bytes(
                b"needle\n"
            )
        else:
            (root / name).write_bytes(random_file(rng))


def test_random_trees_same_text(lib: native.Native, tmp_path: Path) -> None:
    rng = random.Random(20261123)
    answered = handed = 0
    for n in range(60):
        root = tmp_path / f"t{n}"
        random_tree(rng, root)
        for _ in range(8):
            pattern = rng.choice(["needle", "ne", "e", '"', "\\", "é", "漢字", "\t", "x" * 3])
            glob = rng.choice([None, None, "*", "*.py", "?.txt*", "*.t?t?", "a*", "*é*", "??"])
            cap = rng.choice([1, 2, 5, 1000])
            python, fast = both(lib, root, pattern, glob, cap)
            if fast == native.USE_PYTHON:
                handed += 1
                continue
            answered += 1
            if fast == native.TOO_BIG:
                assert python is None, (pattern, glob)
            else:
                assert fast == python, (root, pattern, glob, cap)
    # Most searches are answered in C; only odd names and lines are handed back.
    assert answered > 3 * handed, (answered, handed)
    assert copies_answered[0] > 2 * handed, copies_answered


def test_globs_mean_what_fnmatch_means(lib: native.Native, tmp_path: Path) -> None:
    names = ["a.py", "ab.py", "a.pyc", ".py", "é.py", "漢字.txt", "x.t", "abcabc", "a*b", "q?x"]
    root = tmp_path / "ws"
    root.mkdir()
    for name in names:
        (root / name).write_text("needle\n")
    for glob in ["*.py", "a*", "*", "?.py", "??.py", "*b*c", "a*b*c*", "?", "*.?", "a?b", "x"]:
        python, fast = both(lib, root, "needle", glob)
        assert fast == python, glob


def test_budgets(lib: native.Native, tmp_path: Path) -> None:
    root = tmp_path / "ws"
    (root / "sub").mkdir(parents=True)
    for i in range(40):
        (root / f"f{i}.txt").write_text("needle\n" * 10)
        (root / "sub" / f"g{i}.txt").write_text("other\n")
    _, inline = both(lib, root, "needle", None, budget=(grep_mod.INLINE_FILES, 1 << 20))
    assert inline == native.TOO_BIG  # 80 files
    python, fast = both(lib, root, "needle", None)
    assert isinstance(fast, bytes) and fast == python
    _, small = both(lib, root, "needle", None, budget=(256, 1000))
    assert small == native.TOO_BIG  # 80 x 70 bytes to read
    # Truncation: the first `cap` matches in walk order, and the flag.
    python, fast = both(lib, root, "needle", None, cap=15)
    assert fast == python and fast.endswith(b'"truncated":true}')  # type: ignore[union-attr]
    # A UTF-16 file is ripgrep's (it transcodes); a single file is the Python path's.
    (root / "utf16.txt").write_bytes("needle".encode("utf-16"))
    python, fast = both(lib, root, "needle", None)
    assert python is None and fast == native.TOO_BIG
    _, single = both(lib, root, "needle", None, path="/workspace/f1.txt")
    assert single == native.USE_PYTHON


def test_unreadable_and_raced_entries_are_left_out(lib: native.Native, tmp_path: Path) -> None:
    root = tmp_path / "ws"
    (root / "locked").mkdir(parents=True)
    (root / "locked" / "in.txt").write_text("needle\n")
    (root / "ok.txt").write_text("needle\n")
    os.chmod(root / "locked", 0)
    try:
        python, fast = both(lib, root, "needle", None)
        assert fast == python
    finally:
        os.chmod(root / "locked", 0o755)


def test_deep_trees_go_to_ripgrep(lib: native.Native, tmp_path: Path) -> None:
    root = tmp_path / "ws"
    root.mkdir()
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        # Deeper than any path name may be: built one relative step at a time.
        for _ in range(grep_mod.MAX_DEPTH + 2):
            os.mkdir("d", dir_fd=fd)
            sub = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = sub
        os.close(os.open("f.txt", os.O_CREAT | os.O_WRONLY, 0o644, dir_fd=fd))
    finally:
        os.close(fd)
    python, fast = both(lib, root, "needle", None)
    assert python is None and fast == native.TOO_BIG
    shallow = tmp_path / "shallow"
    (shallow / ("d/" * grep_mod.MAX_DEPTH)).mkdir(parents=True)
    (shallow / ("d/" * grep_mod.MAX_DEPTH) / "f.txt").write_text("needle\n")
    python, fast = both(lib, shallow, "needle", None)
    assert python is not None and fast == python
