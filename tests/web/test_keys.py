"""The tenant's API keys in the dashboard (headless Chromium), for a key with the admin scope: listed without their
secrets, one made (its secret shown once, and it is a working key with the scopes and agent ticked), one revoked
after a confirmation (it stops working at once); the key in use cannot be revoked from the page; a key without the
scope gets no panel and asks nothing of the keys routes."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from moorage.store.model import API_KEY_SCOPES
from tests.web.test_agent_key import _key
from tests.web.test_views import _deploy, _sign_in, _watch


def test_the_pages_scopes_are_the_stores() -> None:
    js = (Path(__file__).parents[2] / "src/moorage/web/static/keys.js").read_text()
    line = next(x for x in js.splitlines() if x.startswith("const KEY_SCOPES = "))
    assert line == "const KEY_SCOPES = [" + ", ".join(f'"{s}"' for s in API_KEY_SCOPES) + "];"


def _whoami(url: str, secret: str) -> httpx.Response:
    return httpx.get(f"{url}/v1/whoami", headers={"authorization": f"Bearer {secret}"})


@pytest.mark.parametrize("store", ["sqlite"], indirect=True)
async def test_a_key_made_in_the_page_works_once_and_revoked_there_stops(live_rt, acme: str, tmp_path: Path,
                                                                          browser_context) -> None:
    await _deploy(live_rt, acme, tmp_path, ("alice", "hello"))
    page = await browser_context.new_page()
    problems = _watch(page)
    await _sign_in(page, live_rt.url, acme)
    await page.wait_for_selector("#keys-table")
    mine = (await asyncio.to_thread(_whoami, live_rt.url, acme)).json()["key_id"]
    own = page.locator(f"#keys-table tr[data-key='{mine}']")
    assert "(this key)" in await own.inner_text() and await own.locator("button").count() == 0

    # No scope ticked: said so, nothing made.
    await page.fill("#key-label", "ci")
    await page.click("#new-key button[type=submit]")
    await page.wait_for_selector("#key-form-error:has-text('at least one scope')")
    assert await page.locator("#keys-table tbody tr").count() == 1

    await page.check("#new-key input[value=invoke]")
    await page.check("#new-key input[value=read]")
    await page.fill("#key-agent", "echo")
    await page.click("#new-key button[type=submit]")
    await page.wait_for_selector("#key-notice code.secret")
    secret = await page.inner_text("#key-notice code.secret")
    who = (await asyncio.to_thread(_whoami, live_rt.url, secret)).json()
    assert who["scopes"] == ["invoke", "read"] and who["agent"] == "echo"
    made = page.locator(f"#keys-table tr[data-key='{who['key_id']}']")
    assert "ci" in await made.inner_text() and secret not in await page.inner_text("#keys-table")

    # Revoked after its confirmation (declined first: it still works).
    page.once("dialog", lambda d: asyncio.ensure_future(d.dismiss()))
    await made.locator(".revoke-key").click()
    await asyncio.sleep(0.3)
    assert (await asyncio.to_thread(_whoami, live_rt.url, secret)).status_code == 200
    page.once("dialog", lambda d: asyncio.ensure_future(d.accept()))
    await made.locator(".revoke-key").click()
    await page.wait_for_selector("#key-notice:has-text('Revoked key ci')")
    assert (await asyncio.to_thread(_whoami, live_rt.url, secret)).status_code == 401
    assert await page.locator(f"#keys-table tr[data-key='{who['key_id']}']").count() == 0
    assert "1 revoked key not shown" in await page.inner_text("#keys")
    assert secret not in await page.content()  # the secret went with the notice that showed it
    assert problems == []

    # A key without the admin scope: no panel, no request for the keys.
    other = await _key(live_rt, acme, ["read", "deploy", "secrets"])
    asked: list[str] = []
    page.on("request", lambda r: asked.append(r.url) if "/v1/keys" in r.url else None)
    await page.click("#signout")
    await _sign_in(page, live_rt.url, other)
    assert await page.locator("#keys").count() == 0 and asked == []
    assert problems == []
