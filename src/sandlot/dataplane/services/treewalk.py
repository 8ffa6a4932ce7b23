"""Walking a directory tree that the sandbox may change meanwhile.

``os.fwalk`` and ``shutil.rmtree`` recurse (a tree deeper than Python's recursion
limit, which a sandbox makes with a loop of ``mkdir d; cd d``, failed them), and
``fwalk`` opens a subdirectory it listed with a plain ``open``: a FIFO swapped in
meanwhile held the walk for good, and a link to a directory was listed as one. Here:

- no recursion: a stack of the directories being walked, as deep as paths go;
- entries are told apart without following links (a link is never entered);
- a subdirectory is opened ``O_DIRECTORY | O_NOFOLLOW | O_NONBLOCK`` from its
  parent's descriptor, so whatever replaced it (a link, a FIFO, a file) is refused
  at once rather than followed or waited on;
- at most :data:`MAX_FDS` descriptors are held however deep the tree: the shallower
  levels are closed and reopened by name (one component at a time, with the same
  flags) when the walk comes back to them.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")

_O_WALK = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC

#: Directory descriptors one walk holds at most.
MAX_FDS = 64

#: Errors that mean an entry is no longer the directory it was listed as.
NOT_A_DIRECTORY = (errno.ENOTDIR, errno.ELOOP, errno.ENOENT)


def open_dir(name: str, dir_fd: int) -> int:
    """Open the subdirectory ``name`` of ``dir_fd``; never follows a link, never waits."""
    return os.open(name, _O_WALK, dir_fd=dir_fd)


def list_dir(fd: int) -> list[tuple[str, bool]]:
    """``(name, is a directory)`` of the entries of the directory ``fd``, links not followed."""
    with os.scandir(fd) as it:
        return [(e.name, e.is_dir(follow_symlinks=False)) for e in it]


class DirStack:
    """The directories from ``top`` (a descriptor, borrowed) down to the one being walked."""

    def __init__(self, top: int) -> None:
        self._top = top
        self._names: list[str] = []
        self._fds: list[int | None] = []
        self._open = 0

    @property
    def depth(self) -> int:
        return len(self._names)

    def fd(self) -> int:
        """The descriptor of the deepest directory (reopened when it was let go)."""
        if not self._fds:
            return self._top
        fd = self._fds[-1]
        if fd is not None:
            return fd
        # Down again from the nearest level still open, keeping the last few.
        start = len(self._fds) - 1
        while start > 0 and self._fds[start - 1] is None:
            start -= 1
        keep_from = max(start, len(self._fds) - MAX_FDS // 2)
        parent = self._top if start == 0 else self._fds[start - 1]
        assert parent is not None
        passing = False  # whether ``parent`` was opened only to pass through it
        for i in range(start, len(self._fds)):
            fd = open_dir(self._names[i], parent)
            if passing:
                os.close(parent)
            passing = i < keep_from
            if not passing:
                self._fds[i] = fd
                self._open += 1
            parent = fd
        self._shed()
        return parent

    def push(self, name: str) -> int:
        """Enter the subdirectory ``name`` of the deepest directory; its descriptor."""
        fd = open_dir(name, self.fd())
        self._names.append(name)
        self._fds.append(fd)
        self._open += 1
        self._shed()
        return fd

    def pop(self) -> str:
        """Leave the deepest directory; its name."""
        fd = self._fds.pop()
        if fd is not None:
            os.close(fd)
            self._open -= 1
        return self._names.pop()

    def _shed(self) -> None:
        # The shallowest levels are the last the walk needs again.
        i = 0
        while self._open > MAX_FDS and i < len(self._fds) - 1:
            fd = self._fds[i]
            if fd is not None:
                os.close(fd)
                self._fds[i] = None
                self._open -= 1
            i += 1

    def close(self) -> None:
        for fd in self._fds:
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._fds.clear()
        self._names.clear()
        self._open = 0


class TreeWalk(Generic[T]):
    """A depth-first walk of the directory ``top`` (a descriptor, borrowed) on a
    :class:`DirStack`: iterating yields ``(name, is a directory, context)`` for each entry
    of the directory being walked, whose descriptor :meth:`fd` is. A directory is walked
    only when the caller :meth:`enter` s it (with the context its entries carry), at once,
    before the rest of its parent; ``left(name, parent_fd)`` is called as the walk leaves
    it. Entries come in the order listed with ``listed_order``, else the reverse."""

    def __init__(
        self,
        top: int,
        context: T,
        *,
        listed_order: bool = False,
        left: Callable[[str, int], None] | None = None,
    ) -> None:
        self._stack = DirStack(top)
        self._listed_order = listed_order
        self._left = left
        self._todo: list[tuple[list[tuple[str, bool]], T]] = [(self._listing(top), context)]

    def _listing(self, fd: int) -> list[tuple[str, bool]]:
        entries = list_dir(fd)
        if self._listed_order:
            entries.reverse()  # :meth:`list.pop` takes them from the end
        return entries

    def __iter__(self) -> Iterator[tuple[str, bool, T]]:
        todo = self._todo
        while todo:
            entries, context = todo[-1]
            if not entries:
                todo.pop()
                if todo:
                    name = self._stack.pop()
                    if self._left is not None:
                        self._left(name, self._stack.fd())
                continue
            name, is_dir = entries.pop()
            yield name, is_dir, context

    def fd(self) -> int:
        """The directory holding the entry last yielded (until :meth:`enter`)."""
        return self._stack.fd()

    def enter(self, name: str, context: T) -> bool:
        """Walk the subdirectory ``name`` next; ``False`` when it is no longer a directory
        (a link, a FIFO, gone: never followed, never waited on)."""
        try:
            fd = self._stack.push(name)
        except OSError as exc:
            if exc.errno not in NOT_A_DIRECTORY:
                raise
            return False
        self._todo.append((self._listing(fd), context))
        return True

    def again(self, name: str, is_dir: bool) -> None:
        """Yield ``name`` once more, as the next entry (it changed kind meanwhile)."""
        self._todo[-1][0].append((name, is_dir))

    def close(self) -> None:
        self._stack.close()


def remove_tree(dir_fd: int, name: str) -> None:
    """Remove the directory ``name`` of ``dir_fd`` and everything in it (links are removed,
    never followed); whatever the sandbox adds meanwhile may make it fail, never hang."""

    def rmdir(entry: str, parent: int) -> None:
        os.rmdir(entry, dir_fd=parent)

    top = open_dir(name, dir_fd)
    walk: TreeWalk[None] = TreeWalk(top, None, left=rmdir)
    try:
        for entry, is_dir, _ in walk:
            if is_dir:
                if not walk.enter(entry, None):
                    # Not a directory any more: whatever it is now goes.
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(entry, dir_fd=walk.fd())
                continue
            try:
                os.unlink(entry, dir_fd=walk.fd())
            except IsADirectoryError:
                walk.again(entry, True)  # a directory made meanwhile
            except FileNotFoundError:
                pass
    finally:
        walk.close()
        os.close(top)
    os.rmdir(name, dir_fd=dir_fd)
