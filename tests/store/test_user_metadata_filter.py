"""GET /v1/agents/{agent}/users?metadata.k=v: the database narrows the rows, so a filter few users match is one
query, not a read of every user of the agent in pages (524 queries at 50,000 users, bench/results/latest/scale.md);
the users it answers, and their pages, are the ones the filter in Python answered, on SQLite and PostgreSQL."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from moorage.store import TenantStore
from tests.store.test_query_plans import recorded

VALUES: list[Any] = ["gold", "Gold", "gölд 金", "", "5", 5, 5.0, -5, 0, 1.5, 0.1, 1e20, 2 ** 60, True, False, None,
                     [1, 2], ["é"], {"a": 1}, {"a": [1, {"b": "c"}]}, "true", "null", "[1, 2]", "1.5", 'say "hi"']
KEYS = ["plan", "tier.level", "ключ", "", "a'b"]
FILTERS: list[str] = ["gold", "Gold", "gölд 金", "", "5", "5.0", "-5", "0", "1.5", "0.1", "1e+20", "1e20",
                      str(2 ** 60), "true", "false", "null", "[1, 2]", "[1,2]", '["\\u00e9"]', '["é"]', '{"a": 1}',
                      '{"a": [1, {"b": "c"}]}', 'say "hi"', "nope", " 5", "05", "[", "{}"]


def old_filter(users: list[Any], meta: dict[str, Any]) -> list[str]:
    """The filter as it ran in Python over every user (store/agent_users.py before)."""
    def same(value: Any, wanted: Any) -> bool:
        if value == wanted:
            return True
        return isinstance(wanted, str) and not isinstance(value, str) and json.dumps(value) == wanted
    return [u.user for u in users if all(k in u.meta and same(u.meta[k], v) for k, v in meta.items())]


def every_page(ts: TenantStore, meta: dict[str, Any], limit: int) -> list[str]:
    out, after = [], None
    while True:
        page = ts.agent_users.list("echo", limit=limit + 1, after=after, meta=meta)
        out += [u.user for u in page[:limit]]
        if len(page) <= limit:
            return out
        after = page[limit - 1].user


def test_the_filter_answers_the_users_python_answered(tenant: TenantStore) -> None:
    rng = random.Random(2)
    for i in range(160):
        meta = {k: rng.choice(VALUES) for k in KEYS if rng.random() < 0.5}
        tenant.agent_users.put("echo", f"u{i:03d}", meta=meta)
    tenant.agent_users.put("other", "u000", meta={"plan": "gold"})  # another agent's user is never answered
    users = tenant.agent_users.list("echo", limit=1000)
    assert len(users) == 160
    for key in KEYS:
        for wanted in FILTERS:
            want = old_filter(users, {key: wanted})
            assert [u.user for u in tenant.agent_users.list("echo", limit=1000, meta={key: wanted})] == want, \
                (key, wanted)
            assert every_page(tenant, {key: wanted}, 3) == want, (key, wanted)
    for meta in ({"plan": "gold", "ключ": "5"}, {"plan": 5}, {"plan": True}, {"plan": None}, {"plan": [1, 2]},
                 {'we"ird': "x"}, {"tier.level": "gold", "a'b": "null"}):
        want = old_filter(users, meta)
        assert [u.user for u in tenant.agent_users.list("echo", limit=1000, meta=meta)] == want, meta
        assert every_page(tenant, meta, 2) == want, meta


def test_a_filter_few_users_match_is_one_query(tenant: TenantStore, monkeypatch: pytest.MonkeyPatch) -> None:
    for i in range(450):
        tenant.agent_users.put("echo", f"u{i:03d}", meta={"plan": "gold" if i in (7, 420) else "free", "n": i})
    with recorded(monkeypatch) as seen:
        page = tenant.agent_users.list("echo", limit=51, meta={"plan": "gold"})
        numbers = tenant.agent_users.list("echo", limit=51, meta={"n": "420"})
    assert [u.user for u in page] == ["u007", "u420"] and [u.user for u in numbers] == ["u420"]
    assert len(seen) == 2, [s for s, _ in seen]
