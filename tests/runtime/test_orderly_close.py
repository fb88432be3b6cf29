"""Closing a runtime ends its own background work before what that work uses is closed: the automatic checkpoint
a turn takes after its reply went out (waited for, or cancelled past a bound) and the embedding of the turn's
messages. Real runtime (``make_env``'s teardown, as every runtime test closes), process sandboxes, SQLite."""

from __future__ import annotations

import asyncio
import logging
import threading
from pathlib import Path

import pytest

from moorage.memory.embed_queue import THREAD_NAME
from moorage.store import EntityKey, Scope, open_store
from moorage.store.repos.checkpoints import Checkpoints
from tests.runtime.conftest import Env, make_env, write_agent
from tests.timetravel.conftest import AGENT

#: What must never be logged while a runtime closes: background work that ran into a closed driver or store.
AFTER_CLOSE = ("checkpoint after turn failed", "background embedding failed", "a turn failed after its reply")


async def _reply(env: Env, user: str, message: str) -> str:
    async for ev in env.runtime.stream(env.principal, EntityKey("tt", user), message):
        if ev.kind == "done":
            return ev.data.reply
    raise AssertionError("no done event")


def _background_left() -> tuple[list[str], list[str]]:
    """Tasks other than the test's own and the embedding worker threads still alive."""
    tasks = sorted(t.get_name() for t in asyncio.all_tasks() if t is not asyncio.current_task() and not t.done())
    threads = [t.name for t in threading.enumerate() if t.name == THREAD_NAME and t.is_alive()]
    return tasks, threads


def _problems(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [f"{r.levelname} {r.name}: {r.getMessage()}" for r in caplog.records
            if r.name.startswith("moorage") and (r.levelno >= logging.ERROR or r.getMessage().startswith(AFTER_CLOSE))]


async def _turn_with_checkpoint_held(tmp_path: Path):  # type: ignore[no-untyped-def]
    """A runtime whose user ``ada`` had turn 1 (checkpointed) and turn 2, whose reply went out while its automatic
    checkpoint waits for the sandbox's lock, which the test holds. Returns the env's generator, the env, the
    sandbox whose lock is held and turn 2's task."""
    gen = make_env(tmp_path, "process")
    env = await gen.__anext__()
    await env.runtime.deploy(env.principal, write_agent(tmp_path / "agent", "tt", AGENT))
    assert (await _reply(env, "ada", "turn 1")).startswith("done 1")
    await env.runtime.timetravel.list(env.principal, "tt", "ada")  # turn 1's checkpoint taken
    ts = env.store.tenant(env.principal)
    rec = ts.sandboxes.for_scope(Scope.for_user("tt", "ada"))
    sandbox = await env.runtime.driver.open(rec.id)
    await sandbox._lock.acquire()  # the sandbox's own lock: no checkpoint of it can be taken until released
    assert (await asyncio.wait_for(_reply(env, "ada", "turn 2"), 120)).startswith("done 2")  # a guard, not a timing
    (tail,) = env.runtime.timetravel._tails  # the reply went out; the turn's checkpoint runs on
    assert not tail.done()
    return gen, env, sandbox, tail


async def test_closing_waits_for_the_checkpoint_after_a_reply_and_the_embedding(tmp_path: Path,
                                                                               caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    gen, env, sandbox, tail = await _turn_with_checkpoint_held(tmp_path)
    cfg, principal = env.cfg, env.principal
    closing = asyncio.create_task(gen.aclose())  # the whole teardown: runtime, instances, sandboxes, driver, store
    await asyncio.sleep(0.5)
    # The checkpoint cannot proceed, so neither can the close: nothing below it was closed under the checkpoint.
    assert not closing.done() and not tail.done()
    sandbox._lock.release()
    await asyncio.wait_for(closing, 120)  # a guard, not a timing

    # The checkpoint finished (it was not cancelled and did not fail): turn 2 has its checkpoint, not a missing one.
    assert tail.done() and not tail.cancelled() and tail.exception() is None
    assert not env.runtime.timetravel._tails
    store = open_store(cfg)
    try:
        ts = store.tenant(principal)
        cks = Checkpoints(ts).list("tt", "ada")
        assert [(c.kind, c.summary["turn"]["message"]) for c in cks] == [("turn", "turn 2"), ("turn", "turn 1")]
        # The embedding of turn 2's messages ran before the store closed: none is left without a vector.
        session = Scope.session("tt", "ada", "default")
        assert "turn 2" in [e.content for e in ts.events.list(session, limit=1000)]
        assert ts.events.unembedded() == []
    finally:
        store.close()
    assert _background_left() == ([], [])
    assert _problems(caplog) == []


async def test_a_checkpoint_that_never_finishes_is_cancelled_and_the_instance_let_go(tmp_path: Path,
                                                                                   caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    gen, env, sandbox, tail = await _turn_with_checkpoint_held(tmp_path)
    try:
        # The lock stays held for the whole wait: the checkpoint can never finish, so close cancels it.
        finished, cancelled = await env.runtime.timetravel.close(timeout_s=0.2)
        assert (finished, cancelled) == (0, 1)
        assert tail.cancelled() and not env.runtime.timetravel._tails
        # Cancelled, the turn let its instance go: no turn of it is in flight, and no checkpoint row was written.
        live = env.manager.live(env.store.tenant(env.principal), Scope.for_user("tt", "ada"))
        assert live is not None and not live.activity.busy
        cks = Checkpoints(env.store.tenant(env.principal)).list("tt", "ada")
        assert [c.summary["turn"]["message"] for c in cks] == ["turn 1"]
        assert any("cancelling them" in r.getMessage() for r in caplog.records)
    finally:
        sandbox._lock.release()
    await gen.aclose()
    assert _background_left() == ([], [])
    assert _problems(caplog) == []
