"""The grep cache answers exactly what a fresh walk of the tree answers, whatever changed.

Each test copies a tree (a first search), checks that the next search reads the
copy (a hit), changes the tree one way, and checks that the next search answers
what a walk of the tree without the cache answers.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from sandlot.dataplane.services import grep as grep_mod
from sandlot.dataplane.services import grepcache, native
from sandlot.dataplane.services.paths import PathResolver
from sandlot.runtime.base import Mount
from tests.dataplane.conftest import Server

FULL = (grep_mod.SMALL_TREE_FILES, grep_mod.SMALL_TREE_BYTES)


_pool = ThreadPoolExecutor(1, thread_name_prefix="test-pool")


@pytest.fixture(params=["by name", "through /proc"])
def cache(lib: native.Native, request: pytest.FixtureRequest) -> Iterator[grepcache.GrepCache]:
    made = grepcache.GrepCache(lib, by_cwd=request.param == "by name")
    yield made
    made.close()


def search(
    lib: native.Native,
    root: Path,
    cache: grepcache.GrepCache | None,
    pattern: str = "needle",
    glob: str | None = None,
) -> bytes | int:
    """A search, then (if it read the tree) the copy the dataplane takes in the background,
    here right away on a thread like the file pool's."""
    found = grep_mod._NativeSearch(lib, pattern.encode(), glob and glob.encode(), 1000, None, cache)
    with PathResolver([Mount("/workspace", root, True)]) as resolver:
        with resolver.resolve("/workspace") as res:
            answer = found.search(res, *FULL)
        if cache is not None and found.missed is not None:
            copy(cache, resolver, found.missed)
    return answer


def copy(cache: grepcache.GrepCache, resolver: PathResolver, key: grepcache.Key) -> None:
    def run() -> None:
        with resolver.resolve("/workspace") as res:
            fd, _ = grep_mod._open_target(res)
            try:
                cache.load(key, fd, *FULL)
            finally:
                os.close(fd)

    on_pool = threading.current_thread().name.startswith("test-pool")
    run() if on_pool else _pool.submit(run).result()


def watches(cache: grepcache.GrepCache) -> int:
    """The watches the kernel holds for the cache's inotify instance."""
    text = Path(f"/proc/self/fdinfo/{cache._fd}").read_text()
    return sum(1 for line in text.splitlines() if line.startswith("inotify wd:"))


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    root = tmp_path / "ws"
    (root / "sub" / "deeper").mkdir(parents=True)
    (root / "a.txt").write_text("needle a\nother\n")
    (root / "b.py").write_text("no match\nneedle b\n")
    (root / "sub" / "c.txt").write_text("needle c\n")
    (root / "sub" / "deeper" / "d.txt").write_text("x\nneedle d\n")
    (root / "bin.dat").write_bytes(b"needle \x00 binary\n")
    os.symlink("a.txt", root / "link")
    (tmp_path / "outside").mkdir()
    return root


def _append(path: Path, text: str) -> None:
    with path.open("a") as f:
        f.write(text)


def _same_size(root: Path) -> None:
    fd = os.open(root / "a.txt", os.O_WRONLY)
    try:
        os.pwrite(fd, b"needle A", 0)  # same size, within the same clock tick
    finally:
        os.close(fd)


def _hard_link_elsewhere(root: Path) -> Callable[[], None]:
    outside = root.parent / "outside" / "alias.txt"
    os.link(root / "sub" / "c.txt", outside)
    return lambda: _append(outside, "needle through another name\n")


def _replace_atomically(root: Path) -> None:
    tmp = root.parent / "outside" / "new.txt"
    tmp.write_text("needle replaced\n")
    os.replace(tmp, root / "b.py")


def _move_in(root: Path) -> None:
    made = root.parent / "outside" / "m.txt"
    made.write_text("needle m\n")
    made.rename(root / "m.txt")


def _new_directory(root: Path) -> None:
    (root / "n" / "m").mkdir(parents=True)
    (root / "n" / "m" / "f.txt").write_text("needle nested\n")


def _symlink_to_file(root: Path) -> None:
    (root / "link").unlink()
    (root / "link").write_text("needle now a file\n")


CHANGES: dict[str, Callable[[Path], Any]] = {
    "append": lambda r: _append(r / "a.txt", "needle more\n"),
    "truncate": lambda r: os.truncate(r / "b.py", 0),
    "same size in place": _same_size,
    "create": lambda r: (r / "new.txt").write_text("needle new\n"),
    "unlink": lambda r: (r / "a.txt").unlink(),
    "rename inside": lambda r: (r / "a.txt").rename(r / "z.txt"),
    "move in": _move_in,
    "move out": lambda r: (r / "sub" / "c.txt").rename(r.parent / "outside" / "c.txt"),
    "new directory": _new_directory,
    "deep write": lambda r: _append(r / "sub" / "deeper" / "d.txt", "needle deeper\n"),
    "remove directory": lambda r: shutil.rmtree(r / "sub"),
    "binary becomes text": lambda r: (r / "bin.dat").write_bytes(b"needle text\n"),
    "replace atomically": _replace_atomically,
    "symlink becomes file": _symlink_to_file,
    "directory renamed": lambda r: (r / "sub").rename(r / "bus"),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_change_is_seen_by_the_next_search(
    lib: native.Native, cache: grepcache.GrepCache, tree: Path, change: str
) -> None:
    first = search(lib, tree, cache)
    assert isinstance(first, bytes) and first == search(lib, tree, None)
    assert search(lib, tree, cache) == first
    assert cache.stats()["hits"] == 1
    CHANGES[change](tree)
    after = search(lib, tree, cache)
    assert after == search(lib, tree, None) != first
    assert cache.stats()["hits"] == 1  # the copy was dropped, not read
    assert search(lib, tree, cache) == after and cache.stats()["hits"] == 2


def test_a_write_through_another_hard_link(
    lib: native.Native, cache: grepcache.GrepCache, tree: Path
) -> None:
    """The alias is outside the tree: only the file's own watch sees the write."""
    write = _hard_link_elsewhere(tree)
    first = search(lib, tree, cache)
    assert search(lib, tree, cache) == first
    write()
    after = search(lib, tree, cache)
    assert after == search(lib, tree, None) != first
    assert b"through another name" in after  # type: ignore[operator]


def test_permissions_change_what_is_found(
    lib: native.Native, cache: grepcache.GrepCache, tree: Path
) -> None:
    first = search(lib, tree, cache)
    os.chmod(tree / "a.txt", 0o000)
    after = search(lib, tree, cache)
    assert after == search(lib, tree, None)
    assert cache.stats()["hits"] == 0  # as root the text is the same: the copy still went
    os.chmod(tree / "a.txt", 0o644)
    assert search(lib, tree, cache) == first


def test_reading_does_not_drop_a_copy(
    lib: native.Native, cache: grepcache.GrepCache, tree: Path
) -> None:
    search(lib, tree, cache)
    for path in tree.rglob("*"):
        if path.is_file():
            path.read_bytes()
        path.lstat()
    os.listdir(tree / "sub")
    search(lib, tree, cache, "other", "*.txt")
    assert cache.stats()["hits"] == 1


def test_a_change_during_the_copy_is_not_kept(
    lib: native.Native, tree: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file changed after its watch was taken, before the copy is kept: the copy serves
    that one search (it raced the change) and is not kept."""
    cache = grepcache.GrepCache(lib)
    real = lib.fill
    other = tree.parent / "other"
    other.mkdir()
    (other / "o.txt").write_text("needle o\n")

    def racing(*args: Any, **kw: Any) -> native.Fill:
        filled = real(*args, **kw)
        _append(tree / "a.txt", "needle raced\n")
        return filled

    try:
        monkeypatch.setattr(lib, "fill", racing)
        search(lib, tree, cache)
        monkeypatch.setattr(lib, "fill", real)
        assert cache.stats()["copies"] == 0
        assert b"needle raced" in search(lib, tree, cache)  # type: ignore[operator]
        assert cache.stats()["copies"] == 1

        # The event is read by another search (of another tree) while the copy is made.
        def seen_elsewhere(*args: Any, **kw: Any) -> native.Fill:
            filled = real(*args, **kw)
            _append(tree / "b.py", "needle seen elsewhere\n")
            assert search(lib, other, cache) == search(lib, other, None)
            return filled

        search(lib, other, cache)
        _append(tree / "a.txt", "x\n")
        monkeypatch.setattr(lib, "fill", seen_elsewhere)
        search(lib, tree, cache)
        monkeypatch.setattr(lib, "fill", real)
        assert cache.stats()["copies"] == 1  # other's only
        hits = cache.stats()["hits"]
        assert b"seen elsewhere" in search(lib, tree, cache)  # type: ignore[operator]
        assert cache.stats()["hits"] == hits
    finally:
        cache.close()


def test_watches_stay_within_the_budget(lib: native.Native, tree: Path, tmp_path: Path) -> None:
    """A dropped copy's watches stay (idle) for the next copy of the tree, within the budget;
    bytes are bounded too, least recently used copy first out."""
    second = tmp_path / "second"
    second.mkdir()
    (second / "s.txt").write_text("needle s\n" * 200)
    cache = grepcache.GrepCache(lib, max_bytes=1000, max_watches=11)
    try:
        search(lib, tree, cache)
        # Directories ws, sub, deeper; files a.txt, b.py, bin.dat, c.txt, d.txt.
        assert watches(cache) == 8 and cache.stats()["watches"] == 8
        _append(tree / "a.txt", "needle\n")
        search(lib, second, cache)  # drops the first copy; the second is too large to keep
        assert cache.stats()["copies"] == 0
        assert watches(cache) == 10 and cache.stats()["idle_watches"] == 10
        search(lib, tree, cache)  # takes its watches again: the same ones
        assert watches(cache) == 10 and cache.stats()["watches"] == 8
        small = tmp_path / "small"
        small.mkdir()
        (small / "t.txt").write_text("needle t\n" * 100)
        search(lib, small, cache)  # over max_bytes with the first: the first goes
        assert cache.stats()["copies"] == 1 and cache.stats()["watches"] == 2
        assert watches(cache) <= 11  # idle ones removed, oldest first
        assert watches(cache) == cache.stats()["watches"] + cache.stats()["idle_watches"]
        (small / "t.txt").unlink()  # a deleted file's watch goes with it
        search(lib, small, cache)
        assert watches(cache) == cache.stats()["watches"] + cache.stats()["idle_watches"]
    finally:
        cache.close()
    limited = grepcache.GrepCache(lib, max_watches=3)
    try:
        assert search(lib, tree, limited) == search(lib, tree, None)
        assert limited.stats()["copies"] == 0 and watches(limited) <= 3
    finally:
        limited.close()


@pytest.mark.local_only("reads the in-process grep cache's counters")
def test_a_command_s_write_is_in_the_next_grep(server: Server, client: httpx.Client) -> None:
    """Through the dataplane: a command changes a file, and the grep right after sees it."""
    assert native.library() is not None
    (server.workspace / "g").mkdir()
    (server.workspace / "g" / "f.txt").write_text("needle 1\n")

    def grep() -> list[str]:
        r = client.post(server.url("/fs/grep"), json={"pattern": "needle", "path": "g"})
        assert r.status_code == 200, r.text
        return [m["text"] for m in r.json()["matches"]]

    hits = 0
    for i in range(2, 12):
        assert grep() == [f"needle {n}" for n in range(1, i)]
        if i == 2:
            # The cache is the process's: what earlier tests made it count is not ours.
            shared = grepcache._shared
            hits = shared.stats()["hits"] if shared is not None else 0
        r = client.post(
            server.url("/exec"), json={"command": f"echo 'needle {i}' >> g/f.txt", "wait": True}
        )
        assert r.status_code in (200, 201), r.text
        assert r.json()["exit_code"] == 0
    cache = grepcache._shared
    assert cache is not None and cache.stats()["hits"] == hits  # every grep followed a change
    # Without a change, the copy taken in the background answers (and answers the same).
    expected = [f"needle {n}" for n in range(1, 12)]
    for _ in range(100):
        assert grep() == expected
        if cache.stats()["hits"] > hits:
            break
        time.sleep(0.02)
    assert cache.stats()["hits"] > hits
    assert grep() == expected


def test_copying_on_the_pool_leaves_every_working_directory_alone(
    lib: native.Native, cache: grepcache.GrepCache, tree: Path
) -> None:
    """A thread that copies trees has a working directory of its own, left at ``/``: the
    process's (the event loop's, every other thread's) never moves."""
    before = os.getcwd()
    search(lib, tree, cache)
    assert os.getcwd() == before
    seen: list[str] = []
    other = threading.Thread(target=lambda: seen.append(os.getcwd()))
    other.start()
    other.join()
    assert seen == [before]
    if cache.by_cwd:
        assert _pool.submit(os.getcwd).result() == "/"


def test_only_trees_the_cache_would_keep_are_copied(
    lib: native.Native, cache: grepcache.GrepCache, tmp_path: Path
) -> None:
    big = tmp_path / "big"
    big.mkdir()
    for i in range(grep_mod.SMALL_TREE_FILES + 1):
        (big / f"f{i}.txt").write_text("needle\n")
    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / os.fsdecode(b"bad\xffname")).write_text("needle\n")
    for root, status in ((big, native.TOO_BIG), (odd, native.USE_PYTHON)):
        found = grep_mod._NativeSearch(lib, b"needle", None, 1000, None, cache)
        with (
            PathResolver([Mount("/workspace", root, True)]) as resolver,
            resolver.resolve("/workspace") as res,
        ):
            assert found.search(res, *FULL) == status
        assert found.missed is None  # nothing for copy_later to copy


def _random_change(rng: Any, dirs: list[Path], files: list[Path], outside: Path) -> None:
    """One change to the tree (or none, two times in ten)."""
    live = [f for f in files if f.exists()]
    roll = rng.randrange(10)
    target = rng.choice(live) if live else None
    if roll == 0 or target is None:
        made = rng.choice(dirs) / f"n{rng.randrange(1000)}.txt"
        made.write_text("needle new\n")
        files.append(made)
    elif roll == 1:
        _append(target, rng.choice(["needle+\n", "hay\n"]))
    elif roll == 2:
        target.unlink()
    elif roll == 3:
        dest = rng.choice(dirs) / f"r{rng.randrange(1000)}.txt"
        target.rename(dest)
        files.append(dest)
    elif roll == 4:
        os.truncate(target, rng.randrange(0, 12))
    elif roll == 5:
        alias = outside / f"l{rng.randrange(10**9)}"
        os.link(target, alias)
        _append(alias, "needle via alias\n")
    elif roll == 6:
        fd = os.open(target, os.O_WRONLY)
        try:
            os.pwrite(fd, b"NEEDLE", 0)
        finally:
            os.close(fd)
    elif roll == 7:
        made = outside / f"m{rng.randrange(10**9)}"
        made.write_text("needle replaced\n")
        os.replace(made, target)


def test_random_changes_never_leave_a_copy_behind(
    lib: native.Native, cache: grepcache.GrepCache, tmp_path: Path
) -> None:
    """Random trees, random changes in a row (some none): after each, the cached search
    answers what a walk of the tree answers."""
    import random

    rng = random.Random(20261124)
    outside = tmp_path / "outside"
    outside.mkdir()
    hits_before = cache.stats()["hits"]
    for n in range(12):
        root = tmp_path / f"t{n}"
        dirs = [root, root / "a", root / "a" / "b", root / "c"]
        for d in dirs:
            d.mkdir(parents=True)
        files: list[Path] = []
        for i in range(rng.randint(3, 12)):
            f = rng.choice(dirs) / f"f{i}.txt"
            lines = (rng.choice(["needle\n", "hay\n", "x needle y\n"]) for _ in range(5))
            f.write_text("".join(lines))
            files.append(f)
        for _ in range(25):
            _random_change(rng, dirs, files, outside)
            expected = search(lib, root, None)
            assert search(lib, root, cache) == expected
            assert search(lib, root, cache) == expected  # from the copy, when it was kept
    assert cache.stats()["hits"] - hits_before > 100


def test_a_tree_whose_copy_was_refused_is_not_copied_again_at_once(
    lib: native.Native, tree: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = grepcache.GrepCache(lib, max_bytes=10)  # every copy too large to keep
    resolver = PathResolver([Mount("/workspace", tree, True)])
    try:
        found = grep_mod._NativeSearch(lib, b"needle", None, 1000, None, cache)
        with resolver.resolve("/workspace") as res:
            found.search(res, *FULL)
        key = found.missed
        assert key is not None and cache.start_copy(key)
        assert not cache.start_copy(key)  # under way
        copy(cache, resolver, key)
        cache.end_copy(key)
        assert cache.stats()["copies"] == 0
        assert not cache.start_copy(key)  # refused a moment ago
        monkeypatch.setattr(grepcache, "REFUSED_BACKOFF", 0.0)
        assert cache.start_copy(key)
    finally:
        resolver.close()
        cache.close()
