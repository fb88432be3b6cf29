"""Builds providers and the gateway from ``moorage.config.Config`` (the only place config meets ``llm/``).

``llm_provider`` picks the adapter; ``llm_base_url``, ``llm_api_key`` and ``llm_model`` configure it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from moorage.config import Config
from moorage.errors import ConfigError
from moorage.llm.anthropic import AnthropicProvider
from moorage.llm.embedded import EmbeddedProvider
from moorage.llm.gateway import LLMGateway, Route
from moorage.llm.openai import OpenAICompatibleProvider
from moorage.llm.provider import Provider
from moorage.llm.usage import UsageSink

PROVIDERS = ("embedded", "openai", "anthropic")


def provider_from_config(cfg: Config) -> Provider:
    kind = cfg.llm_provider
    if kind == "embedded":
        return EmbeddedProvider(threads=cfg.llm_threads)
    if kind == "openai":
        if not cfg.llm_base_url and not cfg.llm_api_key:
            raise ConfigError(
                "llm_provider 'openai' needs llm_base_url (a compatible server) or llm_api_key (api.openai.com)",
                hint="set MOORAGE_LLM_BASE_URL=http://127.0.0.1:8000/v1 for vLLM/llama.cpp/Ollama, or MOORAGE_LLM_API_KEY",
            )
        if not cfg.llm_model:
            raise ConfigError("llm_provider 'openai' needs llm_model", hint="set MOORAGE_LLM_MODEL, e.g. gpt-4o-mini")
        return OpenAICompatibleProvider(cfg.llm_base_url or "https://api.openai.com/v1", cfg.llm_api_key, cfg.llm_model)
    if kind == "anthropic":
        if not cfg.llm_api_key:
            raise ConfigError("llm_provider 'anthropic' needs llm_api_key", hint="set MOORAGE_LLM_API_KEY")
        return AnthropicProvider(
            cfg.llm_api_key, cfg.llm_model or "claude-sonnet-4-5", base_url=cfg.llm_base_url or "https://api.anthropic.com"
        )
    raise ConfigError(f"unknown llm_provider {kind!r}", hint=f"use one of: {', '.join(PROVIDERS)}")


def gateway_from_config(cfg: Config, *, usage_sink: UsageSink | None = None,
                        tenant_name: Callable[[str], str | None] | None = None) -> LLMGateway:
    """The gateway ``cfg`` describes; with ``llm_policy`` set, the operator's per-tenant policy applies (tenants
    are named through ``tenant_name``, tenant id -> name)."""
    provider = provider_from_config(cfg)
    if not cfg.llm_policy:
        return LLMGateway({provider.name: provider}, default_route=Route(provider.name), usage_sink=usage_sink)
    from moorage.llm.policy import PolicyResolver, load_policy

    policy = load_policy(Path(cfg.llm_policy))
    return LLMGateway({provider.name: provider}, default_route=Route(provider.name), usage_sink=usage_sink,
                      policy=PolicyResolver(policy, tenant_name or (lambda _tid: None)),
                      prices=policy.price_table(), refuse_unpriced=policy.unknown_models == "refuse")
