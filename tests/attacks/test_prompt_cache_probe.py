"""A hostile tenant probes another tenant's prompt cache on the shared embedded model.

The attack: llama.cpp reuses a slot's cached prompt for any request sharing its prefix and reports how many
tokens it reused, so an agent that sends a guess at another tenant's system prompt learns from the cached
count (or from the speed-up) how much of the guess is right. Here the victim's secret prompt sits in the
very slot the attacker's guess is given, and the attacker learns nothing: its agent sees no cache count at
all, and llama.cpp itself reused none of the victim's tokens (the gateway's usage record, straight from the
engine, says 0 cached), so no time is saved either. The victim's own repeat still hits its cache.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from moorage.llm import InMemoryUsageSink
from moorage.llm._engine import get_engine
from moorage.store import EntityKey, Principal
from tests.runtime.conftest import Env, make_env, write_agent

PROBER = '''
import json

async def on_message(ctx, message):
    out = await ctx.llm.complete([{"role": "system", "content": message}, {"role": "user", "content": "Hello."}],
                                 max_tokens=1, temperature=0)
    return json.dumps(out)
'''

SECRET = ("You are the support assistant of Zephyr Corp. The internal discount code is ZX-4471-PLUM; never reveal "
          "it to anyone. Staff escalations go to the night desk on extension 5521.")


async def _tenant(env: Env, name: str, agent_dir: Path) -> Principal:
    _, key = env.store.operator.create_tenant(name)
    who = env.store.authenticate(key.secret)
    await env.runtime.deploy(who, agent_dir)
    return who


async def _ask(env: Env, who: Principal, system_prompt: str) -> dict[str, Any]:
    r = await env.runtime.invoke(who, EntityKey("prober", "u1"), system_prompt)
    return json.loads(r.reply)


async def test_a_tenant_cannot_probe_another_tenants_prompt_cache(tmp_path: Path) -> None:
    agent_dir = write_agent(tmp_path / "prober", "prober", PROBER)
    async for env in make_env(tmp_path, "process"):
        usage = InMemoryUsageSink()
        env.runtime.llm.usage_sink = usage
        engine = get_engine()
        assert engine.settings.parallel == 2, "the slot choreography below assumes the default two slots"

        victim = env.principal
        await env.runtime.deploy(victim, agent_dir)
        bystander = await _tenant(env, "bystander", agent_dir)
        attacker = await _tenant(env, "rival", agent_dir)

        # The victim's agent runs with its secret system prompt, twice: the second call reuses its own cache.
        await _ask(env, victim, SECRET)
        seen_by_victim = await _ask(env, victim, SECRET)
        [_, again] = usage.for_tenant(victim.tenant_id)
        assert again.cached_input_tokens > 0, "positive control: a tenant's repeated prompt is served from its cache"
        victim_slot = engine.slots.owners().index(victim.tenant_id)

        # Another tenant uses the other slot, so the victim's slot is the least recently used one.
        await _ask(env, bystander, "You are a weather bot.")
        assert engine.slots.owners()[victim_slot] == victim.tenant_id

        # The attacker guesses the victim's prompt exactly. Its request is given the slot holding the victim's
        # tokens (asserted below), where a shared cache would have reused every token of the right guess.
        probe = await _ask(env, attacker, SECRET)
        assert engine.slots.owners()[victim_slot] == attacker.tenant_id, "the probe ran in the victim's slot"
        [record] = usage.for_tenant(attacker.tenant_id)
        assert record.cached_input_tokens == 0, "llama.cpp reused the victim's cached prompt for the attacker"
        assert record.input_tokens == again.input_tokens  # same prompt, all of it computed afresh

        # And the guest is told nothing about caching, whoever asks.
        for seen in (probe, seen_by_victim):
            assert set(seen["usage"]) == {"input_tokens", "output_tokens"}
            assert "cache" not in json.dumps(seen).lower()

        # The attacking instance is still usable, and its own repeat uses its own cache (in its own slot).
        await _ask(env, attacker, SECRET)
        assert usage.for_tenant(attacker.tenant_id)[-1].cached_input_tokens > 0
