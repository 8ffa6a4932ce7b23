"""When a stream stops reconnecting: fast before the server ever answered, patiently after."""

from __future__ import annotations

import time

from sandlot.sdk.transport import RetryBudget


def test_never_acknowledged_gives_up_after_the_attempts() -> None:
    budget = RetryBudget(attempts=3, window=60.0)
    assert [budget.fail() for _ in range(4)] == [True, True, True, False]


def test_acknowledged_keeps_trying_for_the_window() -> None:
    budget = RetryBudget(attempts=2, window=0.3)
    budget.acknowledge()
    assert all(budget.fail() for _ in range(20))  # far beyond the attempts, within the window
    time.sleep(0.35)
    assert budget.fail() is False


def test_each_acknowledgement_starts_a_new_budget() -> None:
    budget = RetryBudget(attempts=2, window=0.0)
    budget.acknowledge()
    assert budget.fail() and budget.fail() and not budget.fail()
    budget.acknowledge()
    assert budget.failures == 0 and budget.fail()
    assert RetryBudget().backoff() == 0.05 and budget.backoff() == 0.1  # doubling per failure
