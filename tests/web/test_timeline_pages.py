"""The dashboard's timeline read the newest 200 checkpoints of a user and nothing said there were more: an
instance with a longer history (``[agent.timetravel] keep`` above 200, named checkpoints) showed only part of it,
and its oldest points could not be rolled back to from the page. It says when older ones exist and a "Show older
checkpoints" button adds the next page, in headless Chromium over a real server and runtime."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.api.conftest import aclient
from tests.timetravel.conftest import tt_archive

#: The timeline's page (app.js TIMELINE_PAGE), and the checkpoints made past it.
PAGE, PAST = 200, 5


@pytest.mark.parametrize("store", ["sqlite"], indirect=True)
async def test_the_timeline_shows_older_checkpoints_on_request(live_rt, runtime, acme: str, tmp_path: Path,
                                                               browser_context):
    async with aclient(live_rt, acme) as c:
        r = await c.post("/v1/agents/tt/deployments", content=tt_archive(tmp_path, manifest="[agent.timetravel]\n"
                                                                                              "keep = 1000\n"),
                         headers={"content-type": "application/gzip"})
        assert r.status_code == 201, r.text
        r = await c.post("/v1/agents/tt/invoke", json={"message": "turn 1", "user": "carol"})
        assert r.json()["reply"].startswith("done 1"), r.text
        base = "/v1/agents/tt/users/carol/checkpoints"
        for _ in range(PAGE + PAST - 1):  # with the turn's: PAGE + PAST checkpoints
            r = await c.post(base, json={})
            assert r.status_code in (200, 201), r.text
        listed = (await c.get(base, params={"limit": 500})).json()
        assert len(listed["data"]) == PAGE + PAST and listed["next_cursor"] is None
        oldest = listed["data"][-1]["id"]

    page = await browser_context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    await page.goto(live_rt.url + "/ui/")
    await page.fill("#key", acme)
    await page.click("#login-form button[type=submit]")
    await page.wait_for_selector("body[data-loaded=fleet]")
    await page.goto(f"{live_rt.url}/ui/#/user/tt/carol")
    await page.wait_for_selector("body[data-loaded=user] #checkpoints")

    items = page.locator("#checkpoints li.ck")
    assert await items.count() == PAGE
    assert f"The newest {PAGE} checkpoints" in await page.inner_text("#checkpoints")
    assert await page.locator(f"#checkpoints li.ck[data-checkpoint='{oldest}']").count() == 0
    await page.click("#checkpoints-more")
    await page.wait_for_selector(f"#checkpoints li.ck[data-checkpoint='{oldest}']")
    assert await items.count() == PAGE + PAST
    assert await page.locator("#checkpoints-more").count() == 0  # that was the last page
    said = await page.inner_text("#checkpoints")
    assert f"{PAGE + PAST} checkpoints" in said and "The newest" not in said
    # The oldest point, read from the second page, is one the page can roll back to.
    first = page.locator(f"#checkpoints li.ck[data-checkpoint='{oldest}']")
    assert "turn 1" in await first.inner_text() and await first.locator("button.rollback").count() == 1
    assert errors == []
