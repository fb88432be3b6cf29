"""A key limited to one agent reads that agent's fleet, usage and sandboxes, naming the agent on the query as for
workflow runs and traces (without it, or with another agent, a 403 whose hint says what to add), and never another
agent's instances, counts, wakes, costs or sandboxes, nor anything of another tenant (whose agent has the same name)."""

from __future__ import annotations

from pathlib import Path

from moorage.client import AsyncClient
from moorage.client.errors import AuthError, NotFound
from moorage.store import Store
from tests.api.conftest import aclient, agent_archive

GZ = {"content-type": "application/gzip"}
#: Ledger amounts per (tenant, agent, user): distinct enough that any leak shows in a sum.
SPEND = {("acme", "echo", "u1"): (100, 0.5), ("acme", "echo", "u2"): (20, 0.25),
         ("acme", "other", "u1"): (7000, 9.0), ("globex", "echo", "g1"): (300_000, 40.0)}


async def _setup(live_rt, store: Store, keys: dict[str, str], tmp_path: Path) -> dict[tuple[str, str, str], str]:  # noqa: ANN001
    """Deploys, one turn per user (its instance), the ledger's spend; a sleep and a wake of acme/other's instance.
    Returns each (tenant, agent, user)'s sandbox id."""
    boxes = {}
    for tenant, agent, user in SPEND:
        async with aclient(live_rt, keys[tenant]) as admin:
            if (await admin.get(f"/v1/agents/{agent}")).status_code == 404:
                r = await admin.post(f"/v1/agents/{agent}/deployments", content=agent_archive(tmp_path, agent), headers=GZ)
                assert r.status_code == 201, r.text
            r = await admin.post(f"/v1/agents/{agent}/invoke", json={"message": "hi", "user": user})
            assert r.status_code == 200, r.text
        ts = store.tenant(store.authenticate(keys[tenant]))
        tokens, usd = SPEND[tenant, agent, user]
        ts.usage.add("input_tokens", tokens, agent_id=agent, user_id=user)
        ts.usage.add("cost_usd", usd, agent_id=agent, user_id=user)
        boxes[tenant, agent, user] = next(b.id for b in ts.sandboxes.list() if b.agent_id == agent and b.scope.user == user)
    async with aclient(live_rt, keys["acme"]) as admin:  # the other agent's instance wakes once: a wake of its own
        for verb in ("sleep", "wake"):
            r = await admin.post(f"/v1/sandboxes/{boxes['acme', 'other', 'u1']}/{verb}")
            assert r.status_code == 200, r.text
    return boxes


async def test_a_key_for_one_agent_reads_its_agents_fleet_usage_and_sandboxes_only(live_rt, store: Store,  # noqa: ANN001
                                                                                  acme: str, globex: str,
                                                                                  tmp_path: Path) -> None:
    keys = {"acme": acme, "globex": globex}
    boxes = await _setup(live_rt, store, keys, tmp_path)
    async with aclient(live_rt, acme) as admin:
        key = (await admin.post("/v1/keys", json={"scopes": ["read"], "agent": "echo"})).json()["secret"]
        whole = (await admin.get("/v1/fleet", params={"since": 0})).json()
        assert whole["total"] == 3 and whole["wake_ms"]["count"] >= 1, whole  # the tenant's, for contrast
        echo_usage = (await admin.get("/v1/usage", params={"agent": "echo"})).json()["totals"]
    async with aclient(live_rt, key) as c:
        # Each listing names its agent: without it, or with another, refused (never a silent filter).
        for path in ("/v1/fleet", "/v1/usage", "/v1/sandboxes"):
            for params in ({}, {"agent": "other"}):
                r = await c.get(path, params=params)
                assert r.status_code == 403 and "agent=echo" in r.json()["hint"], (path, params, r.text)

        fleet = (await c.get("/v1/fleet", params={"agent": "echo", "since": 0})).json()
        mine = {boxes["acme", "echo", "u1"], boxes["acme", "echo", "u2"]}
        assert {i["id"] for i in fleet["instances"]} == mine and {i["agent_id"] for i in fleet["instances"]} == {"echo"}
        assert fleet["total"] == 2 and sum(fleet["counts"].values()) == 2, fleet
        assert fleet["wake_ms"]["count"] == 0, fleet["wake_ms"]  # the other agent's wake is not its
        assert fleet["usage"]["input_tokens"] == 120 and fleet["cost"]["model"] == 0.75, fleet
        assert fleet["usage"] == echo_usage  # its compute seconds too: none of the other agent's sleep

        usage = (await c.get("/v1/usage", params={"agent": "echo"})).json()
        assert usage["totals"]["input_tokens"] == 120 and usage["cost_usd"] == 0.75, usage
        one = (await c.get("/v1/usage", params={"agent": "echo", "user": "u1", "group": "day"})).json()
        assert one["totals"]["input_tokens"] == 100 and one["cost_usd"] == 0.5, one  # not the other agent's u1
        assert sum(d["totals"].get("input_tokens", 0) for d in one["days"]) == 100

        listed = (await c.get("/v1/sandboxes", params={"agent": "echo"})).json()
        assert {b["id"] for b in listed["data"]} == mine and listed["next_cursor"] is None
        paged, cursor = [], None
        while True:
            page = (await c.get("/v1/sandboxes", params={"agent": "echo", "limit": 1,
                                                         **({"cursor": cursor} if cursor else {})})).json()
            paged += [b["id"] for b in page["data"]]
            if (cursor := page["next_cursor"]) is None:
                break
        assert sorted(paged) == sorted(mine)

        r = await c.get(f"/v1/sandboxes/{boxes['acme', 'echo', 'u1']}")
        assert r.status_code == 200 and r.json()["agent_id"] == "echo", r.text
        # Another agent's sandbox, another tenant's and one that does not exist: the same 404.
        answers = []
        for sandbox_id in (boxes["acme", "other", "u1"], boxes["globex", "echo", "g1"], "sbx-nothing"):
            r = await c.get(f"/v1/sandboxes/{sandbox_id}")
            assert r.status_code == 404, r.text
            answers.append({k: str(v).replace(sandbox_id, "<id>") for k, v in r.json().items()
                            if k not in ("trace_id", "instance")})
        assert answers[0] == answers[1] == answers[2] and "<id>" in answers[0]["detail"], answers

    # The SDK passes the agent on, and its errors say the same.
    async with AsyncClient(live_rt.url, key, max_retries=0) as sdk:
        assert (await sdk.fleet(agent="echo", since=0, limit=1))["total"] == 2
        assert (await sdk.usage(agent="echo"))["totals"]["input_tokens"] == 120
        assert {b["id"] for b in (await sdk.list_sandboxes(agent="echo"))["data"]} == mine
        for call in (sdk.fleet(), sdk.usage(agent="other"), sdk.list_sandboxes()):
            try:
                await call
                raise AssertionError("a listing without the key's agent was answered")
            except AuthError as e:
                assert e.status == 403 and "agent=echo" in (e.hint or "")
        try:
            await sdk.get_sandbox(boxes["acme", "other", "u1"])
            raise AssertionError("another agent's sandbox was found")
        except NotFound:
            pass


async def test_another_tenants_agent_of_the_same_name_is_not_counted(live_rt, store: Store, acme: str,  # noqa: ANN001
                                                                    globex: str, tmp_path: Path) -> None:
    keys = {"acme": acme, "globex": globex}
    boxes = await _setup(live_rt, store, keys, tmp_path)
    async with aclient(live_rt, globex) as admin:
        key = (await admin.post("/v1/keys", json={"scopes": ["read"], "agent": "echo"})).json()["secret"]
    for secret in (globex, key):  # its admin key and its key limited to echo see globex's echo only
        async with aclient(live_rt, secret) as c:
            fleet = (await c.get("/v1/fleet", params={"agent": "echo", "since": 0})).json()
            assert [i["id"] for i in fleet["instances"]] == [boxes["globex", "echo", "g1"]], fleet
            assert fleet["usage"]["input_tokens"] == 300_000 and fleet["cost"]["model"] == 40.0, fleet
            usage = (await c.get("/v1/usage", params={"agent": "echo"})).json()
            assert usage["totals"]["input_tokens"] == 300_000 and usage["cost_usd"] == 40.0, usage
            listed = (await c.get("/v1/sandboxes", params={"agent": "echo"})).json()["data"]
            assert [b["id"] for b in listed] == [boxes["globex", "echo", "g1"]]
            for theirs in (boxes["acme", "echo", "u1"], boxes["acme", "other", "u1"]):
                assert (await c.get(f"/v1/sandboxes/{theirs}")).status_code == 404
