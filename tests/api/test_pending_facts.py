"""Facts that wait for confirmation (what an agent ``learn``s, what a tool said) can be listed, confirmed and
rejected over HTTP and through the SDK, by the tenant that owns them only; a confirmed fact counts as known from
its confirmation. Both store backends."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from moorage.client import AsyncClient, Client
from moorage.client.errors import Conflict, NotFound
from moorage.memory import FactCandidate, SemanticMemory
from moorage.store import Scope, Store
from tests.api.conftest import acme, aclient, agent_archive, globex, live_rt, runtime  # noqa: F401 - fixtures

LEARNS = '''
async def on_message(ctx, message):
    _, attribute, value = message.split(" ", 2)
    r = await ctx.memory.learn("user", attribute, value, f"the user's {attribute} is {value}")
    return r["status"]
'''


def _pending(ts, agent: str, user: str, attribute: str, value: str):  # type: ignore[no-untyped-def]
    return SemanticMemory(ts).record(Scope.for_user(agent, user), FactCandidate("user", attribute, value, value),
                                     origin="agent").fact


async def test_what_an_agent_learns_is_listed_confirmed_and_rejected_through_the_sdk(
        live_rt, store: Store, acme: str, tmp_path: Path) -> None:  # noqa: F811
    async with AsyncClient(live_rt.url, acme) as sdk:
        await sdk.deploy("pal", agent_archive(tmp_path, "pal", LEARNS))
        await sdk.add_fact("pal", "ada", "user", "city", "Lisbon")  # what the user said herself
        for attribute, value in [("city", "Porto"), ("likes", "jazz"), ("likes", "tea"), ("employer", "Hooli"),
                                 ("pet", "Miso")]:
            turn = await sdk.invoke("pal", f"learn {attribute} {value}", user="ada")
            assert turn["reply"] == "pending", turn
        # Paged (two at a time), oldest first, each once.
        pages = []
        cursor = None
        while True:
            page = await sdk.list_pending_facts("pal", "ada", limit=2, cursor=cursor)
            pages.append([f["value"] for f in page["data"]])
            cursor = page["next_cursor"]
            if cursor is None:
                break
        assert pages == [["Porto", "jazz"], ["tea", "Hooli"], ["Miso"]]
        waiting = {f["value"]: f async for f in sdk.paginate(sdk.list_pending_facts, "pal", "ada", limit=2)}
        assert all(f["status"] == "pending" and f["confirmed_at"] is None for f in waiting.values())
        # Current facts leave them out until they are confirmed.
        assert [f["value"] for f in (await sdk.list_facts("pal", "ada"))["data"]] == ["Lisbon"]

        await asyncio.sleep(0.05)
        before = time.time()
        await asyncio.sleep(0.05)
        done = await sdk.confirm_fact("pal", "ada", waiting["Porto"]["id"])
        assert done["action"] == "confirmed" and done["fact"]["status"] == "active", done
        assert done["previous"]["value"] == "Lisbon" and done["fact"]["confirmed_at"] > before
        assert (await sdk.reject_fact("pal", "ada", waiting["Hooli"]["id"]))["fact"]["status"] == "rejected"
        assert [f["value"] async for f in sdk.paginate(sdk.list_pending_facts, "pal", "ada")] == ["jazz", "tea", "Miso"]
        assert [f["value"] for f in (await sdk.list_facts("pal", "ada", attribute="city"))["data"]] == ["Porto"]
        # Known at an instant before the confirmation: the value believed then, Lisbon, and only it.
        then = (await sdk.list_facts("pal", "ada", attribute="city", known_at=before))["data"]
        assert [f["value"] for f in then] == ["Lisbon"], then
        now = (await sdk.list_facts("pal", "ada", attribute="city", known_at=time.time()))["data"]
        assert [f["value"] for f in now] == ["Porto"], now

        # Deciding twice is a conflict that names what to do; nothing changes.
        for decide in (sdk.confirm_fact, sdk.reject_fact):
            for fact_id in (waiting["Porto"]["id"], waiting["Hooli"]["id"]):
                with pytest.raises(Conflict, match="not pending"):
                    await decide("pal", "ada", fact_id)
        with pytest.raises(NotFound):
            await sdk.confirm_fact("pal", "ada", "no-such-fact")
    ts = store.tenant(store.authenticate(acme))
    assert ts.facts.get(waiting["Hooli"]["id"]).status == "rejected"


def test_the_sync_client_lists_and_decides_pending_facts(live, store: Store, acme: str) -> None:  # noqa: F811
    ts = store.tenant(store.authenticate(acme))
    ts.agents.create("pal")
    ts.agent_users.put("pal", "bo")  # one of its users: with nothing pending, an empty list (not a 404)
    first = _pending(ts, "pal", "bo", "city", "Oslo")
    second = _pending(ts, "pal", "bo", "pet", "Rex")
    with Client(live.url, acme) as sdk:
        assert [f["id"] for f in sdk.paginate(sdk.list_pending_facts, "pal", "bo", limit=1)] == [first.id, second.id]
        assert sdk.confirm_fact("pal", "bo", first.id)["fact"]["value"] == "Oslo"
        assert sdk.reject_fact("pal", "bo", second.id)["fact"]["status"] == "rejected"
        assert sdk.list_pending_facts("pal", "bo") == {"data": [], "next_cursor": None}
    assert SemanticMemory(ts).current(Scope.for_user("pal", "bo"), "user", "city").value == "Oslo"


async def test_no_other_tenant_user_or_key_can_list_or_decide_them(
        live, store: Store, acme: str, globex: str) -> None:  # noqa: F811
    victim = store.tenant(store.authenticate(acme))
    victim.agents.create("pal")
    fact = _pending(victim, "pal", "ada", "email", "ada@example.org")
    thief = store.tenant(store.authenticate(globex))
    thief.agents.create("pal")  # the same agent and user names in another tenant
    _pending(thief, "pal", "ada", "email", "thief@example.org")
    base = "/v1/agents/pal/users/ada/facts"
    async with aclient(live, globex) as c:
        listed = (await c.get(f"{base}/pending")).json()["data"]
        assert [f["value"] for f in listed] == ["thief@example.org"]  # its own, never the other tenant's
        for verb in ("confirm", "reject"):
            r = await c.post(f"{base}/{fact.id}/{verb}")
            assert r.status_code == 404 and "ada@example.org" not in r.text, r.text
    async with aclient(live, acme) as c:
        # Another user's path of the same tenant does not reach ada's fact.
        assert (await c.post(f"/v1/agents/pal/users/bo/facts/{fact.id}/confirm")).status_code == 404
        assert (await c.get("/v1/agents/pal/users/bo/facts/pending")).status_code == 404  # not one of its users
        read_only = (await c.post("/v1/keys", json={"scopes": ["read"]})).json()["secret"]
        for user in ("ada", "bo"):  # a users = "existing" agent issues tokens to its users only
            victim.agent_users.put("pal", user)
        ada = (await c.post("/v1/agents/pal/users/ada/tokens", json={})).json()["token"]
        bo = (await c.post("/v1/agents/pal/users/bo/tokens", json={})).json()["token"]
    async with aclient(live, read_only) as c:  # reading is enough to list, not to decide
        assert [f["id"] for f in (await c.get(f"{base}/pending")).json()["data"]] == [fact.id]
        assert (await c.post(f"{base}/{fact.id}/confirm")).status_code == 403
    async with aclient(live, ada) as c:  # the user herself sees what waits, but does not vouch through her token
        assert [f["id"] for f in (await c.get(f"{base}/pending")).json()["data"]] == [fact.id]
        assert (await c.post(f"{base}/{fact.id}/reject")).status_code == 403
    async with aclient(live, bo) as c:  # another user's token reads nothing of ada's
        assert (await c.get(f"{base}/pending")).status_code == 403
    assert victim.facts.get(fact.id).status == "pending" and victim.facts.get(fact.id).version == fact.version


async def test_a_malformed_cursor_is_refused(live, store: Store, acme: str) -> None:  # noqa: F811
    store.tenant(store.authenticate(acme)).agents.create("pal")
    async with aclient(live, acme) as c:
        for cursor in ("eyJhZnRlciI6IDd9", "not-a-cursor"):  # {"after": 7}, and no JSON at all
            r = await c.get("/v1/agents/pal/users/ada/facts/pending", params={"cursor": cursor})
            assert r.status_code == 422 and "cursor" in r.json()["detail"], r.text
