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
