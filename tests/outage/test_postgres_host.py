"""A serving `moorage up` host (PostgreSQL + S3, process driver) while PostgreSQL restarts, has its connections
cut, or is stopped: callers get a prompt 503 with Retry-After meanwhile, and the host carries on by itself after,
its heartbeat and background loops included, without losing an acknowledged turn."""

from __future__ import annotations

import time
from typing import Iterator

import httpx
import pytest

from tests.fleet.harness import Fleet, replied, until
from tests.outage.conftest import Outages


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory, outages: Outages, seaweedfs, s3_bucket) -> Iterator[Fleet]:  # noqa: ANN001
    base = tmp_path_factory.mktemp("pghost")
    f = Fleet(base, outages.cluster.create_database("pghost"), seaweedfs.settings(s3_bucket, f"outage-{base.name}"),
              n=1, checkpoint_interval_s="1")
    try:
        f.deploy()
        yield f
    finally:
        f.close()


def _heartbeat(f: Fleet) -> float:
    (row,) = f.host_rows()
    return row.heartbeat_at


def _log_after(f: Fleet, mark: int) -> str:
    return f.hosts[0].log.read_bytes()[mark:].decode(errors="replace")


def _recovered(f: Fleet) -> None:
    """The heartbeat beats again and the webhook outbox's loop runs without failing (both use the owner's
    connection, which the server closed)."""
    t0 = time.time()
    until(lambda: _heartbeat(f) > t0, "the host heartbeats again", 15)
    mark = f.hosts[0].log.stat().st_size
    time.sleep(2)  # four rounds of the outbox
    assert "webhook round failed" not in _log_after(f, mark)


@pytest.mark.parametrize("cut", ["restart", "terminate"])
def test_turns_heartbeats_and_background_loops_carry_on_after_a_restart_or_cut_connections(
        host: Fleet, outages: Outages, cut: str) -> None:
    user = f"u-{cut}"
    assert replied(host.turn(0, user)) == "1: hi"
    if cut == "restart":
        outages.restart()
    else:
        assert outages.terminate("pghost") >= 2
    assert replied(host.turn(0, user)) == "2: hi"          # its first turn after: no error
    assert replied(host.turn(0, f"{user}-new")) == "1: hi"
    _recovered(host)


def _ready(f: Fleet) -> httpx.Response:
    return httpx.get(f"{f.hosts[0].url}/readyz", timeout=30)


def test_turns_while_postgresql_is_down_get_a_prompt_503_and_the_host_recovers_without_a_restart(
        host: Fleet, outages: Outages) -> None:
    assert replied(host.turn(0, "ada")) == "1: hi"
    assert _ready(host).json() == {"status": "ready"}
    outages.stop()
    try:
        # A load balancer asking the host whether to send it requests is told no, and why, within seconds (an
        # answer stands for a second).
        until(lambda: _ready(host).status_code == 503, "the host says it is not ready", 10, every_s=0.2)
        r = _ready(host)
        assert r.json()["status"] == "store-unreachable" and "PostgreSQL" in r.json()["detail"], r.text
        for user in ("ada", "newcomer"):
            t0 = time.monotonic()
            r = host.turn(0, user)
            assert time.monotonic() - t0 < 10, "the request hung on the store"
            assert r.status_code == 503 and r.headers.get("Retry-After"), r.text
            body = r.json()
            assert "cannot reach PostgreSQL" in body["detail"] and "reconnects by itself" in body["hint"], body
        time.sleep(6)  # longer than the pool retries in the background
    finally:
        outages.start()
    r = host.turn(0, "ada")
    assert replied(r) == "2: hi"                           # nothing acknowledged was lost, nothing counted twice
    assert replied(host.turn(0, "newcomer")) == "1: hi"
    _recovered(host)
    until(lambda: _ready(host).status_code == 200, "the host is ready again", 10)


def test_a_turn_running_while_postgresql_restarts_is_answered_and_stored(host: Fleet, outages: Outages) -> None:
    from concurrent.futures import ThreadPoolExecutor

    assert replied(host.turn(0, "cal")) == "1: hi"
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(host.turn, 0, "cal", "slow")       # 4 s in the agent
        time.sleep(1)
        outages.restart()
        r = running.result(timeout=60)
    assert replied(r) == "2: slow"
    run = host.api[0].get(f"/v1/workflows/{r.json()['run_id']}")
    assert run.status_code == 200, run.text
    stored = run.json()["run"]                                     # acknowledged, and stored as answered
    assert (stored["status"], stored["result"]["reply"]) == ("succeeded", "2: slow"), stored
    assert replied(host.turn(0, "cal")) == "3: hi"


def test_an_async_turn_accepted_before_postgresql_went_down_runs_once_it_is_back(host: Fleet,
                                                                                outages: Outages) -> None:
    from concurrent.futures import ThreadPoolExecutor

    assert replied(host.turn(0, "eve")) == "1: hi"
    with ThreadPoolExecutor(1) as pool:
        slow = pool.submit(host.turn, 0, "eve", "slow")          # eve's session is busy for 4 s
        time.sleep(1)
        r = host.api[0].post("/v1/agents/echo/invoke?async=true", json={"message": "later", "user": "eve"})
        assert r.status_code == 202, r.text                        # accepted: queued behind the slow turn
        ex = r.json()["id"]
        outages.stop()
        try:
            slow.result(timeout=60)
            time.sleep(2)
        finally:
            outages.start()

    def status() -> str:
        r = host.api[0].get(f"/v1/executions/{ex}")
        return r.json()["status"] if r.status_code == 200 else ""

    until(lambda: status() in ("succeeded", "failed"), "the async turn ran", 60)
    got = host.api[0].get(f"/v1/executions/{ex}").json()
    assert got["status"] == "succeeded" and got["reply"].endswith(": later"), got


def test_background_loops_log_an_outage_once_then_its_end_not_every_failed_round(host: Fleet,
                                                                                  outages: Outages) -> None:
    assert replied(host.turn(0, "lou")) == "1: hi"
    mark = host.hosts[0].log.stat().st_size
    outages.stop()
    try:
        time.sleep(16)  # three rounds or more of the outbox (each waits out the connection wait) and the heartbeat
    finally:
        outages.start()
    until(lambda: "webhook round works again" in _log_after(host, mark), "the outbox's loop says it works again", 30)
    until(lambda: "fleet heartbeat works again" in _log_after(host, mark), "the heartbeat says it works again", 30)
    text = _log_after(host, mark)
    # One line when the rounds began failing, none per round after it (the next would come after a minute).
    assert text.count("webhook round failed") == 1, text
    assert text.count("fleet heartbeat failed") == 1, text
    assert "still failing" not in text, text
    # The connection pool's own warning of each failed attempt to connect (several a second): the first only.
    assert text.count("error connecting in") <= 1, text
    assert replied(host.turn(0, "lou")) == "2: hi"


def test_idle_sleeps_refused_during_an_outage_are_one_line_then_the_instance_sleeps(host: Fleet, outages: Outages,
                                                                                   tmp_path) -> None:  # noqa: ANN001
    """An instance due to sleep while PostgreSQL is down has its sleep refused every round of the idle loop; the
    log says so once (per minute), not once per round, and the sleep happens once the store is back. It stays
    awake on this host until then (docs/fleet.md, "A store outage and sleeps"): its sleep is a claim on its record,
    which takes the store; whether the idle loop or a shipment waiting for the store gets to it first."""
    import json
    from moorage.devservices.fleet import write_counter_agent
    from tests.fleet.harness import tar_dir

    agent = write_counter_agent(tmp_path, name="napper")
    toml = agent / "moorage.toml"
    toml.write_text(toml.read_text().replace('sleep = "fixed:3600"', 'sleep = "fixed:2"'))
    r = host.api[0].post("/v1/agents/napper/deployments", content=tar_dir(agent),
                         headers={"Content-Type": "application/gzip"})
    assert r.status_code == 201, r.text
    assert replied(host.api[0].post("/v1/agents/napper/invoke", json={"message": "hi", "user": "nap"})) == "1: hi"
    sandbox = host.hosts[0].data / "sandboxes" / host.records()["nap"].id
    mark = host.hosts[0].log.stat().st_size
    outages.stop()  # before its 2 s of idleness are up
    try:
        time.sleep(16)  # its sleep is due, and refused, round after round
        assert json.loads((sandbox / "meta.json").read_text())["state"] == "running"  # awake until the store is back
    finally:
        outages.start()
    until(lambda: host.records()["nap"].state == "sleeping", "the idle sleep once the store is back", 30)
    text = _log_after(host, mark)
    # At most one line for the outage, and its end once a sleep goes through. (Zero when the idle loop never got to
    # try: on a loaded host the instance's shipment may hold it, waiting for the store, through the whole outage.)
    assert text.count("idle sleep failed") <= 1, text
    assert "idle sleep failed" not in text or "idle sleep works again" in text, text
