"""A rolling upgrade of a fleet, seen from the host not upgraded yet: the first upgraded host migrated the shared
store past what this version knows. A host of this version that starts again then (a crash, a reboot, an operator's
restart before its turn to be upgraded) starts and serves when every newer migration was recorded as one older
versions may serve past, and is refused with what to do otherwise. And an instance the previous release shipped is
pulled whole by this one (its shipment, as that release wrote it, is test data). bench/upgrade/run.py runs two real
versions side by side."""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

import psycopg
import pytest

from moorage.config import Config
from moorage.devservices.fleet import LocalHost, write_counter_agent
from moorage.cli.up import tar_dir
from moorage.store import open_store
from moorage.store.schema import CONTROL_MIGRATIONS, OLDER_MAY_SERVE, TENANT_MIGRATIONS


def _newer(pg_url: str, name: str, ahead: int) -> None:
    """What a newer moorage's start leaves: ``ahead`` more migrations of each component recorded as ``name``."""
    with psycopg.connect(pg_url, autocommit=True) as c:
        for component, known in (("control", CONTROL_MIGRATIONS[-1].version), ("tenant", TENANT_MIGRATIONS[-1].version)):
            for v in range(known + 1, known + 1 + ahead):
                c.execute("INSERT INTO schema_migrations (component, version, name, applied_at) VALUES (%s, %s, %s, "
                          "now()) ON CONFLICT DO NOTHING", (component, v, f"{v}: {name}"))


def _store_migrated(pg_url: str) -> None:
    store = open_store(Config(store_url=pg_url))
    store.close()


def test_migrations_that_older_versions_may_serve_past_are_recorded_so(pg_url: str) -> None:
    _store_migrated(pg_url)
    with psycopg.connect(pg_url) as c:
        names = dict(c.execute("SELECT version, name FROM schema_migrations WHERE component = 'tenant'").fetchall())
    assert all(names[v].endswith(OLDER_MAY_SERVE) for v in (26, 27, 28)), names
    assert not names[25].endswith(OLDER_MAY_SERVE), names[25]  # a column and the trigger that fills it


def test_a_host_not_upgraded_yet_starts_and_serves_when_the_newer_migrations_allow_it(tmp_path: Path,
                                                                                         pg_url: str) -> None:
    _store_migrated(pg_url)
    _newer(pg_url, "an index a newer moorage reads" + OLDER_MAY_SERVE, ahead=2)
    h = LocalHost("h1", tmp_path / "h1", {"MOORAGE_STORE_URL": pg_url}, start_timeout_s=90)
    try:
        api = h.client(h.key)
        r = api.post("/v1/agents/echo/deployments", content=tar_dir(write_counter_agent(tmp_path)),
                     headers={"Content-Type": "application/gzip"})
        assert r.status_code == 201, r.text
        r = api.post("/v1/agents/echo/invoke", json={"message": "hi", "user": "ada"})
        assert r.status_code == 200 and r.json()["reply"] == "1: hi", r.text
        assert "the store was migrated by a newer moorage" in h.log.read_text()
    finally:
        h.stop()


def test_a_host_not_upgraded_yet_is_refused_with_what_to_do_when_a_newer_migration_does_not(tmp_path: Path,
                                                                                               pg_url: str) -> None:
    _store_migrated(pg_url)
    _newer(pg_url, "an index a newer moorage reads" + OLDER_MAY_SERVE, ahead=1)
    _newer(pg_url, "a column older versions would not fill", ahead=2)  # the second one has no such mark
    with pytest.raises(RuntimeError) as e:
        LocalHost("h1", tmp_path / "h1", {"MOORAGE_STORE_URL": pg_url}, start_timeout_s=90)
    said = str(e.value)
    assert "newer than this moorage knows" in said and "in a rolling upgrade of a fleet: upgrade this host now" in said, \
        said[-1500:]


#: An instance's directory as e27f536 (the release before) shipped it: its manifest and chunks, written by that
#: version's Shipper (a file, a hard link to it, a symbolic link, a directory, a 20 KB file of mode 0600 in 3 chunks).
OLD_SHIPMENT = Path(__file__).resolve().parents[1] / "data" / "upgrade" / "e27f536-shipment"


def test_an_instance_the_previous_release_shipped_is_pulled_whole_by_this_one(tmp_path: Path) -> None:
    from moorage.fleet.ship import Shipper
    from moorage.objects.local import LocalObjectStore

    store = LocalObjectStore(tmp_path / "bucket")
    for f in OLD_SHIPMENT.rglob("*"):
        if f.is_file():
            store.put_bytes(str(f.relative_to(OLD_SHIPMENT)), f.read_bytes())
    shipper = Shipper(store)
    try:
        dest = tmp_path / "sandbox"
        shipper.pull("instances/t1/sbx1/snapshots/snap-1.json", "instances/t1/sbx1", dest, epoch=3)
    finally:
        shipper.close()
    assert (dest / "counter.txt").read_text() == "counter 7\n"
    assert (dest / "counter-hard.txt").read_text() == "counter 7\n"
    assert (dest / "counter-hard.txt").stat().st_ino == (dest / "counter.txt").stat().st_ino
    assert os.readlink(dest / "link") == "sub/note.txt" and (dest / "link").read_text() == "hello from e27f536\n"
    blob = dest / "sub" / "blob.bin"
    assert hashlib.sha256(blob.read_bytes()).hexdigest() == BLOB_SHA256
    assert stat.S_IMODE(blob.stat().st_mode) == 0o600


BLOB_SHA256 = "27a982d870572aa256ad218fe3399e054ab9a052601f837fddbf2bc29b7a492c"
