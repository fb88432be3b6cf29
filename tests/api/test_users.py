"""End-users as a resource over HTTP with the real runtime: idempotent put, get, list with metadata filters and
pages, eager provisioning (forked, then asleep), delete = forget; another tenant sees none of it."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

from moorage.store import Store
from tests.api.conftest import aclient, agent_archive

GZ = {"content-type": "application/gzip"}


def existing_users_archive(tmp_path: Path, name: str = "strict") -> bytes:
    """An agent with the default ``users = "existing"``: turns for users nobody created are refused."""
    root = tmp_path / f"src-{name}"
    root.mkdir(parents=True, exist_ok=True)
    (root / "moorage.toml").write_text(f'[agent]\nname = "{name}"\nentry = "agent.py"\n')
    (root / "agent.py").write_text('async def on_message(ctx, message):\n    return f"hi {ctx.user}: " + message\n')
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for p in sorted(root.iterdir()):
            tar.add(p, arcname=p.name)
    return buf.getvalue()


async def test_put_is_an_idempotent_get_or_create_and_turns_follow(live_rt, acme: str, tmp_path: Path):
    async with aclient(live_rt, acme) as c:
        assert (await c.post("/v1/agents/strict/deployments", content=existing_users_archive(tmp_path), headers=GZ)).status_code == 201
        r = await c.post("/v1/agents/strict/invoke", json={"message": "hello", "user": "cust-42"})
        assert r.status_code == 404

        first = await c.put("/v1/agents/strict/users/cust-42", json={"metadata": {"plan": "pro", "seats": 3},
                                                                    "limits": {"compute_seconds_per_day": 600}})
        assert first.status_code == 201, first.text
        assert first.headers["location"] == "/v1/agents/strict/users/cust-42"
        again = await c.put("/v1/agents/strict/users/cust-42", json={"metadata": {"plan": "pro", "seats": 3},
                                                                    "limits": {"compute_seconds_per_day": 600}})
        assert again.status_code == 200
        assert {k: v for k, v in again.json().items() if k != "updated_at"} == \
               {k: v for k, v in first.json().items() if k != "updated_at"}
        bare = await c.put("/v1/agents/strict/users/cust-42")  # no body: get, change nothing
        assert bare.status_code == 200 and bare.json()["metadata"] == {"plan": "pro", "seats": 3}
        assert bare.json()["limits"] == {"compute_seconds_per_day": 600.0}
        assert bare.json()["instance"] is None  # lazy: nothing forked before the first turn
        # A get-or-create replays no stored answer for its Idempotency-Key (docs/api.md): asked again it is a get.
        keyed = [await c.put("/v1/agents/strict/users/cust-43", json={}, headers={"Idempotency-Key": "put-43"})
                 for _ in range(2)]
        assert [r.status_code for r in keyed] == [201, 200]
        assert "idempotent-replayed" not in keyed[1].headers

        r = await c.post("/v1/agents/strict/invoke", json={"message": "hello", "user": "cust-42"})
        assert r.status_code == 200 and r.json()["reply"] == "hi cust-42: hello"
        got = (await c.get("/v1/agents/strict/users/cust-42")).json()
        assert got["instance"]["state"] in ("running", "sleeping")

        assert (await c.put("/v1/agents/strict/users/cust-42", json={"limits": {"bogus": 1}})).status_code == 422
        assert (await c.put("/v1/agents/strict/users/cust-42", json={"limits": {"tokens_per_month": -1}})).status_code == 422
        assert (await c.put("/v1/agents/nobody/users/cust-42", json={})).status_code == 404
        assert (await c.put("/v1/agents/strict/users/bad%20id", json={})).status_code == 422


async def test_list_filters_by_metadata_and_pages(live_rt, acme: str, tmp_path: Path):
    async with aclient(live_rt, acme) as c:
        assert (await c.post("/v1/agents/echo/deployments", content=agent_archive(tmp_path), headers=GZ)).status_code == 201
        for i in range(7):
            meta = {"plan": "pro" if i % 2 else "free", "n": i, "beta": i == 3}
            assert (await c.put(f"/v1/agents/echo/users/u{i}", json={"metadata": meta})).status_code == 201
        seen, cursor = [], None
        while True:
            page = (await c.get("/v1/agents/echo/users", params={"limit": 2, **({"cursor": cursor} if cursor else {})})).json()
            seen += [u["id"] for u in page["data"]]
            cursor = page["next_cursor"]
            if cursor is None:
                break
        assert seen == [f"u{i}" for i in range(7)]
        pro = (await c.get("/v1/agents/echo/users", params={"metadata.plan": "pro"})).json()["data"]
        assert [u["id"] for u in pro] == ["u1", "u3", "u5"]
        beta = (await c.get("/v1/agents/echo/users", params={"metadata.plan": "pro", "metadata.beta": "true"})).json()
        assert [u["id"] for u in beta["data"]] == ["u3"]
        p1 = (await c.get("/v1/agents/echo/users", params={"metadata.plan": "pro", "limit": 2})).json()
        p2 = (await c.get("/v1/agents/echo/users", params={"metadata.plan": "pro", "cursor": p1["next_cursor"]})).json()
        assert [u["id"] for u in p1["data"] + p2["data"]] == ["u1", "u3", "u5"] and p2["next_cursor"] is None


async def test_eager_provisioning_forks_then_sleeps(live_rt, acme: str, store: Store, tmp_path: Path):
    async with aclient(live_rt, acme) as c:
        assert (await c.post("/v1/agents/echo/deployments", content=agent_archive(tmp_path), headers=GZ)).status_code == 201
        r = await c.put("/v1/agents/echo/users/early?provision=true", json={"metadata": {"plan": "pro"}})
        assert r.status_code == 201, r.text
        instance = r.json()["instance"]
        assert instance is not None and instance["state"] == "sleeping"
        ts = store.tenant(store.authenticate(acme))
        rec = ts.sandboxes.get(instance["sandbox_id"])
        assert rec.state == "sleeping" and rec.scope.user == "early"
        # The first turn wakes that very instance: no second fork.
        assert (await c.post("/v1/agents/echo/invoke", json={"message": "hi", "user": "early"})).json()["reply"] == "echo: hi"
        assert [b.id for b in ts.sandboxes.list() if b.scope.user == "early"] == [rec.id]


async def test_delete_forgets_the_user(live_rt, acme: str, store: Store, tmp_path: Path):
    async with aclient(live_rt, acme) as c:
        assert (await c.post("/v1/agents/echo/deployments", content=agent_archive(tmp_path), headers=GZ)).status_code == 201
        assert (await c.put("/v1/agents/echo/users/leaver", json={"metadata": {"x": 1}})).status_code == 201
        assert (await c.post("/v1/agents/echo/invoke", json={"message": "remember me", "user": "leaver"})).status_code == 200
        r = await c.delete("/v1/agents/echo/users/leaver")
        assert r.status_code == 200 and r.json()["deleted"] is True and r.json()["removed"] > 0
        assert (await c.get("/v1/agents/echo/users/leaver")).status_code == 404
        assert (await c.get("/v1/agents/echo/users/leaver/events")).status_code == 404  # no such user now, no log
    ts = store.tenant(store.authenticate(acme))
    assert [b for b in ts.sandboxes.list() if b.scope.user == "leaver"] == []


async def test_users_do_not_cross_tenants(live_rt, acme: str, globex: str, tmp_path: Path):
    async with aclient(live_rt, globex) as g:
        assert (await g.post("/v1/agents/echo/deployments", content=agent_archive(tmp_path, version="g"), headers=GZ)).status_code == 201
        assert (await g.put("/v1/agents/echo/users/shared-id", json={"metadata": {"owner": "globex"}})).status_code == 201
    async with aclient(live_rt, acme) as a:
        assert (await a.post("/v1/agents/echo/deployments", content=agent_archive(tmp_path), headers=GZ)).status_code == 201
        assert (await a.get("/v1/agents/echo/users/shared-id")).status_code == 404
        assert (await a.get("/v1/agents/echo/users")).json()["data"] == []
        # The same external id in another tenant is another user: created fresh, globex's metadata unseen.
        mine = await a.put("/v1/agents/echo/users/shared-id", json={})
        assert mine.status_code == 201 and mine.json()["metadata"] == {}
        assert (await a.delete("/v1/agents/echo/users/shared-id")).status_code == 200
    async with aclient(live_rt, globex) as g:
        assert (await g.get("/v1/agents/echo/users/shared-id")).json()["metadata"] == {"owner": "globex"}
