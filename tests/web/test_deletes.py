"""Forgetting a user and deleting an agent from the dashboard (headless Chromium): each asks for the name typed back
(anything else does nothing), the delete shows how far it got as it goes, the page then moves to where the thing
was listed and says what was done; a key whose scopes do not allow it gets no button; a key limited to the agent it
deletes is revoked with it, and the page asks for another."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from tests.api.conftest import aclient
from tests.web.test_agent_key import _key
from tests.web.test_views import _deploy, _sign_in, _watch


def _answering(page: Any) -> dict[str, str]:
    """Answers each prompt with ``answers["prompt"]``; returns the dict to set it in."""
    answers = {"prompt": ""}

    async def on_dialog(d: Any) -> None:
        await d.accept(answers["prompt"])

    page.on("dialog", lambda d: asyncio.ensure_future(on_dialog(d)))
    return answers


@pytest.mark.parametrize("store", ["sqlite"], indirect=True)
async def test_an_operator_forgets_a_user_then_deletes_the_agent(live_rt, acme: str, tmp_path: Path,
                                                                 browser_context) -> None:
    await _deploy(live_rt, acme, tmp_path, ("alice", "hello"), ("bob", "hi"))
    async with aclient(live_rt, acme) as c:
        for i in range(8):
            assert (await c.put(f"/v1/agents/echo/users/u{i}", json={})).status_code == 201
    page = await browser_context.new_page()
    problems = _watch(page)
    answers = _answering(page)
    await _sign_in(page, live_rt.url, acme)

    # Forget bob from his page: a wrong name does nothing; his own does it, and the agent's page says so.
    await page.goto(f"{live_rt.url}/ui/#/user/echo/bob")
    await page.wait_for_selector("body[data-loaded=user]")
    answers["prompt"] = "bobby"
    await page.click("#forget-user")
    await page.wait_for_selector("#forget-user-error:has-text('Nothing done')")
    async with aclient(live_rt, acme) as c:
        assert (await c.get("/v1/agents/echo/users/bob")).status_code == 200
    answers["prompt"] = "bob"
    await page.click("#forget-user")
    await page.wait_for_selector("body[data-loaded=agent] #deleted-notice")
    assert "Forgot bob" in await page.inner_text("#deleted-notice")
    users = await page.locator("#users-table tr[data-user]").evaluate_all("rows => rows.map(r => r.dataset.user)")
    assert "bob" not in users and "alice" in users, users
    async with aclient(live_rt, acme) as c:
        assert (await c.get("/v1/agents/echo/users/bob")).status_code == 404

    # Delete the agent from its page: then the fleet says what was done.
    answers["prompt"] = "echo"
    await page.click("#delete-agent")
    await page.wait_for_selector("body[data-loaded=fleet] #deleted-notice")
    assert await page.inner_text("#deleted-notice") == "Deleted agent echo: 9 end-users forgotten."
    async with aclient(live_rt, acme) as c:
        assert (await c.get("/v1/agents/echo")).status_code == 404
    assert problems == []


@pytest.mark.parametrize("store", ["sqlite"], indirect=True)
async def test_the_progress_of_a_delete_is_shown_and_a_key_limited_to_the_agent_goes_with_it(
        live_rt, acme: str, tmp_path: Path, browser_context, monkeypatch: pytest.MonkeyPatch) -> None:
    from moorage.runtime import agent_delete

    monkeypatch.setattr(agent_delete, "PROGRESS_EVERY_S", 0.0)  # a line after every user: something to watch
    await _deploy(live_rt, acme, tmp_path, ("alice", "hello"))
    async with aclient(live_rt, acme) as c:
        for i in range(12):
            assert (await c.put(f"/v1/agents/echo/users/u{i:02}", json={})).status_code == 201
    mine = await _key(live_rt, acme, ["deploy", "read"], agent="echo")
    page = await browser_context.new_page()
    problems = _watch(page)
    answers = _answering(page)
    await page.goto(live_rt.url + "/ui/")
    await page.fill("#key", mine)
    await page.click("#login-form button[type=submit]")
    await page.wait_for_selector("body[data-loaded=agent]")  # such a key lands on its agent
    assert await page.locator("#forget-user").count() == 0
    await page.evaluate("""() => {
        window.__said = [];
        const at = document.getElementById("delete-agent-progress");
        new MutationObserver(() => window.__said.push(at.textContent)).observe(at, {childList: true, characterData: true, subtree: true});
    }""")
    answers["prompt"] = "echo"
    await page.click("#delete-agent")
    await page.wait_for_selector("#login:not([hidden])")
    assert "This key was limited to it and was revoked with it." in await page.inner_text("#login-error")
    said = await page.evaluate("window.__said")
    assert "forgetting 13 end-users…" in said and any(s.startswith("end-users forgotten: ") for s in said), said
    async with aclient(live_rt, acme) as c:
        assert (await c.get("/v1/agents/echo")).status_code == 404
    assert problems == []


@pytest.mark.parametrize("store", ["sqlite"], indirect=True)
async def test_keys_whose_scopes_do_not_allow_it_get_no_button(live_rt, acme: str, tmp_path: Path,
                                                               browser_context) -> None:
    await _deploy(live_rt, acme, tmp_path, ("alice", "hello"))
    page = await browser_context.new_page()
    problems = _watch(page)
    for scopes, forget, delete in ((["read"], 0, 0), (["read", "provision"], 1, 0), (["read", "deploy"], 0, 1)):
        key = await _key(live_rt, acme, scopes)
        await page.goto(live_rt.url + "/ui/")
        await page.evaluate("k => sessionStorage.setItem('moorage.apiKey', k)", key)
        for view, loaded, button, n in (("#/user/echo/alice", "user", "#forget-user", forget),
                                        ("#/agent/echo", "agent", "#delete-agent", delete)):
            await page.goto(f"{live_rt.url}/ui/{view}")
            await page.wait_for_selector(f"body[data-loaded={loaded}]")
            assert await page.locator(button).count() == n, (scopes, view)
    assert problems == []
