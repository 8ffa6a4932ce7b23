"""``sandlot sync`` and ``sandlot pull``: a local tree into a sandbox, and back.

The sandbox is a thread's (``THREAD[:DIR]``) or one named by id (``--sandbox ID[:DIR]``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import stat
import time
from collections.abc import AsyncIterator, Iterable
from pathlib import Path, PurePosixPath
from typing import Any

import typer
from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

from sandlot.cli.client import console, run, shown, split_target
from sandlot.cli.context import IdleTimeoutOption, KeyOption, SandboxDirOption, UrlOption
from sandlot.cli.errors import err_console, fail
from sandlot.cli.pulls import PullError, pull_tree
from sandlot.cli.settings import CliSettings
from sandlot.cli.trees import Entry, LocalTree, load_manifest, save_manifest, scan, tar_stream, walk
from sandlot.protocol.errors import SandlotError
from sandlot.sdk import ArchiveResult, AsyncSandbox, AsyncSandlot, FileNotFound, RequestTimeout

DEFAULT_REMOTE = "/workspace"


async def _aiter(chunks: Any) -> AsyncIterator[bytes]:
    for chunk in chunks:
        yield chunk
        await asyncio.sleep(0)


async def push(
    sandbox: AsyncSandbox,
    source: LocalTree | Iterable[Entry],
    remote: str,
    *,
    delete: bool,
    show: bool,
    digests: dict[str, str] | None = None,
    idle: float | None = None,
) -> ArchiveResult:
    """Send a tree as one tar stream into ``remote`` (with a progress bar when ``show``).

    ``source`` is a scanned tree or the entries of a walk still going on (the
    upload then starts with the first entry, and the bar counts bytes without a
    total). ``digests`` receives the SHA-256 of every file sent, for the manifest.
    ``idle``: seconds the transfer may go without a byte moving (no overall deadline).
    """
    if not show:
        stream = tar_stream(source, digests=digests)
        return await _upload(sandbox, remote, stream, delete, idle)
    total = source.total_bytes if isinstance(source, LocalTree) else None
    with Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        console=err_console,
        transient=False,
    ) as progress:
        task = progress.add_task("sync", total=total)
        stream = tar_stream(source, progress=lambda n: progress.advance(task, n), digests=digests)
        return await _upload(sandbox, remote, stream, delete, idle)


async def _upload(
    sandbox: AsyncSandbox, remote: str, stream: Any, delete: bool, idle: float | None
) -> ArchiveResult:
    # No deadline on the whole transfer (a large tree takes what it takes): ``idle``
    # bounds each step instead.
    return await sandbox.upload_archive(
        remote, _aiter(stream), delete_missing=delete, idle_timeout=idle
    )


def sync_command(
    local_dir: Path = typer.Argument(..., help="The local directory to send."),
    target: str | None = typer.Argument(
        None,
        metavar="[THREAD[:DIR]]",
        help="THREAD or THREAD:/remote/dir (default dir: /workspace), or --sandbox.",
        show_default=False,
    ),
    sandbox_id: str | None = SandboxDirOption,
    delete: bool = typer.Option(
        False, "--delete", help="Remove remote files the local tree does not have."
    ),
    watch: bool = typer.Option(False, "--watch", help="Keep pushing local changes until Ctrl-C."),
    idle_timeout: float | None = IdleTimeoutOption,
    url: str = UrlOption,
    api_key: str = KeyOption,
) -> None:
    """Send a local tree into the thread's sandbox (or --sandbox ID) as one tar stream
    (honours .gitignore).

    Links pointing out of the tree are not sent (the sandbox refuses them). With
    --delete, nothing is removed in the sandbox when part of the local tree could
    not be read: the command then says what, and exits with status 1.
    """
    dest, remote = split_target(target, sandbox_id)
    if not local_dir.is_dir():
        raise fail(f"{local_dir} is not a directory", 2)
    remote = remote or DEFAULT_REMOTE
    root = local_dir.resolve()
    where = dest.thread or dest.sandbox_id

    async def body(client: AsyncSandlot, settings: CliSettings) -> int:
        sandbox = await dest.open(client)
        started = time.monotonic()
        digests: dict[str, str] = {}
        tree = LocalTree(root)
        source: LocalTree | Iterable[Entry]
        if delete:
            # What to remove is known only once the whole tree was read: walked first.
            tree = source = scan(root, check_readable=True)
        else:
            # The tree is walked while it is sent: the sandbox starts on the first files.
            source = walk(root, tree)
        # A part of the tree that could not be read may hold what the sandbox has.
        delete_missing = delete and not tree.errors
        idle = settings.idle_timeout
        try:
            result = await push(
                sandbox,
                source,
                remote,
                delete=delete_missing,
                show=True,
                digests=digests,
                idle=idle,
            )
        except RequestTimeout:
            raise fail(f"nothing moved for {idle:g} s (--idle-timeout)") from None
        save_manifest(root, digests)
        err_console.print(
            f"synced {len(tree.files)} files ({tree.total_bytes} bytes) to {where}:{remote} "
            f"in {time.monotonic() - started:.2f} s"
            + (f", {result.deleted} removed" if result.deleted else "")
        )
        _warn_skipped(tree)
        if delete and tree.errors:
            err_console.print(
                "[bold red]error:[/] nothing removed in the sandbox (--delete): "
                f"{len(tree.errors)} local paths could not be read"
            )
        if watch:
            await _watch_and_push(sandbox, root, remote, idle)
        return 1 if delete and tree.errors else 0

    raise typer.Exit(run(url, api_key, body, idle_timeout=idle_timeout))


def _names(items: list[tuple[str, str]]) -> str:
    """The first few ``(name, detail)`` as a list to print, and how many more."""
    listed = ", ".join(f"{shown(a)} ({shown(b)})" for a, b in items[:SHOWN_NAMES])
    more = len(items) - SHOWN_NAMES
    return listed + (f" and {more} more" if more > 0 else "")


def _warn_skipped(tree: LocalTree) -> None:
    if tree.links_out:
        err_console.print(
            f"[yellow]skipped {len(tree.links_out)} links[/] pointing out of the tree: "
            + _names(tree.links_out)
        )
    if tree.errors:
        err_console.print(
            f"[yellow]could not read {len(tree.errors)} local paths[/]: " + _names(tree.errors)
        )


async def _watch_and_push(sandbox: AsyncSandbox, root: Path, remote: str, idle: float) -> None:
    """Push what changes locally, file by file, as it changes.

    File events only wake the loop; what to send is decided by comparing the
    tree with what was last sent (size and mtime), so nothing is missed between
    the first sync and the moment the watcher started, or in a burst of events.
    A file is removed in the sandbox only once it is gone from the disk (or is no
    longer a file): one newly ignored, or in a directory that cannot be read, is
    left there. A failed round is reported and tried again at the next change.
    """
    from watchfiles import awatch

    def index(tree: LocalTree) -> dict[str, tuple[int, float]]:
        return {f.rel: (f.size, f.mtime) for f in tree.files}

    sent = index(scan(root))
    manifest = load_manifest(root)
    failed = False
    err_console.print(f"[dim]watching {root} (Ctrl-C to stop)[/]")
    async for changes in awatch(root, debounce=200, yield_on_timeout=True, rust_timeout=1000):
        if failed and not changes:
            continue
        tree = scan(root)
        now = index(tree)
        changed = [f for f in tree.files if sent.get(f.rel) != now[f.rel]]
        # Only what this sync sent is removed remotely, never the sandbox's own files.
        gone = sorted(rel for rel in set(sent) - set(now) if not _is_file(root / rel))
        try:
            # Removals first: a file replaced by a directory of the same name goes
            # before what the directory holds is sent.
            for rel in gone:
                with contextlib.suppress(FileNotFound):
                    await sandbox.delete(str(PurePosixPath(remote) / rel), recursive=True)
                manifest.pop(rel, None)
                del sent[rel]
            if changed:
                subset = LocalTree(root, files=changed, dirs=_parents([f.rel for f in changed]))
                await push(
                    sandbox, subset, remote, delete=False, show=False, digests=manifest, idle=idle
                )
        except (SandlotError, OSError) as exc:
            failed = True
            message = exc.message if isinstance(exc, SandlotError) else str(exc)
            err_console.print(
                f"[bold red]error:[/] {shown(message)} (tried again at the next change)"
            )
            save_manifest(root, manifest)
            continue
        failed = False
        if changed or gone:
            # A file no longer listed but still there (ignored now, or unreadable) is
            # forgotten, not removed: listed again, it is sent again.
            sent = now
            save_manifest(root, manifest)
            stamp = time.strftime("%H:%M:%S")
            console.print(f"[dim]{stamp}[/] pushed {len(changed)} changed, {len(gone)} removed")


def _is_file(path: Path) -> bool:
    """Whether a regular file (not a link, not a directory) is at ``path``; ``True`` when
    that cannot be known (a directory on the way cannot be read)."""
    try:
        return stat.S_ISREG(path.lstat().st_mode)
    except (FileNotFoundError, NotADirectoryError):
        return False
    except OSError:
        return True


async def _closed(chunks: AsyncIterator[bytes]) -> None:
    aclose = getattr(chunks, "aclose", None)
    if aclose is not None:
        await aclose()


def _parents(rels: list[str]) -> list[str]:
    dirs: set[str] = set()
    for rel in rels:
        parent = PurePosixPath(rel).parent
        while str(parent) not in (".", ""):
            dirs.add(str(parent))
            parent = parent.parent
    return sorted(dirs, key=lambda d: (d.count("/"), d))


#: The default of ``pull --max-bytes``.
DEFAULT_PULL_MAX_BYTES = 4 << 30
#: Names listed when a pull skips some files (the rest are counted).
SHOWN_NAMES = 5


def pull_command(
    target: str | None = typer.Argument(
        None,
        metavar="[THREAD[:DIR]]",
        help="THREAD or THREAD:/remote/dir (default dir: /workspace), or --sandbox.",
        show_default=False,
    ),
    local_dir: Path | None = typer.Argument(
        None, metavar="LOCAL", help="The local directory to update.", show_default=False
    ),
    sandbox_id: str | None = SandboxDirOption,
    force: bool = typer.Option(False, "--force", help="Overwrite local changes too."),
    max_bytes: int = typer.Option(
        DEFAULT_PULL_MAX_BYTES,
        "--max-bytes",
        min=0,
        help="Fail (writing nothing) when the files to write hold more bytes than this.",
    ),
    idle_timeout: float | None = IdleTimeoutOption,
    url: str = UrlOption,
    api_key: str = KeyOption,
) -> None:
    """Bring the sandbox's changes back (a thread's, or --sandbox ID); a file you changed
    locally is never overwritten silently.

    A conflicting file (changed locally and remotely since the last sync or
    pull) is left as it is, and the sandbox's version is written next to it as
    FILE.sandlot-remote; the command then exits with status 1. Nothing is written
    inside .git, over the sync manifest, through a local symlink, or where the local
    .gitignore files exclude; nothing at all unless the whole archive arrived.
    """
    if sandbox_id is not None and local_dir is None:
        # Click hands the first positional to THREAD: with --sandbox it is LOCAL.
        target, local_dir = None, Path(target) if target is not None else None
    source, remote = split_target(target, sandbox_id)
    if local_dir is None:
        raise fail("name the local directory: sandlot pull THREAD[:DIR] LOCAL", 2)
    remote = remote or DEFAULT_REMOTE
    umask = os.umask(0o022)
    os.umask(umask)

    async def body(client: AsyncSandlot, settings: CliSettings) -> int:
        root = local_dir.resolve()
        root.mkdir(parents=True, exist_ok=True)
        sandbox = await source.open(client)
        idle = settings.idle_timeout
        chunks = sandbox.download_archive_stream(remote, idle_timeout=idle)
        try:
            report = await pull_tree(chunks, root, force=force, max_bytes=max_bytes, umask=umask)
        except PullError as exc:
            raise fail(shown(str(exc))) from None
        except RequestTimeout:
            raise fail(f"no data came for {idle:g} s (--idle-timeout); nothing written") from None
        finally:
            # Ended here, not at the loop's shutdown: the download's connection is closed now.
            await _closed(chunks)
        err_console.print(
            f"pulled {len(report.written)} files, {len(report.unchanged)} unchanged"
            + (f", [bold red]{len(report.conflicts)} conflicts[/]" if report.conflicts else "")
            + (f", {report.ignored} ignored (.gitignore)" if report.ignored else "")
        )
        if report.skipped:
            names = ", ".join(
                f"{shown(rel)} ({shown(why)})" for rel, why in report.skipped[:SHOWN_NAMES]
            )
            more = len(report.skipped) - SHOWN_NAMES
            err_console.print(
                f"[yellow]skipped {len(report.skipped)} files[/] the sandbox sent: {names}"
                + (f" and {more} more" if more > 0 else "")
            )
        for rel in report.conflicts:
            name = shown(rel)
            err_console.print(f"  [red]conflict[/] {name} (the sandbox's in {name}.sandlot-remote)")
        return 1 if report.conflicts else 0

    raise typer.Exit(run(url, api_key, body, idle_timeout=idle_timeout))
