"""Two `moorage up` hosts on one PostgreSQL (real, stopped with pg_ctl) and one S3 server: when PostgreSQL was down
longer than the lease, every host's heartbeat is old, and the first host back must not take that for its peers
being dead (taking their awake instances over from their last shipped snapshot would lose what came after); and a
host cut off from it closes the app sockets it serves before its lease could be taken."""

from __future__ import annotations

import asyncio
import time
from typing import Iterator

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from tests.app.wsapp import agent_py
from tests.fleet.harness import Fleet, replied
from tests.outage.conftest import Outages


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, outages: Outages, seaweedfs, s3_bucket) -> Iterator[Fleet]:  # noqa: ANN001
    base = tmp_path_factory.mktemp("pgfleet")
    # Awake instances are shipped rarely: what a host's disk holds past its last shipment is only there.
    f = Fleet(base, outages.cluster.create_database("pgfleet"), seaweedfs.settings(s3_bucket, f"outage-{base.name}"),
              n=2, checkpoint_interval_s="600")
    try:
        f.deploy()
        yield f
    finally:
        f.close()


def test_after_postgresql_was_down_longer_than_the_lease_no_host_takes_over_its_peers_awake_instances(
        fleet: Fleet, outages: Outages) -> None:
    for n in range(1, 5):
        assert replied(fleet.turn(0, "ada")) == f"{n}: hi"       # awake on h1, shipped after its first turn only
    assert replied(fleet.turn(1, "bob")) == "1: hi"              # awake on h2
    outages.stop()
    try:
        time.sleep(6)                                              # longer than the 4 s lease
    finally:
        outages.start()
    # At once through the other host: both hosts' heartbeats are 6 s old, and neither is dead.
    assert replied(fleet.turn(1, "ada")) == "5: hi"              # not "2: hi" from its shipped snapshot
    assert replied(fleet.turn(0, "bob")) == "2: hi"
    time.sleep(6)                                                  # both beat again
    assert replied(fleet.turn(1, "ada")) == "6: hi"
    recs = fleet.records()
    assert (recs["ada"].host, recs["ada"].lease_epoch, recs["bob"].host) == ("h1", 0, "h2")


WS_AGENT = agent_py(r'''
class Handler(AppHandler):
    def respond(self):
        if not self.upgrade():
            self.wfile.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            return
        self.switch(b"")
        while True:
            opcode, data = self.read_frame()
            if opcode is None or opcode == 8:
                return
            self.frame(1, data)


serve(Handler)


async def on_message(ctx, message):
    return "ok"
''')


def test_an_app_socket_on_a_host_cut_off_from_postgresql_closes_1012_before_its_lease_could_be_taken(
        fleet: Fleet, outages: Outages) -> None:
    """Last in this file. A host that cannot reach the store for nearly a lease (lease 4 s, heartbeat 1 s here)
    closes the app sockets it serves with 1012, as another host may take their instances over once its lease
    lapses: a caller is never left talking to a copy whose changes a takeover would drop. Once the store is back,
    the caller connects again."""
    fleet.deploy_agent("wsa", WS_AGENT, "ports = [8080]\n")
    r = fleet.api[0].post("/v1/agents/wsa/invoke", json={"message": "hi", "user": "cy"})
    assert r.status_code == 200 and r.json()["reply"] == "ok", r.text
    url = fleet.hosts[0].url.replace("http://", "ws://") + "/v1/agents/wsa/users/cy/app/ws"
    auth = {"Authorization": f"Bearer {fleet.key}"}

    async def run() -> None:
        async with connect(url, additional_headers=auth, open_timeout=120) as ws:
            await ws.send("before")
            assert await ws.recv() == "before"
            await asyncio.to_thread(outages.stop)
            t0 = time.monotonic()
            try:
                with pytest.raises(ConnectionClosed) as e:
                    for _ in range(100):
                        await asyncio.wait_for(ws.recv(), 30)
                waited = time.monotonic() - t0
            finally:
                await asyncio.to_thread(outages.start)
            assert e.value.rcvd is not None and e.value.rcvd.code == 1012, e.value
            assert "lost touch" in e.value.rcvd.reason
            assert waited < 4.0 + 2, waited  # before the 4 s lease could lapse, give or take the last heartbeat
        for _ in range(120):  # the store is back: a new socket opens (the first tries may find it still starting)
            try:
                async with connect(url, additional_headers=auth, open_timeout=30) as again:
                    await again.send("after")
                    assert await again.recv() == "after"
                    return
            except (InvalidStatus, ConnectionClosed, OSError):
                await asyncio.sleep(0.5)
        raise AssertionError("no socket after the store came back")

    asyncio.run(run())
