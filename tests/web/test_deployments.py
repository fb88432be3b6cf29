"""An agent's deployments in the dashboard (headless Chromium): newest first, the live one marked; with the deploy
scope an earlier ready one is made live again (the agent's users' next turns run it) and one that is neither live
nor building is deleted after a confirmation (then no longer listed); a key that may only read sees them and changes nothing."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.api.conftest import agent_archive, aclient
from tests.web.test_agent_key import _key
from tests.web.test_views import _deploy, _sign_in, _watch


@pytest.mark.parametrize("store", ["sqlite"], indirect=True)
async def test_an_earlier_deployment_is_made_live_and_a_later_one_deleted_from_the_page(live_rt, acme: str,
                                                                                        tmp_path: Path,
                                                                                        browser_context) -> None:
    await _deploy(live_rt, acme, tmp_path, ("alice", "hello"))
    async with aclient(live_rt, acme) as c:
        r = await c.post("/v1/agents/echo/deployments", content=agent_archive(tmp_path, version="2"),
                         headers={"content-type": "application/gzip"})
        assert r.status_code == 201, r.text
        assert (await c.post("/v1/agents/echo/invoke", json={"message": "hi", "user": "alice"})).json()["reply"] == "echo2: hi"

    reader = await _key(live_rt, acme, ["read"])
    page = await browser_context.new_page()
    problems = _watch(page)
    await _sign_in(page, live_rt.url, reader)
    await page.goto(f"{live_rt.url}/ui/#/agent/echo")
    await page.wait_for_selector("body[data-loaded=agent] #deployments-table")
    rows = page.locator("#deployments-table tbody tr")
    assert [await rows.nth(i).get_attribute("data-status") for i in range(2)] == ["live", "ready"]
    assert [await rows.nth(i).get_attribute("data-deployment") for i in range(2)] == ["2", "1"]
    assert await page.locator("#deployments button").count() == 0  # a key that may only read

    await page.click("#signout")
    await _sign_in(page, live_rt.url, acme)
    await page.goto(f"{live_rt.url}/ui/#/agent/echo")
    await page.wait_for_selector("body[data-loaded=agent] #deployments-table")
    assert await page.locator("#deployments tr[data-deployment='2'] button").count() == 0  # the live one: nothing
    await page.click("#deployments tr[data-deployment='1'] .make-live")
    await page.wait_for_selector("#deleted-notice:has-text('Deployment 1 of echo is live again')")
    await page.wait_for_selector("#deployments tr[data-deployment='1'][data-status=live]")
    async with aclient(live_rt, acme) as c:
        assert (await c.post("/v1/agents/echo/invoke", json={"message": "hi", "user": "alice"})).json()["reply"] == "echo: hi"

    # Deployment 2, no longer live: deleted after its confirmation (declined first: nothing happens).
    page.once("dialog", lambda d: asyncio.ensure_future(d.dismiss()))
    await page.click("#deployments tr[data-deployment='2'] .delete-deployment")
    await asyncio.sleep(0.3)
    async with aclient(live_rt, acme) as c:
        assert {d["number"]: d["status"] for d in (await c.get("/v1/agents/echo/deployments")).json()["data"]}[2] == "ready"
    page.once("dialog", lambda d: asyncio.ensure_future(d.accept()))
    await page.click("#deployments tr[data-deployment='2'] .delete-deployment")
    await page.wait_for_selector("#deleted-notice:has-text('Deleted deployment 2 of echo')")
    # No longer listed (nor a rollback's target): one row left, the live one.
    assert await page.locator("#deployments tr[data-deployment='2']").count() == 0
    assert await page.locator("#deployments tr[data-deployment='1'][data-status=live]").count() == 1
    async with aclient(live_rt, acme) as c:
        assert [d["number"] for d in (await c.get("/v1/agents/echo/deployments")).json()["data"]] == [1]
    assert problems == []
