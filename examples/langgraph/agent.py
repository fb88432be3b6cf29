"""Example 5: an unchanged LangGraph graph as a moorage agent. Its checkpoints live in moorage's store under
the end-user the turn is for; its interrupt() becomes a moorage interrupt (answered through the API, the
webhook or the dashboard); moorage's rollback and fork move the graph's state with the rest of the agent.

Messages: "note TEXT" adds a note to the user's notebook (the graph's state); "do TASK" plans the task with
the model, asks a human to approve it, and on approval does it (writes a file in the agent's sandbox).
"""

import operator
from typing import Annotated, TypedDict

from langgraph.graph import END, START, StateGraph
from langgraph.types import interrupt

from guest.langgraph_saver import MoorageCheckpointer, current_ctx, run_graph


class Notebook(TypedDict, total=False):
    request: str
    notes: Annotated[list, operator.add]
    plan: str
    approved: bool
    done: Annotated[list, operator.add]


def route(state: Notebook) -> str:
    return "note" if state["request"].startswith("note ") else "plan"


def note(state: Notebook) -> dict:
    return {"notes": [state["request"][len("note "):]]}


async def plan(state: Notebook) -> dict:
    task = state["request"][len("do "):]
    ctx = current_ctx()  # the moorage turn running the graph: model calls go through the host's gateway
    idea = await ctx.llm.chat(f"In one short sentence, how would you {task}?", max_tokens=40)
    return {"plan": f"{task}: {idea.strip() or 'just do it'}"}


def review(state: Notebook) -> dict:
    # The turn pauses here (status "waiting"); the answer resumes the graph from this node.
    answer = interrupt({"question": f"Go ahead with '{state['plan']}'?", "plan": state["plan"]})
    return {"approved": str(answer).strip().lower() in ("yes", "y", "approve", "approved", "ok")}


def act(state: Notebook) -> dict:
    if not state.get("approved"):
        return {}
    n = len(state.get("done") or []) + 1
    current_ctx().files.write(f"done/{n}.txt", state["plan"] + "\n")
    return {"done": [state["plan"]]}


builder = StateGraph(Notebook)
builder.add_node("note", note)
builder.add_node("plan", plan)
builder.add_node("review", review)
builder.add_node("act", act)
builder.add_conditional_edges(START, route, ["note", "plan"])
builder.add_edge("note", END)
builder.add_edge("plan", "review")
builder.add_edge("review", "act")
builder.add_edge("act", END)
graph = builder.compile(checkpointer=MoorageCheckpointer())


async def on_message(ctx, message):
    # One thread per session of this user (the user is bound by moorage, never chosen here).
    state = await run_graph(ctx, graph, {"request": message.strip()})
    if message.startswith("note "):
        return "notes: " + ", ".join(state.get("notes") or [])
    if state.get("approved"):
        return f"done: {state['plan']} ({len(state.get('done') or [])} done so far)"
    return f"not approved: {state.get('plan', '')}"
