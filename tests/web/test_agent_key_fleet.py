"""The dashboard's agent page shows that agent's share of the fleet (instances awake and asleep, wakes, cost) from
`GET /v1/fleet?agent=`: to a key limited to the agent, which could not be shown them before, and to a tenant key;
never the other agents' counts or costs."""

from __future__ import annotations

from pathlib import Path

import pytest

from moorage.store import Store
from tests.api.conftest import aclient, agent_archive
from tests.web.test_views import _watch

GZ = {"content-type": "application/gzip"}


async def _fleet_of_two_agents(live, store: Store, admin: str, tmp_path: Path) -> None:  # noqa: ANN001
    """echo: alice awake, bob asleep, 0.50 USD of model calls; other: zed and yan awake, one wake, 9.00 USD."""
    ts = store.tenant(store.authenticate(admin))
    async with aclient(live, admin) as c:
        for agent, users in (("echo", ("alice", "bob")), ("other", ("zed", "yan"))):
            r = await c.post(f"/v1/agents/{agent}/deployments", content=agent_archive(tmp_path, agent), headers=GZ)
            assert r.status_code == 201, r.text
            for user in users:
                assert (await c.post(f"/v1/agents/{agent}/invoke", json={"message": "hi", "user": user})).status_code == 200
        box = {b.scope.user: b.id for b in ts.sandboxes.list()}
        assert (await c.post(f"/v1/sandboxes/{box['bob']}/sleep")).status_code == 200
        for verb in ("sleep", "wake"):
            assert (await c.post(f"/v1/sandboxes/{box['zed']}/{verb}")).status_code == 200
    ts.usage.add("cost_usd", 0.5, agent_id="echo", user_id="alice")
    ts.usage.add("cost_usd", 9.0, agent_id="other", user_id="zed")


@pytest.mark.parametrize("store", ["sqlite"], indirect=True)
async def test_the_agent_page_shows_that_agents_share_of_the_fleet(live_rt, store: Store, acme: str, tmp_path: Path,  # noqa: ANN001
                                                                   browser_context) -> None:
    await _fleet_of_two_agents(live_rt, store, acme, tmp_path)
    async with aclient(live_rt, acme) as c:
        r = await c.post("/v1/keys", json={"scopes": ["read"], "agent": "echo"})
        key = r.json()["secret"]

    page = await browser_context.new_page()
    problems = _watch(page)
    await page.goto(live_rt.url + "/ui/")
    await page.fill("#key", key)
    await page.click("#login-form button[type=submit]")
    await page.wait_for_selector("body[data-loaded=agent]")  # its agent's page, with its share of the fleet
    assert (await page.inner_text(".card-awake .card-value")).strip() == "1"
    assert (await page.inner_text(".card-asleep .card-value")).strip() == "1"
    assert "0 wakes" in await page.inner_text(".card-wake")  # the other agent's wake is not its
    assert (await page.inner_text("#cost-model")).strip() == "0.50 USD"
    assert "USD" in await page.inner_text("#cost-compute")
    limited = await page.inner_text("#limited")
    assert "limited to agent echo" in limited and "nothing of the tenant's other agents" in limited, limited
    assert problems == []  # no refused request: every listing named its agent

    # A tenant key's agent page of the other agent: that agent's share, not the tenant's total.
    await page.evaluate("sessionStorage.clear()")
    await page.goto(live_rt.url + "/ui/#/agent/other")
    await page.fill("#key", acme)
    await page.click("#login-form button[type=submit]")
    await page.wait_for_selector("body[data-loaded=agent]")
    assert (await page.inner_text(".card-awake .card-value")).strip() == "2"
    assert (await page.inner_text(".card-asleep .card-value")).strip() == "0"
    assert "1 wakes" in await page.inner_text(".card-wake")
    assert (await page.inner_text("#cost-model")).strip() == "9.00 USD"
    assert await page.locator("#limited").count() == 0
    assert problems == []
