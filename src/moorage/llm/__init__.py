"""moorage's LLM gateway: provider adapters (OpenAI-compatible, Anthropic, embedded llama.cpp),
per-tenant limits and budgets, retries, pricing and per-call accounting.

Host-only: credentials live here and never reach a sandbox.
"""

from moorage.llm.anthropic import AnthropicProvider
from moorage.llm.embedded import EmbeddedProvider
from moorage.llm.errors import (
    BadToolCall,
    BudgetExceeded,
    ModelNotFound,
    ProviderAuthFailed,
    ProviderError,
    ProviderUnavailable,
    RateLimited,
)
from moorage.llm.factory import gateway_from_config, provider_from_config
from moorage.llm.gateway import LLMGateway, Route
from moorage.llm.limits import Admission, Budget, RateLimit, TenantLimits
from moorage.llm.openai import OpenAICompatibleProvider
from moorage.llm.pricing import ModelPrice, PriceTable
from moorage.llm.provider import Capabilities, Provider, collect
from moorage.llm.retry import RetryPolicy
from moorage.llm.secret import Secret
from moorage.llm.types import (
    ChatChunk,
    ChatRequest,
    ChatResponse,
    Message,
    ResponseFormat,
    ToolCall,
    ToolSpec,
    Usage,
)
from moorage.llm.usage import InMemoryUsageSink, UsageRecord, UsageSink

__all__ = [
    "Admission", "AnthropicProvider", "BadToolCall", "Budget", "BudgetExceeded", "Capabilities", "ChatChunk",
    "ChatRequest", "ChatResponse", "EmbeddedProvider", "InMemoryUsageSink", "LLMGateway", "Message",
    "ModelNotFound", "ModelPrice", "OpenAICompatibleProvider", "PriceTable", "Provider", "ProviderAuthFailed",
    "ProviderError", "ProviderUnavailable", "RateLimit", "RateLimited", "ResponseFormat", "RetryPolicy", "Route",
    "Secret", "TenantLimits", "ToolCall", "ToolSpec", "Usage", "UsageRecord", "UsageSink", "collect",
    "gateway_from_config", "provider_from_config",
]
