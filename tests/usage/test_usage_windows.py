"""`GET /v1/usage?since=&until=` reads one window, `[since, until)`: windows that meet at an hour or a midnight count
each ledger row once, so a product invoicing by its own periods (a customer's local month, an hour) gets totals that
add up to the whole. Before, `since` had no end: a closed period could be read only as whole UTC days."""

from __future__ import annotations

import math
import time

from moorage.store import Scope, Store
from tests.api.conftest import LiveServer

DAY = 86400.0


def test_windows_that_meet_partition_the_ledger(live: LiveServer, store: Store, acme: str, globex: str) -> None:
    ts = store.tenant(store.authenticate(acme))
    midnight = math.floor(time.time() / DAY) * DAY - 2 * DAY  # two days ago, 00:00 UTC
    ada = Scope.for_user("bot", "ada")
    # A row on each side of an hour edge and of midnight, and on the edges themselves.
    for at, amount in ((midnight - 3600.5, 1.0), (midnight - 0.25, 2.0), (midnight, 4.0), (midnight + 3599.0, 8.0),
                       (midnight + 3600.0, 16.0), (midnight + DAY + 5.0, 32.0), (midnight + 2 * DAY - 1.0, 64.0)):
        ts.usage.add("input_tokens", amount, agent_id="bot", user_id="ada", ts=at)
        ts.usage.add("compute_seconds", amount / 2, agent_id="bot", user_id="ada", scope=ada, ts=at)
    ts.usage.add("input_tokens", 1000.0, agent_id="other", user_id="bob", ts=midnight + 10.0)
    ts.usage.add("disk_bytes", 100.0, agent_id="bot", user_id="ada", scope=ada, ts=midnight - 10.0)
    ts.usage.add("disk_bytes", 300.0, agent_id="bot", user_id="ada", scope=ada, ts=midnight + DAY + 10.0)
    edges = [midnight - DAY, midnight - 3600.0, midnight, midnight + 3600.0, midnight + 1.5 * DAY, time.time() + 60]
    with live.client(acme) as c, live.client(globex) as g:
        def read(since: float, until: float | None, **q: str) -> dict:
            r = c.get("/v1/usage", params={"since": since, **({"until": until} if until is not None else {}), **q})
            assert r.status_code == 200, r.text
            return r.json()

        for q in ({}, {"agent": "bot"}, {"agent": "bot", "user": "ada"}, {"user": "ada"}):
            whole = read(edges[0], edges[-1], **q)["totals"]
            parts = [read(a, b, **q)["totals"] for a, b in zip(edges, edges[1:])]
            for kind in ("input_tokens", "compute_seconds"):
                assert sum(p.get(kind, 0.0) for p in parts) == whole[kind], (q, kind, parts)
            assert read(edges[0], None, **q)["totals"]["input_tokens"] == whole["input_tokens"]  # until: no end
        # What each window holds, exactly: the hour before midnight, the first hour of the day, the rest.
        assert [p["input_tokens"] for p in (read(a, b, agent="bot")["totals"] for a, b in zip(edges, edges[1:]))] == \
            [1.0, 2.0, 4.0 + 8.0, 16.0 + 32.0, 64.0]
        # The storage levels of a window: each instance's last measurement in it.
        assert read(midnight - DAY, midnight)["totals"]["disk_bytes"] == 100.0
        assert read(midnight - DAY, midnight + 2 * DAY)["totals"]["disk_bytes"] == 300.0
        assert read(midnight, midnight + DAY)["totals"].get("disk_bytes") is None
        days = read(midnight - 3600.0, midnight + 3600.0, group="day", agent="bot")["days"]
        assert [d["totals"]["input_tokens"] for d in days] == [2.0, 4.0 + 8.0]
        assert read(midnight, midnight)["totals"] == {}  # an empty window
        r = c.get("/v1/usage", params={"since": midnight, "until": midnight - 1})
        assert r.status_code == 422 and "until" in r.json()["detail"], r.text
        # Another tenant's window over the same time holds none of acme's rows.
        r = g.get("/v1/usage", params={"since": edges[0], "until": edges[-1], "agent": "bot", "user": "ada"})
        assert r.status_code == 200 and r.json()["totals"] == {} and r.json()["until"] == edges[-1], r.text
