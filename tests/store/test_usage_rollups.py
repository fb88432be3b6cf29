"""The usage rollups (store migrations 28 and 31) give the sums and storage levels the ledger gave: on a random ledger, after
deletions (forgetting a user, the TTL sweep, an instance's latest measurement) and after the migration built them
from rows written before it, on SQLite and PostgreSQL. And a tenant's totals no longer read a year of ledger rows."""

from __future__ import annotations

import math
import random
import re
import threading
import time
from pathlib import Path

import pytest

from moorage.store import Scope, Store, TenantStore
from moorage.store.base import StoreContention
from moorage.store.postgres import PostgresBackend
from moorage.store.sqlite import SQLiteBackend
from moorage.usage import ledger
from tests.store.test_query_plans import recorded

KINDS = ("input_tokens", "output_tokens", "cost_usd", "compute_seconds", "wakes", *ledger.GAUGES)
NOW = time.time()


def fill(ts: TenantStore, rng: random.Random, n: int = 400) -> None:
    """Rows over 40 days (some on a day's first second), of two agents (and none), users, their instances."""
    at = NOW
    for _ in range(n):
        kind = rng.choice(KINDS)
        agent = rng.choice(("echo", "echo", "bot", None))
        user = rng.choice(("alice", "bob", "carol", "dave", None)) if agent else None
        if kind in ledger.GAUGES:  # an instance's measurement names its instance (ledger.record)
            agent, user = agent or "echo", user or "erin"
        r = rng.random()
        if r < 0.1:
            at = math.floor(NOW / 86400 - rng.randrange(40)) * 86400.0  # a day's first instant
        elif r < 0.4:
            at = min(NOW, at + rng.choice((0.0, rng.uniform(0, 7200))))  # the same instant or day as the last
        else:
            at = NOW - rng.uniform(0, 40 * 86400)
        amount = rng.uniform(0, 3) if kind in ("cost_usd", "compute_seconds") else float(rng.randrange(0, 5000))
        scope = Scope.for_user(agent, user) if agent and user else None
        ts.usage.add(kind, amount, agent_id=agent, user_id=user, scope=scope, ts=at)


def reference(ts: TenantStore, since: float, agent: str | None, user: str | None) -> tuple[dict, dict, list]:
    """What the code before the rollups reported, from every ledger row: the sums, the levels, the days."""
    rows = ts.read("SELECT id, ts, kind, amount, agent_id, user_id, scope FROM usage ORDER BY ts, id")
    until = time.time() + 86400.0
    rows = [r for r in rows if r[1] >= since and (agent is None or r[4] == agent) and (user is None or r[5] == user)]
    sums: dict[str, float] = {}
    for r in rows:
        sums[r[2]] = sums.get(r[2], 0.0) + r[3]
    last: dict[tuple, float] = {}
    day_last: dict[tuple, float] = {}
    days: dict[int, dict[str, float]] = {}
    for r in rows:
        if r[1] >= until:
            continue
        if r[2] in ledger.GAUGES:
            last[(r[2], r[6] or "")] = r[3]
            day_last[(int(r[1] // 86400), r[2], r[6] or "")] = r[3]
        else:
            d = days.setdefault(int(r[1] // 86400), {})
            d[r[2]] = d.get(r[2], 0.0) + r[3]
    levels: dict[str, float] = {}
    for (kind, _), v in last.items():
        levels[kind] = levels.get(kind, 0.0) + v
    for (d, kind, _), v in day_last.items():
        days.setdefault(d, {})[kind] = days.setdefault(d, {}).get(kind, 0.0) + v
    totals = {**sums, **levels}
    return sums, totals, [days[d] for d in sorted(days)]


def same(got: dict[str, float], want: dict[str, float]) -> bool:
    return got.keys() == want.keys() and all(got[k] == pytest.approx(want[k], rel=1e-9, abs=1e-9) for k in want)


def check(ts: TenantStore) -> None:
    for since in (0.0, NOW - 30 * 86400, NOW - 7.5 * 86400, math.floor(NOW / 86400 - 3) * 86400.0, NOW - 3600):
        for agent, user in ((None, None), ("echo", None), ("bot", None), ("echo", "alice"), (None, "bob")):
            sums, totals, days = reference(ts, since, agent, user)
            assert same(ts.usage.totals(since=since, agent_id=agent, user_id=user), sums), (since, agent, user)
            assert same(ledger.totals(ts, since=since, agent=agent, user=user), totals), (since, agent, user)
            got = ledger.by_day(ts, since=since, agent=agent, user=user)
            assert len(got) == len(days) and all(same(g["totals"], w) for g, w in zip(got, days)), (since, agent)


def test_the_rollups_sum_as_the_ledger_did_and_follow_its_deletions(tenant: TenantStore) -> None:
    rng = random.Random(28)
    fill(tenant, rng)
    check(tenant)
    tenant.forget_user("alice", "echo")  # a user's rows go
    check(tenant)
    with tenant._tx() as c:  # the sweep of a TTL; an instance's latest measurement (its level falls back)
        c.x("DELETE FROM usage WHERE ts < ?", (NOW - 35 * 86400,))
        latest = c.q("SELECT id FROM usage WHERE kind = 'disk_bytes' AND scope IS NOT NULL ORDER BY ts DESC, id DESC "
                     "LIMIT 3")
        gauges = c.q("SELECT id FROM usage WHERE kind IN ('disk_bytes', 'snapshot_bytes') ORDER BY id")
        for (i,) in [*latest, *random.Random(5).sample(gauges, len(gauges) // 4)]:
            c.x("DELETE FROM usage WHERE id = ?", (i,))
    check(tenant)
    with tenant._tx() as c:  # every row: nothing is left in the rollups, not even a float's remainder
        c.x("DELETE FROM usage")
    assert tenant.read("SELECT COUNT(*) FROM usage_days")[0][0] == 0
    assert tenant.read("SELECT COUNT(*) FROM usage_levels")[0][0] == 0
    assert ledger.totals(tenant, since=0.0) == {}


def test_a_since_before_the_epoch_or_past_any_day_reads_the_bounds_not_a_500(tenant: TenantStore) -> None:
    """``GET /v1/fleet?since=-3.7e113`` (found by the API's property-based test) was a 500: the rollups' day number of
    such a time is an integer no store can bind. Times before the epoch or past the year 5138 read as those bounds."""
    fill(tenant, random.Random(7))
    everything = ledger.totals(tenant, since=0.0)
    assert everything and ledger.totals(tenant, since=-3.7e113) == everything
    assert tenant.usage.totals(since=-1e300) == tenant.usage.totals(since=0.0)
    assert ledger.totals(tenant, since=1e300) == {} and tenant.usage.totals(since=1e300) == {}
    assert ledger.by_day(tenant, since=-1e300, until=1e300) == ledger.by_day(tenant, since=0.0)


@pytest.mark.parametrize("upto", [27, 30])  # before the rollups (28); before the checkpoints' levels (31)
@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
def test_the_migration_builds_the_rollups_of_rows_written_before_it(kind: str, upto: int, tmp_path: Path,
                                                                    request: pytest.FixtureRequest) -> None:
    if kind == "sqlite":  # a tenant at schema ``upto`` (create_tenant would migrate it to the latest)
        b = SQLiteBackend(tmp_path / "store")
        before = Store(b)
        tid = "a" * 32
        with b.control_tx() as c:
            c.x("INSERT INTO tenants (id, name, created_at, version) VALUES (?, ?, ?, 1)", (tid, "old", 0.0))
        b.init_tenant(tid, upto=upto)
        b._migrated.add(str(b.tenant_path(tid)))  # pretend this process already checked it
        make = lambda: Store(SQLiteBackend(tmp_path / "store"))  # noqa: E731
    else:
        url = request.getfixturevalue("pg_url")
        before = Store(PostgresBackend(url, upto=upto))
        tid = before.operator.create_tenant("old")[0].id
        make = lambda: Store(PostgresBackend(url))  # noqa: E731
    fill(before.tenant(before.operator.principal(tid)), random.Random(7))
    before.close()
    after = make()
    ts = after.tenant(after.operator.principal(tid))
    assert ts.read("SELECT COUNT(*) FROM usage_days")[0][0] > 0
    check(ts)
    fill(ts, random.Random(8), n=50)  # and keeps them from there
    check(ts)
    after.close()


def test_a_tenants_totals_read_at_most_a_day_of_ledger_rows(tenant: TenantStore,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """GET /v1/usage of a tenant or agent (also by day), the fleet view, the tenant's LLM budget before a turn: whole
    days come from the rollups; a statement over the ledger rows or the instances' levels is bounded to the part of
    a day at either end."""
    fill(tenant, random.Random(3), n=60)
    with recorded(monkeypatch) as seen:
        for since in (0.0, NOW - 30 * 86400):
            ledger.totals(tenant, since=since)
            ledger.totals(tenant, since=since, agent="echo")
            ledger.by_day(tenant, since=since)
            ledger.by_day(tenant, since=since, agent="echo")
    per_row = [(sql, p) for sql, p in seen if re.search(r"FROM (usage|usage_levels)\b", sql)]
    assert per_row
    for sql, params in per_row:
        assert "ts >= ? AND ts < ?" in sql and params[1] - params[0] <= 86400, sql


def test_forgetting_users_while_others_sleep_neither_deadlocks_nor_fails(request: pytest.FixtureRequest) -> None:
    """On PostgreSQL a forget deleted a user's ledger rows (and their shared rollup rows) in its rows' order while
    other users' sleeps wrote their measurements in theirs: the two deadlocked and one failed (40P01, a 500)."""
    store = Store(PostgresBackend(request.getfixturevalue("pg_url"), pool_size=20))
    ts = store.tenant(store.operator.principal(store.operator.create_tenant("acme")[0].id))
    now = time.time()
    for u in range(30):
        with ts.transaction():
            for i in range(15):
                for kind in ("disk_bytes", "snapshot_bytes", "compute_seconds", "input_tokens"):
                    ts.usage.add(kind, 100.0 + i, agent_id="echo", user_id=f"u{u}", scope=Scope.for_user("echo", f"u{u}"),
                                 ts=now - 10 * i)
    failed: list[BaseException] = []

    def forget(u: int) -> None:
        try:
            ts.forget_user(f"u{u}", "echo")
        except BaseException as e:  # noqa: BLE001 - collected, asserted below
            failed.append(e)

    def sleep(u: int) -> None:  # a sleep records its compute and its instance's bytes in one transaction
        scope = Scope.for_user("echo", f"w{u}")
        for i in range(5):
            try:
                with ts.transaction():
                    ts.usage.add("compute_seconds", 1.0, agent_id="echo", user_id=f"w{u}", scope=scope)
                    ts.usage.add("disk_bytes", 1000.0 + i, agent_id="echo", user_id=f"w{u}", scope=scope)
                    ts.usage.add("snapshot_bytes", 2000.0 + i, agent_id="echo", user_id=f"w{u}", scope=scope)
            except BaseException as e:  # noqa: BLE001
                failed.append(e)

    threads = [threading.Thread(target=forget, args=(u,)) for u in range(30)]
    threads += [threading.Thread(target=sleep, args=(u,)) for u in range(15)]
    random.Random(40).shuffle(threads)
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failed == []
    assert ts.read("SELECT COUNT(*) FROM usage WHERE user_id LIKE 'u%'") == [(0,)]
    for agent in (None, "echo"):
        sums, totals, days = reference(ts, 0.0, agent, None)
        assert same(ts.usage.totals(since=0.0, agent_id=agent), sums)
        assert same(ledger.totals(ts, since=0.0, agent=agent), totals)
        got = ledger.by_day(ts, since=0.0, agent=agent)
        assert len(got) == len(days) and all(same(g["totals"], w) for g, w in zip(got, days))
    store.close()


def test_a_deadlock_the_store_broke_is_a_retryable_503_and_a_forget_runs_again(request: pytest.FixtureRequest) -> None:
    """Whatever still deadlocks on PostgreSQL answers a typed 503 (retry: nothing was kept), not the server's own
    failure; a forget or a ledger write outside a caller's transaction runs again by itself."""
    store = Store(PostgresBackend(request.getfixturevalue("pg_url")))
    ts = store.tenant(store.operator.principal(store.operator.create_tenant("acme")[0].id))
    ts.usage.add("wakes", 1, agent_id="a")
    ts.usage.add("wakes", 1, agent_id="b")
    ids = [r[0] for r in ts.read("SELECT id FROM usage ORDER BY id")]
    barrier = threading.Barrier(2)
    got: list[BaseException] = []

    def cross(first: int, second: int) -> None:
        try:
            with ts.transaction() as t:
                t.ambient().x("UPDATE usage SET amount = amount + 1 WHERE id = ?", (first,))
                barrier.wait()
                t.ambient().x("UPDATE usage SET amount = amount + 1 WHERE id = ?", (second,))
        except BaseException as e:  # noqa: BLE001
            got.append(e)

    threads = [threading.Thread(target=cross, args=ids), threading.Thread(target=cross, args=ids[::-1])]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 1 and isinstance(got[0], StoreContention), got
    assert got[0].http_status == 503 and "retry" in (got[0].hint or "")

    calls = []
    real = ts._forget_user

    def once_aborted(user: str, agent: str | None) -> int:
        calls.append(user)
        if len(calls) == 1:
            raise StoreContention("aborted to break a deadlock")
        return real(user, agent)

    ts._forget_user = once_aborted  # type: ignore[method-assign]
    ts.usage.add("wakes", 1, agent_id="a", user_id="alice")
    assert ts.forget_user("alice") >= 1 and calls == ["alice", "alice"]
    store.close()


def test_sleeps_of_one_agents_users_at_once_do_not_deadlock(request: pytest.FixtureRequest) -> None:
    """On PostgreSQL each sleep moves its instance's levels from their last measurement to the new one: their sums
    lost the old row's shard and gained the new row's, in that order, and two sleeps whose shards crossed
    deadlocked (28 of 1,000 sleeps here failed, 40P01). A level now stays in its instance's shard."""
    store = Store(PostgresBackend(request.getfixturevalue("pg_url"), pool_size=30))
    ts = store.tenant(store.operator.principal(store.operator.create_tenant("acme")[0].id))
    failed: list[BaseException] = []

    def sleeps(u: int) -> None:
        scope = Scope.for_user("echo", f"w{u}")
        for i in range(40):
            try:
                with ts.transaction():  # a caller's transaction: nothing in it runs again by itself
                    ts.usage.add("disk_bytes", 1000.0 + i, agent_id="echo", user_id=f"w{u}", scope=scope)
                    ts.usage.add("snapshot_bytes", 2000.0 + i, agent_id="echo", user_id=f"w{u}", scope=scope)
            except BaseException as e:  # noqa: BLE001 - collected, asserted below
                failed.append(e)

    threads = [threading.Thread(target=sleeps, args=(u,)) for u in range(25)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failed == []
    assert same(ledger.totals(ts, since=0.0, agent="echo"), reference(ts, 0.0, "echo", None)[1])
    store.close()


def _deadlocks(ts: TenantStore) -> int:
    """The deadlocks PostgreSQL broke in this database so far (pg_stat_database; flushed by a backend when idle)."""
    time.sleep(1.5)
    return ts.read("SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()")[0][0]


def test_deletions_across_agents_at_once_take_the_agents_in_one_order(request: pytest.FixtureRequest) -> None:
    """Forgetting a user of every agent and the usage ledger's retention sweep each delete rows of several agents in
    one transaction, and each row's deletion locked its agent (store/usage_rollups.py) in the order the rows came: a
    user's by agent, the sweep's by time. Two of them at once deadlocked on PostgreSQL (a sweep failed, a forget ran
    again); now each takes its agents' locks in one order before it deletes, and PostgreSQL breaks no deadlock."""
    store = Store(PostgresBackend(request.getfixturevalue("pg_url"), pool_size=24))
    ts = store.tenant(store.operator.principal(store.operator.create_tenant("acme")[0].id))
    ts.retention.set("usage", 31 * 86400.0)
    rng = random.Random(41)
    now = time.time()
    for u in range(16):  # rows over 60 days, of six agents: of three in the user's instances, the rest not
        instances = rng.sample(range(6), 3)
        with ts.transaction() as t:
            for a in instances:
                ts._touch(t.ambient(), Scope.for_user(f"a{a}", f"u{u}"), now)
            for _ in range(300):
                a = rng.randrange(6)
                kinds = ("input_tokens", "compute_seconds", "wakes") + (("disk_bytes",) if a in instances else ())
                ts.usage.add(rng.choice(kinds), float(rng.randrange(1, 500)), agent_id=f"a{a}", user_id=f"u{u}",
                             scope=Scope.for_user(f"a{a}", f"u{u}") if a in instances else None,
                             ts=now - rng.uniform(0, 60 * 86400))
    before = _deadlocks(ts)
    failed: list[BaseException] = []

    def forget(u: int) -> None:
        try:
            ts.forget_user(f"u{u}")
        except BaseException as e:  # noqa: BLE001 - collected, asserted below
            failed.append(e)

    def sweep() -> None:
        try:
            ts.retention.sweep_records(time.time(), batch=150)
        except BaseException as e:  # noqa: BLE001
            failed.append(e)

    threads = [threading.Thread(target=forget, args=(u,)) for u in range(12)]
    threads += [threading.Thread(target=sweep) for _ in range(6)]
    random.Random(42).shuffle(threads)
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failed == []
    assert _deadlocks(ts) == before
    assert ts.read("SELECT COUNT(*) FROM usage WHERE user_id IN ('u0', 'u5', 'u11') OR ts < ?",
                   (now - 31 * 86400.0 - 60,)) == [(0,)]
    assert ts.read("SELECT COUNT(*) FROM usage WHERE user_id = 'u13'")[0][0] > 0
    for agent in (None, "a0", "a3"):
        sums, totals, days = reference(ts, 0.0, agent, None)
        assert same(ts.usage.totals(since=0.0, agent_id=agent), sums)
        assert same(ledger.totals(ts, since=0.0, agent=agent), totals)
    store.close()
