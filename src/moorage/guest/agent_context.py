"""``ctx`` inside the sandbox, what an agent's code touches: model calls, memory, files, exec, fetch and MCP through
the host, durable steps and interrupts, and the errors the agent catches. Stdlib only."""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import subprocess
from typing import Any, Callable, Dict, List, Optional

from . import children
from .agent_load import LoadedAgent
from .rpc import BUSY as HOST_BUSY, Context, RpcError


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


class ExecTimeout(subprocess.TimeoutExpired):
    """``ctx.exec`` ran past its timeout: the command, or a process it left running with its output (``cmd &``)."""

    def __str__(self) -> str:
        return ("ctx.exec(%r) did not end within %g s: the command is still running, or a process it started in the "
                "background still holds its output (start a process that should keep running with ctx.spawn(argv), "
                "or give the command a larger timeout)" % (self.cmd, self.timeout))


#: The secrets' names ``_secret_env`` put into os.environ (this guest process's, kept across turns and redeploys),
#: so one no longer handed over is taken out even when the deployment no longer names it.
_SECRET_ENV_PUT: set = set()

def secret_env_names(agent: LoadedAgent) -> List[str]:
    """The secrets the agent opted into its environment (``[agent.secrets] env``)."""
    names = (agent.manifest.get("secrets") or {}).get("env")
    return [n for n in names if isinstance(n, str)] if isinstance(names, list) else []


def put_secret_env(names: List[str], env: Dict[str, Any]) -> None:
    """Put ``env`` (the host's values of the opted-in secrets ``names``) into os.environ, and take out every one put
    there before that is no longer handed over: deleted since, or no longer opted into (a redeploy without it). A
    process started before keeps the environment it was started with. Before a turn and before an app request's
    ``on_wake``, so whatever wakes the sandbox, the processes ``on_wake`` starts get the same environment."""
    for name in (_SECRET_ENV_PUT | set(names)) - set(env):
        os.environ.pop(name, None)
    os.environ.update({str(k): str(v) for k, v in env.items()})
    _SECRET_ENV_PUT.clear()
    _SECRET_ENV_PUT.update(str(k) for k in env)


#: HostError kinds that a retry would get again: a step that meets one fails at once instead of being retried.
FINAL_KINDS = frozenset({"egress-denied", "egress-policy", "invalid-input", "not-found", "tenant-scope"})


class Suspended(Exception):
    """Raised by ``ctx.interrupt`` when the workflow must wait for a human: the turn ends as ``waiting``."""

    def __init__(self, payload: Any) -> None:
        super().__init__("waiting for a human answer")
        self.payload = payload

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
        """Up to ``k`` events of the scope, best first, each ``{"id", "text", "speaker", "ts", "kind", "scope",
        "meta", "score", "event"}``: the same shape as the API's search (``GET …/events/search``)."""
        return (await self._host.call("memory.search", {"query": query, "k": k, "scope": scope}))["hits"]

    async def facts(self, subject: Optional[str] = None, *, as_of: Optional[float] = None,
                    known_at: Optional[float] = None) -> List[Dict[str, Any]]:
        """The user's trusted facts true now; ``as_of``: true at that time (seconds since the epoch); ``known_at``:
        as moorage believed them then (a value superseded since is returned as it was)."""
        return (await self._host.call("memory.facts", {"subject": subject, "as_of": as_of,
                                                        "known_at": known_at}))["facts"]

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
        """Run a command in the sandbox and wait for it to end and its output to close: {"exit_code", "stdout",
        "stderr"}. A process that should keep running after the turn is started with ``spawn``."""
        def run() -> Dict[str, Any]:
            try:
                p = subprocess.run(argv, cwd=cwd or self._workdir, capture_output=True, text=True, timeout=timeout)
            except subprocess.TimeoutExpired as e:
                raise ExecTimeout(e.cmd, e.timeout) from None
            return {"exit_code": p.returncode, "stdout": p.stdout, "stderr": p.stderr}

        return await asyncio.get_running_loop().run_in_executor(None, run)

    async def spawn(self, argv: List[str], *, cwd: Optional[str] = None, log: Optional[str] = None) -> Dict[str, Any]:
        """Start a process that keeps running after this turn (a server, a watcher) and return at once: {"pid",
        "log"}. Its output goes to ``log`` (a path; relative to the work directory), or nowhere. It runs until it
        ends or the sandbox sleeps (the micro-VM driver keeps it across a sleep, the process driver does not: start it
        from the agent module's ``on_wake(ctx)`` to have it back after every wake)."""
        if log is not None:
            os.makedirs(os.path.dirname(self.files._p(log)) or ".", exist_ok=True)
        out = subprocess.DEVNULL if log is None else open(self.files._p(log), "ab")
        try:
            p = subprocess.Popen(argv, cwd=cwd or self._workdir, stdin=subprocess.DEVNULL, stdout=out,
                                 stderr=subprocess.STDOUT, start_new_session=True)
        finally:
            if log is not None:
                out.close()
        children.reap(p)  # as it ends, so it leaves no zombie; no thread that counts against the pids limit
        return {"pid": p.pid, "log": None if log is None else self.files._p(log)}

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
        """Put the secrets this agent opted into (``[agent.secrets] env``) into os.environ for its code and the
        processes it starts from now on (``put_secret_env``)."""
        names = secret_env_names(self.agent)
        put_secret_env(names, (await self._host.call("secrets.env", {}))["env"] if names else {})

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
                # A refusal the host would give again (egress denied, invalid input) is not tried again.
                left = 0 if isinstance(e, HostError) and e.kind in FINAL_KINDS else retries
                verdict = await self._host.call("durable.fail", {"seq": seq, "name": name, "attempt": attempt,
                                                                 "error": error, "retries": left})
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


class _NoTurn:
    """The host calls of ``on_wake``'s ctx: it runs outside any turn, so the host serves none of them."""

    async def call(self, method: str, params: Dict[str, Any], timeout: float = 300.0) -> Any:
        raise HostError("%s is not available in on_wake: it runs outside a turn (start processes there; call the "
                        "host from on_message)" % method, 0,
                        {"kind": "not-in-a-turn", "hint": "move this call into on_message"})


class WakeContext(AgentContext):
    """``ctx`` of the agent module's ``on_wake(ctx)``: what brings background processes back (``spawn``, ``exec``,
    ``files``), outside any turn, so model, memory, fetch and durable calls raise ``HostError`` (kind
    ``not-in-a-turn``)."""

    def __init__(self, rpc: Context, agent: LoadedAgent, workdir: str) -> None:
        super().__init__(rpc, agent, {"turn_id": ""}, workdir)
        self._host = self.llm._host = self.memory._host = _NoTurn()  # type: ignore[assignment]

    async def emit(self, event: str, data: Any = None) -> None:
        raise HostError("ctx.emit is not available in on_wake: there is no caller to stream to", 0,
                        {"kind": "not-in-a-turn", "hint": "emit from on_message"})

