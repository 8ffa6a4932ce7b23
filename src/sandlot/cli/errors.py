"""How the CLI reports failures: one line on stderr, no traceback, a useful exit code."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import typer
from rich.console import Console

from sandlot.protocol.errors import SandlotError

err_console = Console(stderr=True, highlight=False)


def fail(message: str, code: int = 1) -> typer.Exit:
    err_console.print(f"[bold red]error:[/] {message}")
    return typer.Exit(code)


@contextlib.contextmanager
def friendly_errors() -> Iterator[None]:
    """Turn expected failures into a clear message and exit code 1 (2 for bad usage)."""
    from sandlot.broker.settings import ConfigError
    from sandlot.web.settings import ConfigError as WebConfigError

    try:
        yield
    except SandlotError as exc:
        raise fail(f"{exc.message} ({exc.wire_code})") from None
    except (ConfigError, WebConfigError) as exc:
        raise fail(f"configuration: {exc}", 2) from None
    except OSError as exc:
        raise fail(f"{exc.strerror or exc}: {exc.filename or ''}".rstrip(": ")) from None
