"""What the relay remembers of a hosted box's commands stays bounded."""

from __future__ import annotations

from sandlot.protocol.sessions import Template
from sandlot.providers.hostedstate import MAX_RELAY_EXECS, Hosted


def test_finished_commands_are_forgotten_oldest_first_past_the_bound() -> None:
    hosted = Hosted("sb_bound", 1, Template(name="default", image="host"))
    watched = hosted.new_exec("sleep 1", "cmd-watched", None, False)
    hosted.ended(watched, 0)
    watched.clients = 1  # a client still reads its output: kept
    running = hosted.new_exec("sleep 9", "cmd-running", None, False)  # never ended: kept
    for i in range(3 * MAX_RELAY_EXECS):
        ex = hosted.new_exec("true", f"cmd-{i}", None, False)
        hosted.ended(ex, 0)
    assert len(hosted.execs) <= MAX_RELAY_EXECS + 1
    assert len(hosted.by_command) == len(hosted.execs)
    assert hosted.find_exec("cmd-watched") is watched
    assert hosted.find_exec("cmd-running") is running
    last = f"cmd-{3 * MAX_RELAY_EXECS - 1}"
    assert hosted.find_exec(last).command_id == last
    assert "cmd-0" not in hosted.by_command
