"""A background loop whose rounds keep failing (the store out of reach for ten minutes) logs the first failure,
then at most one line a minute, then one line when a round works again."""

from __future__ import annotations

import logging

from moorage.log import FailingRounds, get_logger


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_ten_minutes_of_failed_rounds_are_a_dozen_lines_and_the_recovery_one() -> None:
    clock = _Clock()
    caplog = _Lines()
    logger = logging.getLogger("moorage.test.rounds")
    logger.addHandler(caplog)
    logger.setLevel(logging.INFO)
    failures = FailingRounds(get_logger("moorage.test.rounds"), "webhook round", clock=clock)
    for _ in range(1200):  # a round every half second for ten minutes
        failures.failed(ConnectionError("the store cannot reach PostgreSQL right now (connection refused)\nmore"))
        clock.now += 0.5
    failures.ok()
    failures.ok()  # a second round that works says nothing more
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "webhook round failed"
    still = lines[1:-1]
    assert 9 <= len(still) <= 10 and all(s.startswith("webhook round still failing: ") for s in still), lines
    assert still[0].endswith(" UTC: the store cannot reach PostgreSQL right now (connection refused)"), still[0]
    assert " 121 rounds since " in still[0], still[0]
    assert lines[-1].startswith("webhook round works again after 1200 failed rounds since "), lines[-1]
    assert caplog.records[-1].levelno == logging.INFO and caplog.records[0].levelno == logging.ERROR
    # Failing again later starts over: its first failure is said at once.
    failures.failed(RuntimeError("again"))
    assert caplog.records[-1].getMessage() == "webhook round failed" and failures.rounds == 1


def test_a_call_begun_before_a_failure_does_not_end_the_failed_rounds() -> None:
    """Two awake instances shipping at once as the store goes down: one's call fails, the other's (begun before,
    its bytes already sent) returns after that; it said "works again", and the next failure "failed" again."""
    clock = _Clock()
    caplog = _Lines()
    logger = logging.getLogger("moorage.test.rounds2")
    logger.addHandler(caplog)
    logger.setLevel(logging.INFO)
    failures = FailingRounds(get_logger("moorage.test.rounds2"), "shipping", clock=clock)
    began = clock()
    clock.now += 0.1
    failures.failed(ConnectionError("refused"))
    clock.now += 0.1
    failures.ok(began)  # begun before the failure: no sign the store is back
    failures.failed(ConnectionError("refused"))
    assert [r.getMessage() for r in caplog.records] == ["shipping failed"]
    later = clock()
    failures.ok(later)
    assert caplog.records[-1].getMessage().startswith("shipping works again after 2 failed rounds")
