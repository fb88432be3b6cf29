"""Fixtures for the LLM tests: the real embedded model (loaded once) and real local wire servers."""

from __future__ import annotations

from typing import AsyncIterator, Iterator

import pytest

from moorage.llm import AnthropicProvider, EmbeddedProvider, OpenAICompatibleProvider, Provider
from moorage.llm._engine import get_engine

from .wire_servers import MODEL, WireServer, anthropic_app, openai_app

#: Looks like a real key so that redaction is exercised on something realistic.
API_KEY = "sk-test-4f9a0c2e7b1d4e8a9c3f5b6d7e8f9a0b"

PROVIDER_KINDS = ["embedded", "openai", "anthropic"]


@pytest.fixture(scope="session", autouse=True)
def _engine() -> None:
    get_engine()  # load the model once, before any timeout-sensitive test


@pytest.fixture(scope="session")
def openai_server() -> Iterator[WireServer]:
    with WireServer(openai_app, API_KEY) as s:
        yield s


@pytest.fixture(scope="session")
def anthropic_server() -> Iterator[WireServer]:
    with WireServer(anthropic_app, API_KEY) as s:
        yield s


@pytest.fixture(autouse=True)
def _fresh_scripts(request: pytest.FixtureRequest) -> None:
    for name in ("openai_server", "anthropic_server"):
        if name in request.fixturenames:
            request.getfixturevalue(name).script.reset()


def make_provider(kind: str, openai_url: str = "", anthropic_url: str = "", key: str = API_KEY) -> Provider:
    if kind == "embedded":
        return EmbeddedProvider()
    if kind == "openai":
        return OpenAICompatibleProvider(openai_url + "/v1", key, MODEL)
    if kind == "anthropic":
        return AnthropicProvider(key, MODEL, base_url=anthropic_url)
    raise ValueError(kind)


@pytest.fixture(params=PROVIDER_KINDS)
async def provider(request: pytest.FixtureRequest, openai_server: WireServer, anthropic_server: WireServer) -> AsyncIterator[Provider]:
    p = make_provider(request.param, openai_server.url, anthropic_server.url)
    yield p
    await p.aclose()
