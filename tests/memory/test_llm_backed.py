"""Model-backed summarizer and fact extractor through the real gateway and a real OpenAI-wire server."""

from __future__ import annotations

import asyncio
import json
import uuid

from moorage.llm import OpenAICompatibleProvider
from moorage.llm.gateway import LLMGateway, Route
from moorage.memory import ContextBuilder, SemanticMemory
from moorage.memory.context import CompactionPolicy
from moorage.memory.llm_backed import GatewayFactExtractor, GatewaySummarizer
from moorage.store import Scope, TenantStore
from tests.llm.wire_servers import MODEL, Canned, WireServer, openai_app


def _reply(content: str) -> Canned:
    return Canned(body={"id": "chatcmpl-" + uuid.uuid4().hex[:12], "object": "chat.completion", "created": 0,
                        "model": MODEL, "choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                                                     "finish_reason": "stop"}],
                        "usage": {"prompt_tokens": 30, "completion_tokens": 10, "total_tokens": 40}})


def _gateway(url: str) -> LLMGateway:
    p = OpenAICompatibleProvider(f"{url}/v1", "sk-test", MODEL)
    return LLMGateway({p.name: p}, default_route=Route(p.name))


async def test_fact_extractor_uses_the_model_and_the_write_policy(tenant: TenantStore) -> None:
    with WireServer(openai_app, "sk-test") as wire:
        gw = _gateway(wire.url)
        loop = asyncio.get_running_loop()
        wire.script.push(_reply(json.dumps({"facts": [
            {"subject": "I", "attribute": "home town", "value": "Bergen"},
            {"subject": "user", "attribute": "mood", "value": "probably tired"},
        ]})))
        sem = SemanticMemory(tenant, GatewayFactExtractor(gw, tenant.tenant_id, loop))
        scope = Scope.for_user("bot", "ada")
        ev = tenant.events.append(scope, "message", "I grew up in Bergen, long day today.", speaker="user")
        changes = await asyncio.to_thread(sem.observe, scope, ev)
        by_attr = {c.fact.attribute: c.fact for c in changes}
        # Stated verbatim by the user: the user's word. Not in the text: only a model inference.
        assert by_attr["home_town"].value == "Bergen" and by_attr["home_town"].trust == "user_stated"
        assert by_attr["mood"].trust == "model_inferred"
        assert "Bergen" in [f.value for f in sem.recall(scope)]
        body = wire.script.requests[0]["body"]
        assert body["response_format"]["type"] == "json_schema"  # constrained output, not hope
        await gw.aclose()


async def test_summarizer_writes_the_frozen_segment(tenant: TenantStore) -> None:
    with WireServer(openai_app, "sk-test") as wire:
        gw = _gateway(wire.url)
        loop = asyncio.get_running_loop()
        for _ in range(20):
            wire.script.push(_reply("Ada planned a trip to Bergen on 12 May; budget 900 EUR."))
        policy = CompactionPolicy(budget_tokens=600, compact_at_tokens=450, keep_recent_tokens=120, summary_max_tokens=80,
                                  max_turn_tokens=200)
        builder = ContextBuilder("You are helpful.", (), policy=policy,
                                 summarizer=GatewaySummarizer(gw, tenant.tenant_id, loop))

        def talk() -> list[str]:
            outs = []
            for i in range(40):
                builder.add("user", f"turn {i}: let us plan the Bergen trip, item {i} of the list, with details")
                outs.append(json.dumps(builder.build().messages))
            return outs

        outs = await asyncio.to_thread(talk)
        assert builder.stats.compactions >= 1
        assert "Ada planned a trip to Bergen on 12 May" in outs[-1]
        assert all(len(json.loads(o)) >= 1 for o in outs)
        await gw.aclose()


async def test_fact_extractor_falls_back_to_patterns_when_the_model_fails(tenant: TenantStore) -> None:
    # With the provider down every turn failed (503 after the gateway's retries) and its message was lost.
    from moorage.errors import UnavailableError

    class Down:
        async def complete(self, tenant_id, request, *, entity=None):  # noqa: ANN001, ANN202
            raise UnavailableError("the model provider could not be reached")

    class NoJson:
        async def complete(self, tenant_id, request, *, entity=None):  # noqa: ANN001, ANN202
            class R:
                text = "Sure! Here are the facts: the user lives in Lisbon."
            return R()

    loop = asyncio.get_running_loop()
    for gw in (Down(), NoJson()):
        extractor = GatewayFactExtractor(gw, tenant.tenant_id, loop)  # type: ignore[arg-type]
        got = await asyncio.to_thread(extractor.extract, "I live in Lisbon.", speaker="user")
        assert [(c.attribute, c.value, c.inferred) for c in got] == [("lives_in", "Lisbon", False)]
