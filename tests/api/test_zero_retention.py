"""Zero retention per agent, end to end through the host ``moorage up`` runs (``Host``) over HTTP: an agent with
``[agent.retention] zero_retention = true`` answers its turns (memory works within the turn) and afterwards the
store holds nothing of them — messages, notes, facts, runs, journal, traces, sessions, executions — while the
user's sandbox and the usage ledger stay, and another agent of the same user keeps everything. Turning it on
through the API purges what an agent had kept."""

from __future__ import annotations

import asyncio
import io
import tarfile
from pathlib import Path

import httpx
import pytest

from moorage.config import Config
from moorage.runtime.host import Host
from moorage.store import Scope, TenantStore
from moorage.store import zero_retention
from moorage.webhooks.delivery import announce
from tests.runtime.test_host_adaptive import serve

AGENT = '''
async def on_message(ctx, message):
    await ctx.memory.remember("note: " + message)
    await ctx.memory.learn("user", "said", message, "the user said " + message)
    notes = sorted(h["text"] for h in await ctx.memory.recall(message) if h["text"].startswith("note: "))
    await ctx.step("stamp", lambda: message)
    return f"{ctx.agent}: {message} {notes}"
'''


def archive(name: str, retention: str = "") -> bytes:
    files = {"moorage.toml": f'[agent]\nname = "{name}"\nentry = "agent.py"\n[agent.lifecycle]\nusers = "auto"\n'
                             + retention,
             "agent.py": AGENT.replace("{ctx.agent}", name)}
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for n, text in files.items():
            info = tarfile.TarInfo(n)
            info.size = len(text.encode())
            tar.addfile(info, io.BytesIO(text.encode()))
    return buf.getvalue()


def kept(ts: TenantStore, agent: str, user: str) -> dict[str, int]:
    """Rows the store holds about ``user`` of ``agent``, by table (content first, then what must stay)."""
    like = [f"user:{agent}/{user}", f"session:{agent}/{user}/%", f"workflow:{agent}/{user}/%"]
    where = "scope = ? OR scope LIKE ? OR scope LIKE ?"
    out = {t: ts.read(f"SELECT COUNT(*) FROM {t} WHERE {where}", like)[0][0]
           for t in ("events", "facts", "state", "spans", "workflow_runs", "journal")}
    out["steps"] = ts.read(f"SELECT COUNT(*) FROM steps WHERE run_id IN (SELECT id FROM workflow_runs WHERE {where})",
                           like)[0][0]
    for t in ("sessions", "executions"):
        out[t] = ts.read(f"SELECT COUNT(*) FROM {t} WHERE agent_id = ? AND user_id = ?", [agent, user])[0][0]
    out["sandboxes"] = ts.read(f"SELECT COUNT(*) FROM sandboxes WHERE {where}", like)[0][0]
    out["usage"] = ts.read("SELECT COUNT(*) FROM usage WHERE agent_id = ? AND user_id = ?", [agent, user])[0][0]
    return out


CONTENT = ("events", "facts", "state", "spans", "workflow_runs", "journal", "steps", "sessions", "executions")


@pytest.mark.timeout(300)
async def test_zero_retention_agent_keeps_nothing_of_its_turns(tmp_path: Path) -> None:
    cfg = Config(data_dir=tmp_path / "data", sandbox_driver="process")
    host = Host.open(cfg)
    await host.start()
    server, task, url = await serve(host, cfg)
    try:
        _, key = host.store.operator.create_tenant("acme")
        ts = host.store.tenant(host.store.authenticate(key.secret))
        async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {key.secret}"}, timeout=120) as c:
            for name, table in (("ghost", "[agent.retention]\nzero_retention = true\n"), ("keeper", "")):
                r = await c.post(f"/v1/agents/{name}/deployments", content=archive(name, table),
                                 headers={"content-type": "application/gzip"})
                assert r.status_code == 201, r.text
            assert (await c.get("/v1/agents/ghost/retention")).json() == \
                {"agent": "ghost", "ttl_s": None, "zero_retention": True}

            # Within a turn the agent has its memory: the note it just wrote is there.
            for name in ("ghost", "keeper"):
                r = await c.post(f"/v1/agents/{name}/invoke", json={"message": "tea", "user": "ylva", "session": "s1"})
                assert r.status_code == 200, r.text
                assert r.json()["reply"] == f"{name}: tea ['note: tea']"
            trace = r.json()["trace_id"]
            ghost_trace = (await c.post("/v1/agents/ghost/invoke", json={"message": "cake", "user": "ylva"})).json()
            # ... but nothing from the earlier turn: it was not kept.
            assert ghost_trace["reply"] == "ghost: cake ['note: cake']"
            left = kept(ts, "ghost", "ylva")
            assert {t: left[t] for t in CONTENT} == dict.fromkeys(CONTENT, 0), left
            assert left["sandboxes"] == 1  # the user's sandbox stays
            # The usage ledger stays too: the awake seconds written as the instance sleeps outlive the next turn.
            box = ts.sandboxes.for_scope(Scope.for_user("ghost", "ylva"))
            assert (await c.post(f"/v1/sandboxes/{box.id}/sleep")).status_code == 200
            assert (await c.post("/v1/agents/ghost/invoke", json={"message": "bun", "user": "ylva"})).status_code == 200
            left = kept(ts, "ghost", "ylva")
            assert {t: left[t] for t in CONTENT} == dict.fromkeys(CONTENT, 0), left
            assert left["usage"] >= 1 and ts.usage.totals(agent_id="ghost", user_id="ylva")["compute_seconds"] > 0
            # The trace keeps only the API's request span (method, route, status: an access log, no user, no
            # content); the turn's own spans went with it.
            spans = (await c.get(f"/v1/traces/{ghost_trace['trace_id']}")).json()["spans"]
            assert [s["name"] for s in spans] == ["POST /v1/agents/{agent}/invoke"], spans
            # (the user id has letters no hex trace or span id can hold, so a match is the user, not an id)
            assert "ylva" not in str(spans) and "cake" not in str(spans)
            assert (await c.get(f"/v1/traces/{trace}")).status_code == 200  # keeper's trace is there
            kept_keeper = kept(ts, "keeper", "ylva")
            assert all(kept_keeper[t] > 0 for t in ("events", "facts", "workflow_runs", "sessions")), kept_keeper

            # Streamed turns too.
            async with c.stream("POST", "/v1/agents/ghost/invoke?stream=true",
                                json={"message": "jam", "user": "ylva"}) as r:
                assert r.status_code == 200 and "ghost: jam" in "".join([x async for x in r.aiter_text()])
            assert {t: kept(ts, "ghost", "ylva")[t] for t in CONTENT} == dict.fromkeys(CONTENT, 0)

            # An async turn: its run and execution stay until the outcome is announced (GET and webhooks read
            # them), then they go too.
            r = await c.post("/v1/agents/ghost/invoke?async=true", json={"message": "pie", "user": "ylva"})
            assert r.status_code == 202
            for _ in range(600):
                view = (await c.get(r.headers["location"])).json()
                if view["status"] == "succeeded":
                    break
                await asyncio.sleep(0.05)
            assert view["reply"] == "ghost: pie ['note: pie']"
            await asyncio.to_thread(announce, ts)  # what the host's delivery loop does each round
            await asyncio.to_thread(zero_retention.sweep, ts)  # what its retention sweep does
            assert {t: kept(ts, "ghost", "ylva")[t] for t in CONTENT} == dict.fromkeys(CONTENT, 0)
            assert (await c.get(r.headers["location"])).status_code == 404

            # Turning zero retention on through the API purges what keeper had kept; off again, it keeps.
            r = await c.put("/v1/agents/keeper/retention", json={"zero_retention": True})
            assert r.status_code == 200 and r.json() == {"agent": "keeper", "ttl_s": None, "zero_retention": True}
            assert {t: kept(ts, "keeper", "ylva")[t] for t in CONTENT} == dict.fromkeys(CONTENT, 0)
            assert (await c.put("/v1/agents/keeper/retention", json={"zero_retention": False})).status_code == 200
            assert (await c.post("/v1/agents/keeper/invoke", json={"message": "egg", "user": "ylva"})).status_code == 200
            assert kept(ts, "keeper", "ylva")["events"] > 0
            assert ts.sandboxes.for_scope(Scope.for_user("ghost", "ylva")) is not None

            # The tenant-wide view lists both agents' own settings.
            tenant = (await c.get("/v1/retention")).json()
            assert {a["agent"]: a["zero_retention"] for a in tenant["agents"]} == {"ghost": True}
    finally:
        server.should_exit = True
        await task
        await host.close()


async def test_retention_table_is_validated_at_deploy(tmp_path: Path) -> None:
    from moorage.runtime.package import AgentPackageError, retention_ttl_s, retention_zero

    assert retention_zero({}) is None and retention_ttl_s({}) is None
    assert retention_zero({"retention": {"zero_retention": True}}) is True
    assert retention_zero({"retention": {"ttl_s": 60}}) is False
    for bad in ({"zero_retention": "yes"}, {"zero_retention": True, "ttl_s": 60}, {"zero_retention": False}, {}):
        with pytest.raises(AgentPackageError) as e:
            retention_zero({"retention": bad})
        assert "[agent.retention]" in e.value.message and e.value.hint, bad


async def test_zero_retention_on_both_store_backends(live_rt, store, acme: str, tmp_path: Path) -> None:
    """The purge's SQL on SQLite and on PostgreSQL (row-level security): a synchronous turn and a failed one."""
    ts = store.tenant(store.authenticate(acme))
    body = AGENT.replace('    await ctx.step("stamp", lambda: message)\n',
                         '    await ctx.step("stamp", lambda: message)\n    if message == "boom":\n'
                         '        raise RuntimeError("boom")\n')
    files = {"moorage.toml": '[agent]\nname = "ghost"\nentry = "agent.py"\n[agent.lifecycle]\nusers = "auto"\n'
                             '[agent.retention]\nzero_retention = true\n', "agent.py": body.replace("{ctx.agent}", "ghost")}
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for n, text in files.items():
            info = tarfile.TarInfo(n)
            info.size = len(text.encode())
            tar.addfile(info, io.BytesIO(text.encode()))
    async with httpx.AsyncClient(base_url=live_rt.url, headers={"Authorization": f"Bearer {acme}"}, timeout=120) as c:
        assert (await c.post("/v1/agents/ghost/deployments", content=buf.getvalue(),
                             headers={"content-type": "application/gzip"})).status_code == 201
        for message in ("tea", "cake"):
            r = await c.post("/v1/agents/ghost/invoke", json={"message": message, "user": "ylva"})
            assert r.json()["reply"] == f"ghost: {message} ['note: {message}']", r.text
            assert {t: kept(ts, "ghost", "ylva")[t] for t in CONTENT} == dict.fromkeys(CONTENT, 0)
        r = await c.post("/v1/agents/ghost/invoke", json={"message": "boom", "user": "ylva"})
        assert r.status_code == 502  # the agent failed: its failed run goes too
        assert {t: kept(ts, "ghost", "ylva")[t] for t in CONTENT} == dict.fromkeys(CONTENT, 0)
        assert kept(ts, "ghost", "ylva")["sandboxes"] == 1
