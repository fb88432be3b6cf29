"""The router on real sandboxes and a real store: resolution, NotFound without orphans, ordering, 409 and 429."""

from __future__ import annotations

import asyncio

import pytest

from moorage.errors import NotFound, TenantScopeError
from moorage.lifecycle.policies import FixedTimeout
from moorage.router import Busy, Overloaded
from moorage.store import EntityKey, Principal, Scope
from tests.lifecycle.test_manager_env import PROCESS_ONLY, TEMPLATE_FILE, LcEnv, lc_env  # noqa: F401  (fixture)


def _p(env: LcEnv) -> Principal:
    return env.ts.principal


async def _no_instances(env: LcEnv) -> None:
    assert env.ts.sandboxes.list() == []
    assert await env.driver().list() == []


@pytest.mark.parametrize("lc_env", PROCESS_ONLY, indirect=True)
async def test_unknown_agent_or_user_is_not_found_and_provisions_nothing(lc_env: LcEnv) -> None:
    env = lc_env
    r = env.router(env.manager())
    with pytest.raises(NotFound) as e:
        await r.route(_p(env), EntityKey("ghost", "alice"), {"op": "echo", "text": "x"})
    assert e.value.http_status == 404 and "ghost" in e.value.message
    env.agent("helper")  # users must exist (the default)
    with pytest.raises(NotFound) as e:
        await r.route(_p(env), EntityKey("helper", "mallory"), {"op": "echo", "text": "x"})
    assert "mallory" in e.value.message and "lifecycle.users" in (e.value.hint or "")
    await _no_instances(env)
    env.ts.agent_users.put("helper", "alice")
    assert await r.route(_p(env), EntityKey("helper", "alice"), {"op": "echo", "text": "hello"}) == "hello"
    assert len(env.ts.sandboxes.list()) == 1


@pytest.mark.parametrize("lc_env", PROCESS_ONLY, indirect=True)
async def test_users_are_auto_created_only_where_the_agent_allows(lc_env: LcEnv) -> None:
    env = lc_env
    env.agent("open-agent", users="auto")
    r = env.router(env.manager())
    assert await r.route(_p(env), EntityKey("open-agent", "newcomer"), {"op": "echo", "text": "hi"}) == "hi"
    assert env.ts.users.get("newcomer").id == "newcomer"


@pytest.mark.parametrize("lc_env", PROCESS_ONLY, indirect=True)
async def test_end_user_token_cannot_act_for_another_user(lc_env: LcEnv) -> None:
    env = lc_env
    env.agent("helper", users="auto")
    r = env.router(env.manager())
    token = Principal(env.ts.tenant_id, frozenset({"invoke"}), agent="helper", user="alice")
    with pytest.raises(TenantScopeError):
        await r.route(token, EntityKey("helper", "bob"), {"op": "echo", "text": "x"})
    await _no_instances(env)


@pytest.mark.parametrize("lc_env", PROCESS_ONLY, indirect=True)
async def test_instances_are_scoped_per_user_or_per_session_as_configured(lc_env: LcEnv) -> None:
    env = lc_env
    env.agent("per-user", users="auto")
    env.agent("per-session", users="auto", scope="session")
    r = env.router(env.manager())
    for s in ("s1", "s2"):
        await r.route(_p(env), EntityKey("per-user", "alice", session=s), {"op": "echo", "text": "x"})
        await r.route(_p(env), EntityKey("per-session", "alice", session=s), {"op": "echo", "text": "x"})
    assert {rec.scope for rec in env.ts.sandboxes.list(agent_id="per-user")} == {Scope.for_user("per-user", "alice")}
    assert {rec.scope for rec in env.ts.sandboxes.list(agent_id="per-session")} == {
        Scope.session("per-session", "alice", "s1"), Scope.session("per-session", "alice", "s2")}
    loc = await r.locate(_p(env), EntityKey("per-session", "alice", session="s2"))
    assert loc is not None and loc.host == "host-a" and loc.state == "running"


@pytest.mark.parametrize("lc_env", PROCESS_ONLY, indirect=True)
async def test_turns_of_one_session_apply_in_arrival_order(lc_env: LcEnv) -> None:
    env = lc_env
    env.agent("helper", users="auto", concurrency="parallel")
    r = env.router(env.manager())
    key = EntityKey("helper", "alice", session="s1")
    # Each turn reads the log, pauses, and rewrites it: any interleaving would lose or reorder lines.
    results = await asyncio.gather(*[r.route(_p(env), key, {"op": "append", "text": f"t{i}", "pause": 0.02})
                                     for i in range(20)])
    assert results == [f"t{i}" for i in range(20)]
    log = await r.route(_p(env), key, {"op": "read", "path": "log"})
    assert log.split() == [f"t{i}" for i in range(20)]


@pytest.mark.parametrize("lc_env", PROCESS_ONLY, indirect=True)
async def test_reject_policy_answers_busy_409_for_a_second_session(lc_env: LcEnv) -> None:
    env = lc_env
    env.agent("helper", users="auto", concurrency="reject")
    m = env.manager(policy=FixedTimeout(3600))
    r = env.router(m)
    first = asyncio.create_task(r.route(_p(env), EntityKey("helper", "alice", session="s1"), {"op": "hold", "seconds": 1.5}))
    while (li := m.live(env.ts, Scope.for_user("helper", "alice"))) is None or not li.activity.busy:
        await asyncio.sleep(0.02)
    with pytest.raises(Busy) as e:
        await r.route(_p(env), EntityKey("helper", "alice", session="s2"), {"op": "echo", "text": "x"})
    assert e.value.http_status == 409 and "queue" in (e.value.hint or "")
    assert await first is True
    # Once the instance is free, the other session is served.
    assert await r.route(_p(env), EntityKey("helper", "alice", session="s2"), {"op": "echo", "text": "now"}) == "now"


@pytest.mark.parametrize("lc_env", PROCESS_ONLY, indirect=True)
async def test_queue_policy_serves_the_second_session_after_the_first(lc_env: LcEnv) -> None:
    env = lc_env
    env.agent("helper", users="auto", concurrency="queue")
    m = env.manager(policy=FixedTimeout(3600))
    r = env.router(m)
    done: list[str] = []

    async def go(session: str, turn: dict) -> None:
        await r.route(_p(env), EntityKey("helper", "alice", session=session), turn)
        done.append(session)

    first = asyncio.create_task(go("s1", {"op": "hold", "seconds": 1.0}))
    while (li := m.live(env.ts, Scope.for_user("helper", "alice"))) is None or not li.activity.busy:
        await asyncio.sleep(0.02)
    await go("s2", {"op": "echo", "text": "x"})
    await first
    assert done == ["s1", "s2"]


@pytest.mark.parametrize("lc_env", PROCESS_ONLY, indirect=True)
async def test_overload_is_a_typed_429_with_retry_after_never_a_hang(lc_env: LcEnv) -> None:
    env = lc_env
    env.agent("helper", users="auto", concurrency="parallel")
    m = env.manager(policy=FixedTimeout(3600))
    r = env.router(m, max_pending=3, max_session_queue=2, retry_after_s=2.5)
    key = lambda s: EntityKey("helper", "alice", session=s)  # noqa: E731
    holds = [asyncio.create_task(r.route(_p(env), key(f"s{i}"), {"op": "hold", "seconds": 1.5})) for i in range(3)]
    await asyncio.sleep(0)
    assert r.pending == 3
    with pytest.raises(Overloaded) as e:
        await r.route(_p(env), key("s9"), {"op": "echo", "text": "x"})
    assert e.value.http_status == 429 and e.value.retry_after_s == 2.5
    assert all(await asyncio.gather(*holds))
    assert await r.route(_p(env), key("s9"), {"op": "echo", "text": "ok"}) == "ok"
    # One session's line is bounded too: 1 running + 2 waiting, the next one is refused at once.
    r2 = env.router(m, max_session_queue=2)
    line = [asyncio.create_task(r2.route(_p(env), key("s1"), {"op": "hold", "seconds": 0.5})) for _ in range(3)]
    await asyncio.sleep(0)
    with pytest.raises(Overloaded):
        await r2.route(_p(env), key("s1"), {"op": "echo", "text": "x"})
    assert all(await asyncio.gather(*line))


async def test_hundred_concurrent_turns_through_the_router_wake_a_sleeping_agent_once(lc_env: LcEnv) -> None:
    env = lc_env
    env.agent("helper", users="auto", concurrency="parallel")
    m = env.manager(policy=FixedTimeout(3600))
    r = env.router(m)
    assert await r.route(_p(env), EntityKey("helper", "alice"), {"op": "read", "path": TEMPLATE_FILE}) == \
        "prepared in the template"
    assert await m.sleep(env.ts, Scope.for_user("helper", "alice"))
    replies = await asyncio.gather(*[r.route(_p(env), EntityKey("helper", "alice", session=f"s{i}"),
                                             {"op": "echo", "text": f"r{i}"}) for i in range(100)])
    assert replies == [f"r{i}" for i in range(100)]
    assert len(env.spans("lifecycle.woke")) == 1
    assert env.ts.usage.totals()["wakes"] == 1
