"""The README's "through the official `openai` client", when something fails: the client says what the server
said. It said only "Error code: 404" (or "An error occurred during streaming"): the OpenAI-compatible routes answered
problem+json without the `error` object (or the `message`) the official clients read. Now their problems carry
OpenAI's error object beside their own members, and a stream's in-band error its message and code."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import openai
import pytest

from moorage import Client
from moorage.client import ApiError
from moorage.devservices.fleet import LocalHost

AGENT_PY = '''async def on_message(ctx, message):
    if message == "fail late":
        await ctx.emit("token", "looking... ")  # the stream has begun: its failure is said in-band
    if message.startswith("fail"):
        raise ValueError("the order book is closed")
    return "ok: " + message
'''


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalHost]:
    base = tmp_path_factory.mktemp("openai-errors")
    server = LocalHost("up", base / "data", {"MOORAGE_LOG_LEVEL": "warning"}, start_timeout_s=120)
    agent = base / "shop"
    agent.mkdir()
    (agent / "moorage.toml").write_text('[agent]\nname = "shop"\nentry = "agent.py"\n[agent.lifecycle]\nusers = "auto"\n')
    (agent / "agent.py").write_text(AGENT_PY)
    try:
        with Client(server.url, server.key) as sdk:
            sdk.deploy("shop", agent)
        yield server
    finally:
        server.stop()


def test_the_openai_client_says_what_failed(host: LocalHost) -> None:
    client = openai.OpenAI(base_url=f"{host.url}/v1", api_key=host.key, max_retries=0)
    said = [{"role": "user", "content": "hi"}]
    assert client.chat.completions.create(model="shop", user="ada", messages=said).choices[0].message.content == "ok: hi"
    with pytest.raises(openai.NotFoundError) as gone:
        client.chat.completions.create(model="nope", user="ada", messages=said)
    assert "no agent 'nope'" in gone.value.message and gone.value.code == "not-found", gone.value.message
    assert gone.value.response.headers["content-type"] == "application/problem+json"
    assert gone.value.response.json()["detail"] == "no agent 'nope'"  # still problem+json, as every route's
    with pytest.raises(openai.AuthenticationError) as refused:
        openai.OpenAI(base_url=f"{host.url}/v1", api_key="mrg_wrong", max_retries=0).models.list()
    assert refused.value.message != "Error code: 401" and refused.value.code, refused.value.message
    with pytest.raises(openai.InternalServerError) as raised:
        client.chat.completions.create(model="shop", user="ada", messages=[{"role": "user", "content": "fail"}])
    assert "the order book is closed" in raised.value.message and raised.value.code == "agent-error", raised.value.message


def test_a_streamed_turns_failure_says_what_failed(host: LocalHost) -> None:
    client = openai.OpenAI(base_url=f"{host.url}/v1", api_key=host.key, max_retries=0)
    stream = client.chat.completions.create(model="shop", user="bob", stream=True,
                                            messages=[{"role": "user", "content": "fail late"}])
    seen = []
    with pytest.raises(openai.APIError) as failed:
        for chunk in stream:
            seen += [c.delta.content for c in chunk.choices if c.delta.content]
    assert seen == ["looking... "]
    assert "the order book is closed" in failed.value.message, failed.value.message
    assert failed.value.code == "agent-error"


def test_the_model_list_names_the_agents_a_completion_can_run(host: LocalHost, tmp_path: Path) -> None:
    too_big = tmp_path / "huge"
    too_big.mkdir()
    (too_big / "moorage.toml").write_text('[agent]\nname = "huge"\nentry = "agent.py"\nvcpus = 200\n')
    (too_big / "agent.py").write_text(AGENT_PY)
    with Client(host.url, host.key) as sdk, pytest.raises(ApiError, match="vcpus = 200"):
        sdk.deploy("huge", too_big)  # refused at deploy: the agent has a failed deployment, none live
    client = openai.OpenAI(base_url=f"{host.url}/v1", api_key=host.key, max_retries=0)
    assert [m.id for m in client.models.list()] == ["shop"]
