"""The no-code agent: a system prompt, typed tools and a model in moorage.toml, run by the built-in loop.

The model is a real OpenAI-wire server on 127.0.0.1 scripted to ask for a tool and then answer, so the loop,
the tool's JSON schema (derived from its signature) and the tool running inside the sandbox are all checked.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

from moorage.config import Config
from moorage.runtime.host import Host
from moorage.store import EntityKey
from tests.conftest import stop_all_sandboxes
from tests.runtime.conftest import write_agent
from tests.llm.wire_servers import MODEL, Canned, WireServer, openai_app

TOOLS = '''
import os
from typing import Literal


def get_weather(city: str, unit: Literal["C", "F"] = "C") -> dict:
    """Current weather for a city."""
    # Runs inside the sandbox: its working directory is the agent's own disk.
    with open("weather-calls.txt", "a") as f:
        f.write(city + "\\n")
    return {"city": city, "temperature": 18, "unit": unit, "cwd": os.getcwd()}
'''

WORKFLOW = '''
async def on_message(ctx, message):
    if message.startswith("no, "):
        await ctx.correct(message[4:])
    await ctx.step("plan", lambda: "planned")
    log = await ctx.history()
    return json.dumps(log)

import json
'''


def _reply(message: dict) -> Canned:
    return Canned(body={"id": "chatcmpl-" + uuid.uuid4().hex[:12], "object": "chat.completion", "created": 0, "model": MODEL,
                        "choices": [{"index": 0, "message": message, "finish_reason": "tool_calls" if message.get("tool_calls") else "stop"}],
                        "usage": {"prompt_tokens": 20, "completion_tokens": 5, "total_tokens": 25}})


async def test_builtin_loop_calls_a_typed_tool_in_the_sandbox(tmp_path: Path) -> None:
    with WireServer(openai_app, "sk-test") as wire:
        cfg = Config(data_dir=tmp_path / "data", sandbox_driver="process", llm_provider="openai",
                     llm_base_url=f"{wire.url}/v1", llm_api_key="sk-test", llm_model=MODEL)
        agent = tmp_path / "weather"
        agent.mkdir()
        (agent / "moorage.toml").write_text(
            '[agent]\nname = "weather"\nsystem_prompt = "You report the weather."\ntools = ["tools.py:get_weather"]\n'
            '[agent.lifecycle]\nusers = "auto"\n')
        (agent / "tools.py").write_text(TOOLS)
        host = Host.open(cfg)
        await host.start()
        try:
            _, key = host.store.operator.create_tenant("acme")
            principal = host.store.authenticate(key.secret)
            await host.runtime.deploy(principal, agent)
            wire.script.push(
                _reply({"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps({"city": "Oslo"})}}]}),
                _reply({"role": "assistant", "content": "It is 18 degrees in Oslo."}),
            )
            r = await host.runtime.invoke(principal, EntityKey("weather", "ada"), "How warm is it in Oslo?")
            assert r.reply == "It is 18 degrees in Oslo."
            first, second = (q["body"] for q in wire.script.requests)
            # The schema came from the signature: a required string, an enum with a default.
            (tool,) = first["tools"]
            params = tool["function"]["parameters"]
            assert tool["function"]["name"] == "get_weather" and tool["function"]["description"] == "Current weather for a city."
            assert params["properties"]["city"] == {"type": "string"} and params["required"] == ["city"]
            assert params["properties"]["unit"]["enum"] == ["C", "F"]
            assert first["messages"][0]["role"] == "system" and "You report the weather." in first["messages"][0]["content"]
            # The tool ran in the sandbox and its result went back to the model.
            tool_msg = next(m for m in second["messages"] if m["role"] == "tool")
            result = json.loads(tool_msg["content"])
            assert result["temperature"] == 18 and result["cwd"] == "/work"
            ts = host.store.tenant(principal)
            (rec,) = ts.sandboxes.list(agent_id="weather")
            sb = await host.driver.open(rec.id)
            assert (await sb.read_file("/work/weather-calls.txt")) == b"Oslo\n"
            # The tool call is a span of the turn's trace, with the entity's attributes.
            (span,) = [s for s in ts.spans.trace(r.trace_id) if s.name == "tool"]
            assert span.attrs["tool"] == "get_weather" and span.attrs["user"] == "ada"
        finally:
            await stop_all_sandboxes(host.driver)
            await host.close()


async def test_agent_reads_its_step_log_and_the_users_corrections(env, tmp_path: Path) -> None:
    agent = write_agent(tmp_path / "wf", "wf", WORKFLOW)
    await env.runtime.deploy(env.principal, agent)
    r = await env.runtime.invoke(env.principal, EntityKey("wf", "ada"), "no, use the other supplier")
    log = json.loads(r.reply)
    assert [e["kind"] for e in log] == ["correction", "step"]
    assert log[1]["step"] == "plan" and log[1]["status"] == "succeeded"
