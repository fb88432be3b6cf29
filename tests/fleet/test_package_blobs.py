"""The object store's deploy packages (``fleet/package_blobs.py``): kept while a deployment of any tenant names one,
then retired and deleted in two steps; a deploy that names one again while a collection decides keeps it, and one
that names it while a collection is deleting it waits for that collection and writes it again. Both store backends,
both object stores (local files, SeaweedFS S3); through `moorage up` hosts in tests/fleet/test_gc_fleet.py."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

from moorage.fleet.gc import template_use
from moorage.fleet.package_blobs import PackageCollector, keep, marker_key
from moorage.objects import Blobs, ObjectStore
from moorage.store import Store


def _package(blobs: Blobs, tmp_path: Path, text: str) -> tuple[str, Path]:
    path = tmp_path / f"{text}.tar.gz"
    path.write_bytes(text.encode() * 100)
    return blobs.put_blob(path), path


def test_packages_go_in_two_steps_once_no_deployment_names_them(store: Store, object_store: ObjectStore,
                                                                 tmp_path: Path) -> None:
    blobs = Blobs(object_store, "packages", suffix=".tar.gz")
    (a, _), (b, _), (c, _) = (_package(blobs, tmp_path, t) for t in ("a", "b", "c"))
    acme = store.tenant(store.authenticate(store.operator.create_tenant("acme")[1].secret))
    globex = store.tenant(store.authenticate(store.operator.create_tenant("globex")[1].secret))
    agent = acme.agents.create("x")
    da = acme.deployments.create(agent.id, {}, "p", a)
    acme.deployments.set_status(da.id, "failed")
    other = globex.agents.create("y")
    globex.deployments.create(other.id, {}, "p", b)  # another tenant's deployment keeps b

    def use():  # noqa: ANN202
        return template_use(store, grace_s=0)

    gc = PackageCollector(blobs, host="h1", grace_s=0, settle_s=60)
    rep = gc.collect(use(), use, now=1e10)
    assert (rep.retired, rep.deleted) == (1, 0)  # c: named by nobody
    assert json.loads(object_store.get_bytes(marker_key(c)))["state"] == "retired"
    acme.deployments.delete(da.id)
    assert gc.collect(use(), use, now=1e10 + 30).retired == 1  # a too, now
    assert gc.collect(use(), use, now=1e10 + 61).deleted == 1  # c, settled; a not yet
    assert not blobs.has(c) and not object_store.exists(marker_key(c)) and blobs.has(a) and blobs.has(b)

    # A deploy of a's bytes again (any tenant) before a is deleted: it stays, its marker goes.
    again = acme.deployments.create(agent.id, {}, "p", a)
    rep = gc.collect(use(), use, now=1e10 + 200)
    assert (rep.restored, rep.deleted) == (1, 0) and blobs.has(a) and not object_store.exists(marker_key(a))
    acme.deployments.set_status(again.id, "failed")
    acme.deployments.delete(again.id)
    gc.collect(use(), use, now=1e10 + 300)
    # A deploy that lands between the marking and the collection's second read of the store: kept.
    def landing():  # noqa: ANN202
        acme.deployments.create(agent.id, {}, "p", a)
        return use()

    rep = gc.collect(use(), landing, now=1e10 + 400)
    assert (rep.restored, rep.deleted) == (1, 0) and blobs.has(a) and not object_store.exists(marker_key(a))
    assert gc.collect(use(), use, now=1e10 + 500).retired == 0  # idempotent: nothing left to do


def test_a_deploy_naming_a_package_being_deleted_waits_and_writes_it_again(object_store: ObjectStore,
                                                                          tmp_path: Path) -> None:
    blobs = Blobs(object_store, "packages", suffix=".tar.gz")
    sha, path = _package(blobs, tmp_path, "pkg")
    object_store.put_bytes(marker_key(sha), json.dumps({"state": "deleting", "at": time.time()}).encode())
    done = threading.Event()
    t = threading.Thread(target=lambda: (keep(blobs, sha, path, wait_s=30, poll_s=0.05), done.set()))
    t.start()
    time.sleep(0.5)
    assert not done.is_set()  # it waits for the collection
    object_store.delete(blobs.key(sha))  # the collection read the store before the deployment: it deletes
    object_store.delete(marker_key(sha))
    t.join(10)
    assert done.is_set() and blobs.has(sha)  # written again
    # No marker, or a retired one: written at once when missing, left when there.
    object_store.put_bytes(marker_key(sha), json.dumps({"state": "retired", "at": 0}).encode())
    started = time.monotonic()
    keep(blobs, sha, path, wait_s=30)
    assert time.monotonic() - started < 5 and blobs.has(sha)


def test_leftover_markers_are_cleared(store: Store, object_store: ObjectStore, tmp_path: Path) -> None:
    """A deletion cut short leaves its marker: without the package it goes; with a package named again (and the
    deletion older than the settle time) the package stays and the marker goes."""
    blobs = Blobs(object_store, "packages", suffix=".tar.gz")
    sha, _ = _package(blobs, tmp_path, "named")
    ts = store.tenant(store.authenticate(store.operator.create_tenant("acme")[1].secret))
    ts.deployments.create(ts.agents.create("x").id, {}, "p", sha)
    gone = "f" * 64
    for s in (sha, gone):
        object_store.put_bytes(marker_key(s), json.dumps({"state": "deleting", "at": 1e10}).encode())

    def use():  # noqa: ANN202
        return template_use(store, grace_s=0)

    gc = PackageCollector(blobs, grace_s=0, settle_s=60)
    assert gc.collect(use(), use, now=1e10 + 10).restored == 0  # a collection may still be deleting it
    assert not object_store.exists(marker_key(gone))
    assert gc.collect(use(), use, now=1e10 + 61).restored == 1
    assert not object_store.exists(marker_key(sha)) and blobs.has(sha)
