"""``DELETE /v1/agents/{agent}`` over a real runtime (process sandboxes), both store backends: every end-user of the
agent and everything the agent kept leave the store (no table names it afterwards but the usage ledger, whose
amounts stay in the tenant's totals) and its instances leave the host's disk; its keys stop working; the name is
free for a new agent that starts empty; another agent of the tenant keeps all it had; and no other tenant, key of
another agent or read-only key can delete it."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from moorage.store import Scope, Store
from tests.api.conftest import aclient, agent_archive, sse_events

pytestmark = pytest.mark.asyncio
GZ = {"content-type": "application/gzip"}
NAME = "zedagent"  # a name no other row holds by chance: the walk below looks for it in every table


def _rows_naming(store: Store, ts: Any, needle: str) -> dict[str, list[str]]:
    """Every row of the tenant's store, table by table, whose text holds ``needle``."""
    with ts._tx(write=False) as c:
        if c.dialect == "postgres":
            tables = [r[0] for r in c.q("SELECT table_name FROM information_schema.tables "
                                        "WHERE table_schema = current_schema() AND table_type = 'BASE TABLE'")]
        else:
            tables = [r[0] for r in c.q("SELECT name FROM sqlite_master WHERE type = 'table' "
                                        "AND name NOT LIKE 'events_fts%'")]
        found: dict[str, list[str]] = {}
        for t in tables:
            hits = [str(r) for r in c.q(f"SELECT * FROM {t}") if needle in str(r)]
            if hits:
                found[t] = hits
    return found


async def _turn(c: Any, user: str, agent: str = NAME) -> Any:
    return await c.post(f"/v1/agents/{agent}/invoke", json={"message": "hi", "user": user})


async def test_deleting_an_agent_forgets_all_it_kept_and_frees_its_name(live_rt, runtime, store, acme: str,
                                                                        globex: str, tmp_path: Path) -> None:
    async with aclient(live_rt, acme) as c:
        for n, agent in ((1, NAME), (2, NAME), (1, "keeper")):
            r = await c.post(f"/v1/agents/{agent}/deployments", content=agent_archive(tmp_path, agent, version=f"-{n}"),
                             headers=GZ)
            assert r.status_code == 201, r.text
        for user in ("ada", "bob"):
            assert (await _turn(c, user)).json()["reply"] == "echo-2: hi"
        assert (await _turn(c, "ada", "keeper")).json()["reply"] == "echo-1: hi"
        r = await c.post(f"/v1/agents/{NAME}/invoke", json={"message": "once", "user": "ada"},
                         headers={"Idempotency-Key": "k-1"})  # its answer is stored, naming the user
        assert r.status_code == 200, r.text
        assert (await c.put(f"/v1/agents/{NAME}/users/cat", json={"metadata": {"plan": "pro"}})).status_code == 201
        assert (await c.put(f"/v1/agents/{NAME}/secrets/API", json={"value": "agent-secret"})).status_code == 200
        assert (await c.put(f"/v1/agents/{NAME}/users/ada/secrets/TOKEN", json={"value": "s3"})).status_code == 200
        assert (await c.post(f"/v1/agents/{NAME}/webhooks", json={"url": "http://127.0.0.1:9/hook"})).status_code == 201
        assert (await c.put(f"/v1/agents/{NAME}/retention", json={"ttl_s": 86400})).status_code == 200
        r = await c.post(f"/v1/agents/{NAME}/invoke?async=true", json={"message": "later", "user": "bob"})
        assert r.status_code == 202, r.text
        ts = store.tenant(store.authenticate(acme))
        bound = ts.keys.create(["invoke", "read"], agent=NAME).secret
        other_agent = ts.keys.create(["deploy", "read"], agent="keeper").secret
        read_only = ts.keys.create(["read"]).secret
        async with aclient(live_rt, bound) as k:
            assert (await _turn(k, "dan")).status_code == 200
        issued = await c.post(f"/v1/agents/{NAME}/users/ada/tokens", json={})
        assert issued.status_code == 201, issued.text
        ada_token = issued.json()["token"]
        sandboxes = {rec.id for rec in ts.sandboxes.list(agent_id=NAME)}
        # And an instance no user owns (a workflow run's without one), recorded only: it goes with the agent too.
        ts.sandboxes.create(Scope.workflow(NAME, "run-1"), state="sleeping")
        assert len(sandboxes) >= 3 and all((runtime.driver.root / s).exists() for s in sandboxes)
        execution = f"/v1/executions/{r.json()['id']}"
        for _ in range(100):  # the async turn ends (its record stays, with its messages)
            if (await c.get(execution)).json()["status"] not in ("queued", "running"):
                break
            await asyncio.sleep(0.1)

        # Another tenant, a key of another agent, a read-only key: none deletes it; nothing changed.
        async with aclient(live_rt, globex) as g:
            assert (await g.delete(f"/v1/agents/{NAME}")).status_code == 404
        for secret in (other_agent, read_only):
            async with aclient(live_rt, secret) as k:
                assert (await k.delete(f"/v1/agents/{NAME}")).status_code == 403
        assert (await _turn(c, "ada")).json()["reply"] == "echo-2: hi"
        assert (await c.delete("/v1/agents/nobody")).status_code == 404
        assert (await c.delete("/v1/agents/no%20agent")).status_code == 422

        r = await c.delete(f"/v1/agents/{NAME}")
        assert r.status_code == 200, r.text
        assert r.json()["agent"] == NAME and r.json()["deleted"] is True and r.json()["users"] == 4, r.text
        left = _rows_naming(store, ts, NAME)
        spans = left.pop("spans", [])
        assert all("DELETE /v1/agents/{agent}" in s for s in spans), spans  # the delete's own record, no more
        assert set(left) <= {"usage", "usage_days", "usage_levels", "usage_level_days"}, left
        assert not any(u in row for rows in left.values() for row in rows for u in ("'ada'", "'bob'", "'dan'")), left

        # Gone: the agent, its users, its keys; its instances from the disk; nothing in the store names it but the
        # usage ledger (amounts kept, no user named) and the delete request's own trace.
        assert (await c.get(f"/v1/agents/{NAME}")).status_code == 404
        assert (await _turn(c, "ada")).status_code == 404
        assert (await c.delete(f"/v1/agents/{NAME}")).status_code == 404
        assert (await c.get(execution)).status_code == 404
        async with aclient(live_rt, bound) as k:
            assert (await _turn(k, "dan")).status_code == 401
        assert not any((runtime.driver.root / s).exists() for s in sandboxes)

        # The other agent keeps its user and its memory; the name starts anew.
        assert (await _turn(c, "ada", "keeper")).json()["reply"] == "echo-1: hi"
        assert [u["id"] for u in (await c.get("/v1/agents/keeper/users")).json()["data"]] == ["ada"]
        r = await c.post(f"/v1/agents/{NAME}/deployments", content=agent_archive(tmp_path, NAME, version="-1"),
                         headers=GZ)
        assert r.status_code == 201 and r.json()["number"] == 1, r.text
        assert (await _turn(c, "ada")).json()["reply"] == "echo-1: hi"
        assert (await c.get(f"/v1/agents/{NAME}/users")).json()["data"][0]["id"] == "ada"
        async with aclient(live_rt, ada_token) as k:  # issued for the old agent's ada: not the new one's
            assert (await _turn(k, "ada")).status_code == 401
        assert (await c.get(f"/v1/agents/{NAME}/secrets")).json()["data"] == []
        assert (await c.get(f"/v1/agents/{NAME}/webhooks")).json()["data"] == []
        assert (await c.get(f"/v1/agents/{NAME}/retention")).json()["ttl_s"] is None


async def test_an_agent_being_deleted_takes_no_new_turn_user_or_deploy(live_rt, store, acme: str,
                                                                      tmp_path: Path) -> None:
    """Marked (a delete that a stopped host cut short): reads and the delete are served, anything that adds is a
    409 saying so, and sending the delete again finishes it."""
    async with aclient(live_rt, acme) as c:
        r = await c.post(f"/v1/agents/{NAME}/deployments", content=agent_archive(tmp_path, NAME), headers=GZ)
        assert r.status_code == 201, r.text
        assert (await _turn(c, "ada")).status_code == 200
        ts = store.tenant(store.authenticate(acme))
        ts.agents.mark_deleting(NAME)
        assert (await c.get(f"/v1/agents/{NAME}")).json()["config"]["deleting"]["since"] > 0
        refused = [await _turn(c, "ada"), await _turn(c, "eve"),
                   await c.put(f"/v1/agents/{NAME}/users/fay", json={}),
                   await c.post(f"/v1/agents/{NAME}/deployments", content=agent_archive(tmp_path, NAME, version="-2"),
                                headers=GZ),
                   await c.post(f"/v1/agents/{NAME}/rollback", json={})]
        for r in refused:
            assert r.status_code == 409 and "being deleted" in r.json()["detail"], r.text
        assert [d["number"] for d in (await c.get(f"/v1/agents/{NAME}/deployments")).json()["data"]] == [1]
        r = await c.delete(f"/v1/agents/{NAME}")
        assert r.status_code == 200 and r.json()["users"] == 1, r.text
        assert (await c.get(f"/v1/agents/{NAME}")).status_code == 404


async def _events(c: Any, path: str, *, stop_after: int | None = None) -> list[tuple[str, Any]]:
    return await sse_events(c, "DELETE", path, headers={"accept": "text/event-stream"}, stop_after=stop_after)


async def test_a_streamed_delete_says_how_far_it_got_and_a_caller_that_leaves_does_not_cut_it(
        live_rt, acme: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Long work shows progress: the users forgotten so far (here after each one), then the answer; the SDK's
    ``delete_agent_stream`` reads the same. A caller that leaves mid-way leaves the delete running to its end."""
    from moorage.client import AsyncClient
    from moorage.runtime import agent_delete

    monkeypatch.setattr(agent_delete, "PROGRESS_EVERY_S", 0.0)
    async with aclient(live_rt, acme) as c:
        for agent in (NAME, "leaver"):
            r = await c.post(f"/v1/agents/{agent}/deployments", content=agent_archive(tmp_path, agent), headers=GZ)
            assert r.status_code == 201, r.text
            assert (await _turn(c, "ada", agent)).status_code == 200
            for i in range(12):
                assert (await c.put(f"/v1/agents/{agent}/users/u{i:02}", json={})).status_code == 201

        events = await _events(c, f"/v1/agents/{NAME}?stream=true")
        kinds, said = [k for k, _ in events], [d.get("message") for k, d in events if k == "progress"]
        assert kinds[-1] == "deleted" and set(kinds[:-1]) == {"progress"}, events
        assert said[0] == "forgetting 13 end-users" and "end-users forgotten: 12 of 13" in said, said
        assert said[-1] == "deleting what the agent kept, its deployments and the agent", said
        assert events[-1][1] == {**events[-1][1], "agent": NAME, "deleted": True, "users": 13}
        assert (await c.get(f"/v1/agents/{NAME}")).status_code == 404

        first = await _events(c, "/v1/agents/leaver?stream=true", stop_after=1)  # then the connection closes
        assert first[0] == ("progress", {"message": "forgetting 13 end-users"})
        for _ in range(300):
            if (await c.get("/v1/agents/leaver")).status_code == 404:
                break
            await asyncio.sleep(0.1)
        assert (await c.get("/v1/agents/leaver")).status_code == 404
        assert (await c.get("/v1/agents/leaver/users")).status_code == 404

    async with AsyncClient(live_rt.url, acme) as sdk:  # the SDK streams it; an unknown agent is its ApiError
        await sdk.deploy(NAME, agent_archive(tmp_path, NAME, version="-2"))
        events = [ev async for ev in sdk.delete_agent_stream(NAME)]
        assert events[-1]["event"] == "deleted" and events[-1]["data"]["deleted"] is True, events
        from moorage.client import ApiError

        with pytest.raises(ApiError) as e:
            async for _ in sdk.delete_agent_stream(NAME):
                pass
        assert e.value.status == 404
