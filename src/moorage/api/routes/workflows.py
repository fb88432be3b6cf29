"""Durable workflow runs: list, inspect (steps and journal history), answer an interrupt, cancel.

Reads come from the tenant's store; answering and cancelling go to the runtime, which owns the run.
"""

from __future__ import annotations

from typing import Any

from starlette.concurrency import run_in_threadpool

from moorage.api import schemas as S
from moorage.api.pagination import keyset_page, parse_limit, position
from moorage.api.routes._common import PAGE
from moorage.api.routes.executions import announce_interrupt
from moorage.api.routing import Call, Endpoint, Param
from moorage.errors import InvalidInput, NotFound, TenantScopeError
from moorage.store.model import WorkflowRun
from moorage.store.repos.workflows import RUN_STATUSES
from moorage.webhooks.executions import ExecutionRunner


def list_runs(call: Call) -> dict[str, Any]:
    status = call.query("status")
    if status is not None and status not in RUN_STATUSES:
        raise InvalidInput(f"unknown status {status!r}", hint=f"one of {', '.join(RUN_STATUSES)}")
    agent = call.query("agent")
    limited = call.who.agent
    if limited is not None and agent != limited:  # its own agent's runs, asked for by name; never a silent filter
        raise TenantScopeError(f"this key is limited to agent {limited!r}; it may list that agent's runs only",
                               hint=f"add agent={limited} to the query, or use a key that is not limited to one agent")
    user = call.query("user")
    if user is not None and agent is None:
        raise InvalidInput("user= lists one end-user's runs of one agent: it needs agent=",
                           hint="add agent=NAME to the query")
    limit = parse_limit(call.query("limit"))
    # Keyed on the last run's (updated_at, id), not an offset (``keyset_page``). A run that changes while you page
    # moves to the end and may be listed again; none is skipped.
    pos = position(call.query("cursor"), {"u": (int, float), "i": str})
    after = (float(pos["u"]), pos["i"]) if pos else None
    runs = call.tenant.runs.list(status=[status] if status else None, agent=agent, user=user, after=after,
                                 limit=limit + 1)
    return keyset_page(runs, limit, lambda r: {"u": r.updated_at, "i": r.id}, S.run)


def _run_of_key(call: Call, run_id: str) -> WorkflowRun:
    """The run, if the caller's key may see it: a key limited to one agent sees that agent's runs only."""
    run = call.tenant.runs.get(run_id)
    if call.who.agent is not None and run.scope.agent != call.who.agent:
        raise NotFound(f"no workflow run {run_id!r}", hint="run ids come from a turn's answer (`run_id`)")
    return run


def get_run(call: Call) -> dict[str, Any]:
    ts = call.tenant
    run = _run_of_key(call, call.path["run_id"])
    history = [{"key": j.key, "step": j.step, "status": j.status, "result": j.result, "error": j.error,
                "created_at": j.created_at, "updated_at": j.updated_at} for j in ts.journal.list(run_id=run.id)]
    return {"run": S.run(run), "steps": [S.step(s) for s in ts.runs.steps(run.id)], "history": history}


async def answer(call: Call) -> dict[str, Any]:
    # Look the run up first: another tenant's run id is "not found" before the runtime is involved.
    await run_in_threadpool(_run_of_key, call, call.path["run_id"])
    body = call.body if isinstance(call.body, dict) else {}
    if "answer" not in body:
        raise InvalidInput("missing field 'answer'", hint="send the reply to the interrupt as `answer`")
    result = await call.runtime.answer(call.who, call.path["run_id"], body["answer"])
    await run_in_threadpool(announce_interrupt, call, result)  # asked again: a new interrupt
    return S.turn(result)


async def cancel(call: Call) -> dict[str, Any]:
    run_id = call.path["run_id"]
    try:
        await run_in_threadpool(_run_of_key, call, run_id)
    except NotFound:
        # An async turn not started yet has no run: its execution id (the run's id to be) cancels it.
        try:
            ex = await run_in_threadpool(call.tenant.executions.get, run_id)
        except NotFound:
            ex = None
        if ex is None or (call.who.agent is not None and ex.agent != call.who.agent):
            raise NotFound(f"no workflow run or execution {run_id!r}") from None
        ex = await ExecutionRunner.of(call.runtime).cancel_queued(call.tenant, run_id)
        if ex is not None:
            return {"id": ex.id, "scope": f"workflow:{ex.agent}/{ex.user}/{ex.id}", "name": "turn",
                    "status": "cancelled", "input": {"message": ex.input.get("message"), "session": ex.session},
                    "state": {}, "current_step": None, "result": None, "error": "cancelled before it started",
                    "created_at": ex.created_at, "updated_at": ex.updated_at, "version": 0}
    await call.runtime.cancel(call.who, run_id)
    return S.run(await run_in_threadpool(call.tenant.runs.get, run_id))


ENDPOINTS = [
    # A key limited to one agent may use these for that agent's runs (agent_checked: the handlers check it).
    Endpoint("GET", "/v1/workflows", list_runs, "List workflow runs", "workflows", "listWorkflows", scope="read",
             query=(*PAGE, Param("status", {"enum": list(RUN_STATUSES)}),
                    Param("agent", S.ID, "only this agent's runs (a key limited to one agent must name its agent)"),
                    Param("user", S.ID, "with agent: only this end-user's runs (their turns and workflows)")),
             response=S.page_of("WorkflowRun"), agent_checked=True),
    Endpoint("GET", "/v1/workflows/{run_id}", get_run, "Get a run with its steps and journal history", "workflows",
             "getWorkflow", scope="read", response=S.ref("WorkflowDetail"), agent_checked=True),
    Endpoint("POST", "/v1/workflows/{run_id}/answer", answer, "Answer a run's interrupt (human approval)",
             "workflows", "answerWorkflow", scope="invoke", body=S.obj({"answer": S.ANY}), response=S.ref("TurnResult"),
             agent_checked=True, long_lived=True),
    Endpoint("POST", "/v1/workflows/{run_id}/cancel", cancel, "Cancel a run", "workflows", "cancelWorkflow",
             scope="invoke", response=S.ref("WorkflowRun"), agent_checked=True),
]
