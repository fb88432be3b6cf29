"""A LangGraph graph inside the sandbox: ``MoorageCheckpointer`` keeps its checkpoints in moorage's store (host
calls ``graph.*``, the turn's own end-user), and ``run_graph`` maps LangGraph's ``interrupt()`` to a moorage interrupt.

Imported only by an agent's code that uses LangGraph (installed from its requirements.txt); the rest of the
guest stays stdlib-only and never imports this module. Usage (docs/langgraph.md)::

    from guest.langgraph_saver import MoorageCheckpointer, run_graph

    graph = builder.compile(checkpointer=MoorageCheckpointer())

    async def on_message(ctx, message):
        state = await run_graph(ctx, graph, {"messages": [("user", message)]})
"""

from __future__ import annotations

import asyncio
import base64
import contextvars
import json
from typing import Any, AsyncIterator, Dict, Iterator, List, Optional, Sequence, Tuple

from langgraph.checkpoint.base import (
    WRITES_IDX_MAP,
    BaseCheckpointSaver,
    ChannelVersions,
    Checkpoint,
    CheckpointMetadata,
    CheckpointTuple,
    get_checkpoint_id,
    get_serializable_checkpoint_metadata,
)
from langgraph.types import Command

#: The turn whose host calls a checkpointer without an explicit ``ctx`` uses: set by ``run_graph``.
_TURN: "contextvars.ContextVar[Optional[Any]]" = contextvars.ContextVar("moorage_langgraph_turn", default=None)
_PAGE = 50


def _bound() -> Tuple[Any, Any]:
    got = _TURN.get()
    if got is None:
        raise RuntimeError("no moorage turn is running this graph: run it with "
                           "`await run_graph(ctx, graph, input)` from the agent's on_message")
    return got


def current_ctx() -> Any:
    """The ``ctx`` of the turn running the graph (inside ``run_graph``): for nodes that call the model or memory."""
    return _bound()[0]


def _blob(typed: Tuple[str, bytes]) -> Dict[str, str]:
    return {"type": typed[0], "data": base64.b64encode(typed[1]).decode("ascii")}


def _unblob(b: Dict[str, str]) -> Tuple[str, bytes]:
    return b["type"], base64.b64decode(b["data"])


def _where(config: Any) -> Tuple[str, str]:
    conf = (config or {}).get("configurable") or {}
    if conf.get("thread_id") is None:
        raise ValueError('a LangGraph config needs configurable.thread_id (run_graph sets it)')
    return str(conf["thread_id"]), str(conf.get("checkpoint_ns") or "")


class MoorageCheckpointer(BaseCheckpointSaver):
    """LangGraph checkpoints in moorage's store, under the end-user this turn is for.

    The host binds the user from the turn; a thread id only names a conversation inside that user's graph
    state. Being the user's store rows, the checkpoints are rolled back, forked and forgotten with the rest of
    the instance (docs/timetravel.md). ``ctx``: a turn to bind to; by default the one ``run_graph`` runs.
    """

    def __init__(self, ctx: Any = None, *, serde: Any = None) -> None:
        super().__init__(serde=serde)
        # A checkpointer bound to one turn remembers the loop that serves its channel (for the sync API).
        self._turn = (ctx, _running_loop()) if ctx is not None else None

    # -- the channel ------------------------------------------------------------------------------

    def _where_calls_go(self) -> Tuple[Any, Any]:
        return self._turn if self._turn is not None else _bound()

    async def _call(self, method: str, params: Dict[str, Any]) -> Any:
        return await self._where_calls_go()[0]._host.call(method, params)

    def _on_loop(self, coro_fn: Any) -> Any:
        """The sync API (``graph.invoke`` in a worker thread, e.g. ``asyncio.to_thread``): the call runs on the
        turn's loop; called on that loop itself it would wait for itself, so that is refused."""
        turn = self._where_calls_go()
        if turn[1] is None or _running_loop() is turn[1]:
            raise RuntimeError("inside a turn run the graph with `await run_graph(ctx, graph, input)` or "
                               "`await graph.ainvoke(...)`: the sync API would block the loop serving the channel")

        async def on_the_loop() -> Any:
            _TURN.set(turn)  # the task runs in its own copy of the loop's context
            return await coro_fn()

        return asyncio.run_coroutine_threadsafe(on_the_loop(), turn[1]).result()

    def _call_sync(self, method: str, params: Dict[str, Any]) -> Any:
        return self._on_loop(lambda: self._call(method, params))

    # -- rows <-> tuples --------------------------------------------------------------------------

    def _tuple(self, row: Dict[str, Any]) -> CheckpointTuple:
        thread, ns = row["thread"], row.get("ns") or ""
        conf = {"thread_id": thread, "checkpoint_ns": ns, "checkpoint_id": row["id"]}
        parent = ({"configurable": {"thread_id": thread, "checkpoint_ns": ns, "checkpoint_id": row["parent_id"]}}
                  if row.get("parent_id") else None)
        writes = [(w["task_id"], w["channel"], self.serde.loads_typed(_unblob(w["value"])))
                  for w in row.get("writes") or []]
        return CheckpointTuple({"configurable": conf}, self.serde.loads_typed(_unblob(row["checkpoint"])),
                               self.serde.loads_typed(_unblob(row["metadata"])), parent, writes)

    def _put_params(self, config: Any, checkpoint: Checkpoint, metadata: CheckpointMetadata) -> Dict[str, Any]:
        thread, ns = _where(config)
        return {"thread": thread, "ns": ns, "checkpoint_id": checkpoint["id"],
                "parent_id": get_checkpoint_id(config),
                "checkpoint": _blob(self.serde.dumps_typed(checkpoint)),
                "metadata": _blob(self.serde.dumps_typed(get_serializable_checkpoint_metadata(config, metadata)))}

    def _writes_params(self, config: Any, writes: Sequence[Tuple[str, Any]], task_id: str,
                       task_path: str) -> Dict[str, Any]:
        thread, ns = _where(config)
        return {"thread": thread, "ns": ns, "checkpoint_id": config["configurable"]["checkpoint_id"],
                "task_id": task_id, "task_path": task_path,
                "writes": [[WRITES_IDX_MAP.get(c, i), c, _blob(self.serde.dumps_typed(v))]
                           for i, (c, v) in enumerate(writes)]}

    @staticmethod
    def _get_params(config: Any) -> Dict[str, Any]:
        thread, ns = _where(config)
        return {"thread": thread, "ns": ns, "checkpoint_id": get_checkpoint_id(config)}

    @staticmethod
    def _matches(t: CheckpointTuple, filter: Optional[Dict[str, Any]]) -> bool:
        return not filter or all(t.metadata.get(k) == v for k, v in filter.items())

    # -- async API (what ainvoke/astream use) -------------------------------------------------------

    async def aget_tuple(self, config: Any) -> Optional[CheckpointTuple]:
        row = (await self._call("graph.get", self._get_params(config)))["checkpoint"]
        return None if row is None else self._tuple(row)

    async def alist(self, config: Any, *, filter: Optional[Dict[str, Any]] = None, before: Any = None,
                    limit: Optional[int] = None) -> AsyncIterator[CheckpointTuple]:
        if config is None:
            raise ValueError("listing needs a thread: moorage keeps one user's threads apart, list one of them")
        thread, ns = _where(config)
        cursor = get_checkpoint_id(before) if before else None
        if get_checkpoint_id(config):
            # A config naming one checkpoint lists just that one (as LangGraph's own savers do).
            t = await self.aget_tuple(config)
            if t is not None and self._matches(t, filter):
                yield t
            return
        n = 0
        while True:
            page = await self._call("graph.list", {"thread": thread, "ns": ns, "before": cursor, "limit": _PAGE})
            for row in page["checkpoints"]:
                cursor = row["id"]
                t = self._tuple(row)
                if not self._matches(t, filter):
                    continue
                yield t
                n += 1
                if limit is not None and n >= limit:
                    return
            if not page.get("more"):
                return

    async def aput(self, config: Any, checkpoint: Checkpoint, metadata: CheckpointMetadata,
                   new_versions: ChannelVersions) -> Any:
        await self._call("graph.put", self._put_params(config, checkpoint, metadata))
        thread, ns = _where(config)
        return {"configurable": {"thread_id": thread, "checkpoint_ns": ns, "checkpoint_id": checkpoint["id"]}}

    async def aput_writes(self, config: Any, writes: Sequence[Tuple[str, Any]], task_id: str,
                          task_path: str = "") -> None:
        await self._call("graph.put_writes", self._writes_params(config, writes, task_id, task_path))

    async def adelete_thread(self, thread_id: str) -> None:
        await self._call("graph.delete_thread", {"thread": str(thread_id)})

    # -- sync API (a graph run with invoke() in a worker thread) -----------------------------------------

    def get_tuple(self, config: Any) -> Optional[CheckpointTuple]:
        row = self._call_sync("graph.get", self._get_params(config))["checkpoint"]
        return None if row is None else self._tuple(row)

    def list(self, config: Any, *, filter: Optional[Dict[str, Any]] = None, before: Any = None,
             limit: Optional[int] = None) -> Iterator[CheckpointTuple]:
        async def collect() -> List[CheckpointTuple]:
            return [t async for t in self.alist(config, filter=filter, before=before, limit=limit)]

        yield from self._on_loop(collect)

    def put(self, config: Any, checkpoint: Checkpoint, metadata: CheckpointMetadata,
            new_versions: ChannelVersions) -> Any:
        self._call_sync("graph.put", self._put_params(config, checkpoint, metadata))
        thread, ns = _where(config)
        return {"configurable": {"thread_id": thread, "checkpoint_ns": ns, "checkpoint_id": checkpoint["id"]}}

    def put_writes(self, config: Any, writes: Sequence[Tuple[str, Any]], task_id: str, task_path: str = "") -> None:
        self._call_sync("graph.put_writes", self._writes_params(config, writes, task_id, task_path))

    def delete_thread(self, thread_id: str) -> None:
        self._call_sync("graph.delete_thread", {"thread": str(thread_id)})


def _running_loop() -> Any:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


# -- the graph's interrupts as moorage interrupts --------------------------------------------------


def _json(v: Any) -> Any:
    """A value as JSON sees it: what the journal keeps, so a replayed turn sees exactly the same."""
    return json.loads(json.dumps(v, default=str))


def _pending(snapshot: Any) -> List[Dict[str, Any]]:
    return [{"id": i.id, "value": _json(i.value)} for i in (getattr(snapshot, "interrupts", None) or ())]


async def _advance(ctx: Any, graph: Any, payload: Any, config: Dict[str, Any], step: int) -> Dict[str, Any]:
    """One run of the graph as a journaled step's body: to the end or to its next interrupt.

    The run is marked in its checkpoints' metadata (this turn, this step), so a step that runs again after a
    crash continues the run it had started (input ``None``) instead of starting the input over, and one that
    had finished just reads where it stopped.
    """
    mark = {"moorage_turn": ctx.turn_id, "moorage_step": step}
    before = await graph.aget_state(config)
    md = getattr(before, "metadata", None) or {}
    ours = md.get("moorage_turn") == ctx.turn_id and md.get("moorage_step") == step
    if ours and not before.next:
        return {"interrupts": []}
    if ours and _pending(before):
        return {"interrupts": _pending(before)}
    run_config = dict(config, metadata={**(config.get("metadata") or {}), **mark})
    await graph.ainvoke(None if ours else payload, run_config)
    return {"interrupts": _pending(await graph.aget_state(config))}


def _moorage_payload(interrupts: List[Dict[str, Any]]) -> Any:
    """What the person answering sees: the graph's own interrupt value, or all of them when several wait."""
    if len(interrupts) == 1:
        return interrupts[0]["value"]
    return {"interrupts": interrupts}


def _resume(interrupts: List[Dict[str, Any]], answer: Any) -> Command:
    if len(interrupts) == 1:
        return Command(resume=answer)
    # Several interrupts wait: an answer keyed by interrupt id answers each; any other answers them all.
    ids = [i["id"] for i in interrupts]
    if isinstance(answer, dict) and set(answer) <= set(ids) and answer:
        return Command(resume=answer)
    return Command(resume={i: answer for i in ids})


async def run_graph(ctx: Any, graph: Any, input: Any, *, thread_id: Optional[str] = None,
                    config: Optional[Dict[str, Any]] = None) -> Any:
    """Run ``graph`` for this turn and return its final state's values.

    The graph's thread is ``thread_id`` (default: the turn's session), inside the end-user moorage bound the
    turn to. Each run is a journaled step, so a recovered or resumed turn does not run a finished part again.
    When the graph calls ``interrupt(value)`` the turn waits (``status: waiting``, the API, the webhook and the
    dashboard show ``value``); answering it (``POST /v1/workflows/{run}/answer``) resumes the graph with
    ``Command(resume=answer)`` from where it stopped.
    """
    cfg: Dict[str, Any] = dict(config or {})
    cfg["configurable"] = {**(cfg.get("configurable") or {}),
                           "thread_id": str(thread_id or (cfg.get("configurable") or {}).get("thread_id")
                                            or ctx.session or "default")}
    token = _TURN.set((ctx, asyncio.get_running_loop()))
    try:
        payload, call = input, 0
        while True:

            # The step's position in the turn marks the run: unique per graph run of the turn (a handler may run
            # graphs several times), the same when the turn is replayed.
            position = int(getattr(ctx, "_step_seq", call))

            async def body(payload: Any = payload, position: int = position) -> Dict[str, Any]:
                return await _advance(ctx, graph, payload, cfg, position)

            outcome = await ctx.step("langgraph" if call == 0 else "langgraph:resume", body, retries=0)
            interrupts = outcome.get("interrupts") or []
            if not interrupts:
                break
            answer = await ctx.interrupt(_moorage_payload(interrupts))  # raises Suspended: the turn waits
            payload, call = _resume(interrupts, answer), call + 1
        return (await graph.aget_state(cfg)).values
    finally:
        _TURN.reset(token)


__all__ = ["MoorageCheckpointer", "current_ctx", "run_graph"]
