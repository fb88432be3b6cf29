"""The host half of the guest checkpointer (runtime/graph_calls.py) on both store backends: history bounded per
thread with the pruned checkpoints' writes gone too, special writes replaced and ordinary ones kept, and the
calls' inputs checked."""

from __future__ import annotations

import base64
from types import SimpleNamespace

import pytest

from moorage.errors import InvalidInput
from moorage.runtime.graph_calls import HISTORY, PREFIX, GraphCalls
from moorage.store import EntityKey, Scope, TenantStore


def _blob(text: str) -> dict[str, str]:
    return {"type": "json", "data": base64.b64encode(text.encode()).decode()}


def _binding(ts: TenantStore, user: str) -> SimpleNamespace:
    return SimpleNamespace(ts=ts, entity=EntityKey("agent", user), user_scope=Scope.for_user("agent", user))


def _id(n: int) -> str:
    return f"1ef0-{n:06d}"


async def test_history_is_bounded_and_pruned_checkpoints_take_their_writes(tenant: TenantStore) -> None:
    calls, b = GraphCalls(), _binding(tenant, "ada")
    for n in range(HISTORY + 5):
        await calls.put(b, {"thread": "t", "ns": "", "checkpoint_id": _id(n), "parent_id": _id(n - 1) if n else None,
                            "checkpoint": _blob(f"c{n}"), "metadata": _blob("{}")})
        await calls.put_writes(b, {"thread": "t", "ns": "", "checkpoint_id": _id(n), "task_id": "task",
                                   "task_path": "", "writes": [[0, "ch", _blob(f"w{n}")]]})
    listed = (await calls.list(b, {"thread": "t", "ns": ""}))["checkpoints"]
    assert [c["id"] for c in listed] == [_id(n) for n in reversed(range(5, HISTORY + 5))]
    assert (await calls.get(b, {"thread": "t", "ns": "", "checkpoint_id": _id(4)}))["checkpoint"] is None
    keys = [r.key for r in tenant.state.list(Scope.for_user("agent", "ada"), prefix=PREFIX, limit=10_000)]
    assert len(keys) == 2 * HISTORY + 1  # a checkpoint and a writes row per kept id, and the index
    page = (await calls.list(b, {"thread": "t", "ns": "", "before": _id(10), "limit": 3}))
    assert [c["id"] for c in page["checkpoints"]] == [_id(9), _id(8), _id(7)] and page["more"]


async def test_special_writes_replace_and_ordinary_writes_stay(tenant: TenantStore) -> None:
    calls, b = GraphCalls(), _binding(tenant, "ada")
    where = {"thread": "t", "ns": "sub:1", "checkpoint_id": _id(1)}
    await calls.put(b, {**where, "parent_id": None, "checkpoint": _blob("c"), "metadata": _blob("{}")})
    for value in ("first", "second"):
        await calls.put_writes(b, {**where, "task_id": "task", "task_path": "p",
                                   "writes": [[0, "ch", _blob(value)], [-3, "__interrupt__", _blob(value)]]})
    got = (await calls.get(b, {"thread": "t", "ns": "sub:1"}))["checkpoint"]
    assert [(w["idx"], base64.b64decode(w["value"]["data"]).decode()) for w in got["writes"]] == [
        (-3, "second"), (0, "first")]
    # Another user's turn reads nothing of it; another namespace of the same thread neither.
    assert (await calls.get(_binding(tenant, "bob"), {"thread": "t", "ns": "sub:1"}))["checkpoint"] is None
    assert (await calls.get(b, {"thread": "t", "ns": ""}))["checkpoint"] is None


@pytest.mark.parametrize("method,bad", [
    ("get", {"thread": "", "ns": ""}),
    ("get", {"thread": "x" * 101, "ns": ""}),
    ("get", {"thread": "t", "ns": "", "checkpoint_id": "../other"}),
    ("list", {"thread": "t", "ns": "", "limit": "ten"}),
    ("put", {"thread": "t", "ns": "", "checkpoint_id": "c1", "checkpoint": {"type": "json", "data": "not base64!"},
             "metadata": _blob("{}")}),
])
async def test_malformed_calls_are_refused(tenant: TenantStore, method: str, bad: dict) -> None:
    with pytest.raises(InvalidInput):
        await GraphCalls().methods()["graph." + method](_binding(tenant, "ada"), bad)  # type: ignore[arg-type]
