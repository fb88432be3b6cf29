"""An end-user token dies with the user it was issued to: once the user is forgotten it is refused (401), also after a
new user of the same id is created (a product that reuses ids, e-mail addresses say, would otherwise let the old
browser act for the new person), and it does not bring a forgotten user of a `users = "auto"` agent back."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from moorage import AsyncClient
from moorage.client import AuthError, NotFound
from tests.api.conftest import aclient, agent_archive


async def test_a_token_is_refused_once_its_user_is_forgotten_and_not_revived_by_the_same_id(live_rt, acme: str,
                                                                                           tmp_path: Path) -> None:
    async with AsyncClient(live_rt.url, acme) as sdk:
        await sdk.deploy("echo", agent_archive(tmp_path))  # users = "auto": a turn registers its user
        await sdk.put_user("echo", "ada@example.com")
        old = (await sdk.issue_user_token("echo", "ada@example.com"))["token"]
        async with AsyncClient(live_rt.url, old) as browser:
            assert (await browser.invoke("echo", "hi"))["reply"] == "echo: hi"
            assert (await sdk.delete_user("echo", "ada@example.com"))["deleted"] is True
            with pytest.raises(AuthError) as refused:
                await browser.invoke("echo", "still me?")
            assert refused.value.status == 401 and "since been forgotten" in refused.value.detail
            assert "fresh token" in (refused.value.hint or "")
            with pytest.raises(NotFound):  # the stale token's turn did not register the user again
                await sdk.get_user("echo", "ada@example.com")

            await sdk.put_user("echo", "ada@example.com")  # another person signs up with the same address
            with pytest.raises(AuthError):
                await browser.invoke("echo", "read their things")
            with pytest.raises(AuthError):
                await browser.list_events("echo", "ada@example.com")
        new = (await sdk.issue_user_token("echo", "ada@example.com"))["token"]
        async with AsyncClient(live_rt.url, new) as browser:
            assert (await browser.invoke("echo", "hello"))["reply"] == "echo: hello"
            assert (await browser.whoami())["user"] == "ada@example.com"


async def test_a_token_issued_before_its_user_existed_dies_with_the_user_it_made(live_rt, acme: str,
                                                                                tmp_path: Path) -> None:
    """On a `users = "auto"` agent a product issues the token first and the user comes with it: the token is tied
    to that user, so after a forget the old browser is refused and does not bring the forgotten person back."""
    async with AsyncClient(live_rt.url, acme) as sdk:
        await sdk.deploy("echo", agent_archive(tmp_path))
        old = (await sdk.issue_user_token("echo", "bea@example.com"))["token"]  # bea never talked to it yet
        async with AsyncClient(live_rt.url, old) as browser:
            assert (await browser.invoke("echo", "hi"))["reply"] == "echo: hi"  # the first turn works as before
            assert (await sdk.get_user("echo", "bea@example.com"))["id"] == "bea@example.com"
            assert (await sdk.delete_user("echo", "bea@example.com"))["deleted"] is True
            with pytest.raises(AuthError) as refused:
                await browser.invoke("echo", "still me?")
            assert refused.value.status == 401 and "since been forgotten" in refused.value.detail
            with pytest.raises(NotFound):  # the stale token's turn did not register the user again
                await sdk.get_user("echo", "bea@example.com")
        # The product issues a new token as the user returns: it works, and so does re-issuing.
        new = (await sdk.issue_user_token("echo", "bea@example.com"))["token"]
        again = (await sdk.issue_user_token("echo", "bea@example.com"))["token"]
        for token in (new, again):
            async with AsyncClient(live_rt.url, token) as browser:
                assert (await browser.invoke("echo", "back"))["reply"] == "echo: back"


LONG_AGENT = '''
import asyncio

async def on_message(ctx, message):
    if message == "long":
        await asyncio.sleep(60)
    return "echo: " + message
'''


async def test_a_forget_ends_a_streamed_turn_of_the_user_already_running(live_rt, runtime, acme: str,
                                                                         tmp_path: Path) -> None:
    """A turn streaming to the user's browser when the user is forgotten does not run on to stream their data: the
    stream ends with an error event (run-cancelled) at once, and the token is refused after."""
    async with aclient(live_rt, acme) as c:
        r = await c.post("/v1/agents/echo/deployments", content=agent_archive(tmp_path, body=LONG_AGENT),
                         headers={"content-type": "application/gzip"})
        assert r.status_code == 201, r.text
        token = (await c.post("/v1/agents/echo/users/cleo/tokens", json={"ttl_s": 600})).json()["token"]
        async with aclient(live_rt, token) as browser:
            async with browser.stream("POST", "/v1/agents/echo/invoke?stream=true", json={"message": "long"}) as s:
                assert s.status_code == 200
                loop = asyncio.get_running_loop()
                deadline = loop.time() + 30
                while not any(b.entity.user == "cleo" for b in list(runtime.turns.values())):
                    assert loop.time() < deadline, "the turn never started"
                    await asyncio.sleep(0.02)
                started = loop.time()
                forget = asyncio.create_task(c.delete("/v1/agents/echo/users/cleo"))
                body = b"".join([chunk async for chunk in s.aiter_bytes()])
                assert loop.time() - started < 20  # not the 60 s the turn would have run
            assert b"event: error" in body and b"run-cancelled" in body and b"event: done" not in body, body
            assert (await forget).json()["deleted"] is True
            r = await browser.post("/v1/agents/echo/invoke", json={"message": "hi"})
            assert r.status_code == 401 and "since been forgotten" in r.text
