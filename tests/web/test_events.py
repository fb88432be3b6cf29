"""A user's episodic memory in the dashboard: newest first, older pages on request, never the whole log at once."""

from __future__ import annotations

from pathlib import Path

import pytest

from moorage.store import Scope, Store
from tests.api.conftest import aclient
from tests.web.test_views import _deploy, _invoke, _sign_in, _watch


@pytest.mark.parametrize("store", ["sqlite"], indirect=True)
async def test_events_read_newest_first_and_page_back_to_the_oldest(live_rt, store: Store, acme: str, tmp_path: Path,
                                                                     browser_context):
    await _deploy(live_rt, acme, tmp_path, ("alice", "hello"))
    ts = store.tenant(store.authenticate(acme))
    with ts.transaction():  # a long session log, with notes in the user's own log between its events
        for i in range(120):
            ts.events.append(Scope.session("echo", "alice", "default"), "message", f"old words {i}", speaker="user")
            if i % 4 == 0:
                ts.events.append(Scope.for_user("echo", "alice"), "note", f"note {i}", speaker="agent")
        ts.events.append(Scope.for_user("echo", "alice"), "summary", "the gist so far")
    await _invoke(live_rt, acme, ("alice", "the latest words"))
    async with aclient(live_rt, acme) as c:  # every event of both logs, newest first
        every = []
        for params in ({}, {"session": "default"}):
            r = await c.get("/v1/agents/echo/users/alice/events", params={"limit": 500, **params})
            every += r.json()["data"]
    expected = [e["content"] for e in sorted(every, key=lambda e: (e["ts"], e["id"]), reverse=True)]
    assert len(expected) == 155

    page = await browser_context.new_page()
    problems = _watch(page)
    reads: list[str] = []
    page.on("request", lambda r: reads.append(r.url) if "/v1/" in r.url and "/events" in r.url else None)
    await _sign_in(page, live_rt.url, acme)
    await page.goto(f"{live_rt.url}/ui/#/user/echo/alice")
    await page.wait_for_selector("body[data-loaded=user]")
    shown = page.locator("#events li .content")
    assert await shown.all_inner_texts() == expected[:25]
    assert "the gist so far" in await page.inner_text("#working")
    # The first screen read one page of each log (and its newest summary), not the logs to their ends.
    assert len(reads) <= 4 and all("order=newest" in u for u in reads), reads

    for n in (50, 75):
        await page.click("#events-older")
        await page.wait_for_selector(f"#events li:nth-child({n})")
        assert await shown.all_inner_texts() == expected[:n]
    while await page.is_visible("#events-older"):
        await page.click("#events-older")
        await page.wait_for_selector("#events-older:not([disabled])", state="attached")  # its page is in
    assert await shown.all_inner_texts() == expected  # back to the first event, each once, in order
    assert problems == []


@pytest.mark.parametrize("store", ["sqlite"], indirect=True)
async def test_any_session_of_the_user_can_be_read_alone(live_rt, store: Store, acme: str, tmp_path: Path,
                                                         browser_context):
    await _deploy(live_rt, acme, tmp_path, ("alice", "hello"))
    ts = store.tenant(store.authenticate(acme))
    for i in range(7):  # s0 is the least recently active: past the 5 the user's page merges
        ts.sessions.open("echo", "alice", f"s{i}")
        ts.events.append(Scope.session("echo", "alice", f"s{i}"), "message", f"said in s{i}", speaker="user")
    await _invoke(live_rt, acme, ("alice", "latest"))
    page = await browser_context.new_page()
    problems = _watch(page)
    await _sign_in(page, live_rt.url, acme)
    await page.goto(f"{live_rt.url}/ui/#/user/echo/alice")
    await page.wait_for_selector("body[data-loaded=user]")
    assert "said in s0" not in await page.inner_text("#events")
    await page.click("#sessions a.session-link:text-is('s0')")
    await page.wait_for_selector("body[data-loaded=user] #events-all")
    assert await page.locator("#events li .content").all_inner_texts() == ["said in s0"]
    assert "session s0 alone" in await page.inner_text("#events")
    assert await page.locator("#sessions tr.picked").inner_text() != ""
    await page.click("#events-all")
    await page.wait_for_selector("body[data-loaded=user] #events:not(:has(#events-all))")
    assert "echo: latest" in await page.inner_text("#events")
    # A session the user does not have is said so, not shown as an empty log.
    await page.goto(f"{live_rt.url}/ui/#/user/echo/alice/session/s99")
    await page.wait_for_selector("body[data-loaded=error]")
    assert "no session 's99'" in await page.inner_text("#view")
    assert problems == []
