"""MoorageSaver with real LangGraph graphs: resume in a new process, tenant isolation, concurrent async use.

Runs on both store backends (SQLite files and a throwaway PostgreSQL cluster) via the ``store`` fixture.
"""

from __future__ import annotations

import asyncio
import json
import operator
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Annotated, TypedDict

import pytest

from langgraph.checkpoint.base import empty_checkpoint
from langgraph.graph import END, START, StateGraph
from langgraph.types import Command, interrupt

from moorage.errors import ConflictError, InvalidInput
from moorage.store import Store, TenantStore
from moorage.store.langgraph import MoorageSaver
from moorage.store.postgres import PostgresBackend
from moorage.store.sqlite import SQLiteBackend


class Draft(TypedDict):
    steps: Annotated[list[str], operator.add]


def build_graph(saver: MoorageSaver):
    def draft(state: Draft) -> dict:
        return {"steps": ["draft"]}

    def review(state: Draft) -> dict:
        answer = interrupt("approve the draft?")
        return {"steps": [f"review:{answer}"]}

    def publish(state: Draft) -> dict:
        return {"steps": ["publish"]}

    g = StateGraph(Draft)
    g.add_node("draft", draft)
    g.add_node("review", review)
    g.add_node("publish", publish)
    g.add_edge(START, "draft")
    g.add_edge("draft", "review")
    g.add_edge("review", "publish")
    g.add_edge("publish", END)
    return g.compile(checkpointer=saver)


# The first half of the run happens in another OS process, which exits without any cleanup.
_FIRST_HALF = textwrap.dedent(
    """
    import json, os, sys
    from moorage.store import Store
    from moorage.store.langgraph import MoorageSaver
    from moorage.store.postgres import PostgresBackend
    from moorage.store.sqlite import SQLiteBackend
    from tests.store.test_langgraph import build_graph

    kind, where, secret = sys.argv[1:4]
    store = Store(SQLiteBackend(where) if kind == "sqlite" else PostgresBackend(where))
    ts = store.tenant(store.authenticate(secret))
    graph = build_graph(MoorageSaver(ts))
    out = graph.invoke({"steps": []}, {"configurable": {"thread_id": "doc-1"}})
    print(json.dumps({"steps": out["steps"], "interrupted": "__interrupt__" in out}), flush=True)
    os._exit(0)
    """
)


def _location(store: Store) -> tuple[str, str]:
    b = store.backend
    if isinstance(b, SQLiteBackend):
        return "sqlite", str(b.root)
    assert isinstance(b, PostgresBackend)
    return "postgres", b.owner_url


def test_graph_resumes_in_a_new_process_and_store(store: Store) -> None:
    _, key = store.operator.create_tenant("acme")
    kind, where = _location(store)
    first = subprocess.run([sys.executable, "-c", _FIRST_HALF, kind, where, key.secret],
                           capture_output=True, text=True, timeout=300, cwd=str(Path(__file__).parents[2]))
    assert first.returncode == 0, first.stderr
    half = json.loads(first.stdout.strip().splitlines()[-1])
    assert half == {"steps": ["draft"], "interrupted": True}

    # A brand-new store instance on the same storage, as after a host restart.
    fresh = Store(SQLiteBackend(where) if kind == "sqlite" else PostgresBackend(where))
    try:
        ts = fresh.tenant(fresh.authenticate(key.secret))
        graph = build_graph(MoorageSaver(ts))
        config = {"configurable": {"thread_id": "doc-1"}}
        assert graph.get_state(config).next == ("review",)
        out = graph.invoke(Command(resume="yes"), config)
        # "draft" ran once, in the first process; the resumed run continued from the interrupt.
        assert out["steps"] == ["draft", "review:yes", "publish"]
        history = list(graph.get_state_history(config))
        assert history[0].values["steps"] == ["draft", "review:yes", "publish"]
        assert len(history) >= 4
    finally:
        fresh.close()


def test_tenant_cannot_see_another_tenants_threads(tenant: TenantStore, other_tenant: TenantStore) -> None:
    a, b = MoorageSaver(tenant), MoorageSaver(other_tenant)
    graph_a = build_graph(a)
    config = {"configurable": {"thread_id": "shared-name"}}
    graph_a.invoke({"steps": []}, config)
    graph_a.invoke(Command(resume="ok"), config)
    mine = list(a.list(config))
    assert mine and mine[0].checkpoint["channel_values"]["steps"] == ["draft", "review:ok", "publish"]

    # B sees nothing under the same thread id, nor anywhere in the store.
    assert b.get_tuple(config) is None
    assert list(b.list(None)) == []
    assert list(b.list(config)) == []
    # B's deletes, copies and prunes cannot reach A's rows.
    b.delete_thread("shared-name")
    b.prune(["shared-name"], strategy="delete")
    b.delete_for_runs([t.metadata["run_id"] for t in mine if "run_id" in t.metadata])
    b.copy_thread("shared-name", "stolen")
    assert list(b.list({"configurable": {"thread_id": "stolen"}})) == []
    assert len(list(a.list(config))) == len(mine)

    # B can use the same thread id for its own, separate history.
    build_graph(b).invoke({"steps": []}, config)
    assert b.get_tuple(config).checkpoint["channel_values"]["steps"] == ["draft"]
    assert a.get_tuple(config).checkpoint["channel_values"]["steps"] == ["draft", "review:ok", "publish"]


async def test_concurrent_async_puts_all_land(tenant: TenantStore) -> None:
    saver = MoorageSaver(tenant)

    async def one_thread(i: int) -> list[str]:
        parent = {"configurable": {"thread_id": f"t{i}", "checkpoint_ns": ""}}
        ids = []
        for step in range(5):
            cp = empty_checkpoint()
            cp["channel_values"] = {"n": step, "who": f"t{i}"}
            cp["channel_versions"] = {"n": step + 1, "who": 1}
            parent = await saver.aput(parent, cp, {"source": "loop", "step": step}, {"n": step + 1} if step else {"n": 1, "who": 1})
            await saver.aput_writes(parent, [("n", step)], task_id=f"task-{step}")
            ids.append(cp["id"])
        return ids

    all_ids = await asyncio.gather(*(one_thread(i) for i in range(12)))
    for i, ids in enumerate(all_ids):
        listed = [t async for t in saver.alist({"configurable": {"thread_id": f"t{i}"}})]
        assert [t.checkpoint["id"] for t in listed] == list(reversed(ids))
        latest = listed[0]
        assert latest.checkpoint["channel_values"] == {"n": 4, "who": f"t{i}"}
        assert latest.pending_writes == [("task-4", "n", 4)]
        assert latest.parent_config["configurable"]["checkpoint_id"] == ids[-2]


def test_list_pages_and_filters_across_threads(tenant: TenantStore) -> None:
    saver = MoorageSaver(tenant, page_size=3)
    for t in range(4):
        parent = {"configurable": {"thread_id": f"p{t}", "checkpoint_ns": ""}}
        for step in range(5):
            cp = empty_checkpoint()
            parent = saver.put(parent, cp, {"source": "loop", "step": step, "tags": {"team": f"x{t % 2}"}}, {})
    everything = list(saver.list(None))
    assert len(everything) == 20
    ids = [t.checkpoint["id"] for t in everything]
    assert ids == sorted(ids, reverse=True) and len(set(ids)) == 20
    assert len(list(saver.list(None, limit=7))) == 7
    assert len(list(saver.list(None, filter={"step": 2}))) == 4
    # Non-scalar values are compared exactly (SQLite checks them in Python, PostgreSQL with JSONB).
    assert len(list(saver.list(None, filter={"tags": {"team": "x1"}}))) == 10
    assert len(list(saver.list(None, filter={"tags": {"team": "x1"}, "step": 4}, limit=1))) == 1


@pytest.mark.parametrize("inline_max", [0, 64])
def test_list_returns_what_get_tuple_returns_one_statement_per_page(
        tenant: TenantStore, inline_max: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each listed checkpoint equals get_tuple's for its id (values held in blobs or inline, pending writes in
    their order, parents, metadata) across pages, threads and namespaces; a page is read by one statement."""
    saver = MoorageSaver(tenant, page_size=4, inline_max=inline_max)
    for thread in ("a", "b"):
        for ns in ("", "sub"):
            config = {"configurable": {"thread_id": thread, "checkpoint_ns": ns}}
            for step in range(5):
                cp = empty_checkpoint()
                # "doc" grows past inline_max=64 from step 1; "n" stays small; "tag" changes every other step.
                cp["channel_values"] = {"doc": f"{thread}{ns}" * 20 * step, "n": step, "tag": f"t{step // 2}"}
                cp["channel_versions"] = {"doc": step + 1, "n": step + 1, "tag": step // 2 + 1}
                changed = {"doc": step + 1, "n": step + 1} | ({"tag": step // 2 + 1} if step % 2 == 0 else {})
                config = saver.put(config, cp, {"step": step, "ns": ns}, changed)
                if step % 2:
                    saver.put_writes(config, [("n", step), ("doc", "pending")], task_id=f"task-{step}")
                    saver.put_writes(config, [("tag", "early")], task_id="a-task")
    reads: list[tuple] = []
    real_read = tenant.backend.tenant_read
    monkeypatch.setattr(tenant.backend, "tenant_read", lambda *a: reads.append(a) or real_read(*a))

    def same(listed: list) -> None:
        for t in listed:
            got = saver.get_tuple(t.config)
            assert got is not None
            assert (t.config, t.checkpoint, t.metadata, t.parent_config, t.pending_writes) == \
                (got.config, got.checkpoint, got.metadata, got.parent_config, got.pending_writes)

    everything = list(saver.list(None))
    assert len(everything) == 20 and len(reads) == 6  # five full pages of 4, then an empty one ends it
    keys = [(t.checkpoint["id"], t.config["configurable"]["thread_id"], t.config["configurable"]["checkpoint_ns"])
            for t in everything]
    assert keys == sorted(keys, reverse=True)
    same(everything)
    # Pending writes in LangGraph's order (task_path, task_id, idx) on every step-3 checkpoint.
    assert [t.pending_writes for t in everything if t.metadata["step"] == 3] == \
        [[("a-task", "tag", "early"), ("task-3", "n", 3), ("task-3", "doc", "pending")]] * 4
    assert any(len(t.checkpoint["channel_values"]["doc"]) > inline_max for t in everything)
    one_ns = list(saver.list({"configurable": {"thread_id": "b", "checkpoint_ns": "sub"}}, limit=3))
    assert [t.metadata["step"] for t in one_ns] == [4, 3, 2]
    same(one_ns)
    older = list(saver.list({"configurable": {"thread_id": "a"}}, before=everything[2].config, filter={"ns": "sub"}))
    assert older and all(t.config["configurable"]["checkpoint_ns"] == "sub" for t in older)
    assert all(t.checkpoint["id"] < everything[2].checkpoint["id"] for t in older)
    same(older)


def test_list_gives_each_checkpoint_its_own_copy_of_a_shared_value(tenant: TenantStore) -> None:
    """A channel value that several listed checkpoints share (one blob version, read once per page) is decoded
    for each of them: equal values, separate objects, so changing one checkpoint's value leaves the others'."""
    saver = MoorageSaver(tenant, inline_max=0)
    config = {"configurable": {"thread_id": "shared", "checkpoint_ns": ""}}
    for step in range(3):
        cp = empty_checkpoint()
        cp["channel_values"] = {"items": [1, 2, {"k": "v"}], "step": step}
        cp["channel_versions"] = {"items": 1, "step": step + 1}
        config = saver.put(config, cp, {"step": step}, {"items": 1, "step": step + 1} if step == 0 else {"step": step + 1})
    listed = list(saver.list({"configurable": {"thread_id": "shared"}}))
    values = [t.checkpoint["channel_values"] for t in listed]
    assert [v["step"] for v in values] == [2, 1, 0]
    assert all(v["items"] == [1, 2, {"k": "v"}] for v in values)
    values[0]["items"].append("changed")
    values[0]["items"][2]["k"] = "changed"
    assert values[1]["items"] == values[2]["items"] == [1, 2, {"k": "v"}]


@pytest.mark.parametrize("inline_max", [0, 4096])
def test_prune_keeps_latest_state_and_drops_old_blobs(tenant: TenantStore, inline_max: int) -> None:
    # inline_max=0: every value is a blob; 4096: the small title lives in the checkpoint row, so only
    # the doc versions (over 4 KiB from step 5) leave blobs behind.
    saver = MoorageSaver(tenant, inline_max=inline_max)
    parent = {"configurable": {"thread_id": "big", "checkpoint_ns": ""}}
    for step in range(1, 6):
        cp = empty_checkpoint()
        cp["channel_values"] = {"doc": "x" * 1000 * step, "title": "t"}
        cp["channel_versions"] = {"doc": step, "title": 1}
        parent = saver.put(parent, cp, {"step": step}, {"doc": step, "title": 1} if step == 1 else {"doc": step})
    saver.prune(["big"])
    left = list(saver.list({"configurable": {"thread_id": "big"}}))
    assert len(left) == 1
    assert left[0].checkpoint["channel_values"] == {"doc": "x" * 5000, "title": "t"}
    with tenant._tx(write=False) as c:
        left_blobs = sorted(c.q("SELECT channel, version FROM lg_blobs WHERE thread_id = 'big'"))
    assert left_blobs == ([("doc", "5"), ("title", "1")] if inline_max == 0 else [("doc", "5")])


def test_misuse_gets_typed_errors(tenant: TenantStore) -> None:
    saver = MoorageSaver(tenant)
    with pytest.raises(InvalidInput, match="thread_id"):
        saver.get_tuple({"configurable": {}})
    with pytest.raises(InvalidInput, match="strategy"):
        saver.prune(["x"], strategy="newest")
    with pytest.raises(InvalidInput, match="checkpoint_id"):
        saver.put_writes({"configurable": {"thread_id": "x"}}, [("a", 1)], "t")
    saver.put({"configurable": {"thread_id": "src", "checkpoint_ns": ""}}, empty_checkpoint(), {}, {})
    saver.put({"configurable": {"thread_id": "dst", "checkpoint_ns": ""}}, empty_checkpoint(), {}, {})
    with pytest.raises(ConflictError, match="already has checkpoints"):
        saver.copy_thread("src", "dst")


def test_checkpoints_without_a_version_map_still_load(tenant: TenantStore) -> None:
    """Rows written before migration 4 have no ``versions`` column value; get_tuple decodes the checkpoint instead."""
    saver = MoorageSaver(tenant)
    config = {"configurable": {"thread_id": "old", "checkpoint_ns": ""}}
    first = None
    for step, value in enumerate(["a", "b"]):
        cp = empty_checkpoint()
        cp["channel_values"] = {"v": value, "n": step}
        cp["channel_versions"] = {"v": step + 1, "n": step + 1}
        config = saver.put(config, cp, {"step": step}, {"v": step + 1, "n": step + 1})
        first = first or config
    saver.put_writes(config, [("v", "pending")], task_id="task-1")
    fresh = saver.get_tuple({"configurable": {"thread_id": "old", "checkpoint_ns": ""}})
    with tenant._tx() as c:
        c.x("UPDATE lg_checkpoints SET versions = NULL WHERE thread_id = ?", ("old",))
    for cfg in ({"configurable": {"thread_id": "old", "checkpoint_ns": ""}}, config, first):
        legacy = saver.get_tuple(cfg)
        assert legacy is not None
        if cfg is first:
            assert legacy.checkpoint["channel_values"] == {"v": "a", "n": 0}
            assert legacy.pending_writes == []
        else:
            assert legacy.checkpoint["channel_values"] == fresh.checkpoint["channel_values"] == {"v": "b", "n": 1}
            assert legacy.pending_writes == fresh.pending_writes == [("task-1", "v", "pending")]
            assert legacy.parent_config == fresh.parent_config
    # list reads such rows the old way too.
    listed = list(saver.list({"configurable": {"thread_id": "old"}}))
    assert [t.checkpoint["channel_values"] for t in listed] == [{"v": "b", "n": 1}, {"v": "a", "n": 0}]
    assert [t.pending_writes for t in listed] == [[("task-1", "v", "pending")], []]


def test_read_joins_a_callers_transaction(tenant: TenantStore) -> None:
    """Inside ts.transaction(), get_tuple sees the caller's uncommitted put (same connection, same snapshot)."""
    saver = MoorageSaver(tenant)
    cp = empty_checkpoint()
    cp["channel_values"] = {"v": 1}
    cp["channel_versions"] = {"v": 1}
    with tenant.transaction():
        saver.put({"configurable": {"thread_id": "tx", "checkpoint_ns": ""}}, cp, {}, {"v": 1})
        got = saver.get_tuple({"configurable": {"thread_id": "tx", "checkpoint_ns": ""}})
        assert got is not None and got.checkpoint["channel_values"] == {"v": 1}


def test_small_values_inline_and_large_ones_in_blobs_round_trip(tenant: TenantStore) -> None:
    """Values up to inline_max live in the checkpoint row; larger ones in lg_blobs; get and list merge both."""
    saver = MoorageSaver(tenant, inline_max=64)
    config = {"configurable": {"thread_id": "mix", "checkpoint_ns": ""}}
    big, small = "B" * 500, {"k": [1, 2, 3]}
    history = []
    for step in range(3):
        cp = empty_checkpoint()
        cp["channel_values"] = {"small": small, "big": big + str(step // 2), "none": None, "raw": b"\x00\x01"}
        cp["channel_versions"] = {"small": 1, "big": step // 2 + 1, "none": 1, "raw": 1, "gone": step + 1}
        nv = {"small": 1, "big": 1, "none": 1, "raw": 1, "gone": 1} if step == 0 else {"gone": step + 1}
        if step == 2:
            nv["big"] = 2
        config = saver.put(config, cp, {"step": step}, nv)
        history.append(cp["channel_values"])
    with tenant._tx(write=False) as c:
        blobs = sorted((ch, v) for ch, v in c.q("SELECT channel, version FROM lg_blobs WHERE thread_id = 'mix'"))
    # Only the large value (once per version), raw bytes (their own serialised type) and the value-less
    # channel's markers went to lg_blobs.
    assert blobs == [("big", "1"), ("big", "2"), ("gone", "1"), ("gone", "2"), ("gone", "3"), ("raw", "1")]
    latest = saver.get_tuple({"configurable": {"thread_id": "mix", "checkpoint_ns": ""}})
    assert latest is not None and latest.checkpoint["channel_values"] == history[-1]
    listed = list(saver.list({"configurable": {"thread_id": "mix"}}))
    assert [t.checkpoint["channel_values"] for t in listed] == list(reversed(history))
    # A fresh saver (cold memo of stored blobs) reads and extends the same thread.
    again = MoorageSaver(tenant, inline_max=64)
    cp = empty_checkpoint()
    cp["channel_values"] = history[-1]
    cp["channel_versions"] = {"small": 1, "big": 2, "none": 1, "raw": 1, "gone": 4}
    again.put(config, cp, {"step": 3}, {"gone": 4})
    got = again.get_tuple({"configurable": {"thread_id": "mix", "checkpoint_ns": ""}})
    assert got is not None and got.checkpoint["channel_values"] == history[-1]


def test_rows_written_before_inlining_still_load(tenant: TenantStore) -> None:
    """Checkpoints whose values are all in lg_blobs (the layout before inline values) read back unchanged,
    and a thread continues across the two layouts."""
    old = MoorageSaver(tenant, inline_max=0)
    config = {"configurable": {"thread_id": "layout", "checkpoint_ns": ""}}
    cp = empty_checkpoint()
    cp["channel_values"] = {"a": "one", "b": [1, 2]}
    cp["channel_versions"] = {"a": 1, "b": 1}
    config = old.put(config, cp, {"step": 0}, {"a": 1, "b": 1})
    new = MoorageSaver(tenant)
    got = new.get_tuple(config)
    assert got is not None and got.checkpoint["channel_values"] == {"a": "one", "b": [1, 2]}
    cp2 = empty_checkpoint()
    cp2["channel_values"] = {"a": "two", "b": [1, 2]}
    cp2["channel_versions"] = {"a": 2, "b": 1}
    config2 = new.put(config, cp2, {"step": 1}, {"a": 2})
    assert new.get_tuple(config2).checkpoint["channel_values"] == {"a": "two", "b": [1, 2]}
    assert old.get_tuple(config).checkpoint["channel_values"] == {"a": "one", "b": [1, 2]}
    assert [t.checkpoint["channel_values"]["a"] for t in new.list({"configurable": {"thread_id": "layout"}})] == ["two", "one"]
