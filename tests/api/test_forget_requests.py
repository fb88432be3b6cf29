"""Forgetting an end-user removes what the API kept of the requests about them: the stored answers replayed for
an Idempotency-Key (a fact's value was still there after the user was erased) and those requests' traces; and
stored answers expire after their replay window instead of being kept for ever. Both store backends."""

from __future__ import annotations

import json
from pathlib import Path

from moorage.store import Store
from moorage.store.repos.journal import HTTP_PENDING_TTL_S, HTTP_REPLAY_TTL_S
from tests.api.conftest import acme, aclient, agent_archive, live_rt, runtime  # noqa: F401 - fixtures

SECRET = "pin-4242-of-gus"


async def test_forgetting_a_user_removes_their_requests_stored_answers_and_traces(
        live_rt, store: Store, acme: str, tmp_path: Path) -> None:  # noqa: F811
    ts = store.tenant(store.authenticate(acme))

    def kept(text: str) -> list[str]:
        rows = ts.read("SELECT key, result FROM journal") + ts.read("SELECT span_id, attrs FROM spans")
        return [r[0] for r in rows if text in (r[1] if isinstance(r[1], str) else json.dumps(r[1], default=str))]

    async with aclient(live_rt, acme) as c:
        r = await c.post("/v1/agents/echo/deployments", content=agent_archive(tmp_path),
                         headers={"content-type": "application/gzip"})
        assert r.status_code == 201, r.text
        for who in ("gus", "ida"):
            assert (await c.post("/v1/agents/echo/invoke", json={"message": "hi", "user": who})).status_code == 200
            r = await c.post(f"/v1/agents/echo/users/{who}/facts", headers={"Idempotency-Key": f"fact-{who}"},
                             json={"subject": who, "attribute": "pin", "value": f"pin-4242-of-{who}"})
            assert r.status_code == 201, r.text
            assert (await c.get(f"/v1/agents/echo/users/{who}/facts")).status_code == 200
        assert kept(SECRET) and kept('"gus"')  # the stored answer and the requests' spans name gus

        erased = await c.delete("/v1/agents/echo/users/gus")
        assert erased.status_code == 200
        assert kept(SECRET) == []  # nothing of gus is left but the record of the erasure itself
        left = [r for r in ts.read("SELECT name, attrs FROM spans") if '"gus"' in str(r[1])]
        assert [name for name, _ in left] == ["DELETE /v1/agents/{agent}/users/{user}"], left
        assert kept("pin-4242-of-ida") and kept('"ida"')  # another user's stay
        # The key's answer is gone with it: the request is new again (not a replay of the erased answer).
        r = await c.post("/v1/agents/echo/users/gus/facts", headers={"Idempotency-Key": "fact-gus"},
                         json={"subject": "gus", "attribute": "pin", "value": "new"})
        assert r.status_code in (201, 404) and r.headers.get("Idempotent-Replayed") is None, r.text


async def test_stored_answers_expire_after_their_replay_window(live_rt, store: Store, acme: str) -> None:  # noqa: F811
    ts = store.tenant(store.authenticate(acme))
    now = 10_000_000.0
    for key, status, age in [("http:done-old", "done", HTTP_REPLAY_TTL_S + 1), ("http:done-new", "done", 60),
                             ("http:pending-day", "pending", HTTP_REPLAY_TTL_S + 1),
                             ("http:pending-old", "pending", HTTP_PENDING_TTL_S + 1), ("turn-step", "done", 10 ** 6)]:
        entry, _ = ts.journal.claim(key)
        if status == "done":
            ts.journal.complete(key, expected_version=entry.version, result={"status": 200})
        with ts.transaction():
            ts.ambient().x("UPDATE journal SET updated_at = ? WHERE key = ?", (now - age, key))
    ts.journal.sweep_http(now)
    assert sorted(r[0] for r in ts.read("SELECT key FROM journal")) == ["http:done-new", "http:pending-day",
                                                                         "turn-step"]


async def test_forgetting_a_user_removes_stored_answers_of_requests_about_their_sandbox_and_execs(
        live_rt, store: Store, acme: str, tmp_path: Path) -> None:  # noqa: F811
    """A cancel of a detached exec (its answer holds the output so far) and a sandbox verb name no user in their
    path: their stored answers are about the sandbox's user all the same, and go when that user is forgotten."""
    import asyncio

    ts = store.tenant(store.authenticate(acme))

    def kept(text: str) -> list[str]:
        return [k for k, v in ts.read("SELECT key, result FROM journal WHERE key >= 'http:' AND key < 'http;'")
                if text in (v if isinstance(v, str) else json.dumps(v, default=str))]

    async with aclient(live_rt, acme) as c:
        r = await c.post("/v1/agents/echo/deployments", content=agent_archive(tmp_path),
                         headers={"content-type": "application/gzip"})
        assert r.status_code == 201, r.text
        boxes = {}
        for who in ("gus", "ida"):
            assert (await c.post("/v1/agents/echo/invoke", json={"message": "hi", "user": who})).status_code == 200
            boxes[who] = next(b["id"] for b in (await c.get("/v1/sandboxes")).json()["data"]
                              if b["scope"].endswith(f"/{who}"))
            r = await c.post(f"/v1/sandboxes/{boxes[who]}/exec", json={
                "argv": ["sh", "-c", f"echo pin-4242-of-{who}; sleep 600"], "detach": True})
            assert r.status_code == 202, r.text
            ex = r.json()["id"]
            await asyncio.sleep(0.5)  # its first line is out
            r = await c.post(f"/v1/executions/{ex}/cancel", headers={"Idempotency-Key": f"cancel-{who}"})
            assert r.status_code == 200, r.text
            r = await c.post(f"/v1/sandboxes/{boxes[who]}/sleep", headers={"Idempotency-Key": f"sleep-{who}"})
            assert r.status_code == 200, r.text
        assert kept(SECRET) and kept(boxes["gus"])  # the cancel's answer holds the output; the verb's, the sandbox

        assert (await c.delete("/v1/agents/echo/users/gus")).status_code == 200
        assert kept(SECRET) == [] and kept(boxes["gus"]) == []
        assert kept("pin-4242-of-ida") and kept(boxes["ida"])  # another user's stay
