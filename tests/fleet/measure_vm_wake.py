"""Measures micro-VM wakes across a fleet of `moorage up` hosts (one PostgreSQL, one SeaweedFS, this machine).

First wake on a host without the template (template + instance pulled, then woken), cross-host wakes with the
template already on the waking host, and local wakes, on the default 256 MiB guest. Figures are the server's wake
time (``instance woke ... ms=``: claim, fetch, adopt, restore) and the client's time for the whole turn.

    .venv/bin/python -m tests.fleet.measure_vm_wake [rounds]
"""

from __future__ import annotations

import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from moorage.cli.up import tar_dir
from moorage.devservices.fleet import LocalHost, fleet_env
from moorage.devservices.postgres import start_cluster
from moorage.devservices.seaweedfs import start_seaweedfs
from tests.fleet.test_microvm_fleet import IMAGES, _agent

_WOKE = re.compile(r"instance woke instance=(\w+) .*?ms=([\d.]+)")


def _woke_ms(log: Path, instance: str, seen: int) -> float:
    hits = [float(m.group(2)) for m in _WOKE.finditer(log.read_text(errors="replace")) if m.group(1) == instance]
    assert len(hits) > seen, f"no new wake of {instance} in {log}"
    return hits[-1]


def main(rounds: int = 5) -> None:
    base = Path(tempfile.mkdtemp(prefix="vm-fleet-wake-"))
    pg = start_cluster()
    s3 = start_seaweedfs()
    hosts: dict[str, LocalHost] = {}
    try:
        s3.create_bucket("fleet")
        env = {**fleet_env(pg.create_database("fleet"), s3.settings("fleet", "m"), lease_ttl_s="15", heartbeat_s="3"),
               "MOORAGE_TEST_IMAGES_DIR": IMAGES}
        for name in ("h1", "h2", "h3"):
            hosts[name] = LocalHost(name, base / name, env, driver="microvm", start_timeout_s=900)
        key = hosts["h1"].key
        api = {n: h.client(key) for n, h in hosts.items()}

        def turn(host: str, user: str) -> float:
            t = time.monotonic()
            r = api[host].post("/v1/agents/echo/invoke", json={"message": "again", "user": user})
            assert r.status_code == 200, r.text
            return (time.monotonic() - t) * 1000

        def sleep(host: str, user: str) -> str:
            r = api[host].get("/v1/sandboxes", params={"agent": "echo"})
            (sb,) = [s for s in r.json()["data"] if s["scope"] == f"user:echo/{user}"]
            r = api[host].post(f"/v1/sandboxes/{sb['id']}/sleep")
            assert r.status_code == 200 and r.json()["slept"] is True, r.text
            return str(sb["id"])

        wakes: dict[str, int] = {}

        def wake(host: str, user: str, instance: str) -> tuple[float, float]:
            client_ms = turn(host, user)
            key_ = f"{host}/{instance}"
            server_ms = _woke_ms(hosts[host].log, instance, wakes.get(key_, 0))
            wakes[key_] = wakes.get(key_, 0) + 1
            return server_ms, client_ms

        t = time.monotonic()
        r = api["h1"].post("/v1/agents/echo/deployments", content=tar_dir(_agent(base)),
                           headers={"Content-Type": "application/gzip"})
        assert r.status_code == 201, r.text
        print(f"deploy on h1 (build + publish template and image): {time.monotonic() - t:.1f} s")
        turn("h1", "u1")
        awake = statistics.median(turn("h1", "u1") for _ in range(5))
        inst = sleep("h1", "u1")
        cold = wake("h2", "u1", inst)  # h2 has no template
        log2 = hosts["h2"].log.read_text(errors="replace")
        fetched = re.findall(r"(template fetched|guest image fetched|snapshot fetched) .*?ms=([\d.]+)", log2)
        print(f"turn on an awake VM: p50 {awake:.0f} ms")
        print(f"cold-host first wake (h2: template + instance pulled): server {cold[0]:.0f} ms, turn {cold[1]:.0f} ms; "
              f"pulls: {fetched}")
        turn("h3", "w")  # h3 gets the template (a fork of its own user)
        cross: list[tuple[float, float]] = []
        local: list[tuple[float, float]] = []
        at = "h2"
        for i in range(rounds):
            other = "h3" if at != "h3" else "h1"
            sleep(at, "u1")
            cross.append(wake(other, "u1", inst))
            at = other
            sleep(at, "u1")
            local.append(wake(at, "u1", inst))
        p50 = lambda xs, k: statistics.median(x[k] for x in xs)  # noqa: E731
        print(f"cross-host wake, template cached: server p50 {p50(cross, 0):.0f} ms, turn p50 {p50(cross, 1):.0f} ms "
              f"({[round(x[0]) for x in cross]})")
        print(f"local wake: server p50 {p50(local, 0):.0f} ms, turn p50 {p50(local, 1):.0f} ms "
              f"({[round(x[0]) for x in local]})")
        pulls = sorted(float(m) for h in ("h1", "h3") for m in
                       re.findall(r"snapshot fetched .*?ms=([\d.]+)", hosts[h].log.read_text(errors="replace")))
        print(f"of which the instance's snapshot pull (chunks it lacked): p50 {statistics.median(pulls):.0f} ms ({pulls})")
        for c in api.values():
            c.close()
    finally:
        for h in hosts.values():
            h.stop()
        s3.stop()
        pg.stop()
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 5)
