"""Named crash points for recovery tests: ``SANDLOT_FAILPOINTS=after_binding_insert,…``.

When a named point is armed the process kills itself with SIGKILL right
there, exactly as a power cut would. Points: ``after_binding_insert`` (the
binding is committed, the provider not yet asked), ``mid_provision`` (the
provider has started creating the sandbox), ``mid_release`` (tokens revoked
and the binding ended in the store, the sandbox not yet deleted).
"""

from __future__ import annotations

import os
import signal

_armed: frozenset[str] = frozenset()


def arm(names: frozenset[str]) -> None:
    global _armed
    _armed = names


def hit(name: str) -> None:
    if name in _armed:
        os.kill(os.getpid(), signal.SIGKILL)
