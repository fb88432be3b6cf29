"""The dashboard's timeline of a user's agent, in headless Chromium over a real server and runtime: the
checkpoints with what each turn did and where the instance is; rolling back from the page (the abandoned
branch then listed and restorable), forking into a new user (whose page says where it came from), a checkpoint
that cannot be restored marked as such, and a key without the ``provision`` scope refused by the API with the page
saying so."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.api.conftest import aclient
from tests.timetravel.conftest import tt_archive
from tests.web.test_dashboard import assert_rendered

BASE = "/v1/agents/tt/users/carol/checkpoints"


async def _ls(c, user: str) -> list[str]:
    reply = (await c.post("/v1/agents/tt/invoke", json={"message": "ls", "user": user})).json()["reply"]
    return sorted(json.loads(reply))


async def _open_user(page, url: str, key: str, user: str) -> None:
    await page.goto(url + "/ui/")
    if await page.is_visible("#login"):
        await page.fill("#key", key)
        await page.click("#login-form button[type=submit]")
        await page.wait_for_selector("body[data-loaded=fleet]")
    await page.goto(f"{url}/ui/#/user/tt/{user}")
    await page.wait_for_selector("body[data-loaded=user] #checkpoints")


@pytest.mark.parametrize("store", ["sqlite"], indirect=True)
async def test_timeline_rollback_and_fork_from_the_dashboard(live_rt, runtime, acme: str, tmp_path: Path, browser_context):
    async with aclient(live_rt, acme) as c:
        # No [agent.timetravel] table: a checkpoint after every turn is the default.
        r = await c.post("/v1/agents/tt/deployments", content=tt_archive(tmp_path, manifest=""),
                         headers={"content-type": "application/gzip"})
        assert r.status_code == 201, r.text
        for i in (1, 2, 3):
            r = await c.post("/v1/agents/tt/invoke", json={"message": f"turn {i}", "user": "carol"})
            assert r.json()["reply"].startswith(f"done {i}"), r.text
        read_key = (await c.post("/v1/keys", json={"scopes": ["read"]})).json()["secret"]

    page = await browser_context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    answers = {"confirm": True, "prompt": "dora"}

    async def on_dialog(d) -> None:
        if d.type == "prompt":
            await d.accept(answers["prompt"])
        elif answers["confirm"]:
            await d.accept()
        else:
            await d.dismiss()

    page.on("dialog", on_dialog)
    await _open_user(page, live_rt.url, acme, "carol")

    # Three turns, newest first, each with what it did; the newest is where the instance is.
    items = page.locator("#checkpoints .branch.current li.ck")
    assert await items.count() == 3
    texts = [await items.nth(i).inner_text() for i in range(3)]
    assert ["turn 3" in texts[0], "turn 2" in texts[1], "turn 1" in texts[2]] == [True, True, True]
    assert "done 3 step=30 files=3" in texts[0] and "side-3" in texts[0]
    assert await items.nth(0).get_attribute("data-head") == "true"
    assert "current" in texts[0] and "current" not in texts[1]
    assert "turn 3" in await page.inner_text("#events")
    assert_rendered(await page.screenshot(full_page=True))

    # Roll back to turn 1 from the page: the view comes back with the instance at turn 1.
    one = page.locator("#checkpoints li.ck", has_text="turn 1")
    one_id = await one.get_attribute("data-checkpoint")
    await one.locator("button.rollback").click()
    await page.wait_for_selector("#checkpoints-notice:has-text('Rolled back to #1')")
    assert await page.locator("#checkpoints li.ck[data-head=true]").get_attribute("data-checkpoint") == one_id
    current = await page.inner_text("#checkpoints .branch.current")
    # The current branch shows the history it grew from (turn 1, where the instance is); the abandoned one only
    # what was left: turns 2-3 and the state the rollback left (its tip).
    assert "grew from #1" in current and "turn 1" in current and "turn 2" not in current
    assert await page.locator("#checkpoints .branch.current li.ck[data-head=true]").get_attribute("data-checkpoint") == one_id
    abandoned = page.locator("#checkpoints .branch.abandoned li.ck")
    assert await abandoned.count() == 3
    tip = abandoned.first
    assert await tip.get_attribute("data-kind") == "before-rollback"
    assert "left when rolling back to #1" in await tip.inner_text()
    assert "turn 3" not in await page.inner_text("#events")  # episodic memory went back too
    async with aclient(live_rt, acme) as c:
        assert (await c.get(BASE)).json()["head"] == one_id
        assert await _ls(c, "carol") == ["1.txt"]  # the sandbox's files
    await page.reload()
    await page.wait_for_selector("body[data-loaded=user] #checkpoints .branch.abandoned")
    timeline = page.locator("#checkpoints")
    await timeline.scroll_into_view_if_needed()
    assert_rendered(await timeline.screenshot(path=str(tmp_path / "timeline.png")), min_ink=0.01)

    # The abandoned branch is restorable from the page.
    tip = page.locator("#checkpoints .branch.abandoned li.ck").first
    tip_id = await tip.get_attribute("data-checkpoint")
    assert (await tip.locator("button.rollback").inner_text()).strip() == "Restore"
    await tip.locator("button.rollback").click()
    await page.wait_for_selector(f"#checkpoints li.ck[data-head=true][data-checkpoint='{tip_id}']")
    async with aclient(live_rt, acme) as c:
        assert await _ls(c, "carol") == ["1.txt", "2.txt", "3.txt"]

    # Fork turn 2 into a new user "dora" (the prompt's answer); her page says where she came from.
    two = page.locator("#checkpoints li.ck", has_text="turn 2").first
    await two.locator("button.fork").click()
    await page.wait_for_selector("#checkpoints-notice a.user-link:has-text('dora')")
    async with aclient(live_rt, acme) as c:
        assert await _ls(c, "dora") == ["1.txt", "2.txt"]
    await page.click("#checkpoints-notice a.user-link:has-text('dora')")
    await page.wait_for_selector("body[data-loaded=user] #checkpoints li.ck[data-kind=fork]")
    fork = await page.inner_text("#checkpoints li.ck[data-kind=fork]")
    assert "forked from carol" in fork
    assert await page.locator("#checkpoints li.ck[data-kind=fork] a.user-link").get_attribute("href") == "#/user/tt/carol"

    # A checkpoint whose sandbox half is not there (as if the host had died while writing it behind its turn) is
    # marked, without buttons: no rollback or fork to it could work.
    async with aclient(live_rt, acme) as c:
        listing = (await c.get(BASE)).json()
    lost = next(ck for ck in listing["data"] if (ck["summary"].get("turn") or {}).get("message") == "turn 3")
    assert lost["restorable"] is True
    await (await runtime.driver.open(lost["sandbox_id"])).delete_checkpoint(lost["sandbox_checkpoint"])
    await _open_user(page, live_rt.url, acme, "carol")
    marked = page.locator(f"#checkpoints li.ck[data-checkpoint='{lost['id']}']")
    assert "cannot be restored" in await marked.locator(".unrestorable").inner_text()
    assert await marked.locator("button").count() == 0
    async with aclient(live_rt, acme) as c:
        assert {ck["id"]: ck["restorable"] for ck in (await c.get(BASE)).json()["data"]}[lost["id"]] is False

    # A key that may only read sees the timeline without the buttons it could not use (they only failed with a
    # 403 before); the API refuses its rollback all the same.
    await page.click("#signout")
    await _open_user(page, live_rt.url, read_key, "carol")
    head_before = await page.locator("#checkpoints li.ck[data-head=true]").get_attribute("data-checkpoint")
    assert await page.locator("#checkpoints li.ck").count() > 1
    assert await page.locator("#checkpoints button.rollback, #checkpoints button.fork").count() == 0
    one = page.locator("#checkpoints li.ck", has_text="turn 1").first
    async with aclient(live_rt, read_key) as c:
        r = await c.post(f"{BASE}/{await one.get_attribute('data-checkpoint')}/rollback", json={})
        assert r.status_code == 403, r.text
    async with aclient(live_rt, acme) as c:
        assert (await c.get(BASE)).json()["head"] == head_before
    assert errors == []
