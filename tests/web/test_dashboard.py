"""The dashboard end to end: a real server over the real runtime (process sandboxes) with a deployed agent and
real turns, /v1/fleet read over HTTP, and /ui driven in headless Chromium (sign in, fleet, user view, trace
timeline) with screenshots decoded and checked to show a rendered page."""

from __future__ import annotations

import asyncio

from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from moorage.store import Store
from tests.api.conftest import aclient, agent_archive
from tests.web.png import decode

PLANTED = "lighthouse-keeper-4711"


async def populate(live: Any, key: str, tmp_path: Path) -> dict[str, Any]:
    """alice: one turn, a planted fact, a workflow waiting for approval (instance awake); bob: a turn, slept,
    woken by a second turn, slept again (instance asleep, one measured wake)."""
    async with aclient(live, key) as c:
        r = await c.post("/v1/agents/echo/deployments", content=agent_archive(tmp_path),
                         headers={"content-type": "application/gzip"})
        assert r.status_code == 201, r.text
        hello = (await c.post("/v1/agents/echo/invoke", json={"message": "hello", "user": "alice"})).json()
        assert hello["reply"] == "echo: hello"
        waiting = (await c.post("/v1/agents/echo/invoke", json={"message": "approve", "user": "alice"})).json()
        assert waiting["status"] == "waiting"
        r = await c.post("/v1/agents/echo/users/alice/facts",
                         json={"subject": "user", "attribute": "job", "value": PLANTED})
        assert r.status_code == 201, r.text
        assert (await c.post("/v1/agents/echo/invoke", json={"message": "first", "user": "bob"})).status_code == 200
        boxes = {b["scope"].split("/")[1]: b for b in (await c.get("/v1/sandboxes")).json()["data"]}
        bob = boxes["bob"]["id"]
        assert (await c.post(f"/v1/sandboxes/{bob}/sleep")).status_code == 200
        assert (await c.post("/v1/agents/echo/invoke", json={"message": "again", "user": "bob"})).json()["reply"] == "echo: again"
        assert (await c.post(f"/v1/sandboxes/{bob}/sleep")).status_code == 200
        return {"hello": hello, "waiting": waiting, "alice": boxes["alice"]["id"], "bob": bob}


@pytest.mark.parametrize("store", ["sqlite", "postgres"], indirect=True)
async def test_fleet_route_reports_states_wakes_resources_and_cost(live_rt, store: Store, acme: str, globex: str,
                                                                   tmp_path: Path):
    seen = await populate(live_rt, acme, tmp_path)
    # Let bob spend a measurable while asleep, so the storage side of the cost split is not zero.
    await asyncio.sleep(0.5)
    async with aclient(live_rt, acme) as c:
        r = await c.get("/v1/fleet")
        assert r.status_code == 200, r.text
        fleet = r.json()
    assert fleet["counts"] == {"running": 1, "sleeping": 1}
    assert (fleet["awake"], fleet["asleep"], fleet["total"]) == (1, 1, 2)
    by_user = {i["user"]: i for i in fleet["instances"]}
    alice, bob = by_user["alice"], by_user["bob"]
    assert (alice["id"], alice["state"], alice["awake"]) == (seen["alice"], "running", True)
    assert (bob["id"], bob["state"], bob["awake"]) == (seen["bob"], "sleeping", False)
    assert alice["session"] is None and bob["session"] is None  # one instance per user: no session to name
    # Most recently active first: bob's instance moved (slept) last.
    assert [i["user"] for i in fleet["instances"]] == ["bob", "alice"]
    # bob woke once (the second turn), and that wake was timed from the lifecycle span.
    assert bob["wakes"] == 1 and bob["last_wake_ms"] > 0
    assert fleet["wake_ms"]["count"] == 1 and fleet["wake_ms"]["p50"] == bob["last_wake_ms"]
    # RAM and disk come from the sandbox the runtime has open: known for the awake one, not guessed for the other.
    assert alice["ram_bytes"] > 0 and alice["disk_bytes"] >= 0
    assert bob["ram_bytes"] is None and bob["disk_bytes"] is None
    cost = fleet["cost"]
    assert cost["awake_s"] > 0 and cost["asleep_s"] > 0
    assert cost["compute"] > 0 and cost["storage"] > 0 and cost["currency"] == "USD"
    # Another tenant sees none of it.
    async with aclient(live_rt, globex) as c:
        other = (await c.get("/v1/fleet")).json()
    assert other["total"] == 0 and other["instances"] == [] and other["wake_ms"]["count"] == 0
    async with httpx.AsyncClient(base_url=live_rt.url) as anon:
        assert (await anon.get("/v1/fleet")).status_code == 401


@pytest.mark.parametrize("store", ["sqlite"], indirect=True)
async def test_ui_is_static_public_and_carries_no_secret(live_rt, acme: str):
    async with httpx.AsyncClient(base_url=live_rt.url) as c:
        r = await c.get("/ui")
        assert r.status_code == 307 and r.headers["location"] == "/ui/"
        page = await c.get("/ui/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert "script-src 'self'" in page.headers["content-security-policy"]
        assert page.headers["x-content-type-options"] == "nosniff" and "x-trace-id" in page.headers
        js = await c.get("/ui/app.js")
        css = await c.get("/ui/style.css")
        assert js.status_code == 200 and "javascript" in js.headers["content-type"]
        assert css.status_code == 200 and css.headers["content-type"].startswith("text/css")
        for body in (page.text, js.text, css.text):
            assert acme not in body and "mrg_" not in body.replace("mrg_...", "")
        assert "<script>" not in page.text  # no inline script: the CSP forbids it
        assert (await c.get("/ui/nope.js")).status_code == 404
        assert (await c.get("/ui/../openapi.json")).status_code in (200, 404)  # normalised by the client, never a file outside
        assert (await c.post("/ui/")).status_code == 405
        assert (await c.get("/healthz")).status_code == 200  # everything else still reaches the API


def assert_rendered(png: bytes, min_ink: float = 0.02) -> np.ndarray:
    """The screenshot is a page with content: varied pixels, and a share of them far from the background."""
    img = decode(png)[..., :3].astype(np.int32)
    assert img.shape[0] > 100 and img.shape[1] > 100
    flat = img.reshape(-1, 3)
    values, counts = np.unique(flat, axis=0, return_counts=True)
    background = values[counts.argmax()]
    ink = (np.abs(flat - background).sum(axis=1) > 60).mean()
    assert flat.std() > 10, "the screenshot is (nearly) one colour"
    assert ink > min_ink, f"only {ink:.3%} of the pixels differ from the background"
    assert len(values) > 50, "too few distinct colours for rendered text and tables"
    return img


@pytest.mark.parametrize("store", ["sqlite"], indirect=True)
async def test_dashboard_in_chromium(live_rt, acme: str, tmp_path: Path, browser_context):
    seen = await populate(live_rt, acme, tmp_path)
    shots = tmp_path / "screenshots"
    shots.mkdir()
    page = await browser_context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)

    # A wrong key is refused and the form comes back; the right one opens the fleet view.
    await page.goto(live_rt.url + "/ui/")
    await page.fill("#key", "mrg_not_a_real_key")
    await page.click("#login-form button[type=submit]")
    await page.wait_for_selector("#login-error:has-text('refused')")
    errors.clear()  # the browser logs the 401 of the refused key as a console error
    await page.fill("#key", acme)
    await page.click("#login-form button[type=submit]")
    await page.wait_for_selector("body[data-loaded=fleet]")
    assert await page.evaluate("sessionStorage.getItem('moorage.apiKey')") == acme
    assert acme not in await page.content()  # kept in sessionStorage, never written into the page

    rows = page.locator("#instances-table tbody tr")
    assert await rows.count() == 2
    table_text = await page.inner_text("#instances-table")
    assert "alice" in table_text and "bob" in table_text and "running" in table_text and "sleeping" in table_text
    assert seen["alice"][:12] in table_text
    assert (await page.inner_text(".card-awake .card-value")).strip() == "1"
    assert (await page.inner_text(".card-asleep .card-value")).strip() == "1"
    assert "USD" in await page.inner_text("#cost-compute") and "USD" in await page.inner_text("#cost-storage")
    assert await page.locator("#traces-table tbody tr").count() > 0
    fleet_png = await page.screenshot(path=str(shots / "fleet.png"), full_page=True)
    assert_rendered(fleet_png)

    # The key survives a reload of the tab (asked once), and the user view shows the three memory tiers.
    await page.reload()
    await page.wait_for_selector("body[data-loaded=fleet]")
    await page.click("#instances-table a.user-link:has-text('alice')")
    await page.wait_for_selector("body[data-loaded=user]")
    assert PLANTED in await page.inner_text("#facts-table")
    assert "ship it?" in await page.inner_text("#approvals .question")
    events = await page.inner_text("#events")
    assert "hello" in events and "echo: hello" in events
    assert "default" in await page.inner_text("#sessions")
    assert await page.locator("#working").count() == 1
    user_png = await page.screenshot(path=str(shots / "user.png"), full_page=True)
    assert_rendered(user_png)

    # The trace of alice's first turn, drawn as bars on one time axis.
    await page.goto(f"{live_rt.url}/ui/#/trace/{seen['hello']['trace_id']}")
    await page.wait_for_selector("body[data-loaded=trace]")
    bars = page.locator("#timeline .span-bar")
    n = await bars.count()
    assert n >= 2
    boxes = [await bars.nth(i).bounding_box() for i in range(n)]
    track = await page.locator("#timeline .span-track").first.bounding_box()
    assert all(b is not None and b["width"] >= 1 and b["height"] > 0 for b in boxes)
    assert all(track["x"] - 1 <= b["x"] and b["x"] + b["width"] <= track["x"] + track["width"] + 1 for b in boxes)
    widest = max(b["width"] for b in boxes)
    assert widest > 0.5 * track["width"]  # the root request spans (almost) the whole axis
    labels = await page.inner_text("#timeline")
    assert "POST /v1/agents/{agent}/invoke" in labels
    trace_png = await page.screenshot(path=str(shots / "trace.png"), full_page=True)
    assert_rendered(trace_png, min_ink=0.01)

    # Forgetting the key brings the sign-in form back.
    await page.click("#signout")
    assert await page.is_visible("#login")
    assert await page.evaluate("sessionStorage.getItem('moorage.apiKey')") is None
    assert errors == []
