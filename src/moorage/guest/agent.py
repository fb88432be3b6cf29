"""The agent runtime inside the sandbox: loads a deployed agent, runs its turns, executes its tools.

Stdlib only. Model calls, memory and durable steps are served by the host over the channel; the guest
never holds a credential and never names its tenant (the host binds identity to the channel).
"""

from __future__ import annotations

import asyncio
import importlib.util
import inspect
import json
import os
import subprocess
import sys
import traceback
import typing
from typing import Any, Callable, Dict, List, Optional

try:
    import tomllib
except ImportError:  # pragma: no cover - the guest image ships Python 3.11
    tomllib = None  # type: ignore[assignment]

from .rpc import BUSY as HOST_BUSY, Context, Registry, RpcError, log

NOT_LOADED = -32010
AGENT_ERROR = -32011
SUSPENDED = -32012

MAX_TOOL_ROUNDS = 6


class StepFailed(Exception):
    """A durable step that failed for good (no attempt left, or a result that is not a JSON value): raised the same
    way when it happens and when a later execution of the workflow replays it."""


class HostError(RpcError):
    """A call to the host (``ctx.fetch``, ``ctx.mcp``, ``ctx.memory``, ...) that the host refused or could not serve.

    ``kind`` is the stable code of the failure ("egress-denied", "egress-failed", "egress-limited", "invalid-input",
    "not-found", "unavailable", ...), ``hint`` what would fix it (or None); ``str(e)`` has both. The agent catches it
    as ``ctx.HostError``.
    """

    def __init__(self, message: str, code: int, data: Any) -> None:
        super().__init__(message, code, data)
        fields = data if isinstance(data, dict) else {}
        self.kind = str(fields.get("kind") or "host-error")
        self.hint = fields.get("hint") if isinstance(fields.get("hint"), str) else None


class Suspended(Exception):
    """Raised by ``ctx.interrupt`` when the workflow must wait for a human: the turn ends as ``waiting``."""

    def __init__(self, payload: Any) -> None:
        super().__init__("waiting for a human answer")
        self.payload = payload


# -- tools: JSON schema from typed signatures ------------------------------------------------------

_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}


def _schema_for(annotation: Any) -> Dict[str, Any]:
    if annotation is inspect.Parameter.empty or annotation is Any:
        return {}
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Literal:
        return {"enum": list(args)}
    if origin is typing.Union:
        non_none = [a for a in args if a is not type(None)]
        return _schema_for(non_none[0]) if len(non_none) == 1 else {"anyOf": [_schema_for(a) for a in non_none]}
    if origin in (list, List):
        return {"type": "array", "items": _schema_for(args[0]) if args else {}}
    if origin in (dict, Dict):
        return {"type": "object"}
    if annotation in _JSON_TYPES:
        return {"type": _JSON_TYPES[annotation]}
    return {}


def tool_schema(fn: Callable[..., Any]) -> Dict[str, Any]:
    """An OpenAI-style function schema derived from ``fn``'s signature, type hints and docstring."""
    sig = inspect.signature(fn)
    try:
        hints = typing.get_type_hints(fn)
    except Exception:
        hints = {}
    props: Dict[str, Any] = {}
    required = []
    for name, p in sig.parameters.items():
        if name in ("ctx", "self") or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        props[name] = _schema_for(hints.get(name, p.annotation))
        if p.default is inspect.Parameter.empty:
            required.append(name)
        else:
            props[name]["default"] = p.default if isinstance(p.default, (str, int, float, bool, type(None))) else None
    doc = inspect.getdoc(fn) or ""
    return {
        "name": fn.__name__,
        "description": doc.split("\n\n")[0].strip(),
        "parameters": {"type": "object", "properties": props, "required": required},
    }


# -- the loaded agent ------------------------------------------------------------------------------


class LoadedAgent:
    def __init__(self, deployment_id: str, path: str, manifest: Dict[str, Any], module: Any,
                 tools: Dict[str, Callable[..., Any]]) -> None:
        self.deployment_id = deployment_id
        self.path = path
        self.manifest = manifest
        self.module = module
        self.tools = tools
        self.handler = getattr(module, manifest.get("handler", "on_message"), None) if module else None

    @property
    def tool_schemas(self) -> List[Dict[str, Any]]:
        # Sorted by name: the schemas are part of the stable prompt prefix and must not reorder.
        return [tool_schema(self.tools[n]) for n in sorted(self.tools)]


def _import_file(name: str, path: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError("cannot import %s" % path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


#: The directories of the agent versions this process imported code from (``load_agent``).
_AGENT_PATHS: List[str] = []


def _under(module: Any, roots: List[str]) -> bool:
    files = [getattr(module, "__file__", None) or ""] + list(getattr(module, "__path__", None) or [])
    return any(f == r or f.startswith(r + os.sep) for f in files if f for r in roots)


def forget_other_versions(path: str) -> None:
    """Before the agent version at ``path`` is imported: the modules of versions loaded before it (its entry, tools
    and its own modules beside them, such as ``helper.py``) leave the process and their directories leave
    ``sys.path``, so the new version's ``import helper`` reads its own file and a module it no longer ships is
    gone. (A redeploy loads the new version into a running sandbox.)"""
    old = [p for p in _AGENT_PATHS if p != path]
    if not old:
        return
    for name, module in list(sys.modules.items()):
        if module is not None and _under(module, old):
            del sys.modules[name]
    sys.path[:] = [p for p in sys.path if p not in old]
    _AGENT_PATHS[:] = [p for p in _AGENT_PATHS if p not in old]
    importlib.invalidate_caches()


def load_agent(deployment_id: str, path: str) -> LoadedAgent:
    """Import the agent package at ``path`` (its moorage.toml, entry module and tools)."""
    manifest_path = os.path.join(path, "moorage.toml")
    with open(manifest_path, "rb") as f:
        doc = tomllib.load(f)
    manifest = doc.get("agent", {})
    forget_other_versions(path)
    if path not in _AGENT_PATHS:
        _AGENT_PATHS.append(path)
    if path not in sys.path:
        sys.path.insert(0, path)  # sibling imports of the agent's own modules
    prefix = "moorage_agent_%s" % deployment_id.replace("-", "_")
    module = None
    entry = manifest.get("entry")
    if entry:
        module = _import_file(prefix, os.path.join(path, entry))
    tools: Dict[str, Callable[..., Any]] = {}
    for spec in manifest.get("tools", []):
        file, _, fname = spec.partition(":")
        mod = module if (entry and file == entry) else _import_file(prefix + "_" + file.replace(".py", "").replace("/", "_"),
                                                                   os.path.join(path, file))
        fn = getattr(mod, fname, None)
        if not callable(fn):
            raise ImportError("tool %r not found in %s" % (fname, file))
        tools[fname] = fn
    agent = LoadedAgent(deployment_id, path, manifest, module, tools)
    if entry and agent.handler is None:
        raise ImportError("%s has no %s(ctx, message) handler" % (entry, manifest.get("handler", "on_message")))
    return agent


# -- ctx: what the agent's code touches -------------------------------------------------------------


class _Host:
    """Calls to the host for this turn; the host checks the turn id belongs to this sandbox."""

    def __init__(self, rpc: Context, turn_id: str) -> None:
        self._rpc = rpc
        self.turn_id = turn_id

    async def call(self, method: str, params: Dict[str, Any], timeout: float = 300.0) -> Any:
        # The host serves a bounded number of this sandbox's calls at once and answers the rest "busy": wait and
        # retry, so an agent that starts many calls together (asyncio.gather) just gets them served in turn.
        delay = 0.005
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            try:
                return await self._rpc.peer.call(method, dict(params, turn_id=self.turn_id), timeout=timeout)
            except RpcError as e:
                if e.code == HOST_BUSY:
                    if asyncio.get_running_loop().time() + delay > deadline:  # busy for as long as the call may take
                        raise HostError("the host stayed busy for %g s: %s" % (timeout, e), e.code,
                                        {"kind": "busy", "hint": "retry later"}) from None
                elif isinstance(e.data, dict) and "kind" in e.data and not isinstance(e, HostError):
                    raise HostError(str(e), e.code, e.data) from None
                else:
                    raise
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.5)


class LLM:
    def __init__(self, host: _Host, agent: LoadedAgent) -> None:
        self._host = host
        self._agent = agent

    async def complete(self, messages: List[Dict[str, Any]], *, tools: Optional[List[Dict[str, Any]]] = None,
                       response_format: Optional[Dict[str, Any]] = None, max_tokens: Optional[int] = None,
                       temperature: Optional[float] = None, model: Optional[str] = None) -> Dict[str, Any]:
        """One model call through the host's gateway. Returns {"text", "tool_calls", "usage", ...}."""
        return await self._host.call("llm.complete", {
            "messages": messages, "tools": tools, "response_format": response_format, "max_tokens": max_tokens,
            "temperature": temperature, "model": model or self._agent.manifest.get("model"),
        })

    async def chat(self, prompt: str, *, system: Optional[str] = None, max_tokens: Optional[int] = None) -> str:
        msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        return (await self.complete(msgs, max_tokens=max_tokens))["text"]


class Memory:
    """The three memory tiers, kept by the host for this agent's user (and session)."""

    def __init__(self, host: _Host) -> None:
        self._host = host

    async def remember(self, text: str, *, kind: str = "note", scope: str = "user") -> int:
        return (await self._host.call("memory.append", {"text": text, "kind": kind, "scope": scope}))["id"]

    async def recall(self, query: str, *, k: int = 5, scope: str = "user") -> List[Dict[str, Any]]:
        return (await self._host.call("memory.search", {"query": query, "k": k, "scope": scope}))["hits"]

    async def facts(self, subject: Optional[str] = None) -> List[Dict[str, Any]]:
        return (await self._host.call("memory.facts", {"subject": subject}))["facts"]

    async def learn(self, subject: str, attribute: str, value: str, text: str) -> Dict[str, Any]:
        return await self._host.call("memory.learn", {"subject": subject, "attribute": attribute, "value": value, "text": text})

    async def context(self, message: str, *, system: Optional[str] = None,
                      tools: Optional[List[Dict[str, Any]]] = None) -> List[Dict[str, Any]]:
        """The model input for this turn: stable prefix (system, tools, summaries, facts) + recent turns + message."""
        return (await self._host.call("memory.context", {"message": message, "system": system, "tools": tools}))["messages"]


class Files:
    def __init__(self, root: str) -> None:
        self.root = root

    def _p(self, path: str) -> str:
        return path if os.path.isabs(path) else os.path.join(self.root, path)

    def read(self, path: str) -> str:
        with open(self._p(path)) as f:
            return f.read()

    def write(self, path: str, text: str) -> None:
        full = self._p(path)
        os.makedirs(os.path.dirname(full) or ".", exist_ok=True)
        tmp = full + ".tmp"
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, full)

    def exists(self, path: str) -> bool:
        return os.path.exists(self._p(path))

    def list(self, path: str = ".") -> List[str]:
        return sorted(os.listdir(self._p(path)))


class AgentContext:
    """``ctx``: the entity this turn is for, model calls, memory, durable steps, files, exec, streaming."""

    #: What the agent's code catches: a call the host refused or failed (``e.kind``), a durable step that failed.
    HostError = HostError
    StepFailed = StepFailed

    def __init__(self, rpc: Context, agent: LoadedAgent, params: Dict[str, Any], workdir: str) -> None:
        self._rpc = rpc
        self._host = _Host(rpc, params["turn_id"])
        self.agent = agent
        self.turn_id: str = params["turn_id"]
        self.entity: Dict[str, Any] = params.get("entity", {})
        self.user: str = self.entity.get("user", "")
        self.session: Optional[str] = self.entity.get("session")
        self.llm = LLM(self._host, agent)
        self.memory = Memory(self._host)
        self.files = Files(workdir)
        self._workdir = workdir
        self._step_seq = 0

    async def emit(self, event: str, data: Any = None) -> None:
        """Stream a partial result or an event to the caller."""
        await self._rpc.emit(event, data)

    async def exec(self, argv: List[str], *, timeout: float = 300.0, cwd: Optional[str] = None) -> Dict[str, Any]:
        def run() -> Dict[str, Any]:
            p = subprocess.run(argv, cwd=cwd or self._workdir, capture_output=True, text=True, timeout=timeout)
            return {"exit_code": p.returncode, "stdout": p.stdout, "stderr": p.stderr}

        return await asyncio.get_running_loop().run_in_executor(None, run)

    async def fetch(self, url: str, *, method: str = "GET", json: Any = None, headers: Optional[Dict[str, str]] = None,
                    body: Optional[str] = None, idempotency_key: Optional[str] = None,
                    timeout: float = 30.0) -> Dict[str, Any]:
        """An HTTP call made by the host on the agent's behalf, under the agent's egress policy.

        Only destinations listed under [agent.egress] allow are reachable (and only public addresses, unless
        the operator allows more). Secrets bound in [agent.secrets] are added by the host for their hosts and
        never come here. Redirects are followed only to allowed destinations; the body is cut at 1 MiB.
        Returns {"status", "headers", "body", "truncated", "url"}.
        """
        return await self._host.call("net.fetch", {"url": url, "method": method, "json": json, "headers": headers or {},
                                                   "body": body, "idempotency_key": idempotency_key,
                                                   "timeout": timeout},
                                     timeout=timeout + 5)

    async def _secret_env(self) -> None:
        """Put the secrets this agent opted into (``[agent.secrets] env``) into os.environ for its code."""
        if not ((self.agent.manifest.get("secrets") or {}).get("env")):
            return
        env = (await self._host.call("secrets.env", {}))["env"]
        os.environ.update({str(k): str(v) for k, v in env.items()})

    async def mcp(self, server: str, tool: str, **arguments: Any) -> Dict[str, Any]:
        """Call a tool of an external MCP server; the host connects and adds the credentials, never the sandbox.

        Returns {"text", "content", "structured", "is_error"}.
        """
        return await self._host.call("mcp.call", {"server": server, "tool": tool, "arguments": arguments})

    async def mcp_tools(self) -> List[Dict[str, Any]]:
        """The external MCP tools this agent may call ({"server", "name", "description", "parameters"}), sorted."""
        return (await self._host.call("mcp.tools", {}))["tools"]

    async def step(self, name: str, fn: Callable[..., Any], *args: Any, idempotency_key: Optional[str] = None,
                   retries: int = 3, **kwargs: Any) -> Any:
        """Run ``fn`` once: its result is journaled by the host before it is returned; a replay returns it."""
        # Positions count this workflow's step/interrupt calls from 0; a replay makes the same calls in order.
        seq = self._step_seq
        self._step_seq += 1
        while True:
            begin = await self._host.call("durable.begin", {"seq": seq, "name": name, "idempotency_key": idempotency_key})
            if begin.get("replay"):
                if begin.get("error"):
                    raise StepFailed("step %r failed: %s" % (name, begin["error"]))
                return begin.get("result")
            key, attempt = begin["idempotency_key"], begin.get("attempt", 1)
            try:
                if "idempotency_key" in inspect.signature(fn).parameters:
                    kwargs["idempotency_key"] = key
                out = fn(*args, **kwargs)
                if inspect.isawaitable(out):
                    out = await out
            except Exception as e:  # noqa: BLE001 - recorded in the step log, then retried or raised
                error = "%s: %s" % (type(e).__name__, e)
                verdict = await self._host.call("durable.fail", {"seq": seq, "name": name, "attempt": attempt,
                                                                 "error": error, "retries": retries})
                if verdict.get("retry"):
                    await asyncio.sleep(float(verdict.get("backoff_s", 0.0)))
                    continue
                raise StepFailed("step %r failed: %s" % (name, error)) from e
            try:
                # What is journaled is what the step returns, live as on replay (a tuple comes back a list).
                out = json.loads(json.dumps(out))
            except (TypeError, ValueError, RecursionError) as e:
                error = "result of step %r is not a JSON value (%s: %s); return plain JSON values" % (
                    name, type(e).__name__, e)
                await self._host.call("durable.fail", {"seq": seq, "name": name, "attempt": attempt, "error": error,
                                                       "retries": 0})
                raise StepFailed("step %r failed: %s" % (name, error)) from e
            await self._host.call("durable.complete", {"seq": seq, "name": name, "idempotency_key": key,
                                                       "attempt": attempt, "result": out})
            return out

    async def interrupt(self, payload: Any) -> Any:
        """Wait for a human: returns their answer when the workflow is resumed with one."""
        seq = self._step_seq
        self._step_seq += 1
        r = await self._host.call("durable.interrupt", {"seq": seq, "payload": payload})
        if r.get("answered"):
            return r.get("answer")
        raise Suspended(payload)

    async def correct(self, note: str) -> None:
        """Record a user's correction: in this turn's log and in the user's log, so later steps, replays and the
        user's later turns of this agent (``history()``, the built-in loop's context) take it into account."""
        seq = self._step_seq
        self._step_seq += 1
        await self._host.call("durable.correct", {"seq": seq, "note": note})

    async def checkpoint(self, name: str) -> Dict[str, Any]:
        """A named checkpoint of this agent instance at this point of the turn: its sandbox (files; with the
        micro-VM driver its memory and processes too) and its memory, facts and journal as written so far.
        Rolled back to or forked from, it is this point again; this turn then counts as failed there."""
        return await self._host.call("timetravel.checkpoint", {"name": name})

    async def history(self) -> List[Dict[str, Any]]:
        """Corrections, notes and failures from this user's earlier turns of this agent (oldest first), then the
        attempted steps, failures and corrections of this turn so far. Each entry is a dict with ``kind`` (step,
        attempt, interrupt, correction, note), ``step``, ``status``, ``attempt``, ``error``, ``note``, ``turn_id``
        (the turn that wrote it) and ``at`` (seconds since the epoch)."""
        return (await self._host.call("durable.history", {}))["history"]


# -- the built-in agent loop (no code: a system prompt, tools and a model in moorage.toml) -----------


#: Corrections from the user's earlier turns that the built-in loop shows the model, most recent last.
MAX_CORRECTIONS_SHOWN = 5
#: Largest tool result (as JSON text) journaled and shown to the model; more is cut.
MAX_TOOL_RESULT = 128 * 1024


async def _model_step(ctx: AgentContext, messages: List[Dict[str, Any]], tools: Optional[List[Dict[str, Any]]],
                      max_tokens: Optional[int]) -> Dict[str, Any]:
    """One model call as a journaled step: a replay returns the journaled output instead of asking again.

    A failed call is logged as a failed attempt but not settled, so a retry of the turn (same Idempotency-Key)
    asks the model again instead of replaying a passing outage.
    """
    seq = ctx._step_seq
    ctx._step_seq += 1
    begin = await ctx._host.call("durable.begin", {"seq": seq, "name": "model", "idempotency_key": None})
    if begin.get("replay"):
        if begin.get("error"):
            raise StepFailed("the model call failed for good earlier: %s" % begin["error"])
        return begin.get("result") or {}
    attempt = begin.get("attempt", 1)
    try:
        out = await ctx.llm.complete(messages, tools=tools, max_tokens=max_tokens)
    except Exception as e:  # noqa: BLE001 - logged as an attempt, then the turn fails as it would have
        try:
            # retries=attempt: the host records an attempt to be retried, never a final failure.
            await ctx._host.call("durable.fail", {"seq": seq, "name": "model", "attempt": attempt,
                                                  "error": "%s: %s" % (type(e).__name__, e), "retries": attempt})
        except Exception:  # noqa: BLE001 - the model's error is the one the caller must see
            pass
        raise
    await ctx._host.call("durable.complete", {"seq": seq, "name": "model", "idempotency_key": begin["idempotency_key"],
                                              "attempt": attempt, "result": out})
    return out


def _tool_body(fn: Callable[..., Any], arguments: Dict[str, Any]) -> Callable[[], Any]:
    """The body of a tool's step: the tool's result as JSON values, or ``{"error": ...}`` when it raised (the
    model sees the failure and may try otherwise; the step itself succeeds, so nothing retries the tool)."""

    async def body() -> Any:
        try:
            result = fn(**arguments)
            if inspect.isawaitable(result):
                result = await result
        except Exception as e:  # noqa: BLE001
            return {"error": "%s: %s" % (type(e).__name__, e)}
        if isinstance(result, str):
            return result if len(result) <= MAX_TOOL_RESULT else result[:MAX_TOOL_RESULT] + " [cut]"
        text = json.dumps(result, default=str)
        if len(text) > MAX_TOOL_RESULT:
            return text[:MAX_TOOL_RESULT] + " [cut]"
        return json.loads(text)  # what the journal holds, so the live turn and its replay see the same

    return body


def _corrections_line(history: List[Dict[str, Any]]) -> str:
    """The user's recent corrections (earlier turns' first), as one short line for the new user turn ('' if none)."""
    notes = [str(e["note"]) for e in history if e.get("kind") in ("correction", "note") and e.get("note")]
    notes = [n if len(n) <= 300 else n[:300] + "..." for n in notes[-MAX_CORRECTIONS_SHOWN:]]
    return "[corrections from the user: %s]" % "; ".join(notes) if notes else ""


async def builtin_loop(ctx: AgentContext, message: str) -> str:
    """The no-code agent: the model asks for tools until it answers.

    Every model call and every tool call is a journaled step, so a turn recovered after a crash replays the
    model's outputs and the tools' results in order (the same path) and runs no tool a second time.
    """
    agent = ctx.agent
    schemas = agent.tool_schemas
    line = _corrections_line(await ctx.history())
    # Like known facts: in the new user turn, never in the stable prefix (system and tools stay byte-identical).
    messages = await ctx.memory.context("%s\n%s" % (line, message) if line else message,
                                        system=agent.manifest.get("system_prompt"), tools=schemas or None)
    out: Dict[str, Any] = {}
    for _ in range(MAX_TOOL_ROUNDS):
        out = await _model_step(ctx, messages, schemas or None, agent.manifest.get("max_tokens"))
        calls = out.get("tool_calls") or []
        if not calls:
            return out.get("text", "")
        messages.append({"role": "assistant", "content": out.get("text") or "", "tool_calls": calls})
        for call in calls:
            name = str(call.get("name", ""))
            fn = agent.tools.get(name)
            if fn is None:
                result: Any = {"error": "unknown tool %r" % name}
            else:
                result = await ctx.step("tool:" + name, _tool_body(fn, call.get("arguments") or {}), retries=0)
            await ctx.emit("tool", {"name": name, "result": result})
            messages.append({"role": "tool", "tool_call_id": call.get("id"), "name": name,
                             "content": result if isinstance(result, str) else json.dumps(result, default=str)})
    return out.get("text", "")


# -- channel methods --------------------------------------------------------------------------------


class AgentRuntime:
    def __init__(self, workdir: str) -> None:
        self.workdir = workdir
        self.agents: Dict[str, LoadedAgent] = {}

    async def load(self, params: Dict[str, Any], rpc: Context) -> Dict[str, Any]:
        dep, path = params["deployment_id"], params["path"]
        try:
            agent = load_agent(dep, path)
        except Exception as e:  # noqa: BLE001 - the developer gets the real error, not a stuck agent
            raise RpcError("agent failed to load: %s: %s" % (type(e).__name__, e), AGENT_ERROR,
                           {"type": type(e).__name__, "traceback": traceback.format_exc(limit=5)})
        self.agents = {dep: agent}  # one live version per sandbox; older modules are dropped
        log("agent loaded", deployment=dep, tools=sorted(agent.tools))
        return {"deployment_id": dep, "tools": agent.tool_schemas, "builtin": agent.handler is None}

    async def turn(self, params: Dict[str, Any], rpc: Context) -> Dict[str, Any]:
        agent = self.agents.get(params.get("deployment_id", ""))
        if agent is None:
            raise RpcError("deployment %s is not loaded" % params.get("deployment_id"), NOT_LOADED)
        ctx = AgentContext(rpc, agent, params, self.workdir)
        message = params.get("message", "")
        try:
            await ctx._secret_env()
            if agent.handler is None:
                reply = await builtin_loop(ctx, message)
            elif inspect.iscoroutinefunction(agent.handler):
                reply = await agent.handler(ctx, message)
            else:
                reply = await asyncio.get_running_loop().run_in_executor(None, agent.handler, ctx, message)
        except Suspended as s:
            return {"status": "waiting", "interrupt": s.payload}
        except RpcError:
            raise
        except Exception as e:  # noqa: BLE001
            raise RpcError("agent raised %s: %s" % (type(e).__name__, e), AGENT_ERROR,
                           {"type": type(e).__name__, "traceback": traceback.format_exc(limit=8)})
        return {"status": "done", "reply": reply if isinstance(reply, (str, dict, list, type(None))) else str(reply)}

    async def info(self, params: Any, rpc: Context) -> Dict[str, Any]:
        return {"loaded": sorted(self.agents)}


def register(registry: Registry) -> None:
    rt = AgentRuntime(os.environ.get("MOORAGE_WORKDIR", "/work"))
    registry.add("agent.load", rt.load)
    registry.add("agent.turn", rt.turn)
    registry.add("agent.info", rt.info)
