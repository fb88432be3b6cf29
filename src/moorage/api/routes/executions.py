"""Async turns: ``Prefer: respond-async`` or ``?async=true`` on invoke answers 202 with an execution id and a
``Location``; ``GET /v1/executions/{id}`` returns its status, result and streamed events.

Executions run detached (``moorage.webhooks.executions``); their outcome also goes to the agent's webhooks.
"""

from __future__ import annotations

from typing import Any

from starlette.concurrency import run_in_threadpool

from moorage.api import schemas as S
from moorage.api.routing import Call, Endpoint, Reply
from moorage.errors import InvalidInput, NotFound
from moorage.store import EntityKey
from moorage.webhooks.executions import ExecutionRunner, status_of


async def enforce_caps(call: Call, entity: EntityKey) -> None:
    """Refuse a turn of an end-user over one of their caps (429 naming it; over compute, the instance sleeps)."""
    from moorage.usage.caps import enforce

    await enforce(call.ctx.runtime, call.tenant, entity)


def wants_async(call: Call) -> bool:
    raw = (call.query("async") or "").lower()
    if raw in ("1", "true", "yes"):
        return True
    if raw not in ("", "0", "false", "no"):
        raise InvalidInput(f"async must be true or false, got {raw!r}")
    prefer = call.request.headers.get("prefer", "")
    return any(p.strip().lower() == "respond-async" for part in prefer.split(",") for p in part.split(";")[:1])


async def submit(call: Call, entity: EntityKey, message: str) -> Reply:
    """Start the turn detached and answer 202 at once (the same Idempotency-Key gives the same execution)."""
    from moorage.api.routes._common import forward_if_awake_elsewhere

    # It runs in the background on the host that holds the instance (here, it would find the instance elsewhere).
    located = EntityKey(entity.agent, entity.user, entity.session or "default")
    await forward_if_awake_elsewhere(call, await call.runtime.router.locate(call.who, located))
    runner = ExecutionRunner.of(call.runtime)
    ex, _ = await runner.submit(call.who, call.tenant, entity, message, call.idempotency_key)
    body = await run_in_threadpool(execution_json, call, ex.id)
    return Reply(body, 202, {"Location": f"/v1/executions/{ex.id}", "Preference-Applied": "respond-async"})


def execution_json(call: Call, execution_id: str) -> dict[str, Any]:
    ts = call.tenant
    ex = ts.executions.get(execution_id)
    p = call.who
    # A key limited to one agent, or an end-user token, sees only executions of its own agent (and user).
    if (p.agent is not None and ex.agent != p.agent) or (p.user is not None and ex.user != p.user):
        raise NotFound(f"no execution {execution_id!r}", hint="execution ids come from a 202 answer's `id`")
    from moorage.runtime import exec_jobs

    if exec_jobs.is_exec(ex):  # a detached exec in a sandbox: a deploy-level operation, shown by its runner
        if p.user is not None or not p.allows("deploy"):
            raise NotFound(f"no execution {execution_id!r}", hint="exec executions need a key with the deploy scope")
        return exec_jobs.ExecJobs.of(call.runtime).view(ts, ex)
    running_here = call.ctx.runtime is not None and ExecutionRunner.of(call.ctx.runtime).running(ex.id)
    status, run = status_of(ts, ex, running_here)
    result = run.result if run is not None and isinstance(run.result, dict) else {}
    interrupt = None
    if run is not None and run.status == "waiting":
        from moorage.durable import DurableEngine

        interrupt = DurableEngine(ts).waiting_for(run.id)
    error = run.error if run is not None else next(
        (e["data"].get("detail") for e in ex.events if e.get("kind") == "error" and isinstance(e.get("data"), dict)), None)
    return {"id": ex.id, "object": "execution", "kind": "turn", "agent": ex.agent, "user": ex.user, "session": ex.session,
            "status": status, "reply": result.get("reply"), "error": error, "interrupt": interrupt,
            "run_id": run.id if run is not None else None,
            # The turn's trace: kept with its result, and from its start (a waiting turn has no result yet).
            "trace_id": result.get("trace_id") or (run.input or {}).get("trace_id") if run is not None else None,
            "events": ex.events, "created_at": ex.created_at, "updated_at": run.updated_at if run else ex.updated_at}


def get_execution(call: Call) -> dict[str, Any]:
    return execution_json(call, call.path["execution_id"])


def announce_interrupt(call: Call, result: Any) -> None:
    """A synchronous turn that stopped for a human answer is a webhook event too (``interrupt.waiting``)."""
    run_id = getattr(result, "run_id", None) or getattr(result, "turn_id", None)
    if getattr(result, "status", None) != "waiting" or not run_id or getattr(result, "replayed", False):
        return  # a request asked again (its Idempotency-Key) was announced the first time
    ts = call.tenant
    run = ts.runs.get(run_id)
    execution_id = None
    try:
        execution_id = ts.executions.get(run_id).id
    except NotFound:
        pass
    # The fields of an async turn's events (``webhooks.delivery.execution_data``), so one receiver reads both.
    ts.deliveries.enqueue(run.scope.agent, "interrupt.waiting", {
        "execution_id": execution_id, "run_id": run_id, "agent": run.scope.agent, "user": run.scope.user,
        "session": (run.input or {}).get("session"), "status": "waiting", "reply": None, "error": None,
        "interrupt": result.interrupt, "trace_id": getattr(result, "trace_id", None),
        "url": f"/v1/executions/{execution_id}" if execution_id else f"/v1/workflows/{run_id}"})


EXECUTION = S.obj({"id": S.STR, "object": S.STR, "kind": {"enum": ["turn", "exec"]}, "agent": S.STR, "user": S.STR,
                   "session": S.STR,
                   "status": {"enum": ["queued", "running", "waiting", "succeeded", "failed", "cancelled"]},
                   "reply": S.ANY, "error": S.NSTR, "interrupt": S.ANY, "run_id": S.NSTR, "trace_id": S.NSTR,
                   # What the turn streamed (token, tool, ... and a last error), each when it came.
                   "events": {"type": "array", "items": S.obj({"kind": S.STR, "data": S.ANY, "at": S.NUM})},
                   "created_at": S.NUM, "updated_at": S.NUM})

def _exec_view() -> dict[str, Any]:
    from moorage.api.routes.sandboxes import EXEC_VIEW  # a detached exec (kind "exec"), documented with its route

    return EXEC_VIEW


ENDPOINTS = [
    Endpoint("GET", "/v1/executions/{execution_id}", get_execution, "Get an async turn: status, result, events",
             "invoke", "getExecution", scope="invoke", also_scopes=("read",), end_user=True, agent_checked=True,
             response={"oneOf": [EXECUTION, _exec_view()]}),
]
