"""The data directory's disk full under a running `moorage up`: every request that must write answers a 507
``disk-full`` problem saying so and what to do (not a 500 to report), what was there before is intact, and the
host serves again as soon as there is room, without a restart and after one."""

from __future__ import annotations

import json
import sqlite3

import pytest

from moorage.client import Client, DiskFull
from tests.diskfull.conftest import GZ, SmallDisk, archive
from tests.lifecycle.crash_up import Up


def _is_disk_full(r) -> None:  # type: ignore[no-untyped-def]
    assert r.status_code == 507, r.text
    body = r.json()
    assert body["type"].endswith("/disk-full") and "out of disk space" in body["detail"], body
    assert "free space" in body["hint"] and "no restart" in body["hint"], body


def test_a_full_disk_answers_507_disk_full_and_nothing_is_lost(host: tuple[Up, SmallDisk]) -> None:
    up, disk = host
    up.start()
    with up.client() as c:
        assert c.post("/v1/agents/echo/deployments", content=archive(), headers=GZ).status_code == 201
        for n in (1, 2):
            assert c.post("/v1/agents/echo/invoke", json={"message": "hi", "user": "ada"}).json()["reply"] == f"{n}: hi"
        disk.fill()
        once = {"Idempotency-Key": "ada-turn-3"}
        _is_disk_full(c.post("/v1/agents/echo/invoke", json={"message": "hi", "user": "ada"}, headers=once))  # a turn
        _is_disk_full(c.post("/v1/agents/echo/invoke", json={"message": "hi", "user": "bob"}))  # a new user
        _is_disk_full(c.post("/v1/agents/echo/users/ada/checkpoints", json={"name": "before"}))
        _is_disk_full(c.post("/v1/agents/echo/deployments", content=archive("2"), headers=GZ))
        _is_disk_full(c.post("/v1/agents/echo/webhooks", json={"url": "http://127.0.0.1:9/hook"}))
        _is_disk_full(c.post("/v1/agents/echo/users/ada/facts",
                             json={"subject": "ada", "attribute": "drinks", "value": "tea", "text": "ada drinks tea"}))
        assert c.get("/v1/agents/echo/users/ada").status_code == 200  # reads still answer
        with Client(up.url, up.key, max_retries=0) as sdk, pytest.raises(DiskFull) as refused:  # the SDK's own type
            sdk.invoke("echo", "hi", user="carol")
        assert refused.value.status == 507 and refused.value.code == "disk-full", refused.value
        disk.free()
        # Room again: the same host serves, ada's state is where it was, the refused requests can be made now.
        r = c.post("/v1/agents/echo/invoke", json={"message": "hi", "user": "ada"}, headers=once)
        assert r.json()["reply"] == "3: hi" and "Idempotent-Replayed" not in r.headers  # run now, not the 507 again
        assert c.post("/v1/agents/echo/invoke", json={"message": "hi", "user": "bob"}).json()["reply"] == "1: hi"
        assert c.post("/v1/agents/echo/users/ada/checkpoints", json={"name": "before"}).status_code == 201
        assert c.post("/v1/agents/echo/deployments", content=archive("2"), headers=GZ).status_code == 201
    up.stop()
    for db in [disk.path / "store" / "control.db", *(disk.path / "store" / "tenants").glob("*.db")]:
        with sqlite3.connect(db) as conn:
            assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",), db
    up.start()
    with up.client() as c:
        assert c.post("/v1/agents/echo/invoke", json={"message": "hi", "user": "ada"}).json()["reply"] == "4: hi"


def test_a_stream_cut_short_by_a_full_disk_ends_with_a_disk_full_error_event(host: tuple[Up, SmallDisk]) -> None:
    """The disk fills while a streamed turn runs: its status (200) is sent, so the end is an ``error`` event, which
    said "internal ... report trace id"; it says the disk is full, like the 507 of a request that had not begun."""
    up, disk = host
    up.start()
    with up.client() as c:
        assert c.post("/v1/agents/echo/deployments", content=archive(), headers=GZ).status_code == 201
        assert c.post("/v1/agents/echo/invoke", json={"message": "hi", "user": "ada"}).json()["reply"] == "1: hi"
        lines = []
        with c.stream("POST", "/v1/agents/echo/invoke?stream=true",
                      json={"message": "fill 0 after 1", "user": "ada"}) as r:
            assert r.status_code == 200
            for line in r.iter_lines():  # the agent's first event, then the end of the turn a second later
                if not lines:
                    disk.fill()
                lines.append(line)
        events = [(a[len("event: "):], json.loads(b[len("data: "):]))
                  for a, b in zip(lines, lines[1:]) if a.startswith("event: ")]
        assert events[0] == ("event", {"event": "waiting", "data": "1"}), events
        kind, error = events[-1]
        assert kind == "error" and error["type"] == "disk-full" and error["status"] == 507, events
        assert "out of disk space" in error["detail"] and "free space" in error["hint"], error
        disk.free()
        assert c.post("/v1/agents/echo/invoke", json={"message": "hi", "user": "ada"}).json()["reply"] == "2: hi"
