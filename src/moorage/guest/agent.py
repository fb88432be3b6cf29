"""The agent runtime inside the sandbox: loads a deployed agent, runs its turns, executes its tools.

Stdlib only. Model calls, memory and durable steps are served by the host over the channel; the guest
never holds a credential and never names its tenant (the host binds identity to the channel). Loading an agent is in
agent_load.py, ``ctx`` in agent_context.py, the built-in loop in agent_loop.py; this module serves the channel methods.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import traceback
from typing import Any, Dict, List, Optional

from .agent_context import AgentContext, Files, HostError, LLM, Memory, StepFailed, Suspended, WakeContext, _Host
from .agent_load import LoadedAgent, forget_other_versions, load_agent, tool_schema
from .agent_loop import MAX_CORRECTIONS_SHOWN, MAX_TOOL_RESULT, MAX_TOOL_ROUNDS, builtin_loop
from .rpc import TOO_LARGE, Context, Registry, RpcError, log

NOT_LOADED = -32010
AGENT_ERROR = -32011
SUSPENDED = -32012
#: How much of an exception's text (and of its traceback) an agent error carries: the whole of a huge one would
#: be over the channel's frame limit, and the turn would never be answered.
MAX_ERROR_TEXT = 4000
MAX_TRACEBACK = 8000
#: The largest reply a turn returns (JSON, in bytes): the channel's frame limit, less room for the frame's own fields.
MAX_REPLY = (8 << 20) - (64 << 10)
#: What agent code raises that ends its turn as the agent's error, not the guest's: SystemExit (sys.exit) and
#: KeyboardInterrupt would otherwise end the guest's supervisor. A cancel is not one of them.
AGENT_RAISES = (Exception, SystemExit, KeyboardInterrupt)


def raised_where(e: BaseException, root: str) -> Any:
    """Where in the agent's own files ``e`` was raised (the innermost frame under ``root``): "agent.py, line 4, in
    helper: return x['missing']", or None when none of its frames is the agent's."""
    root = os.path.realpath(root) + os.sep
    where = None
    for frame in traceback.extract_tb(e.__traceback__):
        path = os.path.realpath(frame.filename)
        if path.startswith(root):
            where = "%s, line %s, in %s%s" % (path[len(root):], frame.lineno, frame.name,
                                               ": " + frame.line if frame.line else "")
    return where


def error_text(e: BaseException) -> str:
    """``str(e)``, cut to MAX_ERROR_TEXT; an exception whose ``__str__`` itself raises still has a text."""
    try:
        text = str(e)
    except Exception as inner:  # noqa: BLE001 - the agent's own __str__; the error is still said
        text = "<its str() raised %s>" % type(inner).__name__
    if len(text) > MAX_ERROR_TEXT:
        text = "%s... (%d characters in all)" % (text[:MAX_ERROR_TEXT], len(text))
    return text


def agent_error(what: str, e: BaseException, root: str) -> RpcError:
    """The turn's answer for an exception of the agent's code: ``what`` raised it, its text and where in the
    agent's files, small enough for one frame whatever the exception holds."""
    tb = traceback.format_exc(limit=8)
    if len(tb) > MAX_TRACEBACK:
        tb = "...\n" + tb[-MAX_TRACEBACK:]
    return RpcError("%s raised %s: %s" % (what, type(e).__name__, error_text(e)), AGENT_ERROR,
                    {"type": type(e).__name__, "traceback": tb, "where": raised_where(e, root)})


def checked_reply(reply: Any) -> Any:
    """The turn's reply as the host gets it: a string, a JSON object or list, or None (anything else is said as its
    ``str()``). A reply that is not JSON, or over the frame limit, is the agent's error that says so."""
    if not isinstance(reply, (str, dict, list, type(None))):
        reply = str(reply)
    try:
        size = len(json.dumps(reply, separators=(",", ":"), ensure_ascii=False).encode("utf-8"))
    except (TypeError, ValueError) as e:
        raise RpcError("the agent returned a reply that is not JSON (%s)" % error_text(e), AGENT_ERROR,
                       {"type": "TypeError", "hint": "return a string, or a dict or list of strings, numbers, "
                                                     "booleans and None (convert sets to lists, bytes to text)"})
    if size > MAX_REPLY:
        raise RpcError("the agent returned a reply of %d bytes, more than the %d a turn can return"
                       % (size, MAX_REPLY), AGENT_ERROR,
                       {"type": "ReplyTooLarge", "hint": "return less: write a large result to a file of the "
                                                          "instance (ctx.files) and return where it is"})
    return reply


# -- channel methods --------------------------------------------------------------------------------


class AgentRuntime:
    def __init__(self, workdir: str) -> None:
        self.workdir = workdir
        self.agents: Dict[str, LoadedAgent] = {}
        #: The agent module's ``on_wake`` is due: this process is new (a cold start, the process driver's wake, a
        #: restart in place) or the VM it runs in was woken (``woken``), and no turn or app request ran it since.
        self.wake_due = True
        self._waking = asyncio.Lock()
        #: Turns whose plain-function handler still runs in its thread after the turn was cancelled (its timeout):
        #: a thread cannot be stopped, so the host restarts the guest when it sees one (``agent.info``'s "stuck").
        self.stuck: "set[str]" = set()
        #: The turn now waiting on ``on_wake``, and the last turns whose cancel (their timeout) came while they did:
        #: ``agent.info`` tells the host that on_wake, not the turn's handler, is what did not return.
        self._in_wake: "Optional[str]" = None
        self._wake_cancelled: "List[str]" = []

    def woken(self) -> None:
        """The VM was woken from a snapshot (``vm.after_wake``): its processes are kept, but ``on_wake`` is run
        again before the next turn or app request, as on every driver."""
        self.wake_due = True

    async def wake_hook(self, rpc: Context) -> None:
        """Run the loaded agent's ``on_wake(ctx)`` if it is due, once however many turns and app requests come at
        the same time (they wait for it). Raises what it raised; it is then due again."""
        if not self.wake_due or not self.agents:
            return  # nothing loaded yet: it runs once the code is (the host loads it, then asks again)
        async with self._waking:
            if not self.wake_due:
                return
            agent = next(iter(self.agents.values()))
            hook = agent.on_wake
            if hook is not None:
                ctx = WakeContext(rpc, agent, self.workdir)
                log("on_wake", deployment=agent.deployment_id)
                if inspect.iscoroutinefunction(hook):
                    await hook(ctx)
                else:
                    await asyncio.get_running_loop().run_in_executor(None, hook, ctx)
            self.wake_due = False

    async def load(self, params: Dict[str, Any], rpc: Context) -> Dict[str, Any]:
        dep, path = params["deployment_id"], params["path"]
        try:
            agent = load_agent(dep, path)
        except Exception as e:  # noqa: BLE001 - the developer gets the real error, not a stuck agent
            raise RpcError("agent failed to load: %s: %s" % (type(e).__name__, e), AGENT_ERROR,
                           {"type": type(e).__name__, "traceback": traceback.format_exc(limit=5),
                            "where": raised_where(e, path)})
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
            turn_id = str(params.get("turn_id"))
            self._in_wake = turn_id
            try:
                await self.wake_hook(rpc)  # after the secrets: processes it starts get those the agent opted into
            except asyncio.CancelledError:
                self._wake_cancelled = self._wake_cancelled[-15:] + [turn_id]
                raise
            except AGENT_RAISES as e:  # noqa: BLE001
                raise agent_error("the agent's on_wake", e, agent.path) from None
            finally:
                if self._in_wake == turn_id:
                    self._in_wake = None
            if agent.handler is None:
                reply = await builtin_loop(ctx, message)
            elif inspect.iscoroutinefunction(agent.handler):
                reply = await agent.handler(ctx, message)
            else:
                reply = await self._in_thread(agent.handler, ctx, message, str(params.get("turn_id")))
        except Suspended as s:
            return {"status": "waiting", "interrupt": s.payload}
        except RpcError as e:
            if e.code != TOO_LARGE:
                raise
            # The agent's own event or host call was over the channel's frame (its send refused it): its error.
            where = raised_where(e, agent.path)
            raise RpcError("the agent sent more than the channel carries in one message (%s)" % e, AGENT_ERROR, {
                "type": "TooLarge", "where": where,
                "hint": "send less at once (emit a large result in parts, or write it to a file of the instance, "
                        "ctx.files)%s" % ("; raised at " + where if where else "")}) from None
        except AGENT_RAISES as e:  # noqa: BLE001
            raise agent_error("agent", e, agent.path) from None
        return {"status": "done", "reply": checked_reply(reply)}

    async def _in_thread(self, handler: Any, ctx: AgentContext, message: Any, turn_id: str) -> Any:
        """A plain-function handler, run in a thread; one its turn's cancel leaves running is counted stuck."""
        ended = []

        def run() -> Any:
            try:
                return handler(ctx, message)
            finally:
                ended.append(True)
                self.stuck.discard(turn_id)

        try:
            return await asyncio.get_running_loop().run_in_executor(None, run)
        except asyncio.CancelledError:
            if not ended:
                self.stuck.add(turn_id)
                if ended:  # it ended as it was added
                    self.stuck.discard(turn_id)
            raise

    async def info(self, params: Any, rpc: Context) -> Dict[str, Any]:
        out = {"loaded": sorted(self.agents), "stuck": len(self.stuck)}  # type: Dict[str, Any]
        turn = params.get("turn_id") if isinstance(params, dict) else None
        if turn:  # asked after that turn timed out: was it still waiting on on_wake?
            out["in_on_wake"] = turn == self._in_wake or turn in self._wake_cancelled
        return out


#: This guest's agent runtime, for the app relay (``on_wake`` before an app request) and the VM's wake.
RUNTIME: "AgentRuntime | None" = None


def register(registry: Registry) -> None:
    global RUNTIME
    rt = RUNTIME = AgentRuntime(os.environ.get("MOORAGE_WORKDIR", "/work"))
    registry.add("agent.load", rt.load)
    registry.add("agent.turn", rt.turn)
    registry.add("agent.info", rt.info)


__all__ = [
    "AGENT_ERROR", "NOT_LOADED", "SUSPENDED", "MAX_CORRECTIONS_SHOWN", "MAX_TOOL_RESULT", "MAX_TOOL_ROUNDS",
    "AgentContext", "AgentRuntime", "Files", "RUNTIME", "WakeContext", "HostError", "LLM", "LoadedAgent", "Memory", "StepFailed", "Suspended",
    "_Host", "builtin_loop", "forget_other_versions", "load_agent", "register", "tool_schema",
]
