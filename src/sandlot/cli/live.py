"""``sandlot exec``, ``sandlot shell`` and ``sandlot watch``: working in a sandbox live.

Each addresses a thread's sandbox (``THREAD``) or a sandbox by id (``--sandbox ID``).
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import json
import os
import signal
import sys
import termios
import time
import tty
from typing import Any

import typer
from typer.core import TyperCommand

from sandlot.cli.client import run, target_of
from sandlot.cli.context import JsonOption, KeyOption, SandboxOption, UrlOption
from sandlot.cli.errors import err_console, fail
from sandlot.cli.settings import CliSettings
from sandlot.protocol.errors import SequenceExpired
from sandlot.sdk import AsyncSandbox, AsyncSandlot, AsyncShell
from sandlot.sdk.transport import RetryBudget

#: Ctrl-] leaves ``sandlot shell`` (the shell keeps running), as in telnet.
DETACH_KEY = b"\x1d"


class CommandAfterDashes(TyperCommand):
    """Keeps what followed ``--``: Click hands THREAD the first positional, before or after
    it, and only this tells ``exec T --sandbox ID -- cmd`` from ``exec --sandbox ID -- cmd``."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:  # Click's own Context
        ctx.meta[AFTER_DASHES] = args[args.index("--") + 1 :] if "--" in args else None
        return super().parse_args(ctx, args)


AFTER_DASHES = "sandlot.after_dashes"


def _split_command(
    ctx: typer.Context, thread: str | None, words: list[str], sandbox: str | None
) -> tuple[str | None, list[str]]:
    """(THREAD, command): with ``--sandbox``, a THREAD is one given before ``--``."""
    if sandbox is None or thread is None:
        return thread, words
    after = ctx.meta.get(AFTER_DASHES)
    if after is None or len(words) + 1 == len(after):
        return None, [thread, *words]
    return thread, words


def exec_command(
    ctx: typer.Context,
    thread: str | None = typer.Argument(
        None,
        metavar="[THREAD]",
        help="The thread whose sandbox runs the command (or --sandbox ID).",
        show_default=False,
    ),
    command: list[str] = typer.Argument(
        None, help="The command after --; one argument runs under the shell.", show_default=False
    ),
    sandbox_id: str | None = SandboxOption,
    cwd: str = typer.Option(None, help="Working directory in the sandbox (default: /workspace)."),
    env: list[str] = typer.Option(None, "--env", help="KEY=VALUE (repeatable)."),
    timeout: float = typer.Option(
        None, help="Kill the command after this many seconds (exit 124)."
    ),
    pty: bool = typer.Option(False, "--pty", help="Run under a pseudo-terminal."),
    url: str = UrlOption,
    api_key: str = KeyOption,
) -> None:
    """Run a command in the thread's sandbox (or --sandbox ID), streaming its output; exit
    with its code.

    The output survives a dropped connection: the command keeps running and
    the client reattaches where it stopped, without running it again.
    """
    thread, words = _split_command(ctx, thread, list(command or []), sandbox_id)
    target = target_of(thread, sandbox_id)
    if not words:
        raise fail("give the command after --: sandlot exec THREAD -- CMD…", 2)
    environ: dict[str, str] = {}
    for item in env or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise fail(f"--env wants KEY=VALUE, got {item!r}", 2)
        environ[key] = value
    argv: str | list[str] = words[0] if len(words) == 1 else words

    async def body(client: AsyncSandlot, _: Any) -> int:
        sandbox = await target.open(client)
        cmd = await sandbox.stream(
            argv, cwd=cwd, env=environ or None, timeout_seconds=timeout, pty=pty
        )
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGINT, lambda: loop.create_task(cmd.signal("SIGINT")))
        loop.add_signal_handler(signal.SIGTERM, lambda: loop.create_task(cmd.signal("SIGTERM")))
        out, err = sys.stdout.buffer, sys.stderr.buffer
        async for chunk in cmd:
            if chunk.lost:
                err_console.print(
                    f"[yellow][sandlot] {chunk.lost} bytes of {chunk.stream} were lost[/]"
                )
                continue
            stream = err if chunk.stream == "stderr" else out
            stream.write(chunk.data.encode())
            stream.flush()
        result = await cmd.wait()
        if result.timed_out:
            err_console.print(f"[yellow][sandlot] timed out after {timeout:g} s[/]")
        return 1 if result.exit_code is None else int(result.exit_code)

    raise typer.Exit(run(url, api_key, body))


class _Terminal:
    """The local terminal in raw mode, restored on exit whatever happens."""

    def __init__(self) -> None:
        self.fd = sys.stdin.fileno()
        self.saved: list[Any] | None = None

    def __enter__(self) -> _Terminal:
        if os.isatty(self.fd):
            self.saved = termios.tcgetattr(self.fd)
            tty.setraw(self.fd)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.saved is not None:
            termios.tcsetattr(self.fd, termios.TCSADRAIN, self.saved)

    @staticmethod
    def size() -> tuple[int, int]:
        try:
            size = os.get_terminal_size(sys.stdout.fileno())
            return size.columns, size.lines
        except OSError:
            return 80, 24


async def _shell_session(
    sandbox: AsyncSandbox, name: str, role: str, profile: str | None
) -> int | None:
    """Relay the terminal to the shared shell until it exits or the user detaches."""
    loop = asyncio.get_running_loop()
    out = sys.stdout.buffer
    shown = -1  # offset just past what was written to the terminal
    detached = asyncio.Event()
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    shell: AsyncShell | None = None  # None while (re)attaching
    pending: list[str] = []  # typed while the connection was down: sent once reattached
    sending: set[asyncio.Task[None]] = set()

    def send(coro: Any) -> None:
        # Keep a reference until the frame is sent (the loop holds tasks weakly).
        task = loop.create_task(coro)
        sending.add(task)
        task.add_done_callback(sending.discard)

    async def type_in(target: AsyncShell, text: str) -> None:
        try:
            await target.send(text)
        except OSError:  # the connection broke under it: typed again once reattached
            pending.append(text)

    async def resize(target: AsyncShell) -> None:
        with contextlib.suppress(OSError):  # a reattach sends the size anyway
            await target.resize(*_Terminal.size())

    def on_input() -> None:
        try:
            data = os.read(sys.stdin.fileno(), 4096)
        except OSError:
            data = b""
        if not data or DETACH_KEY in data:
            detached.set()
            return
        if role == "driver":
            text = decoder.decode(data)
            if text and shell is not None:
                send(type_in(shell, text))
            elif text:
                pending.append(text)

    def on_resize() -> None:
        if shell is not None:
            send(resize(shell))

    loop.add_reader(sys.stdin.fileno(), on_input)
    loop.add_signal_handler(signal.SIGWINCH, on_resize)
    budget = RetryBudget()
    try:
        while not detached.is_set():
            cols, rows = _Terminal.size()
            try:
                attached = await sandbox.shell(
                    name, role=role, profile=profile, cols=cols, rows=rows
                )
            except TimeoutError:
                raise
            except OSError:  # unreachable for now: within the budget, try again
                if not budget.fail():
                    raise
                await asyncio.sleep(budget.backoff())
                continue
            budget.acknowledge()
            shell = attached
            # On reattach, show only what this terminal has not shown yet.
            history = attached.history.encode()
            start = attached.offset - len(history)
            skip = 0 if shown < 0 else max(0, min(len(history), shown - start))
            out.write(history[skip:])
            out.flush()
            shown = attached.offset
            if pending:
                typed = "".join(pending)
                pending.clear()
                send(type_in(attached, typed))
            reader = loop.create_task(_pump(attached, out))
            waiter = loop.create_task(detached.wait())
            await asyncio.wait({reader, waiter}, return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
            if not reader.done():
                reader.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await reader
                await attached.aclose()
                return None
            shell = None
            shown = max(shown, attached.offset)
            reader.result()
            if attached.exit_code is not None:
                return attached.exit_code
            # The connection dropped under a live shell: reattach after a breath.
            await asyncio.sleep(budget.backoff())
        return None
    finally:
        loop.remove_reader(sys.stdin.fileno())
        loop.remove_signal_handler(signal.SIGWINCH)


async def _pump(shell: AsyncShell, out: Any) -> None:
    async for chunk in shell:
        if chunk.lost:
            out.write(f"\r\n[sandlot: {chunk.lost} bytes of output skipped]\r\n".encode())
        else:
            out.write(chunk.data.encode())
        out.flush()


def shell_command(
    thread: str | None = typer.Argument(
        None,
        metavar="[THREAD]",
        help="The thread whose sandbox hosts the shell (or --sandbox ID).",
        show_default=False,
    ),
    sandbox_id: str | None = SandboxOption,
    session: str = typer.Option("main", "--session", help="The shared shell's name."),
    observe: bool = typer.Option(False, "--observe", help="Watch without typing."),
    profile: str = typer.Option(None, help="Shell profile of the template (default: default)."),
    url: str = UrlOption,
    api_key: str = KeyOption,
) -> None:
    """Open a terminal on a shared shell of the thread's sandbox (or --sandbox ID; Ctrl-]
    detaches).

    Everyone attached to the same --session sees the same screen; the shell
    keeps running after you detach, and a dropped connection reattaches
    without losing output.
    """
    target = target_of(thread, sandbox_id)
    role = "observer" if observe else "driver"

    async def body(client: AsyncSandlot, _: Any) -> int | None:
        sandbox = await target.open(client)
        with _Terminal():
            return await _shell_session(sandbox, session, role, profile)

    code = run(url, api_key, body)
    if code is None:
        err_console.print(f"[dim]detached from shell {session!r} (it keeps running)[/]")
        raise typer.Exit(0)
    raise typer.Exit(code)


def _describe(event: Any) -> str:
    d = event.details.get(event.kind, {}) if event.kind else {}
    if event.kind == "fs":
        return f"{d.get('op', '?')} {d.get('path', '')}" + (
            f" -> {d['dst']}" if d.get("dst") else ""
        )
    if event.kind == "exec":
        text = d.get("command")
        if isinstance(text, list):
            text = " ".join(text)
        tail = f" exit {d['exit_code']}" if d.get("exit_code") is not None else ""
        return (
            f"{event.event_type.split('.')[-1]} {d.get('exec_id', '')} {text or ''}{tail}".strip()
        )
    if event.kind == "shell":
        return f"{event.event_type.split('.')[-1]} shell {d.get('name', '')}".strip()
    if event.kind == "phase":
        return f"sandbox {d.get('from')} -> {d.get('to')}" + (
            f" ({d['reason']})" if d.get("reason") else ""
        )
    return json.dumps(d)


def _show(event: Any, as_json: bool) -> None:
    if as_json:
        sys.stdout.write(json.dumps(event.raw, sort_keys=True) + "\n")
    else:
        actor = event.actor or {}
        who = f"{actor.get('type', '')}:{actor.get('id', '')}" if actor else "sandbox"
        stamp = time.strftime("%H:%M:%S")
        kind = event.kind or "?"
        line = f"{stamp} #{event.sequence:<5} {who:<24} {kind:<6} {_describe(event)}"
        sys.stdout.write(line + "\n")
    sys.stdout.flush()


def watch_command(
    thread: str | None = typer.Argument(
        None,
        metavar="[THREAD]",
        help="The thread whose sandbox to watch (or --sandbox ID).",
        show_default=False,
    ),
    sandbox_id: str | None = SandboxOption,
    after: int | None = typer.Option(
        None, help="Start after this event sequence (default: where the last watch stopped)."
    ),
    from_start: bool = typer.Option(False, "--from-start", help="Replay every retained event."),
    as_json: bool = JsonOption,
    url: str = UrlOption,
    api_key: str = KeyOption,
) -> None:
    """The live activity feed: commands started and finished (with who ran them), file changes.

    It resumes where the previous watch of the same sandbox stopped.
    """
    target = target_of(thread, sandbox_id)

    async def body(client: AsyncSandlot, settings: CliSettings) -> None:
        sandbox = await target.open(client)
        cursor_file = settings.watch_dir / f"{sandbox.id}.seq"
        cursor = 0 if from_start else after
        if cursor is None:
            try:
                cursor = int(cursor_file.read_text().strip())
            except (OSError, ValueError):
                cursor = 0
        cursor_file.parent.mkdir(parents=True, exist_ok=True)
        while True:
            stream = sandbox.events(after=cursor)
            try:
                async for event in stream:
                    # Recorded before it is shown, and atomically: a watch killed at any
                    # moment never shows an event again, nor leaves a torn cursor behind.
                    partial = cursor_file.with_suffix(".tmp")
                    partial.write_text(str(event.sequence))
                    partial.replace(cursor_file)
                    _show(event, as_json)
                return
            except SequenceExpired as exc:
                # The sandbox keeps its latest events only: carry on from the oldest kept,
                # saying what is gone (a first watch of a busy sandbox, --from-start, a
                # watch resumed after long).
                oldest = exc.metadata.get("oldest_sequence")
                cursor = max(cursor, stream.last_sequence)
                if not isinstance(oldest, int) or oldest - 1 <= cursor:
                    raise
                if cursor or not from_start:
                    err_console.print(
                        f"[yellow][sandlot] events {cursor + 1} to {oldest - 1} are no longer "
                        f"kept; from #{oldest}[/]"
                    )
                cursor = oldest - 1

    with contextlib.suppress(KeyboardInterrupt):
        run(url, api_key, body)
