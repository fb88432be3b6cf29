"""Forgetting a user of a session-scoped agent whose sessions are awake on two other hosts at once.

The host the forget is sent to forwards it to one holder (one hop), which could not forward it on to the other: it
answered 503 until the other session slept (its idle policy: an hour here). Now the host that serves the forget
asks the other holder to let go of its session (its turn in flight cancelled, its sandbox put to sleep) and takes
it as it takes an asleep one; the forget returns once no session of the user runs anywhere.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.fleet.harness import Fleet, until
from moorage.config import Config
from moorage.store import open_store
from tests.fleet.test_forget_fleet import SlowRelay, _awake_on, _objects_of, _records, fleet, s3  # noqa: F401

pytestmark = pytest.mark.timeout(300)


def _deploy_sessions(f: Fleet) -> None:
    from moorage.cli.up import tar_dir
    from moorage.devservices.fleet import write_counter_agent

    d = write_counter_agent(f.base / "sess", name="sess")
    (d / "moorage.toml").write_text('[agent]\nname = "sess"\nentry = "agent.py"\n'
                                    '[agent.lifecycle]\nscope = "session"\nusers = "auto"\nsleep = "fixed:3600"\n')
    r = f.api[0].post("/v1/agents/sess/deployments", content=tar_dir(d), headers={"Content-Type": "application/gzip"})
    assert r.status_code == 201, r.text


def _turn(f: Fleet, i: int, session: str, text: str = "hi"):  # noqa: ANN202
    return f.api[i].post("/v1/agents/sess/invoke", json={"message": text, "user": "dee", "session": session})


def test_a_forget_of_sessions_awake_on_two_other_hosts_ends_both_and_leaves_nothing(
        fleet: tuple[Fleet, SlowRelay], seaweedfs, s3_bucket, s3: dict[str, str]) -> None:  # noqa: ANN001, F811
    f, _ = fleet
    _deploy_sessions(f)
    assert _turn(f, 1, "one").status_code == 200  # awake on h2
    assert _turn(f, 2, "two").status_code == 200  # awake on h3
    recs = {r.scope.ref: r for r in _records(f)}
    assert (recs["one"].host, recs["one"].state) == ("h2", "running")
    assert (recs["two"].host, recs["two"].state) == ("h3", "running")
    until(lambda: _awake_on(f, "h2") == 1 and _awake_on(f, "h3") == 1, "h2 and h3 each say they hold a session",
          timeout_s=10, every_s=0.2)
    assert all(_processes_of(rec.id) for rec in recs.values())  # each session's sandbox runs on its host
    with ThreadPoolExecutor(2) as pool:
        slow = {i: pool.submit(_turn, f, i, ref, "slow") for i, ref in ((1, "one"), (2, "two"))}  # 4 s in the agent
        until(lambda: _running(f) == 2, "the slow turns run", timeout_s=30, every_s=0.1)
        r = f.api[0].delete("/v1/agents/sess/users/dee")  # through h1, which holds neither
        assert r.status_code == 200 and r.json()["deleted"] is True, r.text
        assert r.headers.get("x-moorage-served-by") in ("h2", "h3")
        # Nothing of the user runs anywhere once the forget returned: both hosts stopped their session's sandbox.
        assert [_processes_of(rec.id) for rec in recs.values()] == [[], []]
        turns = {i: s.result(timeout=60) for i, s in slow.items()}
    for t in turns.values():
        assert t.status_code == 409, t.text  # cancelled: what it would reply is forgotten
    assert _records(f) == []
    for rec in recs.values():
        assert _objects_of(seaweedfs, s3_bucket, s3, rec.id) == []
    assert f.api[2].get("/v1/agents/sess/users/dee").status_code == 404
    until(lambda: _awake_on(f, "h2") == 0 and _awake_on(f, "h3") == 0, "h2 and h3 hold nothing awake",
          timeout_s=10, every_s=0.2)


def _running(f: Fleet) -> int:
    """How many turns of the session agent are running (their durable runs)."""
    store = open_store(Config(store_url=f.store_url))
    try:
        return len([r for ts in store.operator.tenants() for r in ts.runs.list(status=["running"], agent="sess")])
    finally:
        store.close()


def _processes_of(sandbox_id: str) -> list[int]:
    """The processes whose command line names the sandbox (its bubblewrap and what runs inside)."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if sandbox_id.encode() in argv:
            pids.append(int(pid))
    return pids
