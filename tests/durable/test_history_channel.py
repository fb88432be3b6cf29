"""The history of a run an engine drives for a guest comes from the engine's own log of it: the same entries as the
store's, after every kind of write, and read from the store again once that copy can no longer be trusted."""

from __future__ import annotations

import pytest

from moorage.durable import DurableEngine, Proceed, Replay, RunTakenOver, Suspend
from moorage.durable.runlog import RunLog
from moorage.store import Scope, TenantStore


def _entries(engine: DurableEngine, run_id: str) -> list[tuple]:
    return [(h.seq, h.position, h.kind, h.name, h.status, h.attempt, h.result, h.error) for h in engine.history(run_id)]


def _stored(ts: TenantStore, run_id: str) -> list[tuple]:
    return [(h.seq, h.position, h.kind, h.name, h.status, h.attempt, h.result, h.error)
            for h in RunLog.load(ts, run_id).history()]


def test_history_of_a_driven_run_equals_the_stored_log_after_each_write(tenant: TenantStore) -> None:
    engine = DurableEngine(tenant)
    engine.create_run(Scope.workflow("agent", "g1", "alice"), "turn", {})
    engine.open_run("g1")
    assert _entries(engine, "g1") == [] == _stored(tenant, "g1")
    writes = [
        lambda: engine.complete_step("g1", 0, "a", 1, attempt=1),
        lambda: engine.fail_step("g1", 1, "b", "boom", attempt=1, final=False),
        lambda: engine.complete_step("g1", 1, "b", {"ok": True}, attempt=2),
        lambda: engine.record_correction("g1", 2, "use the other API"),
        lambda: engine.fail_step("g1", 3, "c", "gave up", attempt=1, final=True),
    ]
    for write in writes:
        write()
        assert _entries(engine, "g1") == _stored(tenant, "g1")
    assert [e[2] for e in _entries(engine, "g1")] == ["step", "attempt", "step", "correction", "step"]
    assert isinstance(engine.interrupt("g1", 4, {"ask": "go?"}), Suspend)
    assert _entries(engine, "g1") == _stored(tenant, "g1") and _entries(engine, "g1")[-1][4] == "waiting"


def test_history_is_read_again_after_a_write_from_outside_the_channel(tenant: TenantStore) -> None:
    engine = DurableEngine(tenant)
    engine.create_run(Scope.workflow("agent", "g2", "alice"), "turn", {})
    engine.open_run("g2")
    engine.complete_step("g2", 0, "a", 1, attempt=1)
    assert isinstance(engine.interrupt("g2", 1, {"ask": "go?"}), Suspend)
    # The same engine answers and takes a note through its in-process verbs: its channel copy is dropped.
    engine.correct("g2", "the user said: only on weekdays")
    assert _entries(engine, "g2")[-1][2:5] == ("note", "note", "note")
    engine.open_run("g2")  # driven through the channel again
    assert _entries(engine, "g2") == _stored(tenant, "g2")

    # Another executor takes the run over: ours fails its next write and reads the store from then on.
    other = DurableEngine(tenant)
    other.open_run("g2")
    assert other.begin_step("g2", 0, "a") == Replay(1, 1)
    other.record_correction("g2", 2, "written by the other executor")
    with pytest.raises(RunTakenOver):
        engine.record_correction("g2", 2, "ours")
    assert _entries(engine, "g2") == _stored(tenant, "g2")
    assert _entries(engine, "g2")[-1][6] == {"note": "written by the other executor"}


def test_a_run_not_driven_here_is_read_from_the_store(tenant: TenantStore) -> None:
    driver = DurableEngine(tenant)
    driver.create_run(Scope.workflow("agent", "g3", "alice"), "turn", {})
    driver.open_run("g3")
    d = driver.begin_step("g3", 0, "a")
    assert isinstance(d, Proceed)
    driver.complete_step("g3", 0, "a", "x", attempt=d.attempt)
    reader = DurableEngine(tenant)
    assert _entries(reader, "g3") == _entries(driver, "g3") == _stored(tenant, "g3")
