"""A key limited to one agent (with the deploy scope) acts on that agent's sandboxes as an unlimited key does: sleep,
wake, checkpoint, rollback, fork, files, exec (attached and detached), and follows, reads and cancels its execs, through
HTTP and the SDK. Another agent's sandbox or exec (same tenant) and another tenant's are the 404 of an id that does not
exist, and nothing is done to them: not woken, no checkpoint, no user, no exec, a running exec left running, files as
they were. Before, each of these routes refused such a key (403, "this route spans agents")."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx

from moorage.client import AsyncClient
from moorage.client.errors import NotFound
from moorage.runtime import exec_jobs
from moorage.store import Store
from tests.api.conftest import aclient, agent_archive

GZ = {"content-type": "application/gzip"}
#: Runs until the test creates the file `go` in the sandbox's working directory.
GATED = ["sh", "-c", "echo started; while [ ! -e go ]; do sleep 0.05; done; echo finished"]
#: (tenant, agent, user) of each instance: the key is limited to acme's echo; the others are not its.
MINE, OTHER_AGENT, OTHER_TENANT = ("acme", "echo", "u1"), ("acme", "other", "u1"), ("globex", "echo", "g1")


async def _instances(live_rt: Any, store: Store, keys: dict[str, str], tmp_path: Path) -> dict[tuple[str, str, str], str]:
    """Each instance after one turn, with `note.txt` naming whose it is; returns their sandbox ids."""
    boxes = {}
    for tenant, agent, user in (MINE, OTHER_AGENT, OTHER_TENANT):
        async with aclient(live_rt, keys[tenant]) as admin:
            r = await admin.post(f"/v1/agents/{agent}/deployments", content=agent_archive(tmp_path, agent), headers=GZ)
            assert r.status_code == 201, r.text
            r = await admin.post(f"/v1/agents/{agent}/invoke", json={"message": "hi", "user": user})
            assert r.status_code == 200, r.text
            ts = store.tenant(store.authenticate(keys[tenant]))
            sid = next(b.id for b in ts.sandboxes.list() if b.agent_id == agent and b.scope.user == user)
            r = await admin.post(f"/v1/sandboxes/{sid}/exec", json={"argv": ["sh", "-c", f"echo {tenant}-{agent} > note.txt"]})
            assert r.status_code == 200 and r.json()["exit_code"] == 0, r.text
            boxes[tenant, agent, user] = sid
    return boxes


async def _limited_key(live_rt: Any, acme: str) -> str:
    async with aclient(live_rt, acme) as admin:
        r = await admin.post("/v1/keys", json={"scopes": ["deploy", "read"], "agent": "echo"})
        assert r.status_code == 201, r.text
        return r.json()["secret"]


async def _until_started(c: httpx.AsyncClient, execution_id: str) -> None:
    for _ in range(600):
        view = (await c.get(f"/v1/executions/{execution_id}")).json()
        assert view["status"] == "running", view
        if view["stdout"].startswith("started"):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"exec {execution_id} did not start")


async def _settled(c: httpx.AsyncClient, execution_id: str) -> dict[str, Any]:
    for _ in range(600):
        view = (await c.get(f"/v1/executions/{execution_id}")).json()
        if view["status"] != "running":
            return view
        await asyncio.sleep(0.05)
    raise AssertionError(f"exec {execution_id} did not end")


def _same_404(answers: list[httpx.Response], ids: list[str]) -> None:
    """Every answer is a 404 that reads the same once the id it names is taken out (a missing id's answer last)."""
    bodies = []
    for r, the_id in zip(answers, ids):
        assert r.status_code == 404, (the_id, r.request.method, r.request.url, r.text)
        bodies.append({k: str(v).replace(the_id, "<id>") for k, v in r.json().items() if k not in ("trace_id", "instance")})
    assert all(b == bodies[-1] for b in bodies), bodies


async def test_a_key_for_one_agent_acts_on_its_agents_sandbox(live_rt, store: Store, acme: str, globex: str,  # noqa: ANN001
                                                              tmp_path: Path) -> None:
    boxes = await _instances(live_rt, store, {"acme": acme, "globex": globex}, tmp_path)
    key, sid = await _limited_key(live_rt, acme), boxes[MINE]
    box = f"/v1/sandboxes/{sid}"
    async with aclient(live_rt, key) as c:
        r = await c.post(f"{box}/checkpoint", json={"label": "before"})
        assert r.status_code == 200 and (r.json()["agent"], r.json()["user"]) == ("echo", "u1"), r.text
        r = await c.post(f"{box}/exec", json={"argv": ["sh", "-c", "echo changed > note.txt; pwd"]})
        assert r.status_code == 200 and r.json()["status"] == "succeeded", r.text
        cwd = r.json()["stdout"].strip()
        r = await c.get(f"{box}/files", params={"path": cwd})
        assert r.status_code == 200 and "note.txt" in [e["name"] for e in r.json()["entries"]], r.text
        r = await c.get(f"{box}/files/content", params={"path": "note.txt"})
        assert r.status_code == 200 and r.json()["content"] == "changed\n", r.text

        # A detached exec: seen, followed, and while it runs a rollback is the 409 every key gets.
        r = await c.post(f"{box}/exec", json={"argv": GATED, "detach": True})
        assert r.status_code == 202, r.text
        ex = r.json()["id"]
        await _until_started(c, ex)
        r = await c.post(f"{box}/rollback", json={"checkpoint": "before"})
        assert r.status_code == 409 and r.json()["type"].endswith("/exec-running") and ex in r.json()["detail"], r.text
        r = await c.post(f"/v1/executions/{ex}/cancel")
        assert r.status_code == 200 and r.json()["status"] == "cancelled", r.text
        async with c.stream("GET", f"/v1/executions/{ex}/output") as stream:
            assert stream.status_code == 200
            text = "".join([line async for line in stream.aiter_lines()])
        assert "started" in text and "event: end" in text and '"cancelled"' in text, text

        r = await c.post(f"{box}/rollback", json={"checkpoint": "before"})
        assert r.status_code == 200 and r.json()["agent"] == "echo", r.text
        r = await c.get(f"{box}/files/content", params={"path": "note.txt"})
        assert r.json()["content"] == "acme-echo\n", r.text  # the file as it was at the checkpoint
        r = await c.post(f"{box}/fork", json={"to_user": "u1-copy"})
        assert r.status_code == 200 and [f["user"] for f in r.json()["forks"]] == ["u1-copy"], r.text

        r = await c.post(f"{box}/sleep")
        assert r.status_code == 200 and r.json()["slept"] is True, r.text
        r = await c.post(f"{box}/wake")
        assert r.status_code == 200 and r.json()["id"] == sid, r.text
        assert (await c.get(box)).json()["state"] == r.json()["state"]
    ts = store.tenant(store.authenticate(acme))
    copy = next(b for b in ts.sandboxes.list() if b.scope.user == "u1-copy")
    assert copy.agent_id == "echo"


async def test_another_agents_and_tenants_sandboxes_and_execs_are_404_and_untouched(  # noqa: ANN001
        live_rt, runtime, store: Store, acme: str, globex: str, tmp_path: Path) -> None:
    keys = {"acme": acme, "globex": globex}
    boxes = await _instances(live_rt, store, keys, tmp_path)
    key = await _limited_key(live_rt, acme)
    theirs = [OTHER_AGENT, OTHER_TENANT]

    # Their execs, running: not seen, not followed, not cancelled.
    running = {}
    for who in theirs:
        async with aclient(live_rt, keys[who[0]]) as admin:
            r = await admin.post(f"/v1/sandboxes/{boxes[who]}/exec", json={"argv": GATED, "detach": True})
            assert r.status_code == 202, r.text
            running[who] = r.json()["id"]
            await _until_started(admin, running[who])
    ids = [*running.values(), "exec_0123456789abcdef0123456789abcdef"]
    async with aclient(live_rt, key) as c:
        _same_404([await c.get(f"/v1/executions/{i}") for i in ids], ids)
        _same_404([await c.get(f"/v1/executions/{i}/output") for i in ids], ids)
        _same_404([await c.post(f"/v1/executions/{i}/cancel") for i in ids], ids)
    for who, ex in running.items():
        async with aclient(live_rt, keys[who[0]]) as admin:
            assert (await admin.get(f"/v1/executions/{ex}")).json()["status"] == "running"
            assert (await admin.post(f"/v1/sandboxes/{boxes[who]}/exec", json={"argv": ["touch", "go"]})).status_code == 200
            done = await _settled(admin, ex)
            assert (done["status"], done["stdout"]) == ("succeeded", "started\nfinished\n"), done

    # Their sandboxes, asleep, each with a checkpoint a rollback could go to: nothing done to them.
    before, checkpoints = {}, {}
    for who in theirs:
        tenant, agent, user = who
        async with aclient(live_rt, keys[tenant]) as admin:
            r = await admin.post(f"/v1/sandboxes/{boxes[who]}/checkpoint", json={"label": "theirs"})
            assert r.status_code == 200, r.text
            assert (await admin.post(f"/v1/sandboxes/{boxes[who]}/sleep")).status_code == 200
            checkpoints[who] = (await admin.get(f"/v1/agents/{agent}/users/{user}/checkpoints")).json()["data"]
        before[who] = store.tenant(store.authenticate(keys[tenant])).sandboxes.get(boxes[who])
    jobs = set(exec_jobs.ExecJobs.of(runtime).jobs)
    ids = [boxes[OTHER_AGENT], boxes[OTHER_TENANT], "sbx-nothing"]
    target = checkpoints[OTHER_AGENT][0]["id"]
    requests: list[tuple[str, str, dict[str, Any]]] = [
        ("POST", "sleep", {"json": {}}), ("POST", "wake", {"json": {}}),
        ("POST", "checkpoint", {"json": {"label": "stolen"}}), ("POST", "rollback", {"json": {"checkpoint": target}}),
        ("POST", "fork", {"json": {"to_user": "stolen"}}),
        ("GET", "files", {"params": {"path": "."}}), ("GET", "files/content", {"params": {"path": "note.txt"}}),
        ("POST", "exec", {"json": {"argv": ["sh", "-c", "echo stolen > note.txt"]}}),
        ("POST", "exec", {"json": {"argv": ["sh", "-c", "echo stolen > note.txt"], "detach": True}}),
    ]
    async with aclient(live_rt, key) as c:
        for method, verb, kw in requests:
            _same_404([await c.request(method, f"/v1/sandboxes/{i}/{verb}", **kw) for i in ids], ids)

    assert set(exec_jobs.ExecJobs.of(runtime).jobs) == jobs  # no exec started anywhere
    for who in theirs:
        tenant, agent, user = who
        # The same record: not woken, not touched (its version counts every change).
        assert store.tenant(store.authenticate(keys[tenant])).sandboxes.get(boxes[who]) == before[who]
        async with aclient(live_rt, keys[tenant]) as admin:
            assert (await admin.get(f"/v1/agents/{agent}/users/{user}/checkpoints")).json()["data"] == checkpoints[who]
            assert (await admin.get(f"/v1/agents/{agent}/users/stolen")).status_code == 404
            r = await admin.get(f"/v1/sandboxes/{boxes[who]}/files/content", params={"path": "note.txt"})
            assert r.json()["content"] == f"{tenant}-{agent}\n", r.text


async def test_the_sdk_with_a_key_for_one_agent(live_rt, store: Store, acme: str, globex: str,  # noqa: ANN001
                                                tmp_path: Path) -> None:
    boxes = await _instances(live_rt, store, {"acme": acme, "globex": globex}, tmp_path)
    key, sid = await _limited_key(live_rt, acme), boxes[MINE]
    async with AsyncClient(live_rt.url, key, max_retries=0) as sdk:
        assert (await sdk.sandbox_action(sid, "checkpoint", label="sdk"))["agent"] == "echo"
        assert (await sdk.exec(sid, ["sh", "-c", "echo sdk > note.txt"]))["status"] == "succeeded"
        assert "note.txt" in [e["name"] for e in (await sdk.list_files(sid, "."))["entries"]]
        assert (await sdk.read_file(sid, "note.txt"))["content"] == "sdk\n"
        ex = await sdk.exec_detached(sid, ["sh", "-c", "echo detached"])
        events = [ev async for ev in sdk.follow_exec(ex["id"])]
        assert events[-1]["event"] == "end" and any(ev["data"].get("text") == "detached\n" for ev in events), events
        assert (await sdk.wait(ex["id"], poll_s=0.05))["status"] == "succeeded"
        assert (await sdk.get_execution(ex["id"]))["stdout"] == "detached\n"
        gated = await sdk.exec_detached(sid, GATED)
        assert (await sdk.cancel_execution(gated["id"]))["status"] == "cancelled"
        assert (await sdk.sandbox_action(sid, "rollback", label="sdk"))["agent"] == "echo"
        assert (await sdk.read_file(sid, "note.txt"))["content"] == "acme-echo\n"
        assert (await sdk.sandbox_action(sid, "sleep"))["slept"] is True
        assert (await sdk.sandbox_action(sid, "wake"))["id"] == sid

        async with AsyncClient(live_rt.url, acme, max_retries=0) as admin:
            theirs = await admin.exec_detached(boxes[OTHER_AGENT], ["sh", "-c", "echo theirs"])
        for call in (sdk.get_sandbox(boxes[OTHER_AGENT]), sdk.sandbox_action(boxes[OTHER_AGENT], "wake"),
                     sdk.list_files(boxes[OTHER_AGENT], "."), sdk.read_file(boxes[OTHER_TENANT], "note.txt"),
                     sdk.exec(boxes[OTHER_AGENT], ["true"]), sdk.exec_detached(boxes[OTHER_TENANT], ["true"]),
                     sdk.get_execution(theirs["id"]), sdk.cancel_execution(theirs["id"])):
            try:
                await call
                raise AssertionError("another agent's or tenant's sandbox or exec was found")
            except NotFound:
                pass


async def test_the_runtime_keeps_a_key_for_one_agent_to_its_agent(live_rt, runtime, store: Store, acme: str,  # noqa: ANN001
                                                                  globex: str, tmp_path: Path) -> None:
    """Under the routes, the runtime's verbs find no other agent's sandbox for such a key either."""
    from moorage.errors import NotFound as StoreNotFound

    boxes = await _instances(live_rt, store, {"acme": acme, "globex": globex}, tmp_path)
    who = store.authenticate(await _limited_key(live_rt, acme))
    theirs = boxes[OTHER_AGENT]
    async with aclient(live_rt, acme) as admin:
        assert (await admin.post(f"/v1/sandboxes/{theirs}/sleep")).status_code == 200
    ts = store.tenant(who)
    before = ts.sandboxes.get(theirs)
    for verb in (runtime.sandbox(who, theirs, "wake"), runtime.list_files(who, theirs, "."),
                 runtime.read_file(who, theirs, "note.txt"), runtime.exec(who, theirs, ["touch", "stolen"])):
        try:
            await verb
            raise AssertionError("the runtime acted on another agent's sandbox for a key limited to one agent")
        except StoreNotFound:
            pass
    assert ts.sandboxes.get(theirs) == before
    assert (await runtime.sandbox(who, boxes[MINE], "wake"))["id"] == boxes[MINE]
