"""Agent sandboxes: list, get, the lifecycle verbs (sleep, wake, checkpoint, rollback, fork), files.

Every verb first finds the sandbox in the caller's tenant store; the runtime then acts on it.
"""

from __future__ import annotations

import base64
import time
from typing import Any, Callable

from starlette.concurrency import run_in_threadpool

from moorage.api import schemas as S
from moorage.api.pagination import offset_page, parse_limit
from moorage.api.routes._common import PAGE
from moorage.api.routing import Call, Endpoint, Param
from moorage.errors import InvalidInput, UnavailableError

VERBS = ("sleep", "wake", "checkpoint", "rollback", "fork")
PATH = Param("path", {"type": "string", "minLength": 1}, "a path inside the sandbox", required=True)


def list_sandboxes(call: Call) -> dict[str, Any]:
    state, agent = call.query("state"), call.query("agent")
    boxes = call.tenant.sandboxes.list(states=[state] if state else None, agent_id=agent, limit=10_000)
    return offset_page(lambda n: boxes[:n], parse_limit(call.query("limit")), call.query("cursor"), S.sandbox)


def get_sandbox(call: Call) -> dict[str, Any]:
    return S.sandbox(call.tenant.sandboxes.get(call.path["sandbox_id"]))


def runtime_method(call: Call, name: str) -> Callable[..., Any]:
    method = getattr(call.runtime, name, None)
    if method is None:
        raise UnavailableError(f"this runtime cannot {name.replace('_', ' ')} yet",
                               hint="upgrade moorage; sandbox lifecycle verbs need a runtime that provides them")
    return method


def _verb(verb: str) -> Callable[[Call], Any]:
    async def handler(call: Call) -> dict[str, Any]:
        sid = call.path["sandbox_id"]
        await run_in_threadpool(call.tenant.sandboxes.get, sid)
        kw = {k: v for k, v in (call.body or {}).items() if k in ("checkpoint", "label")}
        for k, v in kw.items():
            if not isinstance(v, str):
                raise InvalidInput(f"field {k!r} must be a string")
        started = time.perf_counter()
        result = await runtime_method(call, "sandbox")(call.who, sid, verb, **kw)
        if verb == "wake":
            call.ctx.metrics.observe_wake(time.perf_counter() - started)
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
    await run_in_threadpool(call.tenant.sandboxes.get, sid)
    entries = await runtime_method(call, "list_files")(call.who, sid, _path(call))
    return {"path": _path(call), "entries": list(entries)}


async def read_file(call: Call) -> dict[str, Any]:
    sid = call.path["sandbox_id"]
    await run_in_threadpool(call.tenant.sandboxes.get, sid)
    data = await runtime_method(call, "read_file")(call.who, sid, _path(call))
    if isinstance(data, str):
        return {"path": _path(call), "encoding": "utf-8", "content": data}
    try:
        return {"path": _path(call), "encoding": "utf-8", "content": bytes(data).decode("utf-8")}
    except UnicodeDecodeError:
        return {"path": _path(call), "encoding": "base64", "content": base64.b64encode(bytes(data)).decode()}


_BOX = "/v1/sandboxes/{sandbox_id}"

ENDPOINTS = [
    Endpoint("GET", "/v1/sandboxes", list_sandboxes, "List sandboxes", "sandboxes", "listSandboxes", scope="read",
             query=(*PAGE, Param("state", S.STR), Param("agent", S.STR)), response=S.page_of("Sandbox")),
    Endpoint("GET", _BOX, get_sandbox, "Get a sandbox", "sandboxes", "getSandbox", scope="read", response=S.ref("Sandbox")),
    *[Endpoint("POST", f"{_BOX}/{verb}", _verb(verb), f"{verb.capitalize()} a sandbox", "sandboxes",
               f"{verb}Sandbox", scope="deploy",
               body=S.obj({"checkpoint": S.STR, "label": S.STR}, []), response=S.ref("Result"))
      for verb in VERBS],
    Endpoint("GET", f"{_BOX}/files", list_files, "List a directory inside the sandbox", "sandboxes",
             "listSandboxFiles", scope="deploy", query=(PATH,),
             response=S.obj({"path": S.STR, "entries": {"type": "array"}})),
    Endpoint("GET", f"{_BOX}/files/content", read_file, "Read a file inside the sandbox", "sandboxes",
             "readSandboxFile", scope="deploy", query=(PATH,),
             response=S.obj({"path": S.STR, "encoding": {"enum": ["utf-8", "base64"]}, "content": S.STR})),
]
