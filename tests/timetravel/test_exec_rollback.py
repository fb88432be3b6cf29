"""The operator's reads and execs on a sandbox against a rollback or fork of its instance (docs/timetravel.md,
"Reads and execs"): those arriving while a rollback is asked for wait for it and see the rolled-back files, never
the abandoned branch; a rollback or fork asked for while an exec runs (attached or detached) is refused with a 409
``exec-running`` that names the exec and how to end it, and changes nothing. Before, a read returned the abandoned
branch's files while the rollback waited, and a rollback restored the sandbox under a running exec."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx

from moorage.store import Store
from tests.api.conftest import acme, aclient, live_rt, runtime  # noqa: F401 - fixtures
from tests.timetravel.conftest import tt_archive
from tests.timetravel.test_parallel_agent import SLOW

BASE = "/v1/agents/tt/users/ada/checkpoints"
# Runs until the test creates the file `go` (in the sandbox's working directory, where the notes are).
GATED = ["sh", "-c", "echo started; while [ ! -e go ]; do sleep 0.05; done; echo finished"]


async def _two_turns(c: httpx.AsyncClient, store: Store, secret: str, tmp_path: Path) -> tuple[str, str]:
    """The agent deployed (turns of one instance wait in line), two turns of ada: her sandbox and the checkpoint
    after the first turn."""
    r = await c.post("/v1/agents/tt/deployments", content=tt_archive(tmp_path, body=SLOW),
                     headers={"content-type": "application/gzip"})
    assert r.status_code == 201, r.text
    for n in (1, 2):
        r = await c.post("/v1/agents/tt/invoke", json={"message": f"turn {n}", "user": "ada"})
        assert r.status_code == 200, r.text
    one = (await c.get(BASE)).json()["data"][-1]["id"]
    return store.tenant(store.authenticate(secret)).sandboxes.list()[0].id, one


async def names(c: httpx.AsyncClient, box: str) -> list[str]:
    r = await c.get(f"{box}/files", params={"path": "notes"})
    assert r.status_code == 200, r.text
    return [e["name"] for e in r.json()["entries"]]


def _problem(r: httpx.Response) -> dict[str, Any]:
    assert r.status_code == 409, r.text
    body = r.json()
    assert body["type"].endswith("/exec-running"), body
    return body


async def test_reads_and_execs_during_a_rollback_wait_and_see_the_rolled_back_files(
        live_rt, runtime, acme: str, store: Store, tmp_path: Path) -> None:  # noqa: F811
    async with aclient(live_rt, acme) as c:
        sid, one = await _two_turns(c, store, acme, tmp_path)
        box = f"/v1/sandboxes/{sid}"

        slow = asyncio.create_task(c.post("/v1/agents/tt/invoke", json={"message": "slow 1.5", "user": "ada",
                                                                         "session": "side"}))
        while "slow-a.txt" not in await names(c, box):  # the slow turn runs: the rollback waits for it in line
            await asyncio.sleep(0.02)
        rollback = asyncio.create_task(c.post(f"{BASE}/{one}/rollback", json={}))
        # The rollback is asked for: it waits in the instance's line behind the slow turn.
        while not any(line.members > 1 for line in runtime.router._instances.values()):
            await asyncio.sleep(0.01)
        listing = asyncio.create_task(c.get(f"{box}/files", params={"path": "notes"}))
        read = asyncio.create_task(c.get(f"{box}/files/content", params={"path": "notes/2.txt"}))
        ran = asyncio.create_task(c.post(f"{box}/exec", json={"argv": ["sh", "-c", "ls notes"]}))

        assert (await slow).status_code == 200
        r = await rollback
        assert r.status_code == 200, r.text
        # Each waited for the rollback: what the checkpoint of turn 1 holds, not the abandoned branch (2.txt and
        # the slow turn's files), nor the sandbox half way.
        r = await listing
        assert r.status_code == 200, r.text
        assert [e["name"] for e in r.json()["entries"]] == ["1.txt"]
        assert (await read).status_code == 404
        r = await ran
        assert r.status_code == 200, r.text
        assert r.json()["stdout"] == "1.txt\n"


async def test_a_rollback_or_fork_is_refused_while_a_detached_exec_runs(
        live_rt, acme: str, store: Store, tmp_path: Path) -> None:  # noqa: F811
    async with aclient(live_rt, acme) as c:
        sid, one = await _two_turns(c, store, acme, tmp_path)
        box = f"/v1/sandboxes/{sid}"
        r = await c.post(f"{box}/exec", json={"argv": GATED, "detach": True, "timeout_s": 3600})
        assert r.status_code == 202, r.text
        ex = r.json()["id"]
        while "started" not in (await c.get(f"/v1/executions/{ex}")).json()["stdout"]:
            await asyncio.sleep(0.05)
        before = (await c.get(BASE)).json()["data"]

        for r in [await c.post(f"{BASE}/{one}/rollback", json={}),
                  await c.post(f"{box}/rollback", json={"checkpoint": one}),
                  await c.post(f"{BASE}/{one}/fork", json={"to_user": "bea"}),
                  await c.post(f"{box}/fork", json={"to_users": ["cy"]})]:
            body = _problem(r)
            assert ex in body["detail"] and "while an exec runs" in body["detail"], body
            assert f"POST /v1/executions/{ex}/cancel" in body["hint"], body
        # Nothing changed: no checkpoint taken, no user made, the exec still running and the files as they were.
        assert (await c.get(BASE)).json()["data"] == before
        assert (await c.get("/v1/agents/tt/users/bea")).status_code == 404
        assert (await c.get(f"/v1/executions/{ex}")).json()["status"] == "running"
        assert await names(c, box) == ["1.txt", "2.txt"]

        # As the hint says: cancelled, the rollback goes through.
        assert (await c.post(f"/v1/executions/{ex}/cancel")).json()["status"] == "cancelled"
        r = await c.post(f"{BASE}/{one}/rollback", json={})
        assert r.status_code == 200, r.text
        assert await names(c, box) == ["1.txt"]


async def test_a_rollback_is_refused_while_an_attached_exec_runs(
        live_rt, acme: str, store: Store, tmp_path: Path) -> None:  # noqa: F811
    async with aclient(live_rt, acme) as c:
        sid, one = await _two_turns(c, store, acme, tmp_path)
        box = f"/v1/sandboxes/{sid}"
        ran = asyncio.create_task(c.post(f"{box}/exec", json={"argv": ["sh", "-c", "touch notes/began; " + GATED[2]],
                                                               "timeout_s": 600}))
        while "began" not in await names(c, box):  # running
            await asyncio.sleep(0.02)
        body = _problem(await c.post(f"{BASE}/{one}/rollback", json={}))
        assert "while an exec runs" in body["detail"] and "while [ ! -e go ]" in body["detail"], body
        assert "wait for it to end" in body["hint"] and "detached" in body["hint"], body
        assert not ran.done()

        # Another exec still runs beside it (execs do not wait for each other): it lets the first one end.
        r = await c.post(f"{box}/exec", json={"argv": ["touch", "go"]})
        assert r.status_code == 200 and r.json()["exit_code"] == 0, r.text
        r = await ran
        assert r.json()["stdout"] == "started\nfinished\n", r.text
        r = await c.post(f"{BASE}/{one}/rollback", json={})
        assert r.status_code == 200, r.text


async def test_an_exec_that_comes_while_a_fork_takes_its_checkpoint_waits_for_the_fork(
        live_rt, runtime, acme: str, store: Store, tmp_path: Path) -> None:  # noqa: F811
    """The sandbox verb ``fork`` takes a named checkpoint of the instance as it is, then forks at it. Before, an
    exec that started between the two got the fork refused (409 ``exec-running``) and the named checkpoint stayed
    behind; now the fork holds the instance against execs from before its checkpoint, and the exec waits."""
    async with aclient(live_rt, acme) as c:
        sid, _ = await _two_turns(c, store, acme, tmp_path)
        box = f"/v1/sandboxes/{sid}"
        slow = asyncio.create_task(c.post("/v1/agents/tt/invoke", json={"message": "slow 1.5", "user": "ada",
                                                                         "session": "side"}))
        while "slow-a.txt" not in await names(c, box):  # the slow turn holds the instance's line
            await asyncio.sleep(0.02)
        fork = asyncio.create_task(c.post(f"{box}/fork", json={"to_user": "bea", "label": "before-bea"}))
        while not any(line.members > 1 for line in runtime.router._instances.values()):  # its checkpoint waits
            await asyncio.sleep(0.01)
        ran = asyncio.create_task(c.post(f"{box}/exec", json={"argv": GATED, "timeout_s": 600}))
        await asyncio.sleep(0.3)
        try:
            assert (await slow).status_code == 200
            r = await fork
            assert r.status_code == 200, r.text
            assert [f["user"] for f in r.json()["forks"]] == ["bea"]
            named = [ck for ck in (await c.get(BASE)).json()["data"] if ck["name"] == "before-bea"]
            assert [ck["id"] for ck in named] == [r.json()["checkpoint"]]
            assert (await c.get("/v1/agents/tt/users/bea")).status_code == 200
        finally:  # the exec ran after the fork (or, refused, beside it); another one lets it end
            r = await c.post(f"{box}/exec", json={"argv": ["touch", "go"]})
            assert r.status_code == 200 and r.json()["exit_code"] == 0, r.text
            r = await ran
        assert r.status_code == 200 and r.json()["stdout"] == "started\nfinished\n", r.text


async def test_a_fork_refused_because_a_new_user_was_taken_meanwhile_leaves_no_checkpoint_behind(
        live_rt, runtime, acme: str, store: Store, tmp_path: Path) -> None:  # noqa: F811
    """The sandbox verb ``fork`` checks its new users, takes its checkpoint (waiting for a turn of the instance),
    then forks. A new user who got an instance while it waited refuses the fork (409); before, the named checkpoint
    and its sandbox half stayed behind, now neither does."""
    async with aclient(live_rt, acme) as c:
        sid, _ = await _two_turns(c, store, acme, tmp_path)
        box = f"/v1/sandboxes/{sid}"
        before = [ck["id"] for ck in (await c.get(BASE)).json()["data"]]
        halves = {h.name for h in await (await runtime.driver.open(sid)).checkpoints()}
        slow = asyncio.create_task(c.post("/v1/agents/tt/invoke", json={"message": "slow 1.5", "user": "ada",
                                                                         "session": "side"}))
        while "slow-a.txt" not in await names(c, box):  # the slow turn holds the instance's line
            await asyncio.sleep(0.02)
        fork = asyncio.create_task(c.post(f"{box}/fork", json={"to_user": "cy", "label": "before-cy"}))
        while not any(line.members > 1 for line in runtime.router._instances.values()):  # its checkpoint waits
            await asyncio.sleep(0.01)
        r = await c.post("/v1/agents/tt/invoke", json={"message": "turn 1", "user": "cy"})  # cy taken meanwhile
        assert r.status_code == 200, r.text
        assert (await slow).status_code == 200
        r = await fork
        assert r.status_code == 409 and "already has an instance" in r.json()["detail"], r.text
        listing = (await c.get(BASE)).json()["data"]
        new = [ck for ck in listing if ck["id"] not in before]
        assert [ck["kind"] for ck in new] == ["turn"], listing  # the slow turn's own; no "before-cy"
        added = {h.name for h in await (await runtime.driver.open(sid)).checkpoints()} - halves
        assert len(added) == 1, added  # the slow turn's sandbox half only
        r = await c.post("/v1/agents/tt/invoke", json={"message": "turn 3", "user": "ada"})  # goes on as before
        assert r.status_code == 200, r.text
        r = await c.post(f"{box}/fork", json={"to_user": "dee", "label": "before-dee"})
        assert r.status_code == 200, r.text
