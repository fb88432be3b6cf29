"""An end-user token dies with the user it was issued to: once the user is forgotten it is refused (401), also after a
new user of the same id is created (a product that reuses ids, e-mail addresses say, would otherwise let the old
browser act for the new person), and it does not bring a forgotten user of a `users = "auto"` agent back."""

from __future__ import annotations

from pathlib import Path

import pytest

from moorage import AsyncClient
from moorage.client import AuthError, NotFound
from tests.api.conftest import agent_archive


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
