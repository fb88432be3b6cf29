"""Forgetting a user finds the request spans that name them through an index of the user an unscoped span names
(store migration 21), instead of reading every unscoped span's JSON attributes: with 100,000 spans of other users'
and anonymous requests, forget reads only the user's own. Both store backends."""

from __future__ import annotations

import time
from typing import Any

from moorage.store import Scope, Span, TenantStore
from moorage.store.sql import Conn

N = 100_000


def _span(i: int, **attrs: Any) -> Span:
    return Span(f"t{i}", f"s{i}", None, "GET /v1/agents/{agent}/users/{user}/facts", 1000.0 + i, 1000.5 + i, "ok",
                {"http.method": "GET", **attrs})


def _fill(ts: TenantStore, n: int) -> None:
    """``n`` unscoped spans of other requests: half about other users of the agent, half about no user."""
    rows = []
    for i in range(n):
        user = f"other{i % 5000}" if i % 2 else None
        s = _span(100 + i, **({"moorage.agent": "pal", "moorage.user": user} if user else {}))
        rows.append((s.trace_id, s.span_id, None, s.name, s.start_ts, s.end_ts, s.status,
                     '{"http.method": "GET"' + (f', "moorage.agent": "pal", "moorage.user": "{user}"}}' if user else "}"),
                     None, user, "pal" if user else None))
    with ts.transaction():
        ts.ambient().many("INSERT INTO spans (trace_id, span_id, parent_id, name, start_ts, end_ts, status, attrs, "
                          "scope, user_id, agent_id) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", rows)


def _plans(ts: TenantStore, statements: list[tuple[str, tuple]]) -> list[str]:
    out = []
    with ts.transaction():
        c = ts.ambient()
        for sql, params in statements:
            if ts.dialect == "postgres":
                out.append(" ".join(r[0] for r in c.q(f"EXPLAIN {sql}", params)))
            else:
                out.append(" ".join(str(r[-1]) for r in c.q(f"EXPLAIN QUERY PLAN {sql}", params)))
    return out


def test_forget_deletes_the_users_request_spans_through_the_index(tenant: TenantStore, monkeypatch) -> None:
    _fill(tenant, N)
    # Written through the repository: the user's own request spans (one of another agent), a span about nobody,
    # and one of a turn (scoped: it goes with the user's scope, not here).
    mine = [_span(1, **{"moorage.agent": "pal", "moorage.user": "ada"}), _span(2, **{"moorage.user": "ada"}),
            _span(3, **{"moorage.agent": "other", "moorage.user": "ada"})]
    for s in (*mine, _span(4)):
        tenant.spans.record(s)
    tenant.spans.record(Span("t5", "s5", None, "turn", 1.0, 2.0, "ok", {"moorage.user": "ada"},
                             Scope.session("pal", "ada", "default")))

    ran: list[tuple[str, tuple]] = []
    real = Conn.x

    def x(self: Conn, sql: str, params: Any = ()) -> int:  # the statements forget runs, to explain them below
        if "spans" in sql:
            ran.append((sql, tuple(params)))
        return real(self, sql, params)

    monkeypatch.setattr(Conn, "x", x)
    started = time.perf_counter()
    removed = tenant.spans.forget_user("ada", "pal")
    took = time.perf_counter() - started
    monkeypatch.setattr(Conn, "x", real)
    print(f"\n{tenant.dialect}: forget among {N} unrelated spans took {took * 1000:.1f} ms")

    assert removed == 2  # the spans about ada of pal (or of no agent); another agent's stays
    left = {r[0] for r in tenant.read("SELECT span_id FROM spans WHERE span_id IN ('s1', 's2', 's3', 's4', 's5')")}
    assert left == {"s3", "s4", "s5"}
    assert tenant.spans.forget_user("ada") == 1 and tenant.read("SELECT count(*) FROM spans")[0][0] == N + 2
    # It reads the index of the users spans name, not the table: no row of the 100,000 is looked at.
    [plan] = _plans(tenant, ran)
    if tenant.dialect == "postgres":
        assert "spans_user" in plan and "Seq Scan" not in plan, plan
    else:
        assert "USING INDEX spans_user" in plan, plan


def test_a_span_written_without_the_user_column_is_still_forgotten_on_postgres(pg_url: str) -> None:
    """In a fleet upgraded one host at a time, a host of an earlier version writes request spans without
    ``user_id``: the store fills it in from the attributes, so forgetting the user still deletes them."""
    from moorage.store import Store
    from moorage.store.postgres import PostgresBackend

    store = Store(PostgresBackend(pg_url))
    _, key = store.operator.create_tenant("fleet")
    ts = store.tenant(store.authenticate(key.secret))
    with ts.transaction():  # the insert of spans before migration 21
        for span_id, attrs, scope in [("old", '{"moorage.agent": "pal", "moorage.user": "ada"}', None),
                                      ("anon", '{"http.method": "GET"}', None),
                                      ("turn", '{"moorage.user": "ada"}', "session:pal/ada/default")]:
            ts.ambient().x("INSERT INTO spans (trace_id, span_id, parent_id, name, start_ts, end_ts, status, attrs, "
                           "scope) VALUES ('t', ?, NULL, 'GET /v1/x', 1.0, 2.0, 'ok', ?, ?)", (span_id, attrs, scope))
    assert ts.read("SELECT span_id, user_id, agent_id FROM spans ORDER BY span_id") == [
        ("anon", None, None), ("old", "ada", "pal"), ("turn", None, None)]
    assert ts.spans.forget_user("ada", "pal") == 1
    store.close()
