"""Running a client command: one SDK client, friendly errors, JSON or human output."""

from __future__ import annotations

import asyncio
import json
import os
import re
import ssl
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from sandlot.cli.errors import fail
from sandlot.cli.settings import CliSettings, ConfigError, load_settings
from sandlot.protocol.errors import SandlotError
from sandlot.sdk import AsyncSandbox, AsyncSandlot, ConnectError

T = TypeVar("T")
console = Console(highlight=False)

#: What a name must not bring to a terminal: control characters (an escape sequence
#: rewrites the screen), bidirectional overrides (a name shown reversed), bytes
#: that are not UTF-8 (kept as lone surrogates).
_UNSHOWABLE = re.compile("[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069\ud800-\udfff]")


def _escaped(char: str) -> str:
    code = ord(char)
    if 0xDC80 <= code <= 0xDCFF:  # a byte that was not UTF-8
        return f"\\x{code - 0xDC00:02x}"
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def shown(name: str) -> str:
    """A name from elsewhere (a sandbox's file, say) as Rich markup printing it as it is,
    with what a terminal would act on written as escapes."""
    return escape(_UNSHOWABLE.sub(lambda m: _escaped(m.group()), name))


def run(
    url: str | None,
    api_key: str | None,
    body: Callable[[AsyncSandlot, CliSettings], Awaitable[T]],
    *,
    auto_refresh: bool = True,
    idle_timeout: float | None = None,
) -> T:
    """Run ``body`` with a broker client; expected failures become one line and exit 1."""
    try:
        settings = load_settings(url, api_key, idle_timeout=idle_timeout)
    except ConfigError as exc:
        raise fail(str(exc), 2) from None

    async def main() -> T:
        client = AsyncSandlot(
            settings.url, settings.api_key, timeout=settings.timeout, auto_refresh=auto_refresh
        )
        try:
            return await body(client, settings)
        finally:
            await client.aclose()

    try:
        return asyncio.run(main())
    except ConnectError:
        raise fail(
            f"cannot reach the server at {settings.url} (is `sandlot serve` running?)"
        ) from None
    except TimeoutError as exc:
        raise fail(f"timed out: {exc}") from None
    except SandlotError as exc:
        raise fail(f"{exc.message} ({exc.wire_code})") from None
    except (ConnectionError, ssl.SSLError) as exc:
        raise fail(f"connection to {settings.url} failed: {exc}") from None
    except OSError as exc:
        # Anything else is this machine's: a file or directory the command works on.
        where = f": {shown(os.fsdecode(exc.filename))}" if exc.filename else ""
        raise fail(f"{escape(exc.strerror or str(exc))}{where}") from None
    except KeyboardInterrupt:
        raise typer.Exit(130) from None


@dataclass(frozen=True)
class Target:
    """The sandbox a command works in: a thread's (``ensure``), or one named by id."""

    thread: str | None = None
    sandbox_id: str | None = None

    async def open(self, client: AsyncSandlot) -> AsyncSandbox:
        """The sandbox, once active: the thread's (created if missing), or the one named."""
        if self.sandbox_id is not None:
            return await client.attach_sandbox(self.sandbox_id)
        assert self.thread is not None
        return await client.ensure(self.thread)


def target_of(thread: str | None, sandbox_id: str | None) -> Target:
    """``THREAD`` or ``--sandbox ID``: exactly one of the two (else a usage error, exit 2)."""
    if (thread is None) == (sandbox_id is None):
        raise fail("name the sandbox: THREAD or --sandbox ID (one of the two)", 2)
    if sandbox_id is not None and not sandbox_id:
        raise fail("--sandbox wants a sandbox id", 2)
    if thread is not None and not thread:
        raise fail("name a thread: THREAD", 2)
    return Target(thread, sandbox_id)


def split_target(target: str | None, sandbox_id: str | None) -> tuple[Target, str | None]:
    """``THREAD[:REMOTE_DIR]`` or ``--sandbox ID[:REMOTE_DIR]`` → (target, remote dir or None)."""
    given = target if sandbox_id is None else sandbox_id
    if given is None or (target is not None and sandbox_id is not None):
        raise fail("name the sandbox: THREAD[:DIR] or --sandbox ID[:DIR] (one of the two)", 2)
    name, sep, remote = given.partition(":")
    if not name:
        raise fail("name a thread: THREAD or THREAD:/remote/dir (or --sandbox ID[:DIR])", 2)
    dest = Target(sandbox_id=name) if sandbox_id is not None else Target(thread=name)
    return dest, (remote or None) if sep else None


def print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")


def print_table(rows: list[dict[str, Any]], columns: list[str], *, empty: str = "nothing") -> None:
    if not rows:
        console.print(f"[dim]{empty}[/]")
        return
    table = Table(*columns)
    for row in rows:
        table.add_row(*("" if row.get(c) is None else str(row.get(c)) for c in columns))
    console.print(table)


def print_mapping(data: dict[str, Any]) -> None:
    table = Table(show_header=False, box=None)
    for key, value in data.items():
        table.add_row(
            f"[bold]{key}[/]", json.dumps(value) if isinstance(value, dict | list) else str(value)
        )
    console.print(table)
