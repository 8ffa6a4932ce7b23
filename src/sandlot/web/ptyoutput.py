"""A terminal's output on its way to the browser: what was sent, and how chunks become frames.

The dataplane sends a shell's output in chunks of one read of its terminal (about 4 KB
while a command floods it). :class:`ShellOutput` keeps what the browser has been sent, so
that a replay after an ``attach`` never sends a byte twice or out of order; the chunks it
lets through wait in the browser's queue as :class:`Output` (bytes and the offset of the
first), and :class:`OutputFrames` turns the ones waiting side by side into one frame when
the socket sends:

- **binary** (``/ws/pty?binary=1``, the page's own): a binary WebSocket frame, the offset
  of its first byte as 8 bytes (unsigned, big-endian), then the output's bytes as the
  shell wrote them;
- **text** (the default, boring-ui's frames): ``{"type":"output","data","session_id",
  "offset"}``.

Merging: a frame goes as soon as the socket can send it, with what is queued behind it
(up to :data:`MAX_FRAME` bytes); but while output is *bulk* (the last frame carried
:data:`BULK` bytes or more) the next one waits until :data:`WINDOW` after the last, so that
a flood crosses in a few large frames rather than thousands of small ones, each of which
costs the server, the network and the page's thread. A keystroke's echo after a quiet
moment, or after small output, is never held.
"""

from __future__ import annotations

import json
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass

#: The binary frame's header: the offset of its first byte in the shell's output.
HEADER = struct.Struct(">Q")
#: A frame takes what is queued behind it up to this many bytes.
MAX_FRAME = 256 * 1024
#: A frame of this many bytes or more means bulk output: the next one may wait.
BULK = 1024
#: How long after a bulk frame the next one waits, gathering what comes meanwhile.
WINDOW = 0.008


@dataclass(slots=True)
class Output:
    """A chunk of output for the browser: its bytes and the offset of the first."""

    offset: int
    data: bytes

    def __len__(self) -> int:
        return len(self.data)


class ShellOutput:
    """What the browser has been sent of a shell's output, so that a replay after an
    ``attach`` never sends a byte twice or out of order."""

    def __init__(self, delivered: int) -> None:
        self.delivered = delivered

    def chunk(self, raw: bytes, offset: int) -> Output | None:
        """The part of a ``stdout`` chunk still to send, if any."""
        if offset + len(raw) <= self.delivered:
            return None
        if offset > self.delivered:
            # Sent before an ``attach`` to an earlier offset took effect: it comes again.
            return None
        if offset < self.delivered:
            raw = raw[self.delivered - offset :]
            offset = self.delivered
        self.delivered = offset + len(raw)
        return Output(offset, raw)

    def gap(self, start: int, end: int) -> tuple[int, int] | None:
        """A ``gap`` to tell the browser of (bytes it will never get), if it is news."""
        if start <= self.delivered < end:
            lost = (self.delivered, end)
            self.delivered = end
            return lost
        return None


class OutputFrames:
    """The frames of one socket's output (see the module's docstring)."""

    def __init__(
        self,
        *,
        binary: bool,
        session_id: str,
        window: float = WINDOW,
        max_frame: int = MAX_FRAME,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.binary = binary
        self.session_id = session_id
        self.window = window
        self.max_frame = max_frame
        self._clock = clock
        self._last = 0.0
        self._bulk = False

    def delay(self) -> float:
        """Seconds the next output frame waits (0 unless output is bulk)."""
        if not self._bulk:
            return 0.0
        return max(0.0, self._last + self.window - self._clock())

    def frame(self, parts: list[Output]) -> str | bytes:
        """One frame of contiguous chunks (``parts``, in order)."""
        size = sum(len(p.data) for p in parts)
        self._bulk = size >= BULK
        self._last = self._clock()
        first = parts[0].offset
        if self.binary:
            return b"".join([HEADER.pack(first), *(p.data for p in parts)])
        data = parts[0].data if len(parts) == 1 else b"".join(p.data for p in parts)
        return json.dumps(
            {
                "type": "output",
                "data": data.decode("utf-8", errors="replace"),
                "session_id": self.session_id,
                "offset": first,
            },
            ensure_ascii=False,
            separators=(",", ":"),
        )
