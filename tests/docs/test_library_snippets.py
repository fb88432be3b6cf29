"""The host-side library examples of docs/objects.md (the object store and its blobs) and docs/langgraph.md (the
LangGraph checkpointer over moorage's store, for graphs run outside an agent), run as the pages write them: only the
names the pages leave to the reader (`path`, `key`, `dest`, `builder`, `api_key`, ...) are given."""

from __future__ import annotations

import io
import re
from pathlib import Path
from typing import Any, TypedDict

import pytest

from tests.cli.test_docs_commands import fenced_blocks

ROOT = Path(__file__).resolve().parents[2]


def _block(page: str, starts: str) -> str:
    return next(body for lang, body in fenced_blocks((ROOT / "docs" / page).read_text())
                if lang == "python" and body.startswith(starts))


def test_objects_md_example(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from moorage.config import load

    (tmp_path / "f.bin").write_bytes(b"x" * 100_000)
    scope: dict[str, Any] = {
        "config": load(None, env={"MOORAGE_DATA_DIR": str(tmp_path / "data")}),
        "path": tmp_path / "f.bin", "key": "instances/t1/i1/snapshots/7/disk", "dest": tmp_path / "out.bin",
        "out": io.BytesIO(), "f": io.BytesIO(b"streamed"),
    }
    monkeypatch.chdir(tmp_path)
    exec(compile(_block("objects.md", "from moorage.objects import"), "docs/objects.md", "exec"), scope)  # noqa: S102
    assert type(scope["store"]).__name__ == "LocalObjectStore"
    assert [o.key for o in scope["page"].objects] == ["instances/t1/i1/snapshots/7/disk",
                                                       "instances/t1/i1/snapshots/7/ram.delta"]
    assert scope["out"].getvalue() == b"x" * 100_000
    assert scope["dest"].read_bytes() == b"x" * 100_000 and scope["dest"].stat().st_mode & 0o777 == 0o600
    assert not scope["store"].exists("instances/t1/i1/snapshots/7/ram.delta")  # delete_prefix
    assert scope["store"].exists(f"packages/{scope['digest']}.tar.gz")


def test_langgraph_md_checkpointer_outside_an_agent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from langgraph.graph import END, START, StateGraph

    from moorage.config import load
    from moorage.store import open_store

    class Count(TypedDict):
        n: int

    builder = StateGraph(Count)
    builder.add_node("inc", lambda s: {"n": s["n"] + 1})
    builder.add_edge(START, "inc")
    builder.add_edge("inc", END)
    monkeypatch.setenv("MOORAGE_DATA_DIR", str(tmp_path / "data"))  # `load()`: the host's settings
    setup = open_store(load())
    _, key = setup.operator.create_tenant("acme")
    setup.close()

    scope: dict[str, Any] = {"builder": builder, "api_key": key.secret}
    code = _block("langgraph.md", "from moorage.config import load")
    exec(compile(code, "docs/langgraph.md", "exec"), scope)  # noqa: S102
    thread = {"configurable": {"thread_id": "t1"}}
    assert scope["graph"].invoke({"n": 1}, thread) == {"n": 2}
    scope["store"].close()
    again: dict[str, Any] = {"builder": builder, "api_key": key.secret}  # as another process would, later
    exec(compile(code, "docs/langgraph.md", "exec"), again)  # noqa: S102
    assert again["graph"].get_state(thread).values == {"n": 2}  # the checkpoint was in the store
    again["store"].close()


async def test_durable_md_example(tmp_path: Path) -> None:
    """docs/durable.md's API block: the workflow and the engine's calls, as written (its last lines, a catalogue of
    the other calls, are run for what they return)."""
    from moorage.config import load
    from moorage.store import Scope, open_store

    code = _block("durable.md", "from moorage.durable import")
    workflow, calls = code.split("\nengine = ", 1)
    store = open_store(load(None, env={"MOORAGE_DATA_DIR": str(tmp_path / "data")}))
    _, key = store.operator.create_tenant("acme")
    booked: list[str] = []
    scope: dict[str, Any] = {
        "ts": store.tenant(store.authenticate(key.secret)), "Scope": Scope, "agent": "travel", "user": "ada",
        "run_id": "trip-1", "get_quote": lambda city: {"city": city, "price": 420},
        "book_flight": lambda quote, idempotency_key: booked.append(idempotency_key) or f"ref-{quote['city']}",
        "book_by_phone": lambda quote: "by-phone",
    }
    exec(compile(workflow, "docs/durable.md", "exec"), scope)  # noqa: S102
    lines = ["engine = " + calls.split("\n", 1)[0]] + calls.split("\n", 1)[1].splitlines()
    upto = next(i for i, line in enumerate(lines) if "engine.answer(" in line)
    run_now, catalogue = lines[:upto + 1], lines[upto + 1:]  # the rest: other calls, each on its own
    body = "\n".join("    " + line.split("  #", 1)[0].rstrip() for line in run_now if line.strip())
    exec(compile("async def example():\n" + body + "\n    return run, engine\n", "docs/durable.md", "exec"),  # noqa: S102
         scope)
    run, engine = await scope["example"]()
    try:
        assert run.status == "succeeded" and run.result == {"booked": True, "ref": "ref-Oslo"}, run
        assert len(booked) == 1 and booked[0].startswith("wf:")  # the step's key handed to the booking service
        named = {m for line in catalogue for m in re.findall(r"\bengine\.([a-z_]+)\(", line)}
        assert named >= {"resume", "cancel", "recover", "history", "correct"}, named
        assert all(callable(getattr(engine, m, None)) for m in named), named
        assert [h.kind for h in engine.history(run.id)][:1] and await engine.recover() is not None
    finally:
        store.close()


def test_memory_md_api_sketch_names_what_there_is() -> None:
    """docs/memory.md's API block is a sketch (signatures, not code to run): its import runs, and every method it
    shows on a `cb`, `em` or `sm` is one of that class's."""
    import moorage.memory as memory

    sketch = next(body for lang, body in fenced_blocks((ROOT / "docs" / "memory.md").read_text())
                  if lang == "python" and body.startswith("from moorage.memory import ("))
    exec(sketch.split(")", 1)[0] + ")", {})  # noqa: S102 - the import, as written
    made = {m.group(1): getattr(memory, m.group(2)) for m in re.finditer(r"^(\w+) = (\w+)\(", sketch, flags=re.M)}
    assert set(made) == {"cb", "em", "sm"}, made
    shown = re.findall(r"\b(cb|em|sm)\.([a-z_]+)\(", sketch)
    assert len(shown) > 20 and [f"{v}.{m}" for v, m in shown if not hasattr(made[v], m)] == []


def test_llm_md_gateway_example_names_what_there_is() -> None:
    import moorage.llm as llm

    code = next(body for lang, body in fenced_blocks((ROOT / "docs" / "llm.md").read_text())
                if lang == "python" and body.startswith("gateway = LLMGateway("))
    names = set(re.findall(r"\b([A-Z][A-Za-z]+)\(", code))
    assert len(names) > 8 and sorted(n for n in names if not hasattr(llm, n)) == []
    assert {"complete", "stream", "count_tokens"} <= set(re.findall(r"gateway\.([a-z_]+)\(", code))
    assert all(hasattr(llm.LLMGateway, m) for m in re.findall(r"gateway\.([a-z_]+)\(", code))
