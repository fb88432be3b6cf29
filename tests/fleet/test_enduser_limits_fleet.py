"""One end-user's limits in a fleet of `moorage up` hosts (PostgreSQL, S3): unfinished async turns were counted per
host, so a user sending to N hosts had N times ``user_max_async_turns``; they are counted in the store now, for the
whole fleet. A user's turns to an instance awake on one host are forwarded there and counted by that host, so its
per-end-user places bind them fleet-wide (docs/security.md says which limits stay per host)."""

from __future__ import annotations

from pathlib import Path
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator

import httpx
import pytest

from moorage.cli.up import tar_dir
from moorage.config import Config
from moorage.devservices.fleet import write_counter_agent
from moorage.store import open_store
from tests.fleet.harness import Fleet, until


@pytest.fixture
def s3(seaweedfs, s3_bucket, tmp_path: Path) -> dict[str, str]:  # noqa: ANN001
    return seaweedfs.settings(s3_bucket, f"fleet-{tmp_path.name}")


@pytest.fixture
def fleet(tmp_path: Path, pg_url: str, s3: dict[str, str]) -> Iterator[Fleet]:
    f = Fleet(tmp_path, pg_url, s3, n=2, user_max_async_turns="2", end_user_max_requests="2")
    try:
        f.deploy()
        yield f
    finally:
        f.close()


def _deploy_per_session(f: Fleet) -> None:
    """The counter agent with an instance per session: one user's sessions may be awake on different hosts."""
    d = write_counter_agent(f.base / "per-session", "chat")
    (d / "moorage.toml").write_text('[agent]\nname = "chat"\nentry = "agent.py"\n'
                                    '[agent.lifecycle]\nusers = "auto"\nscope = "session"\nsleep = "fixed:3600"\n')
    r = f.api[0].post("/v1/agents/chat/deployments", content=tar_dir(d), headers={"Content-Type": "application/gzip"})
    assert r.status_code == 201, r.text


def test_async_turns_of_one_end_user_are_bounded_across_the_fleet(fleet: Fleet) -> None:
    _deploy_per_session(fleet)
    h1, h2 = fleet.api
    # Ada's session s1 is awake on h1, s2 on h2: her turns of each are served (and were counted) there.
    for c, session in ((h1, "s1"), (h2, "s2")):
        r = c.post("/v1/agents/chat/invoke", json={"message": "hi", "user": "ada", "session": session})
        assert r.status_code == 200, r.text
    assert {rec.scope.ref: rec.host for rec in _instances(fleet)} == {"s1": "h1", "s2": "h2"}
    token = h1.post("/v1/agents/chat/users/ada/tokens", json={"ttl_s": 600}).json()["token"]
    browsers = [httpx.Client(base_url=h.url, headers={"Authorization": f"Bearer {token}"}, timeout=120)
                for h in fleet.hosts]
    try:
        first = [browsers[0].post("/v1/agents/chat/invoke?async=true", json={"message": "slow", "session": "s1"})
                 for _ in range(2)]
        assert [r.status_code for r in first] == [202, 202], [r.text for r in first]
        # Two unfinished on h1: the user's limit for the whole fleet. Counted per host, h2 had room for two more.
        for b, session in ((browsers[1], "s2"), (browsers[0], "s1"), (browsers[1], "s1")):
            r = b.post("/v1/agents/chat/invoke?async=true", json={"message": "slow", "session": session})
            assert r.status_code == 429, r.text
            assert r.json()["type"].endswith("/overloaded") and "at most 2 async turns" in r.json()["detail"]
            assert r.headers.get("retry-after")
        # Once they ended, the user may send again, to any host.
        for r in first:
            until(lambda: h1.get(f"/v1/executions/{r.json()['id']}").json()["status"] == "succeeded",
                  "the async turn finished", timeout_s=120)
        r = browsers[1].post("/v1/agents/chat/invoke?async=true", json={"message": "again", "session": "s2"})
        assert r.status_code == 202, r.text
        until(lambda: h1.get(f"/v1/executions/{r.json()['id']}").json()["status"] == "succeeded",
              "the last async turn finished", timeout_s=120)
    finally:
        for b in browsers:
            b.close()


def test_turns_in_flight_forwarded_to_the_instances_host_are_counted_there(fleet: Fleet) -> None:
    """The bound docs/security.md states: a turn sent to any host runs where the user's instance is awake, and that
    host counts it among the end-user's requests in flight, whichever host it came through."""
    h1 = fleet.api[0]
    assert h1.post("/v1/agents/echo/invoke", json={"message": "hi", "user": "bo"}).status_code == 200  # awake on h1
    assert fleet.records()["bo"].host == "h1"
    token = h1.post("/v1/agents/echo/users/bo/tokens", json={"ttl_s": 600}).json()["token"]
    browsers = [httpx.Client(base_url=h.url, headers={"Authorization": f"Bearer {token}"}, timeout=120)
                for h in fleet.hosts]
    try:
        with ThreadPoolExecutor(2) as pool:
            # Two slow turns, one through each host: both run on h1 (the second waits behind the first).
            held = [pool.submit(b.post, "/v1/agents/echo/invoke", json={"message": "slow"}) for b in browsers]
            time.sleep(1.5)
            # h2 holds one place of two for bo; h1 holds both: a third through h2 is refused by h1.
            r = browsers[1].post("/v1/agents/echo/invoke", json={"message": "third"})
            assert r.status_code == 429 and r.json()["type"].endswith("/too-many-requests"), r.text
            assert r.headers.get("x-moorage-served-by") == "h1"
            assert [f.result().status_code for f in held] == [200, 200]
        assert browsers[1].post("/v1/agents/echo/invoke", json={"message": "after"}).status_code == 200
    finally:
        for b in browsers:
            b.close()


def _instances(f: Fleet) -> list[Any]:
    store = open_store(Config(store_url=f.store_url))
    try:
        return [r for ts in store.operator.tenants() for r in ts.sandboxes.list(limit=1000) if r.scope.agent == "chat"]
    finally:
        store.close()
