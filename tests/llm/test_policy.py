"""The operator's per-tenant LLM policy, through the gateway against a real local wire server: a model outside a
tenant's allowlist is refused whatever the guest asks for, unpriced models are refused or priced by the
explicit rule, and the tenant's monthly token budget applies; loaded from the file ``llm_policy`` names."""

from __future__ import annotations

from pathlib import Path

import pytest

from moorage.config import Config
from moorage.errors import ConfigError
from moorage.llm import BudgetExceeded, ChatRequest, InMemoryUsageSink, Message
from moorage.llm.factory import gateway_from_config
from moorage.llm.policy import ModelNotAllowed, PolicyResolver, parse_policy
from moorage.llm.gateway import LLMGateway

from .conftest import make_provider
from .test_gateway import openai_ok
from .wire_servers import MODEL, WireServer

POLICY = {
    "llm": {
        "unknown_models": "refuse",
        "prices": {f"openai/{MODEL}": {"input_per_mtok": 2.0, "output_per_mtok": 8.0}},
        "default": {"models": [MODEL]},
        "tenants": {
            "acme": {"models": [MODEL, "cheap-*"], "tokens_per_month": 30},
            "open": {},
        },
    }
}
NAMES = {"t-acme": "acme", "t-globex": "globex", "t-open": "open"}


def gateway(openai_server: WireServer, doc: dict = POLICY) -> tuple[LLMGateway, InMemoryUsageSink]:
    policy = parse_policy(doc)
    sink = InMemoryUsageSink()
    gw = LLMGateway([make_provider("openai", openai_url=openai_server.url)], usage_sink=sink,
                    policy=PolicyResolver(policy, NAMES.get), prices=policy.price_table(),
                    refuse_unpriced=policy.unknown_models == "refuse")
    return gw, sink


def ask(model: str = "") -> ChatRequest:
    return ChatRequest([Message.user("hi")], model=model, max_tokens=5)


async def test_models_outside_the_allowlist_are_refused(openai_server: WireServer) -> None:
    gw, sink = gateway(openai_server)
    try:
        openai_server.script.push(openai_ok("fine"))
        assert (await gw.complete("t-globex", ask(MODEL))).text == "fine"
        with pytest.raises(ModelNotAllowed) as e:
            await gw.complete("t-globex", ask("gpt-expensive"))  # what a guest might ask for
        assert e.value.http_status == 403 and "not allowed" in e.value.message
        assert len(openai_server.script.requests) == 1  # the refused call never left the host
        # A glob in acme's list admits the model, but it has no price: refused, not free by accident.
        with pytest.raises(ModelNotAllowed, match="no price") as e:
            await gw.complete("t-acme", ask("cheap-1"))
        # The advice is one the policy file accepts: "price" alone is refused at start without unknown_price.
        assert "[llm.prices]" in e.value.hint and "unknown_price" in e.value.hint
        assert [r.cost_usd for r in sink.records] == [pytest.approx((20 * 2.0 + 5 * 8.0) / 1e6)]
    finally:
        await gw.aclose()


async def test_an_explicit_price_rule_for_unlisted_models(openai_server: WireServer) -> None:
    doc = {"llm": {**POLICY["llm"], "unknown_models": "price", "prices": {},
                   "unknown_price": {"input_per_mtok": 10.0, "output_per_mtok": 30.0}}}
    gw, sink = gateway(openai_server, doc)
    try:
        openai_server.script.push(openai_ok("priced"))
        assert (await gw.complete("t-open", ask("anything-else"))).text == "priced"  # "open" allows any model
        assert sink.records[-1].cost_usd == pytest.approx((20 * 10.0 + 5 * 30.0) / 1e6)
    finally:
        await gw.aclose()


async def test_the_tenants_monthly_token_budget(openai_server: WireServer) -> None:
    gw, _ = gateway(openai_server)
    try:
        openai_server.script.push(openai_ok("one"))
        await gw.complete("t-acme", ask(MODEL))  # 25 tokens of acme's 30
        with pytest.raises(BudgetExceeded):
            await gw.complete("t-acme", ask(MODEL))
        openai_server.script.push(openai_ok("other tenant"))
        assert (await gw.complete("t-globex", ask(MODEL))).text == "other tenant"  # globex has no budget
    finally:
        await gw.aclose()


def test_policy_files_are_validated_and_loaded_from_config(tmp_path: Path, openai_server: WireServer) -> None:
    for bad in ({"llm": {"unknown_models": "maybe"}}, {"llm": {"unknown_models": "price"}},
                {"llm": {"tenants": {"acme": {"models": "gpt"}}}}, {"llm": {"default": {"tokens_per_month": -1}}},
                {"llm": {"default": {"colour": "red"}}}):
        with pytest.raises(ConfigError):
            parse_policy(bad)
    path = tmp_path / "llm-policy.toml"
    path.write_text(f'[llm]\nunknown_models = "refuse"\n[llm.prices."openai/{MODEL}"]\ninput_per_mtok = 1\n'
                    f'output_per_mtok = 2\n[llm.default]\nmodels = ["{MODEL}"]\n')
    cfg = Config(data_dir=tmp_path / "d", llm_provider="openai", llm_base_url=openai_server.url + "/v1",
                 llm_api_key="sk-test-4f9a0c2e7b1d4e8a9c3f5b6d7e8f9a0b", llm_model=MODEL, llm_policy=str(path))
    gw = gateway_from_config(cfg, tenant_name=NAMES.get)
    assert gw.refuse_unpriced and gw.policy is not None and gw.policy("t-globex").models == (MODEL,)
    assert gateway_from_config(Config(data_dir=tmp_path / "d")).policy is None  # no file: no policy
