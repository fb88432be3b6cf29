"""An agent's webhooks in the dashboard: each endpoint, its newest deliveries with their status, and what the
receiver answered to one that did not arrive; adding a webhook (its secret shown once), deleting one and "Send
again" for a key that may (deploy), none of them for one that reads."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from moorage.store import Store
from moorage.store.webhooks import WEBHOOK_EVENTS
from moorage.webhooks import Dispatcher, verify
from tests.api.conftest import aclient
from tests.api.test_async_webhooks import FAST, Receiver
from tests.web.test_agent_key import _key
from tests.web.test_views import _deploy, _sign_in, _watch


@pytest.mark.parametrize("store", ["sqlite"], indirect=True)
async def test_an_agents_webhooks_show_their_deliveries_and_why_one_failed(live_rt, store: Store, acme: str,
                                                                          tmp_path: Path, browser_context):
    await _deploy(live_rt, acme, tmp_path, ("alice", "hello"))
    async with aclient(live_rt, acme) as c:
        every = (await c.post("/v1/agents/echo/webhooks", json={"url": "http://127.0.0.1:9/hooks"})).json()
        quiet = (await c.post("/v1/agents/echo/webhooks", json={"url": "https://example.com/cancelled-only",
                                                                 "events": ["execution.cancelled"]})).json()
    ts = store.tenant(store.authenticate(acme))
    t0 = time.time()
    data = {"agent": "echo", "user": "alice", "status": "waiting"}
    with ts.transaction():  # settled (or not due) in the same transaction: the host's sender never sees them pending
        for i in range(11):
            (d,) = ts.deliveries.enqueue("echo", "interrupt.waiting", data, at=t0 - 100 + i)
            ts.deliveries.record_attempt(d, at=t0 - 99 + i, status_code=200, error=None, duration_ms=5,
                                         delivered=True, retry_at=None)
        (d,) = ts.deliveries.enqueue("echo", "execution.succeeded", data, at=t0 - 2)
        ts.deliveries.record_attempt(d, at=t0 - 2, status_code=500, error="receiver answered 500", duration_ms=9,
                                     delivered=False, retry_at=None)
        (d,) = ts.deliveries.enqueue("echo", "execution.failed", data, at=t0 - 1)
        ts.deliveries.record_attempt(d, at=t0 - 1, status_code=None, error="connection refused", duration_ms=1,
                                     delivered=False, retry_at=t0 + 600)

    reader = await _key(live_rt, acme, ["read"])
    page = await browser_context.new_page()
    problems = _watch(page)
    await _sign_in(page, live_rt.url, reader)
    await page.click("#instances-table a.agent-link:has-text('echo')")
    await page.wait_for_selector("body[data-loaded=agent] #webhooks")
    assert "null" not in await page.inner_text("#view")  # a full key's agent page has no "not shown" panel
    hook = page.locator(f"#webhooks .webhook[data-webhook='{every['id']}']")
    assert "http://127.0.0.1:9/hooks" in await hook.locator("h3").inner_text()
    rows = hook.locator("table.deliveries tbody tr")
    assert await rows.count() == 10
    assert await hook.locator("button.older").is_visible()
    pending, failed = rows.nth(0), rows.nth(1)
    assert await pending.get_attribute("data-status") == "pending"
    text = await pending.inner_text()
    assert "execution.failed" in text and "no answer: connection refused" in text and "in 10 min" in text, text
    assert await failed.get_attribute("data-status") == "failed"
    assert "HTTP 500: receiver answered 500" in await failed.inner_text()
    assert await rows.nth(2).get_attribute("data-status") == "delivered"
    assert "alice" in await rows.nth(2).locator("a.user-link").inner_text()
    await hook.locator("button.older").click()  # the 3 older ones, then nothing more to read
    await page.wait_for_selector(f"#webhooks .webhook[data-webhook='{every['id']}'] tbody tr:nth-child(13)")
    assert await rows.count() == 13 and not await hook.locator("button.older").is_visible()
    assert {await rows.nth(i).get_attribute("data-status") for i in range(2, 13)} == {"delivered"}
    other = page.locator(f"#webhooks .webhook[data-webhook='{quiet['id']}']")
    assert "No deliveries yet" in await other.inner_text()
    assert "events: execution.cancelled" in await other.locator(".sub").inner_text()
    assert "whsec_" not in await page.inner_text("#view")  # no secret, ever
    # A key that may only read changes nothing here.
    assert await page.locator("#webhooks button.replay, #webhooks .delete-webhook, #add-webhook").count() == 0

    # A key limited to the agent sees them on its landing page.
    await page.click("#signout")
    await _sign_in_limited(page, live_rt.url, await _key(live_rt, acme, ["read"], agent="echo"))
    assert await page.locator("#webhooks .webhook").count() == 2
    assert problems == []


async def _sign_in_limited(page, url: str, key: str) -> None:
    await page.goto(url + "/ui/")
    await page.fill("#key", key)
    await page.click("#login-form button[type=submit]")
    await page.wait_for_selector("body[data-loaded=agent]")


@pytest.mark.parametrize("store", ["sqlite"], indirect=True)
async def test_a_failed_delivery_sent_again_is_followed_until_it_arrives(live_rt, store: Store, acme: str,
                                                                        tmp_path: Path, browser_context):
    await _deploy(live_rt, acme, tmp_path, ("alice", "hello"))
    receiver = Receiver()
    dispatcher = Dispatcher(store, schedule=FAST, poll_s=0.05)  # the host's sender, as tests/api runs it
    sender = asyncio.create_task(dispatcher.run())
    try:
        async with aclient(live_rt, acme) as c:
            hook = (await c.post("/v1/agents/echo/webhooks", json={"url": receiver.url})).json()
        ts = store.tenant(store.authenticate(acme))
        with ts.transaction():  # failed for good while the receiver was away (the host's sender never saw it pending)
            (d,) = ts.deliveries.enqueue("echo", "execution.succeeded", {"agent": "echo", "user": "alice"})
            ts.deliveries.record_attempt(d, at=time.time(), status_code=500, error="receiver answered 500",
                                         duration_ms=9, delivered=False, retry_at=None)
        page = await browser_context.new_page()
        problems = _watch(page)
        await _sign_in(page, live_rt.url, acme)
        await page.goto(f"{live_rt.url}/ui/#/agent/echo")
        await page.wait_for_selector("body[data-loaded=agent] #webhooks")
        row = page.locator(f"#webhooks .webhook[data-webhook='{hook['id']}'] tbody tr")
        assert await row.get_attribute("data-status") == "failed"
        await row.locator("button.replay").click()
        await page.wait_for_selector(f"#webhooks tr[data-delivery='{d.id}'][data-status=delivered]")
        assert len(receiver.delivered()) == 1
        assert await row.locator("button.replay").is_enabled()  # and it may be sent once more
        assert problems == []
    finally:
        sender.cancel()
        await dispatcher.aclose()
        receiver.close()


def test_the_pages_events_are_the_stores() -> None:
    js = (Path(__file__).parents[2] / "src/moorage/web/static/webhooks.js").read_text()
    line = next(x for x in js.splitlines() if x.startswith("const WEBHOOK_EVENTS = "))
    assert line == "const WEBHOOK_EVENTS = [" + ", ".join(f'"{e}"' for e in WEBHOOK_EVENTS) + "];"


@pytest.mark.parametrize("store", ["sqlite"], indirect=True)
async def test_a_webhook_added_in_the_page_signs_with_the_secret_it_showed_once_and_is_deleted_there(
        live_rt, store: Store, acme: str, tmp_path: Path, browser_context):
    await _deploy(live_rt, acme, tmp_path, ("alice", "hello"))
    receiver = Receiver()
    dispatcher = Dispatcher(store, schedule=FAST, poll_s=0.05)
    sender = asyncio.create_task(dispatcher.run())
    try:
        page = await browser_context.new_page()
        problems = _watch(page)
        await _sign_in(page, live_rt.url, acme)
        await page.goto(f"{live_rt.url}/ui/#/agent/echo")
        await page.wait_for_selector("body[data-loaded=agent] #add-webhook")
        assert "has no webhooks" in await page.inner_text("#webhooks")

        # One the API refuses: its words in the page, nothing made.
        await page.fill("#webhook-url", "http://127.0.0.1:0/hooks")
        await page.click("#add-webhook button[type=submit]")
        await page.wait_for_selector("#webhook-error:has-text('port 0')")
        async with aclient(live_rt, acme) as c:
            assert (await c.get("/v1/agents/echo/webhooks")).json()["data"] == []
        assert problems and all("422" in p for p in problems), problems  # that refusal (and the console's word of it)
        problems.clear()

        # Added for one event: the secret is shown once, and it is the one its deliveries are signed with.
        await page.fill("#webhook-url", receiver.url)
        await page.check("#add-webhook input[value='execution.succeeded']")
        await page.click("#add-webhook button[type=submit]")
        await page.wait_for_selector("#webhook-notice code.secret")
        secret = await page.inner_text("#webhook-notice code.secret")
        assert secret.startswith("whsec_")
        async with aclient(live_rt, acme) as c:
            (hook,) = (await c.get("/v1/agents/echo/webhooks")).json()["data"]
            assert hook["url"] == receiver.url and hook["events"] == ["execution.succeeded"]
            r = await c.post("/v1/agents/echo/invoke", json={"message": "hi", "user": "alice"},
                             headers={"Prefer": "respond-async"})
            assert r.status_code == 202, r.text
        for _ in range(200):
            if receiver.delivered():
                break
            await asyncio.sleep(0.05)
        ((headers, body),) = receiver.delivered()
        assert verify(secret, body, headers)["type"] == "execution.succeeded"
        assert await page.locator(f"#webhooks .webhook[data-webhook='{hook['id']}']").count() == 1

        # Deleted after its confirmation (declined first: nothing happens).
        page.once("dialog", lambda d: asyncio.ensure_future(d.dismiss()))
        await page.click(f"#webhooks .webhook[data-webhook='{hook['id']}'] .delete-webhook")
        await asyncio.sleep(0.3)
        async with aclient(live_rt, acme) as c:
            assert len((await c.get("/v1/agents/echo/webhooks")).json()["data"]) == 1
        page.once("dialog", lambda d: asyncio.ensure_future(d.accept()))
        await page.click(f"#webhooks .webhook[data-webhook='{hook['id']}'] .delete-webhook")
        await page.wait_for_selector("#webhook-notice:has-text('Deleted the webhook')")
        assert await page.locator("#webhooks .webhook").count() == 0
        async with aclient(live_rt, acme) as c:
            assert (await c.get("/v1/agents/echo/webhooks")).json()["data"] == []
        assert "whsec_" not in await page.inner_text("#view")  # the secret went with the notice that showed it
        assert problems == []
    finally:
        sender.cancel()
        await dispatcher.aclose()
        receiver.close()
