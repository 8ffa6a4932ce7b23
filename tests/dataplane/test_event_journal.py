"""The event log's journal: what a restarted server reads back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sandlot.dataplane.services.events import JOURNAL, EventLog
from sandlot.protocol.errors import SequenceExpired


def _log(directory: Path, retention: int = 5) -> EventLog:
    log = EventLog("sb_1", retention, lambda: "active")
    log.attach(directory)
    return log


def test_a_new_server_carries_on_the_sequence_with_the_retained_events(tmp_path: Path) -> None:
    first = _log(tmp_path)
    for i in range(30):
        first.append("fs.modified", "fs", {"path": f"/workspace/{i}", "op": "modified"})
    first.close()
    # Compacted as it grows: never more than twice the retention on disk.
    assert len((tmp_path / JOURNAL).read_text().splitlines()) <= 10

    second = _log(tmp_path)
    assert second.last_sequence == 30
    kept = second.since(25)
    assert [seq for seq, _, _ in kept] == [26, 27, 28, 29, 30]
    assert json.loads(kept[-1][2])["details"]["fs"]["path"] == "/workspace/29"
    with pytest.raises(SequenceExpired):
        second.since(3)
    assert second.append("exec.started", "exec", {}) == 31


def test_events_before_the_journal_follow_it(tmp_path: Path) -> None:
    first = _log(tmp_path)
    first.append("sandbox.active", "phase", {})
    first.close()
    second = EventLog("sb_1", 5, lambda: "active")
    assert second.append("sandbox.starting", "phase", {}) == 1
    second.attach(tmp_path)
    assert [(seq, kind) for seq, kind, _ in second.since(0)] == [
        (1, "sandbox.active"),
        (2, "sandbox.starting"),
    ]
    assert json.loads(second.since(1)[0][2])["event_id"] == "sb_1-2"


def test_a_torn_last_line_is_skipped(tmp_path: Path) -> None:
    first = _log(tmp_path)
    first.append("a", "fs", {})
    first.close()
    with open(tmp_path / JOURNAL, "a") as f:
        f.write('{"sequence": 2, "event_ty')
    second = _log(tmp_path)
    assert second.last_sequence == 1
    assert second.append("b", "fs", {}) == 2
