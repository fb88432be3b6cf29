"""Answering turns that wait for a person, from the dashboard: what each asks, Approve / Reject / Answer… for a key
that may answer (none for one that may only read), and what the turn did after."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from tests.api.conftest import aclient, agent_archive
from tests.web.test_agent_key import _key
from tests.web.test_views import _deploy, _sign_in, _watch


@pytest.mark.parametrize("store", ["sqlite"], indirect=True)
async def test_an_operator_answers_waiting_turns_and_sees_what_they_did(live_rt, acme: str, tmp_path: Path,
                                                                       browser_context):
    await _deploy(live_rt, acme, tmp_path, ("alice", "approve"), ("bob", "approve"), ("carol", "approve"))
    page = await browser_context.new_page()
    problems = _watch(page)
    answers = {"prompt": ""}

    async def on_dialog(d: Any) -> None:
        await d.accept(answers["prompt"])

    page.on("dialog", lambda d: asyncio.ensure_future(on_dialog(d)))
    await _sign_in(page, live_rt.url, acme)
    await page.click("#to-approvals")
    await page.wait_for_selector("body[data-loaded=approvals]")
    items = page.locator("#approvals ul.approvals li")
    assert await items.count() == 3
    assert all("ship it?" in t for t in await items.all_inner_texts())

    # Approve alice's: the turn runs on with "yes", the notice says what it replied, her run leaves the list.
    await items.filter(has_text="alice").locator("button.approve").click()
    await page.wait_for_selector("#approvals-notice:has-text('finished')")
    notice = await page.inner_text("#approvals-notice")
    assert "“draft-1 -> yes”" in notice and "alice" in notice, notice
    assert await items.count() == 2 and await items.filter(has_text="alice").count() == 0
    # Reject carol's.
    await items.filter(has_text="carol").locator("button.reject").click()
    await page.wait_for_selector("#approvals-notice:has-text('draft-1 -> no')")
    assert await items.count() == 1

    # bob's, from his own page, with an answer of the operator's own.
    await page.goto(f"{live_rt.url}/ui/#/user/echo/bob")
    await page.wait_for_selector("body[data-loaded=user]")
    answers["prompt"] = "after the freeze"
    await page.locator("#approvals button.answer").click()
    await page.wait_for_selector("#approvals-notice:has-text('draft-1 -> after the freeze')")
    assert "Nothing is waiting for this user" in await page.inner_text("#approvals")
    assert "draft-1 -> after the freeze" in await page.inner_text("#events")
    async with aclient(live_rt, acme) as c:
        waiting = (await c.get("/v1/workflows?status=waiting")).json()["data"]
    assert waiting == []
    assert problems == []


@pytest.mark.parametrize("store", ["sqlite"], indirect=True)
async def test_a_key_that_may_only_read_sees_approvals_without_buttons(live_rt, acme: str, tmp_path: Path,
                                                                      browser_context):
    await _deploy(live_rt, acme, tmp_path, ("alice", "approve"))
    reader = await _key(live_rt, acme, ["read"])
    page = await browser_context.new_page()
    problems = _watch(page)
    await _sign_in(page, live_rt.url, reader)
    for view, loaded in (("#/approvals", "approvals"), ("#/user/echo/alice", "user")):
        await page.goto(f"{live_rt.url}/ui/{view}")
        await page.wait_for_selector(f"body[data-loaded={loaded}]")
        assert "ship it?" in await page.inner_text("#approvals .question")
        assert await page.locator("#approvals button").count() == 0, view
        assert "may not answer" in await page.inner_text("#approvals")
    assert problems == []


@pytest.mark.parametrize("store", ["sqlite"], indirect=True)
async def test_an_approval_answered_elsewhere_meanwhile_says_so(live_rt, acme: str, tmp_path: Path, browser_context):
    (waiting,) = await _deploy(live_rt, acme, tmp_path, ("alice", "approve"))
    page = await browser_context.new_page()
    await _sign_in(page, live_rt.url, acme)
    await page.goto(f"{live_rt.url}/ui/#/approvals")
    await page.wait_for_selector("body[data-loaded=approvals] #approvals button.approve")
    async with aclient(live_rt, acme) as c:  # another operator (or the CLI) answers first
        r = await c.post(f"/v1/workflows/{waiting['run_id']}/answer", json={"answer": "no"})
        assert r.status_code == 200, r.text
    await page.click("#approvals button.approve")
    await page.wait_for_selector("#approvals-error:has-text('not waiting')")
    assert "409" in await page.inner_text("#approvals-error")
    assert (await page.inner_text("#approvals-notice")).strip() == ""
    async with aclient(live_rt, acme) as c:  # its answer stands: the page's click changed nothing
        run = (await c.get(f"/v1/workflows/{waiting['run_id']}")).json()["run"]
    assert run["status"] == "succeeded" and run["result"]["reply"] == "draft-1 -> no", run


@pytest.mark.parametrize("store", ["sqlite"], indirect=True)
async def test_a_waiting_turn_can_be_cancelled_instead_of_answered(live_rt, acme: str, tmp_path: Path, browser_context):
    (waiting,) = await _deploy(live_rt, acme, tmp_path, ("alice", "approve"))
    page = await browser_context.new_page()
    problems = _watch(page)
    confirms: list[str] = []

    async def on_dialog(d: Any) -> None:
        confirms.append(d.message)
        await d.accept()

    page.on("dialog", lambda d: asyncio.ensure_future(on_dialog(d)))
    await _sign_in(page, live_rt.url, acme)
    await page.goto(f"{live_rt.url}/ui/#/user/echo/alice")
    await page.wait_for_selector("body[data-loaded=user] #approvals button.cancel")
    await page.click("#approvals button.cancel")
    await page.wait_for_selector("#approvals-notice:has-text('Cancelled')")
    assert "cancelled" in await page.inner_text("#approvals-notice .badge")
    assert "Nothing is waiting for this user" in await page.inner_text("#approvals")
    assert len(confirms) == 1 and "alice" in confirms[0], confirms  # asked first: it cannot be undone
    async with aclient(live_rt, acme) as c:
        assert (await c.get(f"/v1/workflows/{waiting['run_id']}")).json()["run"]["status"] == "cancelled"
    assert problems == []


@pytest.mark.parametrize("store", ["sqlite"], indirect=True)
async def test_an_agent_that_asks_again_shows_its_next_question(live_rt, acme: str, tmp_path: Path, browser_context):
    body = '''
async def on_message(ctx, message):
    amount = await ctx.interrupt({"question": "Refund how much?"})
    sure = await ctx.interrupt({"question": f"Refund {amount}, sure?"})
    return f"refunded {amount}" if sure == "yes" else "kept"
'''
    async with aclient(live_rt, acme) as c:
        r = await c.post("/v1/agents/shop/deployments", content=agent_archive(tmp_path, "shop", body),
                         headers={"content-type": "application/gzip"})
        assert r.status_code == 201, r.text
        assert (await c.post("/v1/agents/shop/invoke", json={"message": "refund", "user": "dora"})).json()["status"] == "waiting"
    page = await browser_context.new_page()
    problems = _watch(page)
    page.on("dialog", lambda d: asyncio.ensure_future(d.accept("12.50")))
    await _sign_in(page, live_rt.url, acme)
    await page.goto(f"{live_rt.url}/ui/#/approvals")
    await page.wait_for_selector("body[data-loaded=approvals] #approvals button.answer")
    await page.click("#approvals button.answer")
    # The turn asks again: the notice says what, and the run stays listed with its new question.
    await page.wait_for_selector("#approvals-notice:has-text('waits again')")
    assert "“Refund 12.50, sure?”" in await page.inner_text("#approvals-notice")
    assert await page.inner_text("#approvals ul.approvals li .question") == "Refund 12.50, sure?"
    await page.click("#approvals button.approve")
    await page.wait_for_selector("#approvals-notice:has-text('finished')")
    assert "“refunded 12.50”" in await page.inner_text("#approvals-notice")
    assert await page.locator("#approvals ul.approvals li").count() == 0
    assert problems == []
