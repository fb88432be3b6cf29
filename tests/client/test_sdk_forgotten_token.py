"""An end-user token issued before its user was forgotten is refused (401); the ``AuthError`` the SDK raises says what
the product's backend does about it: create the user again (naming the route) and issue a new token, which works."""

from __future__ import annotations

from pathlib import Path

import pytest

from moorage import AsyncClient
from moorage.client import AuthError
from tests.api.conftest import agent_archive


async def test_the_refusal_of_a_token_from_before_a_forget_says_how_to_serve_the_user_again(live_rt, acme: str,
                                                                                           tmp_path: Path) -> None:
    async with AsyncClient(live_rt.url, acme) as backend:
        await backend.deploy("echo", agent_archive(tmp_path))
        await backend.put_user("echo", "cy@example.com")
        old = (await backend.issue_user_token("echo", "cy@example.com"))["token"]
        await backend.delete_user("echo", "cy@example.com")
        async with AsyncClient(live_rt.url, old) as browser:
            with pytest.raises(AuthError) as refused:
                await browser.invoke("echo", "hi")
        hint = refused.value.hint or ""
        assert refused.value.status == 401 and "since been forgotten" in refused.value.detail
        assert "PUT /v1/agents/echo/users/cy@example.com" in hint and "issue a new token" in hint, hint

        # Doing what it says serves the user again.
        await backend.put_user("echo", "cy@example.com")
        new = (await backend.issue_user_token("echo", "cy@example.com"))["token"]
        async with AsyncClient(live_rt.url, new) as browser:
            assert (await browser.invoke("echo", "back"))["reply"] == "echo: back"
