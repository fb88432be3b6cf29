"""The agent runtime inside the sandbox: loads a deployed agent, runs its turns, executes its tools.

Stdlib only. Model calls, memory and durable steps are served by the host over the channel; the guest
never holds a credential and never names its tenant (the host binds identity to the channel). Loading an agent is in
agent_load.py, ``ctx`` in agent_context.py, the built-in loop in agent_loop.py; this module serves the channel methods.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import traceback
from typing import Any, Dict

from .agent_context import AgentContext, Files, HostError, LLM, Memory, StepFailed, Suspended, WakeContext, _Host
from .agent_load import LoadedAgent, forget_other_versions, load_agent, tool_schema
from .agent_loop import MAX_CORRECTIONS_SHOWN, MAX_TOOL_RESULT, MAX_TOOL_ROUNDS, builtin_loop
from .rpc import Context, Registry, RpcError, log

NOT_LOADED = -32010
AGENT_ERROR = -32011
SUSPENDED = -32012


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


# -- channel methods --------------------------------------------------------------------------------


class AgentRuntime:
    def __init__(self, workdir: str) -> None:
        self.workdir = workdir
        self.agents: Dict[str, LoadedAgent] = {}
        #: The agent module's ``on_wake`` is due: this process is new (a cold start, the process driver's wake, a
        #: restart in place) or the VM it runs in was woken (``woken``), and no turn or app request ran it since.
        self.wake_due = True
        self._waking = asyncio.Lock()

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
            try:
                await self.wake_hook(rpc)  # after the secrets: processes it starts get those the agent opted into
            except Exception as e:  # noqa: BLE001
                raise RpcError("the agent's on_wake raised %s: %s" % (type(e).__name__, e), AGENT_ERROR,
                               {"type": type(e).__name__, "traceback": traceback.format_exc(limit=8),
                                "where": raised_where(e, agent.path)}) from None
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
                           {"type": type(e).__name__, "traceback": traceback.format_exc(limit=8),
                            "where": raised_where(e, agent.path)})
        return {"status": "done", "reply": reply if isinstance(reply, (str, dict, list, type(None))) else str(reply)}

    async def info(self, params: Any, rpc: Context) -> Dict[str, Any]:
        return {"loaded": sorted(self.agents)}


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
