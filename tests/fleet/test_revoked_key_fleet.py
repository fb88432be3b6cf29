"""A key revoked through one host of a fleet (`moorage up` hosts on PostgreSQL and S3) while the work it started
detached runs on another: the other host ran its async turns and detached exec on to their end, since a revoke
did not know which work was the key's and only the host running an exec could cancel it. Now that host cancels
them within seconds (its turn queued behind them never starts), each naming the key, and another key's async turn
on the same instance runs to its end (docs/security.md)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from tests.fleet.harness import Fleet, until

pytestmark = pytest.mark.timeout(600)

SLOW_AGENT = '''
import asyncio

async def on_message(ctx, message):
    if message.startswith("sleep "):
        await asyncio.sleep(float(message.split()[1]))
    return "echo: " + message
'''


@pytest.fixture
def fleet(tmp_path: Path, pg_url: str, seaweedfs, s3_bucket) -> Iterator[Fleet]:  # noqa: ANN001
    f = Fleet(tmp_path, pg_url, seaweedfs.settings(s3_bucket, f"fleet-{tmp_path.name}"), n=2)
    try:
        f.deploy_agent("echo", SLOW_AGENT)
        yield f
    finally:
        f.close()


def _status(c: httpx.Client, execution_id: str) -> dict[str, Any]:
    r = c.get(f"/v1/executions/{execution_id}")
    assert r.status_code == 200, r.text
    return r.json()


def _async_turn(c: httpx.Client, user: str, message: str, session: str = "default") -> str:
    r = c.post("/v1/agents/echo/invoke?async=true", json={"message": message, "user": user, "session": session})
    assert r.status_code == 202, r.text
    return r.json()["id"]


def test_a_key_revoked_through_one_host_cancels_its_work_on_another(fleet: Fleet) -> None:
    h1, h2 = fleet.api
    # Ada's and Bea's instances are awake on h2: their async turns and execs run there, whichever host took them.
    for user in ("ada", "bea"):
        r = h2.post("/v1/agents/echo/invoke", json={"message": "hi", "user": user})
        assert r.status_code == 200, r.text
    assert {u: rec.host for u, rec in fleet.records().items()} == {"ada": "h2", "bea": "h2"}
    leaked = h1.post("/v1/keys", json={"scopes": ["invoke", "deploy"], "label": "leaked"}).json()
    kept = h1.post("/v1/keys", json={"scopes": ["invoke"], "label": "kept"}).json()
    k = [h.client(leaked["secret"]) for h in fleet.hosts]
    o = fleet.hosts[0].client(kept["secret"])
    try:
        running = _async_turn(k[0], "ada", "sleep 90", "s")
        queued = _async_turn(k[1], "ada", "sleep 1", "s")  # behind it in its session's line
        r = k[0].post(f"/v1/sandboxes/{fleet.records()['bea'].id}/exec",
                      json={"argv": ["sleep", "90"], "detach": True, "timeout_s": 120})
        assert r.status_code == 202 and r.headers["x-moorage-served-by"] == "h2", r.text
        exec_k = r.json()["id"]
        theirs = _async_turn(o, "bea", "sleep 4")
        until(lambda: _status(h1, running)["status"] == "running" and _status(h1, theirs)["status"] == "running",
              "the async turns run on h2", timeout_s=60, every_s=0.1)
        assert _status(h1, queued)["status"] == "queued" and _status(h1, exec_k)["status"] == "running"
        revoked_at = time.monotonic()
        r = h1.delete(f"/v1/keys/{leaked['id']}")
        assert r.status_code == 200, r.text
        for ex in (running, queued, exec_k):
            until(lambda: _status(h1, ex)["status"] != "running" and _status(h1, ex)["status"] != "queued",
                  f"{ex} ended", timeout_s=20, every_s=0.1)
            end = _status(h1, ex)
            assert end["status"] == "cancelled" and leaked["id"] in end["error"] and "revoked" in end["error"], end
        took = time.monotonic() - revoked_at
        assert took < 20, took  # not the 90 s each would have run
        assert h1.get(f"/v1/workflows/{queued}").status_code == 404  # it never started
        assert h1.get(f"/v1/workflows/{running}").json()["run"]["status"] == "cancelled"
        until(lambda: _status(h1, theirs)["status"] not in ("running", "queued"), "the other key's turn ended",
              timeout_s=60)
        assert _status(h1, theirs)["status"] == "succeeded"
    finally:
        for c in (*k, o):
            c.close()
