"""A deploy whose host died while building its template, in a fleet: the deployment was listed ``building`` for
ever (only a single host's next start marked such deploys failed, and in a fleet another host may be building one
right now). Each deployment records who builds it; once that host is dead (its lease lapsed), any host lists the
deploy as failed, while a deploy another live host is building stays ``building``. Two `moorage up` hosts."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import httpx

from tests.api.conftest import agent_archive
from tests.fleet.harness import Fleet, until

#: Loading the agent takes a while (its template's build waits for it): time to look, and to kill the host.
SLOW_AGENT = '''\
import time
time.sleep(12)


async def on_message(ctx, message):
    return "built: " + message
'''


def _archive(root: Path, name: str, slow: bool = True) -> bytes:
    return agent_archive(root, name, SLOW_AGENT if slow else SLOW_AGENT.replace("time.sleep(12)", ""))


def _deploys(api: httpx.Client, agent: str) -> list[dict[str, Any]]:
    r = api.get(f"/v1/agents/{agent}/deployments")
    return r.json()["data"] if r.status_code == 200 else []


def _deploy_in_background(api: httpx.Client, agent: str, body: bytes) -> list[Any]:
    out: list[Any] = []

    def go() -> None:
        try:
            out.append(api.post(f"/v1/agents/{agent}/deployments", content=body,
                                headers={"Content-Type": "application/gzip"}, timeout=120))
        except BaseException as e:  # noqa: BLE001 - the host may be killed under it
            out.append(e)

    threading.Thread(target=go, daemon=True).start()
    return out


def test_a_deploy_whose_host_died_mid_build_is_listed_failed_by_the_survivor(
        tmp_path: Path, pg_url: str, seaweedfs: Any, s3_bucket: str) -> None:
    f = Fleet(tmp_path, pg_url, seaweedfs.settings(s3_bucket, f"deploy-{tmp_path.name}"), n=2)
    try:
        doomed = _deploy_in_background(f.api[1], "doomed", _archive(tmp_path / "doomed", "doomed"))
        until(lambda: [d["status"] for d in _deploys(f.api[0], "doomed")] == ["building"],
              "h2's deploy is building", 60, 0.1)
        # A live host's build is never taken for abandoned, read through the other host.
        busy = _deploy_in_background(f.api[0], "busy", _archive(tmp_path / "busy", "busy"))
        until(lambda: [d["status"] for d in _deploys(f.api[1], "busy")] == ["building"],
              "h1's deploy is building", 60, 0.1)
        f.hosts[1].kill()
        assert [d["status"] for d in _deploys(f.api[0], "busy")] == ["building"]
        # Once h2's lease lapsed (4 s), its deploy reads failed through h1, never building again.
        until(lambda: [d["status"] for d in _deploys(f.api[0], "doomed")] == ["failed"],
              "the dead host's deploy is listed failed", 60)
        until(lambda: bool(busy), "h1's deploy finished", 120)
        assert isinstance(busy[0], httpx.Response) and busy[0].status_code == 201, busy
        assert [d["status"] for d in _deploys(f.api[0], "busy")] == ["ready"]
        assert not doomed or not isinstance(doomed[0], httpx.Response) or doomed[0].status_code != 201
        # Deploying again through the survivor works (an agent that loads at once), and only the new deployment is
        # live.
        r = f.api[0].post("/v1/agents/doomed/deployments", content=_archive(tmp_path / "again", "doomed", False),
                          headers={"Content-Type": "application/gzip"}, timeout=120)
        assert r.status_code == 201, r.text
        assert [d["status"] for d in _deploys(f.api[0], "doomed")] == ["failed", "ready"]
        t0 = time.monotonic()
        r = f.api[0].post("/v1/agents/doomed/invoke", json={"message": "hi", "user": "ada"}, timeout=120)
        assert r.status_code == 200 and r.json()["reply"] == "built: hi", (r.text, time.monotonic() - t0)
    finally:
        f.close()
