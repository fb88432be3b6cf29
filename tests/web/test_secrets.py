"""An agent's secrets in the dashboard (headless Chromium), for a key with the secrets scope: set (a new value is a
new version; the value field emptied, the value never in the page), listed by name and version, removed after a
confirmation; a key without the scope gets no panel at all (it may not even list the names)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from moorage.runtime.host_calls import secrets_of
from moorage.store import Store
from tests.api.conftest import aclient
from tests.web.test_agent_key import _key
from tests.web.test_views import _deploy, _sign_in, _watch

VALUE = "s3cret-value-that-never-shows"


@pytest.mark.parametrize("store", ["sqlite"], indirect=True)
async def test_a_secret_set_in_the_page_is_the_agents_and_never_shown(live_rt, runtime, store: Store, acme: str,
                                                                      tmp_path: Path, browser_context) -> None:
    await _deploy(live_rt, acme, tmp_path, ("alice", "hello"))
    ts = store.tenant(store.authenticate(acme))
    holder = await _key(live_rt, acme, ["read", "secrets"])  # may change secrets, nothing else
    page = await browser_context.new_page()
    problems = _watch(page)
    await _sign_in(page, live_rt.url, holder)
    await page.goto(f"{live_rt.url}/ui/#/agent/echo")
    await page.wait_for_selector("body[data-loaded=agent] #set-secret")
    assert "has no secrets" in await page.inner_text("#secrets")

    # A name the API would refuse is stopped by the form (its pattern is the API's): nothing sent, nothing set.
    await page.fill("#secret-name", "lower_case")
    await page.fill("#secret-value", VALUE)
    await page.click("#set-secret button[type=submit]")
    assert not await page.locator("#secret-name").evaluate("e => e.checkValidity()")
    assert secrets_of(runtime).list(ts, "echo") == []

    for version, value in ((1, VALUE), (2, VALUE + "-2")):
        await page.fill("#secret-name", "API_TOKEN")
        await page.fill("#secret-value", value)
        await page.click("#set-secret button[type=submit]")
        await page.wait_for_selector(f"#secret-notice:has-text('version {version}')")
        assert await page.input_value("#secret-value") == ""
        assert secrets_of(runtime).reveal(ts, "echo", "API_TOKEN") == value  # the agent's, encrypted at rest
    row = page.locator("#secrets-table tr[data-secret=API_TOKEN]")
    assert (await row.locator("td.num").inner_text()).strip() == "2"
    assert VALUE not in await page.content()  # neither value, anywhere in the document

    # Removed after its confirmation (declined first: nothing happens).
    page.once("dialog", lambda d: asyncio.ensure_future(d.dismiss()))
    await row.locator(".remove-secret").click()
    await asyncio.sleep(0.3)
    assert [s.name for s in secrets_of(runtime).list(ts, "echo")] == ["API_TOKEN"]
    page.once("dialog", lambda d: asyncio.ensure_future(d.accept()))
    await row.locator(".remove-secret").click()
    await page.wait_for_selector("#secret-notice:has-text('Removed secret API_TOKEN')")
    assert secrets_of(runtime).list(ts, "echo") == []
    assert await page.locator("#secrets-table").count() == 0
    assert problems == []

    # A key without the scope: no panel, and its agent page asked nothing of the secrets routes.
    reader = await _key(live_rt, acme, ["read", "deploy"])
    asked: list[str] = []
    page.on("request", lambda r: asked.append(r.url) if "/v1/" in r.url and "/secrets" in r.url else None)
    await page.click("#signout")
    await _sign_in(page, live_rt.url, reader)
    await page.goto(f"{live_rt.url}/ui/#/agent/echo")
    await page.wait_for_selector("body[data-loaded=agent] #webhooks")
    assert await page.locator("#secrets").count() == 0 and asked == []
    async with aclient(live_rt, reader) as c:  # as the API says: that key may not list them
        assert (await c.get("/v1/agents/echo/secrets")).status_code == 403
    assert problems == []
