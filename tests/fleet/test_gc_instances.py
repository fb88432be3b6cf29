"""The collection removes an instance's objects from the object store once its record is gone or being deleted
and nothing of it was written for the grace period: what a shipment wrote after its user was forgotten (a host cut
off in the middle of one; a manifest written just after the shipment read the record) stays nowhere for good.

In process, on both store backends and both object stores (tests/fleet/test_gc.py's harness).
"""

from __future__ import annotations

import time
from pathlib import Path

from moorage.config import Config
from moorage.fleet.gc import BucketCollector, template_use
from moorage.fleet.templates import PublishedTemplates
from moorage.objects import ObjectStore
from moorage.sandbox.process import ProcessDriver
from moorage.store import Scope, Store


def _keys(objects: ObjectStore, prefix: str) -> list[str]:
    return [o.key for o in objects.iter(prefix)]


def test_objects_of_instances_whose_record_is_gone_or_deleted_go_after_the_grace(
        store: Store, object_store: ObjectStore, tmp_path: Path) -> None:
    published = PublishedTemplates(object_store, ProcessDriver(tmp_path / "a", Config(data_dir=tmp_path / "cfg")))
    _, key = store.operator.create_tenant("acme")
    ts = store.tenant(store.authenticate(key.secret))
    ts.agents.create("counter")
    kept = ts.sandboxes.create(Scope.for_user("counter", "ann"), state="sleeping")
    deleting = ts.sandboxes.create(Scope.for_user("counter", "bea"), state="sleeping")
    ts.sandboxes.update(deleting.id, expected_version=deleting.version, state="deleted")
    forgotten = "sb-forgotten-long-ago"  # its record went with its user; a late shipment wrote these
    prefixes = {name: f"instances/{ts.tenant_id}/{sid}/" for name, sid in
                (("kept", kept.id), ("deleting", deleting.id), ("forgotten", forgotten))}
    prefixes["other tenant"] = "instances/t-not-in-this-store/sb-x/"  # not this store's to judge
    for p in prefixes.values():
        object_store.put_bytes(p + "snapshots/000001-1.json", b"{}")
        object_store.put_bytes(p + "chunks/" + "a" * 64, b"chunk")

    def use():  # noqa: ANN202
        return template_use(store, grace_s=0)

    rep = BucketCollector(published, grace_s=600, settle_s=0).collect(use, now=time.time())
    assert all(_keys(object_store, p) for p in prefixes.values())  # written just now: within the grace nothing goes

    rep = BucketCollector(published, grace_s=600, settle_s=0).collect(use, now=time.time() + 601)
    assert _keys(object_store, prefixes["forgotten"]) == [] and _keys(object_store, prefixes["deleting"]) == []
    assert len(_keys(object_store, prefixes["kept"])) == 2
    assert len(_keys(object_store, prefixes["other tenant"])) == 2
    assert rep.instances_deleted == 2
