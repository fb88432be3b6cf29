"""Behaviour of the durable engine on both store backends, in-process.

Replay never re-runs journaled steps; retries are logged; non-determinism is caught; interrupts survive a
host restart and resume after the interrupt; history and corrections are visible; cancellation stops a run.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from typing import Any

import pytest

from moorage.durable import (
    NO_WAIT,
    Backoff,
    DurableEngine,
    NonDeterminismError,
    PermanentFailure,
    Proceed,
    Replay,
    RunNotWaiting,
    RunTakenOver,
    StepFailed,
    Suspend,
    WorkflowContext,
    WorkflowNotRegistered,
)
from moorage.durable.runlog import RunLog
from moorage.store import Scope
from tests.durable.conftest import Host


class HostCrash(BaseException):
    """Stands for the host dying in the middle of a workflow: nothing after it runs, nothing is cleaned up."""


def scope(run_id: str) -> Scope:
    return Scope.workflow("agent", run_id, "alice")


class Bodies:
    """Step bodies that count how often they really ran."""

    def __init__(self) -> None:
        self.ran: Counter[str] = Counter()
        self.keys: list[str] = []
        self.crash_at: str | None = None

    def make(self, name: str, value: Any) -> Any:
        def body(*, idempotency_key: str) -> Any:
            self.ran[name] += 1
            self.keys.append(idempotency_key)
            if name == self.crash_at:
                raise HostCrash(name)
            return value
        return body


async def test_replay_returns_journaled_results_and_never_reruns(host: Host) -> None:
    b = Bodies()

    async def wf(ctx: WorkflowContext, inp: int) -> dict:
        x = await ctx.step("fetch", b.make("fetch", {"n": inp}))
        ctx.state["x"] = x
        y = await ctx.step("think", b.make("think", [1, 2, (3, 4)]))
        z = await ctx.step("send", b.make("send", "sent"))
        return {"x": x, "y": y, "z": z}

    b.crash_at = "send"
    with pytest.raises(HostCrash):
        await DurableEngine(host.ts).start(scope("r1"), "wf", wf, 7)
    run = host.ts.runs.get("r1")
    assert run.status == "running" and run.current_step == "think"
    assert run.state == {"x": {"n": 7}}  # checkpointed with the last journaled step

    b.crash_at = None
    ts = host.restart()
    run = await DurableEngine(ts, {"wf": wf}).resume("r1")
    assert run.status == "succeeded"
    # The tuple became a list both live and on replay: the workflow sees what the journal holds.
    assert run.result == {"x": {"n": 7}, "y": [1, 2, [3, 4]], "z": "sent"}
    assert b.ran == Counter({"fetch": 1, "think": 1, "send": 2})
    # Keys are derived from (run, position), stable across the crash, and passed to the body.
    assert b.keys[2] == b.keys[3] and len(set(b.keys)) == 3
    assert RunLog.load(ts, "r1").derived_key(2) == b.keys[2]
    assert [(s.name, s.status, s.result) for s in ts.runs.steps("r1")] == [
        ("fetch", "succeeded", {"n": 7}), ("think", "succeeded", [1, 2, [3, 4]]), ("send", "succeeded", "sent")]

    # A finished run resumes to itself and runs nothing.
    again = await DurableEngine(ts, {"wf": wf}).resume("r1")
    assert again.version == run.version and b.ran["fetch"] == 1


async def test_start_is_idempotent_by_run_id(host: Host) -> None:
    b = Bodies()

    async def wf(ctx: WorkflowContext, inp: Any) -> Any:
        return await ctx.step("once", b.make("once", 1))

    engine = DurableEngine(host.ts)
    first = await engine.start(scope("same"), "wf", wf)
    second = await engine.start(scope("same"), "wf", wf)
    assert first.status == second.status == "succeeded" and b.ran["once"] == 1
    with pytest.raises(Exception) as e:
        await engine.start(scope("same"), "other", wf)
    assert "exists for workflow 'wf'" in str(e.value)


async def test_retries_with_backoff_are_logged_and_exhaustion_is_a_choice(tenant) -> None:
    delays: list[float] = []

    async def no_sleep(d: float) -> None:
        delays.append(d)

    calls = Counter()

    def flaky() -> str:
        calls["flaky"] += 1
        if calls["flaky"] < 3:
            raise ConnectionError(f"reset #{calls['flaky']}")
        return "ok"

    def broken() -> str:
        calls["broken"] += 1
        raise TimeoutError("vendor A down")

    def refused() -> str:
        calls["refused"] += 1
        raise PermanentFailure("card declined")

    async def wf(ctx: WorkflowContext, inp: Any) -> dict:
        a = await ctx.step("flaky", flaky, retries=3, backoff=Backoff(base=1.0, factor=2.0, cap=10.0, jitter=0.5))
        try:
            await ctx.step("vendor-a", broken, retries=2, backoff=NO_WAIT)
            path = "a"
        except StepFailed as e:
            assert e.attempts == 3 and "vendor A down" in e.error
            path = "b"  # the workflow chooses another path instead of repeating the failed one
        with pytest.raises(StepFailed):
            await ctx.step("charge", refused, retries=5)
        return {"a": a, "path": path, "failures": [(h.name, h.attempt) for h in ctx.failures()]}

    run = await DurableEngine(tenant, sleep=no_sleep, rng=random.Random(3)).start(scope("retry"), "wf", wf)
    assert run.status == "succeeded", run.error
    assert run.result["a"] == "ok" and run.result["path"] == "b"
    assert calls == Counter({"flaky": 3, "broken": 3, "refused": 1})  # a permanent failure is not retried
    # Exponential backoff with jitter: attempt 1 -> 2 waits in [0.5, 1], 2 -> 3 in [1, 2]; NO_WAIT waits 0.
    assert 0.5 <= delays[0] <= 1.0 and 1.0 <= delays[1] <= 2.0 and delays[2:] == [0.0, 0.0]
    log = [(h.kind, h.name, h.status, h.attempt) for h in DurableEngine(tenant).history("retry")]
    assert log == [
        ("attempt", "flaky", "retry", 1), ("attempt", "flaky", "retry", 2), ("step", "flaky", "succeeded", 3),
        ("attempt", "vendor-a", "retry", 1), ("attempt", "vendor-a", "retry", 2), ("step", "vendor-a", "failed", 3),
        ("step", "charge", "failed", 1),
    ]
    assert run.result["failures"] == [["flaky", 1], ["flaky", 2], ["vendor-a", 1], ["vendor-a", 2], ["vendor-a", 3],
                                      ["charge", 1]]
    errors = [h.error for h in DurableEngine(tenant).history("retry")]
    assert errors[0] == "ConnectionError: reset #1" and errors[-1] == "PermanentFailure: card declined"


async def test_retry_budget_and_failed_steps_survive_a_crash(host: Host) -> None:
    calls = Counter()
    crash = {"on": True}

    def flaky() -> str:
        calls["flaky"] += 1
        if crash["on"] and calls["flaky"] == 2:
            raise HostCrash()  # the host dies during the second attempt
        raise ValueError("still failing")

    async def wf(ctx: WorkflowContext, inp: Any) -> str:
        try:
            await ctx.step("flaky", flaky, retries=2, backoff=NO_WAIT)
        except StepFailed as e:
            return f"gave up after {e.attempts}"
        return "impossible"

    with pytest.raises(HostCrash):
        await DurableEngine(host.ts).start(scope("budget"), "wf", wf)
    crash["on"] = False
    run = await DurableEngine(host.restart(), {"wf": wf}).resume("budget")
    # Attempt 1 was logged before the crash; attempt 2 died unlogged and is retried as attempt 2, then 3.
    assert run.result == "gave up after 3" and calls["flaky"] == 4
    # Replaying a failed step raises the same failure again without running it.
    runlog = RunLog.load(host.ts, "budget")
    assert runlog.begin_step(0, "flaky") == Replay(None, 3, "ValueError: still failing")


async def test_non_determinism_is_detected_and_the_run_left_alone(host: Host) -> None:
    b = Bodies()

    async def v1(ctx: WorkflowContext, inp: Any) -> Any:
        await ctx.step("search", b.make("search", 1))
        await ctx.step("book", b.make("book", 2))
        await ctx.step("confirm", b.make("confirm", 3))

    async def v2(ctx: WorkflowContext, inp: Any) -> Any:
        await ctx.step("search", b.make("search", 1))
        try:
            await ctx.step("pay", b.make("pay", 3))  # a different step where "book" was journaled
        except Exception:
            pass  # workflow code cannot swallow the engine's error
        return "should not finish"

    b.crash_at = "confirm"
    with pytest.raises(HostCrash):
        await DurableEngine(host.ts).start(scope("nd"), "wf", v1)
    steps_before = host.ts.runs.steps("nd")
    with pytest.raises(NonDeterminismError) as e:
        await DurableEngine(host.restart()).resume("nd", v2)
    assert e.value.position == 1 and "book" in e.value.message and "pay" in e.value.message
    assert b.ran["pay"] == 0
    run = host.ts.runs.get("nd")
    assert run.status == "pending" and host.ts.runs.steps("nd") == steps_before  # left for a fixed deployment
    b.crash_at = None
    assert (await DurableEngine(host.ts).resume("nd", v1)).status == "succeeded"
    assert b.ran == Counter({"search": 1, "book": 1, "confirm": 2})


async def test_interrupt_waits_and_answer_resumes_after_it_across_a_host_restart(host: Host) -> None:
    b = Bodies()

    async def wf(ctx: WorkflowContext, inp: dict) -> dict:
        quote = await ctx.step("quote", b.make("quote", {"price": 120}))
        ctx.state["quote"] = quote
        decision = await ctx.interrupt({"approve": quote, "for": inp["item"]})
        if decision != "yes":
            return {"booked": False}
        ref = await ctx.step("book", b.make("book", "BK-1"))
        return {"booked": True, "ref": ref, "decision": decision}

    run = await DurableEngine(host.ts).start(scope("ask"), "wf", wf, {"item": "flight"})
    assert run.status == "waiting" and run.current_step == "interrupt:approval"
    assert run.state == {"quote": {"price": 120}}
    assert b.ran == Counter({"quote": 1})

    ts = host.restart()  # the host process is gone; the sandbox may sleep; only the store remains
    engine = DurableEngine(ts, {"wf": wf})
    assert engine.waiting_for("ask") == {"approve": {"price": 120}, "for": "flight"}
    # Resuming without an answer replays up to the interrupt and waits again; nothing re-runs.
    assert (await engine.resume("ask")).status == "waiting" and b.ran["quote"] == 1
    done = await engine.answer("ask", "yes")
    assert done.status == "succeeded" and done.result == {"booked": True, "ref": "BK-1", "decision": "yes"}
    assert b.ran == Counter({"quote": 1, "book": 1})  # resumed after the interrupt, not from the start
    with pytest.raises(RunNotWaiting):
        await engine.answer("ask", "again")
    entries = [(h.kind, h.status) for h in engine.history("ask")]
    assert entries == [("step", "succeeded"), ("interrupt", "answered"), ("step", "succeeded")]
    assert engine.history("ask")[1].result == {"payload": {"approve": {"price": 120}, "for": "flight"}, "answer": "yes"}


async def test_history_shows_failures_and_corrections_and_replays_the_same_choice(host: Host) -> None:
    calls = Counter()

    def vendor(name: str) -> str:
        calls[name] += 1
        if name == "a":
            raise ConnectionError("vendor a refused")
        return f"booked with {name}"

    async def wf(ctx: WorkflowContext, inp: Any) -> dict:
        tried = {h.name for h in ctx.failures()}
        first = "b" if "try-a" in tried else "a"
        try:
            out = await ctx.step(f"try-{first}", vendor, first, retries=1, backoff=NO_WAIT)
        except StepFailed:
            ctx.correct("vendor a is down; use b")
            await ctx.interrupt({"ask": "use vendor b?"})
            notes = [h.note for h in ctx.history() if h.kind in ("note", "correction")]
            out = await ctx.step("try-b", vendor, "b")
            return {"out": out, "notes": notes}
        return {"out": out, "notes": []}

    engine = DurableEngine(host.ts)
    run = await engine.start(scope("hist"), "wf", wf)
    assert run.status == "waiting"
    engine.correct("hist", "the user says: prefer b from now on")  # from outside, while it waits
    ts = host.restart()
    done = await DurableEngine(ts, {"wf": wf}).answer("hist", True)
    assert done.result == {"out": "booked with b",
                           "notes": ["vendor a is down; use b", "the user says: prefer b from now on"]}
    assert calls == Counter({"a": 2, "b": 1})
    kinds = [(h.kind, h.name, h.status) for h in DurableEngine(ts).history("hist")]
    assert kinds == [
        ("attempt", "try-a", "retry"), ("step", "try-a", "failed"), ("correction", "correction", "correction"),
        ("interrupt", "approval", "answered"), ("note", "note", "note"), ("step", "try-b", "succeeded"),
    ]
    # Outside corrections would race a running executor, so they are refused then.
    runlog = RunLog.load(ts, "hist")
    runlog.run = ts.runs.update("hist", expected_version=runlog.run.version, status="running")
    with pytest.raises(Exception) as e:
        runlog.add_note("too late")
    assert "is running" in str(e.value)


async def test_cancel_a_waiting_run(tenant) -> None:
    async def wf(ctx: WorkflowContext, inp: Any) -> Any:
        await ctx.interrupt("ok?")
        raise AssertionError("a cancelled run must not continue")

    engine = DurableEngine(tenant)
    assert (await engine.start(scope("c1"), "wf", wf)).status == "waiting"
    cancelled = engine.cancel("c1", "user changed their mind")
    assert cancelled.status == "cancelled" and cancelled.error == "user changed their mind"
    with pytest.raises(RunNotWaiting):
        await engine.answer("c1", "yes")
    assert (await engine.resume("c1")).status == "cancelled"
    assert engine.cancel("c1").version == cancelled.version  # idempotent


async def test_cancel_a_run_executing_in_this_engine(tenant) -> None:
    entered = asyncio.Event()
    ran_after = Counter()

    async def slow() -> str:
        entered.set()
        await asyncio.sleep(3600)
        return "never"

    async def wf(ctx: WorkflowContext, inp: Any) -> Any:
        await ctx.step("slow", slow)
        ran_after["after"] += 1

    engine = DurableEngine(tenant)
    task = asyncio.create_task(engine.start(scope("c2"), "wf", wf))
    await entered.wait()
    engine.cancel("c2")
    run = await task
    assert run.status == "cancelled" and ran_after["after"] == 0
    assert tenant.runs.steps("c2") == []


async def test_cancel_from_another_host_stops_the_executor_at_its_next_write(host: Host) -> None:
    other = host.second()
    ran = Counter()

    def step_one() -> int:
        ran["one"] += 1
        DurableEngine(other).cancel("c3")  # meanwhile, elsewhere, someone cancels
        return 1

    async def wf(ctx: WorkflowContext, inp: Any) -> Any:
        await ctx.step("one", step_one)
        ran["two"] += 1

    run = await DurableEngine(host.ts).start(scope("c3"), "wf", wf)
    assert run.status == "cancelled" and ran == Counter({"one": 1})
    assert host.ts.runs.steps("c3") == []  # the result lost the compare-and-set with the cancellation


async def test_explicit_idempotency_key_dedupes_across_runs(tenant) -> None:
    sent: list[str] = []

    def send_email(to: str, *, idempotency_key: str) -> dict:
        sent.append(idempotency_key)
        return {"id": f"msg-{len(sent)}"}

    async def wf(ctx: WorkflowContext, inp: dict) -> Any:
        return await ctx.step("email", send_email, inp["to"], idempotency_key=f"welcome:{inp['to']}")

    engine = DurableEngine(tenant)
    a = await engine.start(scope("w1"), "wf", wf, {"to": "bob"})
    b = await engine.start(scope("w2"), "wf", wf, {"to": "bob"})
    assert a.result == b.result == {"id": "msg-1"} and sent == ["welcome:bob"]
    assert [h.attempt for h in engine.history("w2")] == [0]  # settled from the journal, never attempted
    assert tenant.journal.get("welcome:bob").status == "done"


async def test_recover_resumes_runs_left_by_a_dead_host(host: Host) -> None:
    b = Bodies()

    async def wf(ctx: WorkflowContext, inp: int) -> int:
        x = await ctx.step("a", b.make("a", inp))
        y = await ctx.step("b", b.make("b", 10))
        return x + y

    engine = DurableEngine(host.ts)
    b.crash_at = "b"
    for i in range(3):
        with pytest.raises(HostCrash):
            await engine.start(scope(f"rec{i}"), "wf", wf, i)
    host.ts.runs.create(scope("queued"), "wf", 5)  # created, never started
    host.ts.runs.create(scope("unknown"), "other-workflow", 0)
    b.crash_at = None
    report = await DurableEngine(host.restart()).recover({"wf": wf})
    assert sorted(r.id for r in report.resumed) == ["queued", "rec0", "rec1", "rec2"]
    assert {r.id: r.result for r in report.resumed} == {"rec0": 10, "rec1": 11, "rec2": 12, "queued": 15}
    assert report.unregistered == ["unknown"] and report.errors == {}
    assert b.ran == Counter({"a": 4, "b": 7})
    with pytest.raises(WorkflowNotRegistered):
        await DurableEngine(host.ts).resume("unknown")


async def test_two_executors_cannot_both_extend_a_run(tenant) -> None:
    tenant.runs.create(scope("fence"), "wf")
    first, second = RunLog.load(tenant, "fence"), RunLog.load(tenant, "fence")
    first.mark_running()
    with pytest.raises(RunTakenOver):
        second.mark_running()
    d = first.begin_step(0, "s")
    assert isinstance(d, Proceed)
    first.complete_step(0, "s", d.idempotency_key, "mine", attempt=d.attempt)
    with pytest.raises(RunTakenOver):
        second.complete_step(0, "s", d.idempotency_key, "theirs", attempt=1)
    assert [s.result for s in tenant.runs.steps("fence")] == ["mine"]


async def test_channel_primitives_drive_a_run_like_a_guest(host: Host) -> None:
    engine = DurableEngine(host.ts)
    engine.create_run(scope("guest"), "remote", {"q": 1})
    run = engine.open_run("guest")
    assert run.status == "running"
    d = engine.begin_step("guest", 0, "llm")
    assert isinstance(d, Proceed) and d.attempt == 1
    engine.fail_step("guest", 0, "llm", "RateLimited: 429", attempt=1, final=False)
    d = engine.begin_step("guest", 0, "llm")
    assert isinstance(d, Proceed) and d.attempt == 2
    assert engine.complete_step("guest", 0, "llm", {"text": "hi"}, attempt=2, state={"turn": 1}) == {"text": "hi"}
    assert isinstance(engine.interrupt("guest", 1, {"confirm": "send?"}), Suspend)
    v = host.ts.runs.get("guest").version
    with pytest.raises(RunTakenOver):
        engine.checkpoint_state("guest", {"turn": 9}, expected_version=v - 1)

    # The host restarts; the guest wakes and replays through the channel.
    fresh = DurableEngine(host.restart())
    await fresh.answer("guest", "send it", resume=False)
    fresh.open_run("guest")
    assert fresh.begin_step("guest", 0, "llm") == Replay({"text": "hi"}, 2)
    assert fresh.interrupt("guest", 1, {"confirm": "send?"}).value == "send it"
    with pytest.raises(NonDeterminismError):
        fresh.begin_step("guest", 1, "llm")
    new_v = fresh.checkpoint_state("guest", {"turn": 2}, expected_version=host.ts.runs.get("guest").version)
    done = fresh.finish_run("guest", "ok", state={"turn": 3})
    assert done.status == "succeeded" and done.state == {"turn": 3} and done.version == new_v + 1


async def test_many_runs_interleave_in_one_engine_without_crosstalk(tenant) -> None:
    async def body(run: int, i: int) -> list[int]:
        await asyncio.sleep(0)  # yield to the other runs between steps
        return [run, i]

    async def wf(ctx: WorkflowContext, run: int) -> list:
        out = []
        for i in range(5):
            out.append(await ctx.step(f"s{i}", body, run, i))
            ctx.state["last"] = i
        return out

    engine = DurableEngine(tenant)
    runs = await asyncio.gather(*(engine.start(scope(f"par{n}"), "wf", wf, n) for n in range(8)))
    assert [r.result for r in runs] == [[[n, i] for i in range(5)] for n in range(8)]
    assert all(r.state == {"last": 4} and len(tenant.runs.steps(r.id)) == 5 for r in runs)
