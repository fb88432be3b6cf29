"""The dashboard as an operator uses it, in headless Chromium over a real server and runtime."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from moorage.store import Scope, Store
from tests.api.conftest import aclient, agent_archive


async def _deploy(live: Any, key: str, tmp_path: Path, *turns: tuple[str, str]) -> list[dict[str, Any]]:
    async with aclient(live, key) as c:
        r = await c.post("/v1/agents/echo/deployments", content=agent_archive(tmp_path),
                         headers={"content-type": "application/gzip"})
        assert r.status_code == 201, r.text
        out = []
        for user, message in turns:
            r = await c.post("/v1/agents/echo/invoke", json={"message": message, "user": user})
            assert r.status_code == 200, r.text
            out.append(r.json())
        return out


def _watch(page: Any) -> list[str]:
    """Every script error, console error and failed (4xx/5xx) request of the page."""
    problems: list[str] = []
    page.on("pageerror", lambda e: problems.append(f"pageerror {e}"))
    page.on("console", lambda m: problems.append(f"console {m.text} {m.location.get('url')}") if m.type == "error" else None)
    page.on("response", lambda r: problems.append(f"http {r.status} {r.url}") if r.status >= 400 else None)
    return problems


async def _sign_in(page: Any, url: str, key: str) -> None:
    await page.goto(url + "/ui/")
    await page.fill("#key", key)
    await page.click("#login-form button[type=submit]")
    await page.wait_for_selector("body[data-loaded=fleet]")


@pytest.mark.parametrize("store", ["sqlite"], indirect=True)
async def test_signing_in_and_browsing_leaves_the_console_clean(live_rt, acme: str, tmp_path: Path, browser_context):
    await _deploy(live_rt, acme, tmp_path, ("alice", "hello"))
    page = await browser_context.new_page()
    problems = _watch(page)
    await _sign_in(page, live_rt.url, acme)
    await page.click("#instances-table a.user-link:has-text('alice')")
    await page.wait_for_selector("body[data-loaded=user]")
    await page.reload()
    await page.wait_for_selector("body[data-loaded=user]")
    # Not even the browser's own request for /favicon.ico may fail.
    assert problems == []


@pytest.mark.parametrize("store", ["sqlite"], indirect=True)
async def test_a_user_who_is_not_there_is_said_so_not_shown_empty(live_rt, acme: str, tmp_path: Path, browser_context):
    await _deploy(live_rt, acme, tmp_path, ("alice", "hello"), ("bob", "hi"))
    page = await browser_context.new_page()
    await _sign_in(page, live_rt.url, acme)
    await page.goto(f"{live_rt.url}/ui/#/user/echo/bob")
    await page.wait_for_selector("body[data-loaded=user]")
    assert "hi" in await page.inner_text("#events")

    # Forgotten through the API: the page that showed bob must not come back as an empty but valid-looking user.
    async with aclient(live_rt, acme) as c:
        assert (await c.delete("/v1/agents/echo/users/bob")).status_code == 200
    await page.reload()
    await page.wait_for_selector("body[data-loaded=error]")
    text = await page.inner_text("#view")
    assert "no user 'bob'" in text, text
    assert await page.locator("#checkpoints, #events").count() == 0

    # A typo in the URL is the same.
    await page.goto(f"{live_rt.url}/ui/#/user/echo/alcie")
    await page.wait_for_selector("body[data-loaded=error]")
    assert "no user 'alcie'" in await page.inner_text("#view")
    await page.goto(f"{live_rt.url}/ui/#/user/echo/alice")
    await page.wait_for_selector("body[data-loaded=user]")
    assert "hello" in await page.inner_text("#events")


@pytest.mark.parametrize("store", ["sqlite"], indirect=True)
async def test_a_failed_change_does_not_keep_the_last_ones_notice(live_rt, acme: str, tmp_path: Path, browser_context):
    await _deploy(live_rt, acme, tmp_path, ("alice", "one"), ("alice", "approve"))
    page = await browser_context.new_page()
    answers = {"prompt": ""}

    async def on_dialog(d: Any) -> None:
        await (d.accept(answers["prompt"]) if d.type == "prompt" else d.accept())

    page.on("dialog", lambda d: asyncio.ensure_future(on_dialog(d)))
    await _sign_in(page, live_rt.url, acme)
    await page.goto(f"{live_rt.url}/ui/#/user/echo/alice")
    await page.wait_for_selector("body[data-loaded=user] #checkpoints")

    await page.locator("#checkpoints li.ck", has_text="one").first.locator("button.rollback").click()
    await page.wait_for_selector("#checkpoints-notice:has-text('Rolled back to #1')")
    # A fork into an id the API refuses: the error alone is on the page, not the rollback's notice beside it.
    answers["prompt"] = "<img src=x onerror=alert(1)>"
    await page.locator("#checkpoints li.ck").first.locator("button.fork").click()
    await page.wait_for_selector("#checkpoints-error:has-text('422')")
    assert "malformed user id" in await page.inner_text("#checkpoints-error")
    assert (await page.inner_text("#checkpoints-notice")).strip() == ""


@pytest.mark.parametrize("store", ["sqlite"], indirect=True)
async def test_a_turn_waiting_for_approval_shows_no_empty_reply(live_rt, acme: str, tmp_path: Path, browser_context):
    await _deploy(live_rt, acme, tmp_path, ("alice", "one"), ("alice", "approve"))
    page = await browser_context.new_page()
    await _sign_in(page, live_rt.url, acme)
    await page.goto(f"{live_rt.url}/ui/#/user/echo/alice")
    await page.wait_for_selector("body[data-loaded=user] #checkpoints")
    # It has no reply yet: the row says it waits, it does not show an empty reply.
    waiting = page.locator("#checkpoints li.ck", has_text="approve").first
    text = await waiting.inner_text()
    assert "“”" not in text and "→" not in text and "waiting" in text, text
    assert await waiting.locator(".turn-reply").count() == 0
    done = page.locator("#checkpoints li.ck", has_text="one").first
    assert "→ “echo: one”" in await done.inner_text()


@pytest.mark.parametrize("store", ["sqlite"], indirect=True)
async def test_a_users_approval_shows_however_many_others_wait(live_rt, store: Store, acme: str, tmp_path: Path,
                                                               browser_context):
    await _deploy(live_rt, acme, tmp_path, ("alice", "hello"))
    # 260 other runs of the agent waiting since before alice's (the store lists the longest-waiting first).
    ts = store.tenant(store.authenticate(acme))
    with ts.transaction():
        for i in range(260):
            run = ts.runs.create(Scope.workflow("echo", f"r{i:03d}", f"u{i:03d}"), "turn", {"message": "approve"})
            ts.runs.update(run.id, expected_version=run.version, status="waiting", current_step="interrupt:approval")
    (waiting,) = await _invoke(live_rt, acme, ("alice", "approve"))
    assert waiting["status"] == "waiting"

    page = await browser_context.new_page()
    await _sign_in(page, live_rt.url, acme)
    # The fleet lists the longest-waiting ones and says that there are more than it shows.
    assert await page.locator("#waiting li").count() == 50
    assert "more" in await page.inner_text("#waiting .hint")
    await page.goto(f"{live_rt.url}/ui/#/user/echo/alice")
    await page.wait_for_selector("body[data-loaded=user]")
    assert "ship it?" in await page.inner_text("#approvals")


async def _invoke(live: Any, key: str, *turns: tuple[str, str]) -> list[dict[str, Any]]:
    async with aclient(live, key) as c:
        return [(await c.post("/v1/agents/echo/invoke", json={"message": m, "user": u})).json() for u, m in turns]


@pytest.mark.parametrize("store", ["sqlite"], indirect=True)
async def test_a_view_left_while_loading_does_not_replace_the_next_one(live_rt, acme: str, tmp_path: Path,
                                                                      browser_context):
    await _deploy(live_rt, acme, tmp_path, ("alice", "hello"))
    page = await browser_context.new_page()
    await _sign_in(page, live_rt.url, acme)

    # alice's facts answer slowly; the operator goes back to the fleet before her view is drawn.
    async def slow(route: Any) -> None:
        await asyncio.sleep(1.5)
        await route.continue_()

    await page.route("**/v1/agents/echo/users/alice/facts*", slow)
    await page.goto(f"{live_rt.url}/ui/#/user/echo/alice")
    await page.wait_for_timeout(200)
    await page.click("nav a[data-nav=fleet]")
    await page.wait_for_selector("body[data-loaded=fleet]")
    await page.wait_for_timeout(2500)  # alice's view has had its answers by now
    assert await page.evaluate("document.body.dataset.view") == "fleet"
    assert await page.evaluate("document.body.dataset.loaded") == "fleet"
    assert await page.locator("#instances-table").count() == 1
    assert await page.locator("#checkpoints").count() == 0


@pytest.mark.parametrize("store", ["sqlite"], indirect=True)
async def test_forgetting_the_key_while_a_view_loads_leaves_only_the_sign_in_form(live_rt, acme: str, tmp_path: Path,
                                                                                  browser_context):
    await _deploy(live_rt, acme, tmp_path, ("alice", "hello"))
    page = await browser_context.new_page()
    await _sign_in(page, live_rt.url, acme)

    async def slow(route: Any) -> None:
        await asyncio.sleep(1.5)
        await route.continue_()

    await page.route("**/v1/agents/echo/users/alice/facts*", slow)
    await page.goto(f"{live_rt.url}/ui/#/user/echo/alice")
    await page.wait_for_timeout(200)
    await page.click("#signout")
    await page.wait_for_timeout(2500)
    assert await page.is_visible("#login")
    assert (await page.inner_text("#view")).strip() == ""
    # Signed out on purpose: no claim that the key was refused (the abandoned view's requests went without it).
    assert (await page.inner_text("#login-error")).strip() == ""


@pytest.mark.parametrize("store", ["sqlite"], indirect=True)
async def test_episodic_memory_shows_the_newest_events_of_a_long_history(live_rt, store: Store, acme: str,
                                                                         tmp_path: Path, browser_context):
    await _deploy(live_rt, acme, tmp_path, ("alice", "hello"))
    # More than one page (500) of the session's log, a working-memory summary on its second page, then a turn.
    ts = store.tenant(store.authenticate(acme))
    scope = Scope.session("echo", "alice", "default")
    with ts.transaction():
        for i in range(700):
            if i in (100, 600):
                ts.events.append(scope, "summary", f"summary as of {i}")
            ts.events.append(scope, "message", f"old words {i}", speaker="user")
    await _invoke(live_rt, acme, ("alice", "the latest words"))

    page = await browser_context.new_page()
    await _sign_in(page, live_rt.url, acme)
    await page.goto(f"{live_rt.url}/ui/#/user/echo/alice")
    await page.wait_for_selector("body[data-loaded=user]")
    events = page.locator("#events li")
    assert "echo: the latest words" in await events.nth(0).inner_text()
    assert "the latest words" in await events.nth(1).inner_text()
    assert "old words 699" in await events.nth(2).inner_text()
    assert "old words 1" not in await page.inner_text("#events")
    assert "summary as of 600" in await page.inner_text("#working")


@pytest.mark.parametrize("store", ["sqlite"], indirect=True)
async def test_a_malformed_link_says_so(live_rt, acme: str, tmp_path: Path, browser_context):
    await _deploy(live_rt, acme, tmp_path, ("alice", "hello"))
    page = await browser_context.new_page()
    problems = _watch(page)
    await _sign_in(page, live_rt.url, acme)
    # A link cut off in a chat message: a lone "%" cannot be decoded.
    await page.goto(f"{live_rt.url}/ui/#/user/echo/ali%ZZ")
    await page.wait_for_selector("body[data-loaded=error]")
    assert "not valid" in await page.inner_text("#view")
    assert await page.locator("#instances-table").count() == 0
    assert problems == []


@pytest.mark.parametrize("store", ["sqlite"], indirect=True)
async def test_many_facts_and_sessions_are_all_listed_or_said_to_be_more(live_rt, store: Store, acme: str,
                                                                         tmp_path: Path, browser_context):
    await _deploy(live_rt, acme, tmp_path, ("alice", "hello"), ("bob", "hi"))
    ts = store.tenant(store.authenticate(acme))
    with ts.transaction():
        for i in range(230):  # a multi-valued attribute: every value stays current
            ts.facts.insert(Scope.for_user("echo", "alice"), "user", "likes", f"thing {i:03d}", f"I like thing {i}")
        for i in range(2010):
            ts.facts.insert(Scope.for_user("echo", "bob"), "user", "likes", f"thing {i:04d}", f"I like thing {i}")
        for i in range(105):
            ts.sessions.open("echo", "bob", f"s{i:03d}")

    page = await browser_context.new_page()
    await _sign_in(page, live_rt.url, acme)
    await page.goto(f"{live_rt.url}/ui/#/user/echo/alice")
    await page.wait_for_selector("body[data-loaded=user]")
    assert await page.locator("#facts-table tbody tr").count() == 230
    assert await page.locator("#facts .hint, #sessions .hint").count() == 0
    await page.goto(f"{live_rt.url}/ui/#/user/echo/bob")
    await page.wait_for_selector("body[data-loaded=user]")
    assert await page.locator("#facts-table tbody tr").count() == 2000
    assert "there are more" in await page.inner_text("#facts .hint")
    assert await page.locator("#sessions tbody tr").count() == 100
    assert "there are more" in await page.inner_text("#sessions .hint")


@pytest.mark.parametrize("store", ["sqlite"], indirect=True)
async def test_an_agent_with_one_instance_per_session_says_it_has_no_timeline(live_rt, acme: str, tmp_path: Path,
                                                                             browser_context):
    import io
    import tarfile

    buf = io.BytesIO()
    files = {"moorage.toml": '[agent]\nname = "sess"\nentry = "agent.py"\nscope = "session"\n'
                             '[agent.lifecycle]\nusers = "auto"\n',
             "agent.py": "async def on_message(ctx, message):\n    return 'ok ' + message\n"}
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, text in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(text.encode())
            tar.addfile(info, io.BytesIO(text.encode()))
    async with aclient(live_rt, acme) as c:
        r = await c.post("/v1/agents/sess/deployments", content=buf.getvalue(), headers={"content-type": "application/gzip"})
        assert r.status_code == 201, r.text
        for session in ("s1", "s2"):
            r = await c.post("/v1/agents/sess/invoke", json={"message": "hey", "user": "sam", "session": session})
            assert r.status_code == 200, r.text
    page = await browser_context.new_page()
    await _sign_in(page, live_rt.url, acme)
    await page.goto(f"{live_rt.url}/ui/#/user/sess/sam")
    await page.wait_for_selector("body[data-loaded=user]")
    text = await page.inner_text("#checkpoints")
    # Two turns went by: "one is taken after every turn" would be untrue here.
    assert "one instance per session" in text and "after every turn" not in text, text
    assert await page.locator("#sessions tbody tr").count() == 2
    # The fleet has one instance per session of sam's: each row says which session it is.
    await page.goto(f"{live_rt.url}/ui/#/fleet")
    await page.wait_for_selector("body[data-loaded=fleet]")
    rows = await page.locator("#instances-table tbody tr", has_text="sam").all_inner_texts()
    assert len(rows) == 2 and any("session s1" in r for r in rows) and any("session s2" in r for r in rows), rows


@pytest.mark.parametrize("store", ["sqlite"], indirect=True)
async def test_a_rollback_notice_stays_on_the_timeline_it_changed(live_rt, acme: str, tmp_path: Path, browser_context):
    await _deploy(live_rt, acme, tmp_path, ("alice", "one"), ("alice", "two"), ("bob", "hi"), ("bob", "there"))
    page = await browser_context.new_page()
    page.on("dialog", lambda d: asyncio.ensure_future(d.accept()))
    await _sign_in(page, live_rt.url, acme)
    await page.goto(f"{live_rt.url}/ui/#/user/echo/alice")
    await page.wait_for_selector("body[data-loaded=user] #checkpoints")

    # alice's rollback answers slowly; meanwhile the operator opens bob's page.
    async def slow(route: Any) -> None:
        await asyncio.sleep(1.5)
        await route.continue_()

    await page.route("**/v1/agents/echo/users/alice/checkpoints/*/rollback", slow)
    await page.locator("#checkpoints li.ck", has_text="one").first.locator("button.rollback").click()
    await page.wait_for_timeout(200)
    await page.goto(f"{live_rt.url}/ui/#/user/echo/bob")
    await page.wait_for_selector("body[data-loaded=user]")
    await page.wait_for_timeout(2500)  # the rollback has answered and the page was drawn again
    assert await page.evaluate("document.body.dataset.loaded") == "user"
    assert "bob" in await page.inner_text(".pagehead h1")
    assert (await page.inner_text("#checkpoints-notice")).strip() == ""
    async with aclient(live_rt, acme) as c:  # the rollback itself happened, on alice
        listing = (await c.get("/v1/agents/echo/users/alice/checkpoints")).json()
    assert next(ck for ck in listing["data"] if ck["id"] == listing["head"])["seq"] == 1


@pytest.mark.parametrize("store", ["sqlite"], indirect=True)
async def test_long_unbroken_ids_and_text_stay_inside_the_window(live_rt, acme: str, tmp_path: Path, browser_context):
    user = "L" + "x" * 127  # the longest user id the API takes
    word = "y" * 3000
    await _deploy(live_rt, acme, tmp_path, ("alice", "hello"), (user, word))
    async with aclient(live_rt, acme) as c:
        r = await c.post(f"/v1/agents/echo/users/{user}/facts", json={"subject": "user", "attribute": "note", "value": word})
        assert r.status_code == 201, r.text
    page = await browser_context.new_page()
    await _sign_in(page, live_rt.url, acme)
    width = await page.evaluate("window.innerWidth")
    assert await page.evaluate("document.documentElement.scrollWidth") <= width
    disk = await page.locator("#instances-table thead th").last.bounding_box()
    assert disk["x"] + disk["width"] <= width  # the last column (Disk) is on screen
    await page.goto(f"{live_rt.url}/ui/#/user/echo/{user}")
    await page.wait_for_selector("body[data-loaded=user] #checkpoints li.ck")
    assert await page.evaluate("document.documentElement.scrollWidth") <= width
    ck = page.locator("#checkpoints li.ck").first
    what, button = await ck.locator(".what").bounding_box(), await ck.locator("button.rollback").bounding_box()
    overlap_x = min(what["x"] + what["width"], button["x"] + button["width"]) - max(what["x"], button["x"])
    overlap_y = min(what["y"] + what["height"], button["y"] + button["height"]) - max(what["y"], button["y"])
    assert overlap_x <= 0 or overlap_y <= 0, (what, button)  # the button is not drawn over the turn's text
    assert button["x"] + button["width"] <= width


@pytest.mark.parametrize("store", ["sqlite"], indirect=True)
async def test_an_approvals_question_reads_as_the_agent_asked_it(live_rt, acme: str, tmp_path: Path, browser_context):
    body = '''
import json

async def on_message(ctx, message):
    kind = {"text": "Ship the release?", "nested": {"question": {"what": "deploy", "to": "prod"}},
            "plain": {"question": "Refund 12.50?"}}[message]
    return str(await ctx.interrupt(kind))
'''
    async with aclient(live_rt, acme) as c:
        r = await c.post("/v1/agents/ask/deployments", content=agent_archive(tmp_path, "ask", body),
                         headers={"content-type": "application/gzip"})
        assert r.status_code == 201, r.text
        for user in ("text", "nested", "plain"):
            r = await c.post("/v1/agents/ask/invoke", json={"message": user, "user": user})
            assert r.json()["status"] == "waiting", r.text
    page = await browser_context.new_page()
    await _sign_in(page, live_rt.url, acme)
    seen = {}
    for user in ("text", "nested", "plain"):
        await page.goto(f"{live_rt.url}/ui/#/user/ask/{user}")
        await page.wait_for_selector(f"body[data-loaded=user] .pagehead h1:has-text('{user}')")
        seen[user] = (await page.inner_text("#approvals .question")).strip()
        assert (await page.inner_text("#checkpoints .hint")).startswith("1 checkpoint · ")  # one turn so far
    assert seen == {"text": "Ship the release?", "nested": '{"what":"deploy","to":"prod"}', "plain": "Refund 12.50?"}


@pytest.mark.parametrize("store", ["sqlite"], indirect=True)
async def test_a_trace_draws_each_span_under_its_own_parent(live_rt, store: Store, acme: str, browser_context):
    from moorage.store.model import Span

    ts = store.tenant(store.authenticate(acme))
    t0 = 1_800_000_000.0
    # Two concurrent calls of one turn: "fetch b" starts while "fetch a" runs; "dns a" is a's child, and
    # starts after b did.
    for span_id, parent, name, start, end in (("r", None, "POST /v1/agents/{agent}/invoke", 0.0, 0.010),
                                              ("a", "r", "fetch a", 0.001, 0.009), ("b", "r", "fetch b", 0.002, 0.003),
                                              ("a1", "a", "dns a", 0.004, 0.005)):
        ts.spans.record(Span("t" * 32, span_id, parent, name, t0 + start, t0 + end, "ok", {}))
    page = await browser_context.new_page()
    await _sign_in(page, live_rt.url, acme)
    await page.goto(f"{live_rt.url}/ui/#/trace/{'t' * 32}")
    await page.wait_for_selector("body[data-loaded=trace]")
    labels = page.locator("#timeline .span-row:not(.axis) .span-label")
    names = [(await labels.nth(i).inner_text()).strip() for i in range(await labels.count())]
    assert names == ["POST /v1/agents/{agent}/invoke", "fetch a", "dns a", "fetch b"]
    pads = [await labels.nth(i).evaluate("e => e.style.paddingLeft") for i in range(4)]
    assert pads == ["0px", "14px", "28px", "14px"]


@pytest.mark.parametrize("store", ["sqlite"], indirect=True)
async def test_recent_traces_list_turns_not_the_dashboards_own_reads(live_rt, acme: str, tmp_path: Path,
                                                                     browser_context):
    turns = await _deploy(live_rt, acme, tmp_path, ("alice", "hello"), ("bob", "hi"))
    page = await browser_context.new_page()
    await _sign_in(page, live_rt.url, acme)
    # An operator looks around: every view reads the API, and every read is a trace of its own.
    for _ in range(3):
        for view in ("#/user/echo/alice", "#/user/echo/bob", "#/fleet"):
            await page.goto(f"{live_rt.url}/ui/{view}")
            await page.wait_for_selector(f"body[data-loaded={'fleet' if view == '#/fleet' else 'user'}]")
    async with aclient(live_rt, acme) as c:  # and a script polls the fleet, 600 times
        for _ in range(600):
            assert (await c.get("/v1/fleet")).status_code == 200
    await page.reload()
    await page.wait_for_selector("body[data-loaded=fleet]")
    names = await page.locator("#traces-table a.trace-link").all_inner_texts()
    assert not [n for n in names if n.startswith("GET ")], names
    hrefs = await page.locator("#traces-table a.trace-link").evaluate_all("links => links.map(a => a.getAttribute('href'))")
    assert {f"#/trace/{t['trace_id']}" for t in turns} <= set(hrefs)
    assert "POST /v1/agents/{agent}/invoke" in names


@pytest.mark.parametrize("store", ["sqlite"], indirect=True)
async def test_a_timeline_with_automatic_checkpoints_off_says_so(live_rt, acme: str, tmp_path: Path, browser_context):
    from tests.timetravel.conftest import tt_archive

    async with aclient(live_rt, acme) as c:
        r = await c.post("/v1/agents/tt/deployments", headers={"content-type": "application/gzip"},
                         content=tt_archive(tmp_path, manifest="[agent.timetravel]\nauto = false\n"))
        assert r.status_code == 201, r.text
        for i in (1, 2):
            assert (await c.post("/v1/agents/tt/invoke", json={"message": f"turn {i}", "user": "carol"})).status_code == 200
    page = await browser_context.new_page()
    await _sign_in(page, live_rt.url, acme)
    await page.goto(f"{live_rt.url}/ui/#/user/tt/carol")
    await page.wait_for_selector("body[data-loaded=user]")
    text = await page.inner_text("#checkpoints")
    # Two turns went by without a checkpoint: "one is taken after every turn" would be untrue here.
    assert "auto = false" in text and "after every turn" not in text, text


@pytest.mark.parametrize("store", ["sqlite"], indirect=True)
async def test_a_phone_sized_window_never_scrolls_sideways(live_rt, acme: str, tmp_path: Path, browser_context):
    turns = await _deploy(live_rt, acme, tmp_path, ("alice", "hello"), ("alice", "approve"))
    page = await browser_context.new_page()
    await page.set_viewport_size({"width": 390, "height": 844})
    await _sign_in(page, live_rt.url, acme)
    for view, loaded in (("#/fleet", "fleet"), ("#/user/echo/alice", "user"), (f"#/trace/{turns[0]['trace_id']}", "trace"),
                         ("#/approvals", "approvals"), ("#/agent/echo", "agent")):
        await page.goto(f"{live_rt.url}/ui/{view}")
        await page.wait_for_selector(f"body[data-loaded={loaded}]")
        assert await page.evaluate("document.documentElement.scrollWidth") <= 390, view
        card = await page.locator(".card, .panel").first.bounding_box()
        assert card["x"] >= 0 and card["x"] + card["width"] <= 390, view
