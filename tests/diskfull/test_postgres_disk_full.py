"""PostgreSQL's own disk full under a running `moorage up` (the store's cluster on a small filesystem of its own,
filled up): a request whose write the server refuses (SQLSTATE 53100, "could not extend file") answers a 507
``disk-full`` problem saying what to do, not a 500; once there is room the host serves again, without a restart."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Iterator

import pytest

from moorage.devservices.postgres import PostgresCluster, free_port, start_cluster
from tests.diskfull.conftest import GZ, SmallDisk, archive
from tests.lifecycle.crash_up import Up, stop_sandboxes


@pytest.fixture
def pg_on_small_disk() -> Iterator[tuple[PostgresCluster, SmallDisk]]:
    # Not under tmp_path: the cluster runs as the postgres user, who cannot pass pytest's private directories.
    disk = SmallDisk(Path(tempfile.mkdtemp(prefix="moorage-pg-full-")), 96)  # initdb's ~40 MiB, a WAL segment or two
    cluster = None
    try:
        cluster = start_cluster(max_connections=50, root=disk.path)
        yield cluster, disk
    finally:
        if cluster is not None:
            cluster.stop()
        disk.unmount()
        disk.path.rmdir()


def _fact(c, n: int):  # type: ignore[no-untyped-def]
    # Random hex: rows that fill pages fast (under the 2,704 bytes a btree entry may take: facts_current indexes it).
    return c.post("/v1/agents/echo/users/ada/facts", json={"subject": "ada", "attribute": f"note-{n}",
                                                           "value": os.urandom(1000).hex()})


def test_postgresqls_disk_full_answers_507_disk_full_and_the_host_serves_again_once_there_is_room(
        tmp_path: Path, pg_on_small_disk: tuple[PostgresCluster, SmallDisk]) -> None:
    cluster, disk = pg_on_small_disk
    up = Up(tmp_path / "data", free_port(), "process", MOORAGE_STORE_URL=cluster.owner_url)
    try:
        up.start()
        with up.client() as c:
            assert c.post("/v1/agents/echo/deployments", content=archive(), headers=GZ).status_code == 201
            assert c.post("/v1/agents/echo/invoke", json={"message": "hi", "user": "ada"}).json()["reply"] == "1: hi"
            assert _fact(c, 0).status_code == 201
            disk.fill()
            answers = []
            for n in range(1, 200):  # the first write that needs a new page of a table is refused
                r = _fact(c, n)
                answers.append(r.status_code)
                if r.status_code != 201:
                    break
            assert answers[-1] == 507, (answers, r.text)
            body = r.json()
            assert body["type"].endswith("/disk-full") and "out of disk space" in body["detail"], body
            assert "free space" in body["hint"] and "no restart" in body["hint"], body
            assert "could not extend" in cluster.root.joinpath("log").read_text()  # PostgreSQL's own refusal
            assert c.get("/v1/agents/echo/users/ada").status_code == 200  # reads still answer
            disk.free()
            assert _fact(c, 1000).status_code == 201  # no restart: the same host, the same connections
            assert c.post("/v1/agents/echo/invoke", json={"message": "hi", "user": "ada"}).json()["reply"] == "2: hi"
    finally:
        up.stop()
        stop_sandboxes(up.data)
