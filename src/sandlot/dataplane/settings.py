"""Dataplane settings: one frozen object, arguments > ``SANDLOT_DP_*`` env > defaults.

- ``max_output_bytes``: output kept per stream for ``POST /exec`` (``truncated`` beyond).
- ``stream_buffer_bytes``: replay buffer per exec stream (``attach`` within it, ``gap`` beyond).
- ``shell_buffer_bytes`` / ``shell_history_bytes``: a shell's replay buffer and how much
  of it a new client gets as ``history``.
- ``max_frame_bytes``: largest output chunk put in one frame.
- ``reattach_window_seconds``: how long an exited command stays attachable.
- ``max_execs``: execs kept per sandbox (the oldest finished ones go first).
- ``max_retained_output_bytes``: output kept by finished execs of a sandbox, all together
  (beyond it the oldest finished execs are forgotten early).
- ``max_collecting_bytes``: output the running ``POST /exec`` commands of a sandbox keep
  for their answers, all together (each still at most ``max_output_bytes`` per stream);
  what one would keep beyond it is cut (``truncated``).
- ``max_shells``: shells per sandbox.
- ``spare_shells``: once a shell profile has been opened in a sandbox, keep one more of it
  started in the background, so that the next shell opens without waiting for its program.
- ``event_retention``: events kept per sandbox (older cursors get 410 SEQUENCE_EXPIRED).
- ``keepalive_seconds``: SSE comment / idle interval.
- ``max_read_bytes`` / ``max_write_bytes``: JSON file reads/writes (``/fs/read``, ``/fs/write``).
- ``max_upload_bytes`` / ``max_archive_bytes`` / ``max_archive_members``: streamed transfers.
- ``max_archive_transfers``: archives (up or down) of one sandbox running at once, each on
  a thread of the sandbox's own; one more is 429 RATE_LIMITED.
- ``max_list_entries`` / ``max_glob_results`` / ``max_grep_matches``: result caps (``truncated``).
- ``glob_deadline_seconds`` / ``max_glob_visits``: a glob stops (``truncated``) after this
  long or this many directory entries.
- ``grep_timeout_seconds``: how long one ``/fs/grep`` may search (then ``truncated``).
- ``watch_fs``: report changes made by commands in the workspace as ``fs`` events.
- ``watch_debounce_ms``: coalescing window for those.
- ``auth_timeout_seconds``: how long a WebSocket may wait before its ``auth`` frame.
- ``max_websockets_per_token`` / ``max_websockets_per_sandbox``: WebSockets open at once
  (every route together) with one token, and on one sandbox; beyond, closed with 4429.
  Sockets waiting for their ``auth`` frame count as one token of their sandbox.
- ``starting_retry_after``: ``Retry-After`` for 423 SANDBOX_STARTING.
- ``native``: file operations in C (built with the package); off, the pure-Python ones.
- ``grep_cache``: keep the content of searched trees in memory between searches
  (invalidated by inotify); off, every search reads the files.

Every field is also read from ``SANDLOT_DP_<FIELD>`` by :meth:`DataplaneSettings.from_env`
(``SANDLOT_DP_NATIVE=0``, say); nothing else in the dataplane reads the environment.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

MiB = 1 << 20


@dataclass(frozen=True)
class DataplaneSettings:
    max_output_bytes: int = 10 * MiB
    stream_buffer_bytes: int = 1 * MiB
    shell_buffer_bytes: int = 1 * MiB
    shell_history_bytes: int = 64 * 1024
    max_frame_bytes: int = 64 * 1024
    reattach_window_seconds: float = 600.0
    max_execs: int = 1000
    max_retained_output_bytes: int = 256 * MiB
    max_collecting_bytes: int = 256 * MiB
    max_shells: int = 64
    spare_shells: bool = True
    event_retention: int = 10_000
    keepalive_seconds: float = 15.0
    max_read_bytes: int = 16 * MiB
    max_write_bytes: int = 16 * MiB
    max_upload_bytes: int = 16 * 1024 * MiB
    max_archive_bytes: int = 16 * 1024 * MiB
    max_archive_members: int = 200_000
    max_archive_transfers: int = 4
    max_list_entries: int = 10_000
    max_glob_results: int = 10_000
    glob_deadline_seconds: float = 10.0
    max_glob_visits: int = 2_000_000
    max_grep_matches: int = 10_000
    grep_timeout_seconds: float = 30.0
    watch_fs: bool = True
    watch_debounce_ms: int = 50
    auth_timeout_seconds: float = 10.0
    max_websockets_per_token: int = 64
    max_websockets_per_sandbox: int = 256
    starting_retry_after: float = 1.0
    native: bool = True
    grep_cache: bool = True

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str] | None = None, **overrides: Any
    ) -> DataplaneSettings:
        """Build from ``SANDLOT_DP_<FIELD>`` variables, then explicit overrides."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for field in dataclasses.fields(cls):
            name = f"SANDLOT_DP_{field.name.upper()}"
            raw = env.get(name)
            if raw is None:
                continue
            default = field.default
            try:
                if isinstance(default, bool):
                    values[field.name] = raw.strip().lower() in ("1", "true", "yes", "on")
                elif isinstance(default, int):
                    values[field.name] = int(raw)
                else:
                    values[field.name] = float(raw)
            except ValueError:
                kind = type(default).__name__
                raise ValueError(f"{name}: {raw!r} is not a valid {kind}") from None
        values.update(overrides)
        return cls(**values)
