"""``sandlot sync`` and ``sandlot pull``: a local tree into a sandbox, and back.

The sandbox is a thread's (``THREAD[:DIR]``) or one named by id (``--sandbox ID[:DIR]``).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import io
import tarfile
import time
from collections.abc import AsyncIterator, Iterable
from pathlib import Path, PurePosixPath
from typing import Any

import typer
from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

from sandlot.cli.client import console, run, split_target
from sandlot.cli.context import KeyOption, SandboxDirOption, UrlOption
from sandlot.cli.errors import err_console, fail
from sandlot.cli.trees import (
    Entry,
    LocalTree,
    load_manifest,
    plan_pull,
    save_manifest,
    scan,
    tar_stream,
    walk,
)
from sandlot.sdk import ArchiveResult, AsyncSandbox, AsyncSandlot, FileNotFound

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
) -> ArchiveResult:
    """Send a tree as one tar stream into ``remote`` (with a progress bar when ``show``).

    ``source`` is a scanned tree or the entries of a walk still going on (the
    upload then starts with the first entry, and the bar counts bytes without a
    total). ``digests`` receives the SHA-256 of every file sent, for the manifest.
    """
    if not show:
        stream = tar_stream(source, digests=digests)
        return await _upload(sandbox, remote, stream, delete)
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
        return await _upload(sandbox, remote, stream, delete)


async def _upload(sandbox: AsyncSandbox, remote: str, stream: Any, delete: bool) -> ArchiveResult:
    return await sandbox.upload_archive(remote, _aiter(stream), delete_missing=delete)


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
    url: str = UrlOption,
    api_key: str = KeyOption,
) -> None:
    """Send a local tree into the thread's sandbox (or --sandbox ID) as one tar stream
    (honours .gitignore)."""
    dest, remote = split_target(target, sandbox_id)
    if not local_dir.is_dir():
        raise fail(f"{local_dir} is not a directory", 2)
    remote = remote or DEFAULT_REMOTE
    root = local_dir.resolve()
    where = dest.thread or dest.sandbox_id

    async def body(client: AsyncSandlot, _: Any) -> None:
        sandbox = await dest.open(client)
        started = time.monotonic()
        tree = LocalTree(root)
        digests: dict[str, str] = {}
        # The tree is walked while it is sent: the sandbox starts on the first files.
        entries = walk(root, tree)
        result = await push(sandbox, entries, remote, delete=delete, show=True, digests=digests)
        save_manifest(root, digests)
        err_console.print(
            f"synced {len(tree.files)} files ({tree.total_bytes} bytes) to {where}:{remote} "
            f"in {time.monotonic() - started:.2f} s"
            + (f", {result.deleted} removed" if result.deleted else "")
        )
        if watch:
            await _watch_and_push(sandbox, root, remote)

    run(url, api_key, body)


async def _watch_and_push(sandbox: AsyncSandbox, root: Path, remote: str) -> None:
    """Push what changes locally, file by file, as it changes.

    File events only wake the loop; what to send is decided by comparing the
    tree with what was last sent (size and mtime), so nothing is missed between
    the first sync and the moment the watcher started, or in a burst of events.
    """
    from watchfiles import awatch

    def index(tree: LocalTree) -> dict[str, tuple[int, float]]:
        return {f.rel: (f.size, f.mtime) for f in tree.files}

    sent = index(scan(root))
    manifest = load_manifest(root)
    err_console.print(f"[dim]watching {root} (Ctrl-C to stop)[/]")
    async for _changes in awatch(root, debounce=200, yield_on_timeout=True, rust_timeout=1000):
        tree = scan(root)
        now = index(tree)
        changed = [f for f in tree.files if sent.get(f.rel) != now[f.rel]]
        # Only what this sync sent is removed remotely, never the sandbox's own files.
        gone = sorted(set(sent) - set(now))
        if changed:
            subset = LocalTree(root, files=changed, dirs=_parents([f.rel for f in changed]))
            await push(sandbox, subset, remote, delete=False, show=False, digests=manifest)
        for rel in gone:
            with contextlib.suppress(FileNotFound):
                await sandbox.delete(str(PurePosixPath(remote) / rel), recursive=True)
            manifest.pop(rel, None)
        if changed or gone:
            sent = now
            save_manifest(root, manifest)
            stamp = time.strftime("%H:%M:%S")
            console.print(f"[dim]{stamp}[/] pushed {len(changed)} changed, {len(gone)} removed")


def _parents(rels: list[str]) -> list[str]:
    dirs: set[str] = set()
    for rel in rels:
        parent = PurePosixPath(rel).parent
        while str(parent) not in (".", ""):
            dirs.add(str(parent))
            parent = parent.parent
    return sorted(dirs, key=lambda d: (d.count("/"), d))


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
    url: str = UrlOption,
    api_key: str = KeyOption,
) -> None:
    """Bring the sandbox's changes back (a thread's, or --sandbox ID); a file you changed
    locally is never overwritten silently.

    A conflicting file (changed locally and remotely since the last sync or
    pull) is left as it is, and the sandbox's version is written next to it as
    FILE.sandlot-remote; the command then exits with status 1.
    """
    if sandbox_id is not None and local_dir is None:
        # Click hands the first positional to THREAD: with --sandbox it is LOCAL.
        target, local_dir = None, Path(target) if target is not None else None
    source, remote = split_target(target, sandbox_id)
    if local_dir is None:
        raise fail("name the local directory: sandlot pull THREAD[:DIR] LOCAL", 2)
    remote = remote or DEFAULT_REMOTE
    root = local_dir.resolve()
    root.mkdir(parents=True, exist_ok=True)

    async def body(client: AsyncSandlot, _: Any) -> int:
        sandbox = await source.open(client)
        data = await sandbox.download_archive(remote)
        files: dict[str, bytes] = {}
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:*") as tar:
            for member in tar:
                name = PurePosixPath(member.name.removeprefix("./") or ".")
                if not member.isfile() or name.is_absolute() or ".." in name.parts:
                    continue
                extracted = tar.extractfile(member)
                if extracted is not None:
                    files[str(name)] = extracted.read()
        manifest = load_manifest(root)
        plan = plan_pull(root, files, manifest, force=force)
        for rel in plan.write:
            dest = root / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            tmp = dest.with_name(dest.name + ".sandlot-tmp")
            tmp.write_bytes(files[rel])
            tmp.replace(dest)
        for rel in plan.conflicts:
            (root / (rel + ".sandlot-remote")).write_bytes(files[rel])
        # Both sides now agree on the files written or unchanged; a conflict keeps
        # its old base, so the next pull still sees the local change.
        for rel in plan.write + plan.unchanged:
            manifest[rel] = hashlib.sha256(files[rel]).hexdigest()
        save_manifest(root, manifest)
        err_console.print(
            f"pulled {len(plan.write)} files, {len(plan.unchanged)} unchanged"
            + (f", [bold red]{len(plan.conflicts)} conflicts[/]" if plan.conflicts else "")
        )
        for rel in plan.conflicts:
            err_console.print(f"  [red]conflict[/] {rel} (sandbox version in {rel}.sandlot-remote)")
        return 1 if plan.conflicts else 0

    raise typer.Exit(run(url, api_key, body))
