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

from .agent_context import AgentContext, Files, HostError, LLM, Memory, StepFailed, Suspended, _Host
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


def register(registry: Registry) -> None:
    rt = AgentRuntime(os.environ.get("MOORAGE_WORKDIR", "/work"))
    registry.add("agent.load", rt.load)
    registry.add("agent.turn", rt.turn)
    registry.add("agent.info", rt.info)


__all__ = [
    "AGENT_ERROR", "NOT_LOADED", "SUSPENDED", "MAX_CORRECTIONS_SHOWN", "MAX_TOOL_RESULT", "MAX_TOOL_ROUNDS",
    "AgentContext", "AgentRuntime", "Files", "HostError", "LLM", "LoadedAgent", "Memory", "StepFailed", "Suspended",
    "_Host", "builtin_loop", "forget_other_versions", "load_agent", "register", "tool_schema",
]
