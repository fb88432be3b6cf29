"""The OpenAI-compatible endpoint, driven by the official ``openai`` client against a running server."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from moorage.api.routes.openai_compat import last_user_message
from moorage.errors import InvalidInput
from tests.api.conftest import aclient, agent_archive


async def _deploy(live, secret: str, tmp_path: Path) -> None:
    async with aclient(live, secret) as c:
        r = await c.post("/v1/agents/echo/deployments", content=agent_archive(tmp_path),
                         headers={"content-type": "application/gzip"})
        assert r.status_code == 201, r.text


async def test_official_client_chat_and_stream(live_rt, acme, tmp_path: Path):
    await _deploy(live_rt, acme, tmp_path)
    async with openai.AsyncOpenAI(base_url=f"{live_rt.url}/v1", api_key=acme, max_retries=0) as client:
        models = await client.models.list()
        assert [m.id for m in models.data] == ["echo"]

        # Only the last user message is the new turn; the history the client resends is not replayed.
        out = await client.chat.completions.create(
            model="echo", user="alice",
            messages=[{"role": "system", "content": "be nice"}, {"role": "user", "content": "old"},
                      {"role": "assistant", "content": "echo: old"}, {"role": "user", "content": "new"}],
        )
        assert out.choices[0].message.content == "echo: new" and out.choices[0].finish_reason == "stop"
        async with aclient(live_rt, acme) as c:
            events = (await c.get("/v1/agents/echo/users/alice/events", params={"session": "default"})).json()["data"]
        assert [e["content"] for e in events] == ["new", "echo: new"]

        stream = await client.chat.completions.create(model="echo", user="alice", stream=True,
                                                      messages=[{"role": "user", "content": "stream x y"}])
        parts = [ch.choices[0].delta.content or "" async for ch in stream if ch.choices]
        assert "".join(parts) == "x y "

        whole = await client.chat.completions.create(model="echo", user="bob", stream=True,
                                                     messages=[{"role": "user", "content": "hi"}])
        assert "".join([ch.choices[0].delta.content or "" async for ch in whole if ch.choices]) == "echo: hi"

        # The user may also come from the X-Moorage-User header (tenant keys only).
        hdr = await client.chat.completions.create(model="echo", messages=[{"role": "user", "content": "whoami"}],
                                                   extra_headers={"X-Moorage-User": "carol"})
        assert hdr.choices[0].message.content == "user=carol"

        with pytest.raises(openai.UnprocessableEntityError):
            await client.chat.completions.create(model="echo", messages=[{"role": "user", "content": "no user"}])
        with pytest.raises(openai.NotFoundError):
            await client.chat.completions.create(model="ghost", user="a", messages=[{"role": "user", "content": "x"}])


async def test_a_turns_model_tokens_reach_the_caller_and_the_metrics(live_rt, acme, tmp_path: Path):
    await _deploy(live_rt, acme, tmp_path)
    async with aclient(live_rt, acme) as c:
        first = await c.post("/v1/agents/echo/invoke", json={"message": "ask the model", "user": "ann"},
                             headers={"Idempotency-Key": "usage-1"})
        usage = first.json()["usage"]
        assert usage["input_tokens"] > 0 and 0 < usage["output_tokens"] <= 3, first.text
        assert "idempotent-replayed" not in first.headers
        again = await c.post("/v1/agents/echo/invoke", json={"message": "ask the model", "user": "ann"},
                             headers={"Idempotency-Key": "usage-1"})
        # The turn asked again is told what it used, marked as a replay, and not run (or counted) again.
        assert again.json()["usage"] == usage and again.headers["idempotent-replayed"] == "true"
        plain = (await c.post("/v1/agents/echo/invoke", json={"message": "no model", "user": "ann"})).json()
        assert plain["usage"] == {"input_tokens": 0, "output_tokens": 0}
    async with openai.AsyncOpenAI(base_url=f"{live_rt.url}/v1", api_key=acme, max_retries=0) as client:
        out = await client.chat.completions.create(model="echo", user="ann",
                                                   messages=[{"role": "user", "content": "ask the model"}])
        assert out.usage is not None and out.usage.prompt_tokens > 0 and out.usage.completion_tokens > 0
        assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    metrics_token = (live_rt.data_dir / "api" / "metrics-token").read_text().strip()
    async with aclient(live_rt, metrics_token) as c:
        text = (await c.get("/metrics")).text
    counted = {line.split("{")[1].split("}")[0]: float(line.rsplit(" ", 1)[1])
               for line in text.splitlines() if line.startswith("moorage_tokens_total{")}
    assert counted['kind="input_tokens"'] == usage["input_tokens"] + out.usage.prompt_tokens, counted
    assert counted['kind="output_tokens"'] == usage["output_tokens"] + out.usage.completion_tokens, counted


async def test_a_turn_ended_by_the_tenants_model_rate_is_a_429_and_runs_again_later(live_rt, runtime, acme, store,
                                                                                  tmp_path: Path):
    from moorage.llm.limits import RateLimit, TenantLimits

    await _deploy(live_rt, acme, tmp_path)
    tenant_id = store.authenticate(acme).tenant_id
    runtime.llm.admission.set_limits(tenant_id, TenantLimits(requests=RateLimit(per_minute=1)))
    async with aclient(live_rt, acme) as c:
        ok = await c.post("/v1/agents/echo/invoke", json={"message": "ask the model", "user": "ann"})
        assert ok.status_code == 200, ok.text
        limited = await c.post("/v1/agents/echo/invoke", json={"message": "ask the model", "user": "ann"},
                               headers={"Idempotency-Key": "limited-1"})
        # The limit on the agent's own model call, not "the agent failed" (502): when to come back, and why.
        assert limited.status_code == 429 and limited.json()["type"].endswith("/rate-limited"), limited.text
        assert int(limited.headers["retry-after"]) >= 1 and "x-should-retry" not in limited.headers
        runtime.llm.admission.set_limits(tenant_id, TenantLimits())  # the minute has passed
        again = await c.post("/v1/agents/echo/invoke", json={"message": "ask the model", "user": "ann"},
                             headers={"Idempotency-Key": "limited-1"})
        assert again.status_code == 200 and again.json()["usage"]["output_tokens"] > 0, again.text  # ran this time


async def test_official_client_with_an_end_user_token(live_rt, acme, tmp_path: Path):
    await _deploy(live_rt, acme, tmp_path)
    async with aclient(live_rt, acme) as c:
        tok = (await c.post("/v1/agents/echo/users/dana/tokens", json={})).json()["token"]
    async with openai.AsyncOpenAI(base_url=f"{live_rt.url}/v1", api_key=tok, max_retries=0) as client:
        out = await client.chat.completions.create(model="echo", user="mallory",
                                                   messages=[{"role": "user", "content": "whoami"}],
                                                   extra_headers={"X-Moorage-User": "mallory"})
        assert out.choices[0].message.content == "user=dana"
        assert [m.id for m in (await client.models.list()).data] == ["echo"]
        with pytest.raises(openai.PermissionDeniedError):
            await client.chat.completions.create(model="other", messages=[{"role": "user", "content": "x"}])
        async with openai.AsyncOpenAI(base_url=f"{live_rt.url}/v1", api_key="mrg_nope", max_retries=0) as bad:
            with pytest.raises(openai.AuthenticationError):
                await bad.chat.completions.create(model="echo", user="a", messages=[{"role": "user", "content": "x"}])


def test_last_user_message_translation():
    assert last_user_message([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]) == "a"
    parts = [{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": "x"}},
             {"type": "text", "text": "here"}]
    assert last_user_message([{"role": "user", "content": parts}]) == "look\nhere"
    for bad in ([], "hi", [{"role": "system", "content": "x"}], [{"role": "user", "content": "  "}]):
        with pytest.raises(InvalidInput):
            last_user_message(bad)
