"""The statements that forgetting a user, the retention sweep, caps and list pages run use an index, on both
backends: none reads every row of a table that grows with the tenant's users, none sorts a whole table for a page.

Each test runs the real repository call with its statements recorded, then asks the same backend for each one's
plan (SQLite ``EXPLAIN QUERY PLAN``; PostgreSQL ``EXPLAIN`` with sequential scans and sorts priced out, so a plan
that still has one has no index to use). On a store of 50,000 users these were whole-table scans
(bench/results/latest/scale.md).
"""

from __future__ import annotations

import contextlib
import re
import time
from typing import Any, Callable, Iterator

import pytest

from moorage.store import Store, TenantStore
from moorage.store.model import Scope, Span
from moorage.store.repos import common
from moorage.store.repos.journal import replay_mark
from moorage.store.sql import Conn
from moorage.store.tenant import TenantStore as _TS

#: Tables whose rows grow with end-users and their turns (a scan of ``agents`` or ``retention`` is fine).
BIG = ("usage", "spans", "executions", "sandboxes", "workflow_runs", "webhook_deliveries", "webhook_attempts",
       "journal", "events", "facts", "state", "steps", "scopes", "sessions", "checkpoints", "checkpoint_rows",
       "agent_users", "end_users")


#: What row-level security adds to every PostgreSQL index condition: alone, it bounds nothing.
_TENANT = re.compile(r"tenant_id = current_setting\('moorage\.tenant_id'::text, true\)")


@contextlib.contextmanager
def recorded(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[str, tuple]]]:
    """Every statement the store runs inside the block, with its parameters."""
    seen: list[tuple[str, tuple]] = []
    for name in ("q", "one", "x"):
        orig = getattr(Conn, name)

        def wrapped(self: Conn, sql: str, params: Any = (), _orig: Callable[..., Any] = orig) -> Any:
            seen.append((sql, tuple(params)))
            return _orig(self, sql, params)

        monkeypatch.setattr(Conn, name, wrapped)
    orig_read = _TS.read

    def read(self: _TS, sql: str, params: Any = ()) -> list[tuple]:
        seen.append((sql, tuple(params)))
        return orig_read(self, sql, params)

    monkeypatch.setattr(_TS, "read", read)
    yield seen
    monkeypatch.undo()


def plan(store: Store, tenant: TenantStore, sql: str, params: tuple) -> list[str]:
    with store.backend.tenant_tx(tenant.tenant_id) as c:
        if c.dialect == "postgres":
            c.x("SET LOCAL enable_seqscan = off")
            c.x("SET LOCAL enable_sort = off")
            return [r[0] for r in c.q("EXPLAIN " + sql, params)]
        return [r[3] for r in c.q("EXPLAIN QUERY PLAN " + sql, params)]


def whole_table_reads(sql: str, lines: list[str]) -> list[str]:
    """The plan lines that read every row of a big table, or sort one for its order. Walking an index from its
    start is a full read too, unless the statement stops after a page (LIMIT) and seeks no position (a page
    after a cursor that walks from the start reads every row before it)."""
    page_from_start = " LIMIT " in sql and not re.search(r"[<>]=? \?", sql)
    out = []
    for i, ln in enumerate(lines):
        node = ln.strip().removeprefix("->").strip()
        m = re.match(r"SCAN (\w+)$|Seq Scan on (\w+)", node)
        if m and (m.group(1) or m.group(2)) in BIG:
            out.append(node)
        m = re.match(r"SCAN (\w+) USING (?:COVERING )?INDEX \w+$|Index (?:Only )?Scan(?: Backward)? using \w+ on (\w+)"
                     r"|Bitmap Index Scan on (\w+)", node)
        table = m and (m.group(1) or m.group(2) or next((t for t in BIG if (m.group(3) or "").startswith(t)), None))
        if m and table in BIG and not page_from_start:
            # PostgreSQL: an index scan whose Index Cond names nothing but the tenant (row-level security) walks
            # all of the tenant's rows.
            below = []
            for nxt in lines[i + 1:]:
                if nxt.strip().startswith("->"):
                    break
                below.append(nxt.strip())
            conds = [_TENANT.sub("", b) for b in below if b.startswith("Index Cond")]
            if m.group(1) or not any(re.search(r"[=<>]", c) for c in conds):
                out.append(node)
        if "USE TEMP B-TREE FOR ORDER BY" in node or re.match(r"Sort  \(", node):  # not Incremental Sort (of ties)
            out.append(node)
    return out


def scans_of(store: Store, tenant: TenantStore, seen: list[tuple[str, tuple]],
             keep: Callable[[str], bool] = lambda s: True) -> dict[str, list[str]]:
    found = {}
    for sql, params in seen:
        if not keep(sql) or not sql.lstrip().upper().startswith(("SELECT", "DELETE", "UPDATE", "WITH")):
            continue
        bad = whole_table_reads(sql, plan(store, tenant, sql, params))
        if bad:
            found[" ".join(sql.split())] = bad
    return found


def other_users(store: Store, ts: TenantStore, n: int = 60) -> None:
    """Rows of ``n`` other users, and on PostgreSQL its statistics: without them the planner prices every index
    of an empty table the same and picks one at random (a long-lived PostgreSQL store is analysed by
    autovacuum; SQLite is never analysed, so its plans are read as a host would get them)."""
    for i in range(n):
        a_user_with_data(ts, "echo", f"other{i:03d}")
    if store.backend.dialect == "postgres":
        import psycopg

        with psycopg.connect(store.backend.owner_url, autocommit=True) as owner:  # the tables' owner may
            owner.execute("ANALYZE")


def a_user_with_data(ts: TenantStore, agent: str, user: str) -> None:
    """What a few turns leave: a user-scoped value, session events, a workflow run, usage, an async execution."""
    ts.state.put(Scope.for_user(agent, user), "k", {"v": 1}, expected_version=0)
    ts.events.append(Scope("session", agent, user, "default"), "message", "hello there", speaker="user")
    ts.runs.create(Scope("workflow", agent, user, f"run-{user}"), "turn", {"message": "hello"})
    ts.usage.add("compute_seconds", 1.5, agent_id=agent, user_id=user, scope=Scope.for_user(agent, user))
    ts.executions.create(f"ex-{user}", agent, user, "default", {"message": "later"})
    ts.facts.insert(Scope.for_user(agent, user), "user", "name", user, f"the user is called {user}")
    entry, _ = ts.journal.claim(f"http:{user}", step=replay_mark(agent, user))  # an Idempotency-Key's answer
    ts.journal.complete(entry.key, expected_version=entry.version, result={"status": 200})
    run = ts.runs.list(scope=Scope("workflow", agent, user, f"run-{user}"))[0]
    ts.runs.record_step(run.id, 1, "draft", "succeeded", result="draft-1")
    step, _ = ts.journal.claim(f"step:{user}", run_id=run.id, step="draft")  # a durable step of the run
    ts.journal.complete(step.key, expected_version=step.version, result="draft-1")
    now = time.time()
    ts.spans.record(Span(f"trace-{user}", f"span-{user}", None, "turn", now, now + 0.1, "ok", {"user": user},
                         Scope("workflow", agent, user, f"run-{user}")))
    ts.sandboxes.create(Scope.for_user(agent, user), state="sleeping", host="h1")
    hooks = ts.webhooks.list(agent) or [ts.webhooks.create(agent, "https://example.com/hook")]
    for d in ts.deliveries.enqueue(agent, "execution.succeeded", {"agent": agent, "user": user}):
        ts.deliveries.record_attempt(d, at=now, status_code=200, error=None, duration_ms=3.0, delivered=True,
                                     retry_at=None)
    assert hooks


def test_forgetting_a_user_reads_only_their_rows(store: Store, tenant: TenantStore,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    for u in ("alice", "bob"):
        a_user_with_data(tenant, "echo", u)
    other_users(store, tenant)
    with recorded(monkeypatch) as seen:  # DELETE /v1/agents/echo/users/alice
        assert [b.scope.user for b in tenant.sandboxes.of_user("echo", "alice")] == ["alice"]
        assert tenant.forget_user("alice", "echo") > 0
        tenant.agent_users.delete("echo", "alice")
    assert scans_of(store, tenant, seen) == {}
    assert tenant.usage.totals(user_id="bob")  # the other user's rows stay


def test_the_retention_sweep_reads_only_what_expired(store: Store, tenant: TenantStore,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    a_user_with_data(tenant, "echo", "alice")
    other_users(store, tenant)
    tenant.retention.set("session", 60.0)
    with recorded(monkeypatch) as seen:
        tenant.sweep(now=time.time() + 3600)
    assert scans_of(store, tenant, seen) == {}


def test_caps_and_usage_of_one_user_read_only_their_usage(store: Store, tenant: TenantStore,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    a_user_with_data(tenant, "echo", "alice")
    other_users(store, tenant)
    with recorded(monkeypatch) as seen:
        tenant.usage.totals(since=time.time() - 86400, agent_id="echo", user_id="alice")
        tenant.usage.totals(since=0.0, user_id="alice")
    found = {}
    for sql, params in seen:
        lines = plan(store, tenant, sql, params)
        if not any("usage_user" in ln for ln in lines):
            found[sql] = lines
    assert found == {}


def test_a_users_store_footprint_reads_only_their_rows(store: Store, tenant: TenantStore,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    a_user_with_data(tenant, "echo", "alice")
    tenant.checkpoints.take("echo", "alice", kind="manual", name="now")
    other_users(store, tenant)
    with recorded(monkeypatch) as seen:  # the store_mib cap's measure (usage/store_cap.py)
        assert sum(tenant.footprint.user_bytes("echo", "alice").values()) > 0
    assert scans_of(store, tenant, seen) == {}


def test_list_pages_read_in_their_order(store: Store, tenant: TenantStore, monkeypatch: pytest.MonkeyPatch) -> None:
    for u in ("alice", "bob"):
        a_user_with_data(tenant, "echo", u)
    other_users(store, tenant)
    with recorded(monkeypatch) as seen:
        first = tenant.sandboxes.list(limit=1)
        tenant.sandboxes.list(limit=1, after=(first[0].last_active, first[0].id))
        tenant.sandboxes.list(limit=1, agent_id="echo")
        tenant.sandboxes.list(limit=1, agent_id="echo", after=(first[0].last_active, first[0].id))
        runs = tenant.runs.list(limit=1)
        tenant.runs.list(limit=1, after=(runs[0].updated_at, runs[0].id))
    assert scans_of(store, tenant, seen) == {}


def test_the_announcer_reads_only_unsettled_executions(store: Store, tenant: TenantStore,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Each round of the webhook announcer reads the executions not yet announced: through the index on
    ``announced``, never every execution kept (it may sort those it read)."""
    a_user_with_data(tenant, "echo", "alice")
    with recorded(monkeypatch) as seen:
        assert [e.id for e in tenant.executions.unsettled(limit=10)] == ["ex-alice"]
    (sql, params), = seen
    lines = plan(store, tenant, sql, params)
    assert [ln for ln in whole_table_reads(sql, lines) if "Sort" not in ln and "TEMP B-TREE" not in ln] == []


def test_a_revoke_reads_only_its_keys_queued_turns(store: Store, tenant: TenantStore,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A revoke reads the revoked key's async turns with no run yet through the index on the key (store migration
    30), and the revoked keys' check reads the key of each turn a host runs by its id: never every execution. (It
    may sort the key's queued turns it read by id, for its pages: a revoke is rare, and reads them all anyway.)"""
    a_user_with_data(tenant, "echo", "alice")
    tenant.executions.create("ex-k", "echo", "alice", "default", {"message": "hi"}, "key-k")
    other_users(store, tenant)
    with recorded(monkeypatch) as seen:
        assert [e.id for e in tenant.executions.queued_of_key("key-k")] == ["ex-k"]
        assert tenant.executions.keys_of(["ex-k", "ex-alice"]) == {"ex-k": "key-k", "ex-alice": None}
    assert len(seen) == 3
    for sql, params in seen:
        lines = plan(store, tenant, sql, params)
        assert [ln for ln in whole_table_reads(sql, lines) if "Sort" not in ln and "TEMP B-TREE" not in ln] == []


def test_a_sweep_of_a_backlog_deletes_it_in_short_transactions(store: Store, tenant: TenantStore,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A year of spans after their TTL was shortened, a day of Idempotency-Key answers after a host was stopped:
    deleted in one transaction, the sweep held the tenant's write lock for all of it (49,800 expired answers: the
    first turn after the start waited 33 s). Each transaction now deletes at most a batch."""
    for i in range(25):
        a_user_with_data(tenant, "echo", f"u{i:02d}")
    deleted: list[tuple[str, int]] = []
    orig = Conn.x

    def x(self: Conn, sql: str, params: Any = ()) -> int:
        n = orig(self, sql, params)
        if sql.lstrip().startswith("DELETE"):
            deleted.append((sql.split(" WHERE")[0], n))
        return n

    monkeypatch.setattr(Conn, "x", x)
    monkeypatch.setattr(common, "SWEEP_BATCH", 10, raising=False)
    later = time.time() + 400 * 86400
    removed = tenant.retention.sweep_records(later) + tenant.journal.sweep_http(later)
    monkeypatch.undo()
    by_table: dict[str, int] = {}
    for what, n in deleted:
        by_table[what] = by_table.get(what, 0) + n
    assert by_table["DELETE FROM spans"] == 25 and by_table["DELETE FROM journal"] == 25
    assert by_table["DELETE FROM webhook_deliveries"] == 25
    assert removed == sum(by_table.values())
    assert max(n for _, n in deleted) <= 10, deleted


def test_a_page_of_one_agents_spans_walks_them_newest_first(store: Store, tenant: TenantStore,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """GET /v1/traces?agent= and the fleet view: the newest spans of one agent are read in start order and the read
    stops at the page, never every span of the agent sorted (the scope index of migration 26 tempted SQLite to)."""
    other_users(store, tenant)
    with recorded(monkeypatch) as seen:
        page = tenant.spans.recent(limit=5, agent="echo")
        tenant.spans.recent(limit=5, agent="echo", before=(page[-1].start_ts, page[-1].span_id))
    assert len(page) == 5
    for sql, params in seen:
        lines = plan(store, tenant, sql, params)
        assert not [ln for ln in lines if "USE TEMP B-TREE FOR ORDER BY" in ln or re.match(r"\s*(->\s*)?Sort  \(", ln)
                    or re.search(r"SCAN spans$|Seq Scan on spans", ln)], lines


def test_a_start_reads_only_the_heads_with_an_operation_left_half_done(store: Store, tenant: TenantStore,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A host's recovery at start asks for the instances whose fork, restore or rollback was cut short: through an
    index of those heads (migration 27), not a read of every instance's head (50,000 on the scale run's store)."""
    for i in range(40):
        tenant.checkpoints.set_pending("echo", f"u{i:02d}", None if i else {"op": "restore"})
        tenant.checkpoints.set_pending("echo", f"u{i:02d}", {"op": "fork"} if i == 7 else None)
    if store.backend.dialect == "postgres":
        import psycopg

        with psycopg.connect(store.backend.owner_url, autocommit=True) as owner:
            owner.execute("ANALYZE")
    with recorded(monkeypatch) as seen:
        assert tenant.checkpoints.pending() == [("echo", "u07")]
    (sql, params), = seen
    lines = plan(store, tenant, sql, params)
    assert not [ln for ln in lines if re.search(r"SCAN checkpoint_heads$|Seq Scan on checkpoint_heads", ln)], lines
    assert any("checkpoint_heads_pending" in ln for ln in lines), lines


def test_a_start_reads_only_the_checkpoints_still_being_written_behind_their_turns(
        store: Store, tenant: TenantStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """A host's start asks for the automatic checkpoints whose sandbox files a killed host may not have written:
    through an index of those still marked as being written (migration 29), not every checkpoint with a correlated
    MAX(seq) per instance (~0.5 s at 50,000 users on the scale run's store)."""
    marked = []
    for i in range(40):
        for n in range(3):
            ck = tenant.checkpoints.take("echo", f"u{i:02d}", sandbox_id=f"sb{i}", sandbox_checkpoint=f"tt-{i}-{n}",
                                         writing=True)
            if not (i == 7 and n == 2):
                tenant.checkpoints.written("echo", f"u{i:02d}", ck.id)
            else:
                marked.append(ck.id)
    if store.backend.dialect == "postgres":
        import psycopg

        with psycopg.connect(store.backend.owner_url, autocommit=True) as owner:
            owner.execute("ANALYZE")
    with recorded(monkeypatch) as seen:
        assert [ck.id for ck in tenant.checkpoints.written_behind()] == marked
    (sql, params), = seen
    lines = plan(store, tenant, sql, params)
    assert not [ln for ln in lines if re.search(r"SCAN checkpoints$|Seq Scan on checkpoints", ln)], lines
    assert any("checkpoints_writing" in ln for ln in lines), lines
