"""``run_graph``'s unit of work (``_advance``) against the real host calls and store: a graph run that stopped
half-way (its node raised, as a host crash would stop it) is continued by the step's next execution, not started
over with its input again, and a finished one is read rather than run."""

from __future__ import annotations

import operator
from types import SimpleNamespace
from typing import Annotated, TypedDict

import pytest
from langgraph.graph import END, START, StateGraph

from moorage.guest.langgraph_saver import MoorageCheckpointer, _advance  # in the sandbox: guest.langgraph_saver
from moorage.store import TenantStore
from tests.langgraph.test_conformance import _Host


class Log(TypedDict):
    log: Annotated[list, operator.add]


def _graph(tenant: TenantStore, fail: dict[str, bool], runs: list[str]):
    def a(state: Log) -> dict:
        runs.append("a")
        return {"log": ["a"]}

    def b(state: Log) -> dict:
        runs.append("b")
        if fail["b"]:
            raise RuntimeError("the host went away")
        return {"log": ["b"]}

    g = StateGraph(Log)
    g.add_node("a", a)
    g.add_node("b", b)
    g.add_edge(START, "a")
    g.add_edge("a", "b")
    g.add_edge("b", END)
    return g.compile(checkpointer=MoorageCheckpointer(SimpleNamespace(_host=_Host(tenant, "ada"))))


async def test_a_run_stopped_half_way_is_continued_not_started_over(tenant: TenantStore) -> None:
    fail, runs = {"b": True}, []
    graph = _graph(tenant, fail, runs)
    cfg = {"configurable": {"thread_id": "default"}}
    turn = SimpleNamespace(turn_id="turn-1")
    with pytest.raises(RuntimeError):
        await _advance(turn, graph, {"log": ["in"]}, cfg, 0)
    assert (await graph.aget_state(cfg)).next == ("b",)
    fail["b"] = False
    assert await _advance(turn, graph, {"log": ["in"]}, cfg, 0) == {"interrupts": []}
    assert (await graph.aget_state(cfg)).values["log"] == ["in", "a", "b"]  # the input applied once
    assert runs == ["a", "b", "b"]  # a ran once; b again, as LangGraph retries the node that failed
    # The step executed once more (a replay that found no journal entry): the finished run is read, not run.
    assert await _advance(turn, graph, {"log": ["in"]}, cfg, 0) == {"interrupts": []}
    assert runs == ["a", "b", "b"]
    # A second graph run of the same turn (another step position) is a run of its own: its input is applied.
    await _advance(turn, graph, {"log": ["more"]}, cfg, 1)
    assert (await graph.aget_state(cfg)).values["log"] == ["in", "a", "b", "more", "a", "b"]
    # The next turn's run is a new one: its input is applied.
    await _advance(SimpleNamespace(turn_id="turn-2"), graph, {"log": ["again"]}, cfg, 0)
    assert (await graph.aget_state(cfg)).values["log"] == ["in", "a", "b", "more", "a", "b", "again", "a", "b"]


async def test_the_sync_api_works_from_a_worker_thread_and_is_refused_on_the_loop(tenant: TenantStore) -> None:
    import asyncio

    fail, runs = {"b": False}, []
    graph = _graph(tenant, fail, runs)  # the checkpointer is bound here, on the loop serving its calls
    cfg = {"configurable": {"thread_id": "sync"}}
    out = await asyncio.to_thread(graph.invoke, {"log": ["in"]}, cfg)
    assert out["log"] == ["in", "a", "b"]
    assert [t.config["configurable"]["checkpoint_id"] for t in await asyncio.to_thread(lambda: list(
        graph.checkpointer.list(cfg)))] == [t.config["configurable"]["checkpoint_id"]
                                            async for t in graph.checkpointer.alist(cfg)]
    with pytest.raises(RuntimeError, match="would block the loop"):
        graph.invoke({"log": ["again"]}, cfg)
