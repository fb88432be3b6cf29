"""Agent sandboxes: list, get, the lifecycle verbs (sleep, wake, checkpoint, rollback, fork), files, exec.

Every verb first finds the sandbox in the caller's tenant store (a key limited to one agent: its agent's only); the
runtime then acts on it. A detached exec is an execution (``kind: "exec"``) under /v1/executions, followed and
cancelled by the routes at the end here.
"""

from __future__ import annotations

import base64
from typing import Any, Callable

from starlette.concurrency import run_in_threadpool

from moorage.api import schemas as S
from moorage.api.pagination import keyset_page, parse_limit, position
from moorage.api.routes._common import PAGE, agent_of_key, forward_if_awake_elsewhere
from moorage.api.routes.checkpoints import FORK, ROLLBACK
from moorage.api.routing import Call, Endpoint, Param, Reply
from moorage.api.sse import error_payload, event_stream, frame
from moorage.errors import InvalidInput, NotFound, UnavailableError
from moorage.runtime import exec_jobs

VERBS = ("sleep", "wake", "checkpoint", "rollback", "fork")
_SUMMARY = {
    "sleep": "Sleep a sandbox",
    "wake": "Wake a sandbox",
    "checkpoint": "Checkpoint the sandbox's instance (sandbox and memory together)",
    "rollback": "Roll the sandbox's instance back to a checkpoint by id or name",
    "fork": "Fork the sandbox's instance as it is now into new end-users",
}
PATH = Param("path", {"type": "string", "minLength": 1}, "a path inside the sandbox", required=True)


def list_sandboxes(call: Call) -> dict[str, Any]:
    state, agent = call.query("state"), agent_of_key(call, "sandboxes")  # as for workflow runs
    limit = parse_limit(call.query("limit"))
    # Keyed on the last one's (last_active, id), not an offset (``keyset_page``): every instance is reachable
    # however many the tenant has (one per end-user). One active while you page moves to the end and may be listed
    # again; none is skipped.
    pos = position(call.query("cursor"), {"a": (int, float), "i": str})
    boxes = call.tenant.sandboxes.list(states=[state] if state else None, agent_id=agent, limit=limit + 1,
                                       after=(float(pos["a"]), pos["i"]) if pos else None)
    return keyset_page(boxes, limit, lambda b: {"a": b.last_active, "i": b.id}, S.sandbox)


def own_sandbox(call: Call, sandbox_id: str) -> Any:
    """The sandbox ``sandbox_id`` of the caller's tenant, found before anything is done to it. A key limited to one
    agent finds its agent's only: another agent's is the same 404 as an id that does not exist (and is not woken,
    read or touched); the sandbox's own record names its agent, so the route needs no ``?agent=``."""
    box = call.tenant.sandboxes.get(sandbox_id)
    if call.who.agent is not None and box.agent_id != call.who.agent:
        raise NotFound(f"no sandbox {sandbox_id!r}")
    if box.scope.user is not None:  # a stored answer about it goes when its user is forgotten
        call.about = (box.agent_id, box.scope.user)
    return box


def get_sandbox(call: Call) -> dict[str, Any]:
    return S.sandbox(own_sandbox(call, call.path["sandbox_id"]))


def runtime_method(call: Call, name: str) -> Callable[..., Any]:
    method = getattr(call.runtime, name, None)
    if method is None:
        raise UnavailableError(f"this runtime cannot {name.replace('_', ' ')} yet",
                               hint="upgrade moorage; sandbox lifecycle verbs need a runtime that provides them")
    return method


def _verb(verb: str) -> Callable[[Call], Any]:
    async def handler(call: Call) -> dict[str, Any]:
        sid = call.path["sandbox_id"]
        await run_in_threadpool(own_sandbox, call, sid)
        body = call.body if isinstance(call.body, dict) else {}
        kw: dict[str, Any] = {k: v for k, v in body.items() if k in ("checkpoint", "label")}
        for k, v in kw.items():
            if not isinstance(v, str):
                raise InvalidInput(f"field {k!r} must be a string")
        if verb == "fork":
            one, many = body.get("to_user"), body.get("to_users")
            users = [one] if one is not None else many
            if (one is None) == (many is None) or not isinstance(users, list) or not all(isinstance(u, str) for u in users):
                raise InvalidInput('name the new end-user(s): {"to_user": "..."} or {"to_users": ["...", ...]}',
                                   hint="each starts as this instance is now: its sandbox and its memory")
            kw["to_users"] = users
        result = await runtime_method(call, "sandbox")(call.who, sid, verb, **kw)  # its wake is timed where it ran
        return result if isinstance(result, dict) else {"result": result}

    handler.__name__ = f"sandbox_{verb}"
    return handler


def _path(call: Call) -> str:
    path = call.query("path") or ""
    if not path or "\x00" in path or len(path) > 4096:
        raise InvalidInput("pass ?path=, a path inside the sandbox")
    return path


async def list_files(call: Call) -> dict[str, Any]:
    sid = call.path["sandbox_id"]
    await run_in_threadpool(own_sandbox, call, sid)
    entries = await runtime_method(call, "list_files")(call.who, sid, _path(call))
    return {"path": _path(call), "entries": list(entries)}


async def read_file(call: Call) -> dict[str, Any]:
    sid = call.path["sandbox_id"]
    await run_in_threadpool(own_sandbox, call, sid)
    data = await runtime_method(call, "read_file")(call.who, sid, _path(call))
    if isinstance(data, str):
        return {"path": _path(call), "encoding": "utf-8", "content": data}
    try:
        return {"path": _path(call), "encoding": "utf-8", "content": bytes(data).decode("utf-8")}
    except UnicodeDecodeError:
        return {"path": _path(call), "encoding": "base64", "content": base64.b64encode(bytes(data)).decode()}


async def exec_command(call: Call) -> Any:
    """Run a command in the sandbox: the result at the end, or with ``detach`` a 202 and an execution at once."""
    sid = call.path["sandbox_id"]
    rec = await run_in_threadpool(own_sandbox, call, sid)  # another tenant's or agent's: a 404 before anything
    argv = call.field("argv", list)
    if not argv or not all(isinstance(a, str) and "\x00" not in a for a in argv) or len(argv) > 4096:
        raise InvalidInput("argv must be a non-empty list of strings", hint='e.g. {"argv": ["ls", "-la"]}')
    env = call.field("env", dict, required=False)
    if env is not None and not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise InvalidInput("env must map strings to strings")
    cwd = call.field("cwd", str, required=False)
    timeout_s = exec_jobs.check_timeout((call.body or {}).get("timeout_s"))
    jobs = exec_jobs.ExecJobs.of(call.runtime)
    if not call.field("detach", bool, required=False, default=False):
        return await jobs.run(call.who, sid, argv, timeout_s=timeout_s, cwd=cwd, env=env)
    await forward_if_awake_elsewhere(call, rec)  # a detached exec runs on the host where its sandbox is awake
    exec_id = await jobs.start(call.who, call.tenant, sid, argv, timeout_s=timeout_s, cwd=cwd, env=env,
                               idempotency_key=call.idempotency_key)
    ex = await run_in_threadpool(exec_jobs.get_exec, call.tenant, call.who, exec_id)
    body = await run_in_threadpool(jobs.view, call.tenant, ex)
    return Reply(body, 202, {"Location": f"/v1/executions/{exec_id}"})


async def _held_elsewhere(call: Call, ex: Any) -> None:
    """A detached exec still running on another live host of the fleet is followed and cancelled there: raising
    ``Misplaced`` has the request forwarded to that host (docs/fleet.md), which holds its output and its process."""
    from moorage.lifecycle.manager import Misplaced

    jobs = exec_jobs.ExecJobs.of(call.runtime)
    host = ex.input.get("host")
    fleet = getattr(getattr(call.runtime, "instances", None), "fleet", None)
    if fleet is None or not host or host == jobs.host or jobs.local(call.tenant, ex.id) is not None:
        return
    if (await run_in_threadpool(jobs.view, call.tenant, ex))["status"] != "running":
        return
    owner = await run_in_threadpool(fleet.host, host)
    if owner is not None and fleet.alive(owner):  # after a store outage no host is taken for dead at once
        raise Misplaced(None, host)


def own_exec(call: Call, execution_id: str) -> Any:
    """The detached exec ``execution_id`` the caller may follow or cancel (``exec_jobs.get_exec``: another
    tenant's, another agent's and a missing one are the same 404, so none tells that the id exists)."""
    ex = exec_jobs.get_exec(call.tenant, call.who, execution_id)
    if ex.user:  # a stored answer (a cancel's, with the output so far) goes when its user is forgotten
        call.about = (ex.agent, ex.user)
    return ex


async def cancel_exec(call: Call) -> dict[str, Any]:
    ex = await run_in_threadpool(own_exec, call, call.path["execution_id"])
    await _held_elsewhere(call, ex)
    return await exec_jobs.ExecJobs.of(call.runtime).cancel(call.tenant, ex)


async def follow_exec(call: Call) -> Any:
    """Server-sent events: ``output`` ({stream, offset, text}) as it arrives, from the oldest byte kept, then ``end``."""
    ex = await run_in_threadpool(own_exec, call, call.path["execution_id"])
    await _held_elsewhere(call, ex)
    events = exec_jobs.ExecJobs.of(call.runtime).follow(call.tenant, ex)

    async def frames() -> Any:
        try:
            async for kind, data in events:
                yield frame(kind, data)
        except Exception as e:  # noqa: BLE001 - reported in-band: the 200 status is already sent
            yield frame("error", error_payload(e, call.trace_id))

    return event_stream(frames(), call.trace_id, keepalive_s=call.ctx.config.sse_keepalive_s)


_BOX = "/v1/sandboxes/{sandbox_id}"
_EXEC = "/v1/executions/{execution_id}"
EXEC_VIEW = S.obj({"id": S.STR, "object": S.STR, "kind": {"enum": ["exec"]}, "sandbox_id": S.STR, "agent": S.STR,
                   "user": S.NSTR, "argv": {"type": "array", "items": S.STR}, "timeout_s": S.NUM,
                   "status": {"enum": ["running", *exec_jobs.TERMINAL]}, "exit_code": {"type": ["integer", "null"]},
                   "error": S.NSTR, "stdout": S.STR, "stderr": S.STR, "stdout_bytes": S.INT, "stderr_bytes": S.INT,
                   "truncated": {"type": "boolean"}, "created_at": S.NUM, "updated_at": S.NUM})
EXEC_RESULT = S.obj({"object": S.STR, "sandbox_id": S.STR, "argv": {"type": "array", "items": S.STR},
                     "status": {"enum": ["succeeded", "failed", "timed_out"]}, "exit_code": {"type": ["integer", "null"]},
                     "timed_out": {"type": "boolean"}, "stdout": S.STR, "stderr": S.STR,
                     "truncated": {"type": "boolean"}, "duration_s": S.NUM})

#: What each verb answers: sleep and wake the sandbox's; checkpoint, rollback and fork the whole instance's.
VERB_RESULT = {
    "sleep": S.obj({"id": S.STR, "slept": {"type": "boolean"}}),
    "wake": S.obj({"id": S.STR, "state": S.STR}),
    "checkpoint": S.obj({"id": S.STR, "checkpoint": S.STR, "name": S.NSTR, "agent": S.STR, "user": S.STR}),
    "rollback": S.obj({"id": S.STR, **ROLLBACK["properties"]}),
    "fork": S.obj({"id": S.STR, **FORK["properties"]}),
}

ENDPOINTS = [
    # A key limited to one agent lists (naming its agent) and gets, acts on, reads and execs in that agent's
    # sandboxes, and follows and cancels its execs, only (agent_checked: own_sandbox and get_exec check it).
    Endpoint("GET", "/v1/sandboxes", list_sandboxes, "List sandboxes", "sandboxes", "listSandboxes", scope="read",
             agent_checked=True,
             query=(*PAGE, Param("state", S.STR),
                    Param("agent", S.ID, "only this agent's sandboxes (a key limited to one agent must name it)")),
             response=S.page_of("Sandbox")),
    Endpoint("GET", _BOX, get_sandbox, "Get a sandbox", "sandboxes", "getSandbox", scope="read", agent_checked=True,
             response=S.ref("Sandbox")),
    *[Endpoint("POST", f"{_BOX}/{verb}", _verb(verb), _SUMMARY[verb], "sandboxes", f"{verb}Sandbox", scope="deploy",
               agent_checked=True,
               body=S.obj({"checkpoint": S.STR, "label": S.STR,
                           **({"to_user": S.STR, "to_users": {"type": "array", "items": S.STR, "minItems": 1,
                                                              "maxItems": 16}} if verb == "fork" else {})}, []),
               response=VERB_RESULT[verb])
      for verb in VERBS],
    Endpoint("GET", f"{_BOX}/files", list_files, "List a directory inside the sandbox", "sandboxes",
             "listSandboxFiles", scope="deploy", agent_checked=True, query=(PATH,),
             response=S.obj({"path": S.STR, "entries": {"type": "array", "items": S.obj({
                 "name": S.STR, "path": S.STR, "type": {"enum": ["file", "dir", "symlink", "other"]}, "size": S.INT,
                 "mtime": S.NUM})}})),
    Endpoint("GET", f"{_BOX}/files/content", read_file, "Read a file inside the sandbox", "sandboxes",
             "readSandboxFile", scope="deploy", agent_checked=True, query=(PATH,),
             response=S.obj({"path": S.STR, "encoding": {"enum": ["utf-8", "base64"]}, "content": S.STR})),
    # Exec runs anything in the sandbox: the same scope as the other sandbox verbs.
    Endpoint("POST", f"{_BOX}/exec", exec_command, "Run a command in the sandbox (detach: 202 and an execution)",
             "sandboxes", "execSandbox", scope="deploy", agent_checked=True, long_lived=True,
             # Detached: the Idempotency-Key names the execution (a retry gets it, nothing runs twice). A
             # synchronous exec's output can exceed what the HTTP replay journal keeps, so it is not journaled.
             idempotency="runtime",
             body=S.obj({"argv": {"type": "array", "items": S.STR, "minItems": 1},
                         "detach": {"type": "boolean"}, "timeout_s": {"type": "number", "exclusiveMinimum": 0,
                                                                      "maximum": exec_jobs.MAX_TIMEOUT_S},
                         "cwd": S.STR, "env": {"type": "object", "additionalProperties": S.STR}}, ["argv"]),
             response=EXEC_RESULT, other_responses=((202, EXEC_VIEW),)),
    Endpoint("POST", f"{_EXEC}/cancel", cancel_exec, "Cancel a detached exec (kills its processes)", "sandboxes",
             "cancelExecution", scope="deploy", agent_checked=True, response=EXEC_VIEW),
    Endpoint("GET", f"{_EXEC}/output", follow_exec, "Follow a detached exec's output (server-sent events)",
             "sandboxes", "followExecution", scope="deploy", agent_checked=True, streams=True, response=EXEC_VIEW),
]
