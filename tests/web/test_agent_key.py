"""The dashboard with a key limited to one agent: that agent's users, memory, timeline and traces, and a plain
statement of what the API does not show such a key, never a failed view."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.api.conftest import aclient, agent_archive
from tests.web.test_views import _deploy, _watch


async def _key(live: object, admin: str, scopes: list[str], agent: str | None = None) -> str:
    async with aclient(live, admin) as c:
        r = await c.post("/v1/keys", json={"scopes": scopes, **({"agent": agent} if agent else {})})
        assert r.status_code == 201, r.text
        return r.json()["secret"]


@pytest.mark.parametrize("store", ["sqlite"], indirect=True)
async def test_a_key_for_one_agent_browses_that_agents_users(live_rt, acme: str, tmp_path: Path, browser_context):
    await _deploy(live_rt, acme, tmp_path, ("alice", "hello"), ("bob", "hi"), ("alice", "approve"))
    async with aclient(live_rt, acme) as c:  # another agent of the tenant, which this key may not see
        r = await c.post("/v1/agents/other/deployments", content=agent_archive(tmp_path, "other"),
                         headers={"content-type": "application/gzip"})
        assert r.status_code == 201, r.text
        assert (await c.post("/v1/agents/other/invoke", json={"message": "x", "user": "zed"})).status_code == 200
    key = await _key(live_rt, acme, ["read"], agent="echo")

    page = await browser_context.new_page()
    problems = _watch(page)
    await page.goto(live_rt.url + "/ui/")
    await page.fill("#key", key)
    await page.click("#login-form button[type=submit]")
    # It lands on its agent, not on a fleet view the API refuses it.
    await page.wait_for_selector("body[data-loaded=agent]")
    users = await page.locator("#users-table a.user-link").all_inner_texts()
    assert sorted(users) == ["alice", "bob"], users
    limited = await page.inner_text("#limited")
    assert "limited to agent echo" in limited and "cost" in limited, limited
    # Its agent's traces are listed (the key names its agent), none of the other agent's.
    assert await page.locator("#traces-table a.trace-link").count() > 0
    assert "ship it?" in await page.inner_text("#approvals")  # the agent's waiting turns, on its page
    assert await page.inner_text("nav a[data-nav=fleet]") == "Agent echo"

    await page.click("#users-table a.user-link:has-text('alice')")
    await page.wait_for_selector("body[data-loaded=user]")
    assert "echo: hello" in await page.inner_text("#events")
    assert await page.locator("#checkpoints li.ck").count() == 2
    # Its waiting turn is listed (the key names its agent); this key may read it, not answer it.
    approvals = await page.inner_text("#approvals")
    assert "ship it?" in approvals and "may not answer" in approvals, approvals

    # One of its agent's traces opens, with that agent's spans.
    await page.click("nav a[data-nav=fleet]")
    await page.wait_for_selector("body[data-loaded=agent]")
    await page.locator("#traces-table a.trace-link").first.click()
    await page.wait_for_selector("body[data-loaded=trace]")
    assert "zed" not in await page.inner_text("#view")
    # Back home: still its agent.
    await page.click("nav a[data-nav=fleet]")
    await page.wait_for_selector("body[data-loaded=agent]")
    assert problems == []


@pytest.mark.parametrize("store", ["sqlite"], indirect=True)
async def test_a_key_for_one_agent_answers_that_agents_approvals(live_rt, acme: str, tmp_path: Path, browser_context):
    await _deploy(live_rt, acme, tmp_path, ("alice", "approve"))
    async with aclient(live_rt, acme) as c:  # another agent's turn waits too: not this key's to see or answer
        r = await c.post("/v1/agents/other/deployments", content=agent_archive(tmp_path, "other"),
                         headers={"content-type": "application/gzip"})
        assert r.status_code == 201, r.text
        assert (await c.post("/v1/agents/other/invoke", json={"message": "approve", "user": "zed"})).json()["status"] == "waiting"
    key = await _key(live_rt, acme, ["read", "invoke"], agent="echo")
    page = await browser_context.new_page()
    problems = _watch(page)
    await page.goto(live_rt.url + "/ui/")
    await page.fill("#key", key)
    await page.click("#login-form button[type=submit]")
    await page.wait_for_selector("body[data-loaded=agent]")
    await page.click("nav a[data-nav=approvals]")
    await page.wait_for_selector("body[data-loaded=approvals]")
    items = page.locator("#approvals ul.approvals li")
    assert await items.count() == 1 and "alice" in await items.first.inner_text()
    await items.first.locator("button.approve").click()
    await page.wait_for_selector("#approvals-notice:has-text('draft-1 -> yes')")
    assert await page.locator("#approvals-notice a.trace-link").count() == 1  # its agent's trace: readable
    assert await items.count() == 0
    async with aclient(live_rt, acme) as c:
        waiting = (await c.get("/v1/workflows", params={"status": "waiting"})).json()["data"]
    assert [w["scope"].split("/")[0] for w in waiting] == ["workflow:other"]  # zed's is still waiting
    assert problems == []
