"""The workspace watcher under storms of new directories: bounded work per loop step."""

from __future__ import annotations

import asyncio
import collections
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from sandlot.dataplane.services import watch
from sandlot.dataplane.services.treewalk import remove_tree

DEPTH = 1500


class _Counting:
    """``watch._libc`` counting ``inotify_add_watch`` calls per event loop iteration."""

    def __init__(self, libc: Any) -> None:
        self._libc = libc
        self.step = 0
        self.per_step: collections.Counter[int] = collections.Counter()

    def inotify_add_watch(self, fd: int, path: bytes, mask: int) -> int:
        self.per_step[self.step] += 1
        return int(self._libc.inotify_add_watch(fd, path, mask))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._libc, name)


def _watch_while(
    root: Path, command: str, until: int, monkeypatch: pytest.MonkeyPatch
) -> tuple[_Counting, list[tuple[str, str]], int]:
    counting = _Counting(watch._libc)
    monkeypatch.setattr(watch, "_libc", counting)
    changes: list[tuple[str, str]] = []
    batches: list[int] = []

    def sink(found: list[tuple[str, str]]) -> None:
        batches.append(len(found))
        changes.extend(found)

    async def run() -> int:
        loop = asyncio.get_running_loop()

        def tick() -> None:
            counting.step += 1
            loop.call_soon(tick)

        tick()
        inotify = watch.Inotify()
        tree = inotify.watch(str(root), sink, 0.02)
        try:
            proc = await asyncio.create_subprocess_exec(sys.executable, "-c", command, cwd=root)
            assert await asyncio.wait_for(proc.wait(), 120) == 0
            for _ in range(6000):
                if len(tree.wds) >= until and getattr(tree, "walk", None) is None:
                    break
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.1)
            assert max(batches) <= watch.FLUSH_STEP
            return len(tree.wds)
        finally:
            inotify.unwatch(tree)

    return counting, changes, asyncio.run(run())


def test_a_deep_tree_made_under_watch_is_watched_in_bounded_steps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 1,500 levels made one by one: every level was walked to the bottom from the loop
    # as its creation was read (13 s of one event loop step for every sandbox).
    root = tmp_path / "ws"
    root.mkdir()
    make = f"import os\np = 'd'\nfor _ in range({DEPTH}): p += '/a'; os.makedirs(p)"
    try:
        counting, changes, watched = _watch_while(root, make, DEPTH + 2, monkeypatch)
        assert watched == DEPTH + 2  # the root, d and every level
        assert max(counting.per_step.values()) <= 2 * watch.WALK_STEP
        # Each directory is walked about once, not once per level above it.
        assert sum(counting.per_step.values()) <= 3 * (DEPTH + 2)
        created = {path for path, op in changes if op == "created"}
        assert len(created) == DEPTH + 1
    finally:
        remove_tree(os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY), "ws")


def test_a_wide_tree_past_the_bound_is_reported_unwatched(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(watch, "MAX_DIRS_PER_TREE", 300)
    root = tmp_path / "ws"
    root.mkdir()
    make = "import os\nfor i in range(2000): os.makedirs(f'w/{i // 100}/{i % 100}')"
    counting, changes, watched = _watch_while(root, make, 300, monkeypatch)
    assert watched == 300
    assert max(counting.per_step.values()) <= 2 * watch.WALK_STEP
    unwatched = [path for path, op in changes if op == "unwatched"]
    assert len(unwatched) == 1 and unwatched[0].startswith(str(root / "w") + "/")
    # What was made in the watched directories is still reported.
    assert str(root / "w/0/0") in {path for path, op in changes if op == "created"}
    assert len(os.listdir(root / "w")) == 20


def test_a_directory_swapped_for_a_link_mid_walk_is_not_watched_through_it(
    tmp_path: Path,
) -> None:
    # A directory listed over several loop steps is swapped for a link to a directory
    # outside the workspace (on the host, for the local runtime): its subdirectories,
    # still to be watched by path, were watched and listed there, their names reported
    # as the workspace's, and changes there reported for good.
    root = tmp_path / "ws"
    (root / "x" / "sub").mkdir(parents=True)
    for i in range(4 * watch.WALK_STEP):
        (root / "x" / f"f{i}").touch()
    outside = tmp_path / "outside"
    (outside / "sub").mkdir(parents=True)
    (outside / "sub" / "host-secret").touch()
    changes: list[tuple[str, str]] = []

    async def run() -> watch.Tree:
        inotify = watch.Inotify()
        tree = inotify.watch(str(root), changes.extend, 0.01)
        try:
            assert tree.listing is not None  # x is being listed, over several steps
            os.rename(root / "x", root / "x2")
            os.symlink(outside, root / "x")
            for _ in range(500):
                if tree.walk is None and tree.listing is None and not tree.todo:
                    break
                await asyncio.sleep(0.01)
            (outside / "sub" / "made-later").touch()
            await asyncio.sleep(0.2)
            watched = [path for t, path in inotify._wds.values() if t is tree]
            assert not [p for p in watched if p.startswith(str(root / "x") + "/")], watched
            return tree
        finally:
            inotify.unwatch(tree)

    asyncio.run(run())
    assert not [path for path, _ in changes if "host-secret" in path or "made-later" in path]
