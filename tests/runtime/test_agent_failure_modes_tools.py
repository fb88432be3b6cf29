"""A tool of the built-in loop (``tools = [...]``) that fails: its exception reaches the model, cut and always said,
and a tool that never returns is bounded by the agent's ``[agent.limits] turn_timeout_s``.

A tool whose exception text was huge had it journaled and sent to the model whole (10 MB: over the channel's frame,
the turn failed with "exceeds the frame limit"), and one whose ``str()`` itself raised failed the turn as the
agent's error instead of telling the model. The model now reads at most MAX_TOOL_ERROR characters of it, and
``<its str() raised ...>``. A sync tool that blocks (``time.sleep``) blocks the guest's loop: the turn times out,
the sandbox is stopped and the user's next turn runs.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moorage.config import Config
from moorage.runtime.host import Host
from moorage.runtime.turns import TurnTimedOut
from moorage.store import EntityKey
from tests.conftest import stop_all_sandboxes
from tests.llm.wire_servers import MODEL, Canned, WireServer, openai_app
from tests.runtime.test_builtin_loop import _reply

TOOLS = '''
import time


class Unprintable(Exception):
    def __str__(self):
        raise RuntimeError("no text")


def explode() -> str:
    """Fails with a huge message."""
    raise ValueError("x" * (10 << 20))


def unprintable() -> str:
    """Fails with an exception that cannot be printed."""
    raise Unprintable()


def stall() -> str:
    """Never returns."""
    time.sleep(3600)
    return "done"
'''


def _calls(*names: str) -> Canned:
    return _reply({"role": "assistant", "content": None, "tool_calls": [
        {"id": f"call_{i}", "type": "function", "function": {"name": n, "arguments": "{}"}}
        for i, n in enumerate(names)]})


async def test_a_failing_or_stuck_tool_is_told_to_the_model_or_bounded(tmp_path: Path) -> None:
    with WireServer(openai_app, "sk-test") as wire:
        cfg = Config(data_dir=tmp_path / "data", sandbox_driver="process", llm_provider="openai",
                     llm_base_url=f"{wire.url}/v1", llm_api_key="sk-test", llm_model=MODEL)
        agent = tmp_path / "tooler"
        agent.mkdir()
        (agent / "moorage.toml").write_text(
            '[agent]\nname = "tooler"\nsystem_prompt = "You use tools."\n'
            'tools = ["tools.py:explode", "tools.py:unprintable", "tools.py:stall"]\n'
            '[agent.lifecycle]\nusers = "auto"\n[agent.limits]\nturn_timeout_s = 3\n')
        (agent / "tools.py").write_text(TOOLS)
        host = Host.open(cfg)
        await host.start()
        try:
            _, key = host.store.operator.create_tenant("acme")
            principal = host.store.authenticate(key.secret)
            await host.runtime.deploy(principal, agent)
            wire.script.push(_calls("explode", "unprintable"), _reply({"role": "assistant", "content": "Both failed."}))
            r = await host.runtime.invoke(principal, EntityKey("tooler", "ada"), "try them")
            assert r.reply == "Both failed."
            told = [json.loads(m["content"]) for m in wire.script.requests[1]["body"]["messages"] if m["role"] == "tool"]
            assert told[0]["error"].startswith("ValueError: xxx") and len(told[0]["error"]) < 5000, len(told[0]["error"])
            assert told[1] == {"error": "Unprintable: <its str() raised RuntimeError>"}, told[1]

            wire.script.push(_calls("stall"))
            with pytest.raises(TurnTimedOut):
                await host.runtime.invoke(principal, EntityKey("tooler", "ada"), "wait for it")
            wire.script.push(_reply({"role": "assistant", "content": "Back."}))
            assert (await host.runtime.invoke(principal, EntityKey("tooler", "ada"), "again")).reply == "Back."
        finally:
            await stop_all_sandboxes(host.driver)
            await host.close()
