"""The object store's template collection: what the store names stays, the rest goes in two steps (retired, then
deleted after the settle time), an instance that names a retired template brings it back, a template being deleted
is refused by fetchers, and guest images go once no template names them.

In process, on both store backends (SQLite, PostgreSQL) and both object stores (local files, SeaweedFS S3); the
fleet test at the end of tests/fleet/test_gc_fleet.py runs it in `moorage up` hosts.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moorage.config import Config
from moorage.fleet.gc import MARKER, BucketCollector, template_use
from moorage.fleet.ship import SnapshotUnavailable
from moorage.fleet.templates import PublishedTemplates
from moorage.objects import ObjectStore
from moorage.sandbox.process import ProcessDriver
from moorage.store import Scope, Store
from tests.fleet.test_templates import _image, _template


def _keys(objects: ObjectStore, prefix: str) -> list[str]:
    return [o.key for o in objects.iter(prefix)]


def test_published_templates_are_kept_while_the_store_names_them_then_retired_then_deleted(
        store: Store, object_store: ObjectStore, tmp_path: Path) -> None:
    cfg = Config(data_dir=tmp_path / "cfg")
    a, b = ProcessDriver(tmp_path / "a", cfg), ProcessDriver(tmp_path / "b", cfg)
    pa, pb = PublishedTemplates(object_store, a), PublishedTemplates(object_store, b)
    _, key = store.operator.create_tenant("acme")
    ts = store.tenant(store.authenticate(key.secret))
    agent = ts.agents.create("counter")
    d1 = ts.deployments.create(agent.id, {}, "packages/x.tar.gz", "0" * 64)
    d2 = ts.deployments.create(agent.id, {}, "packages/y.tar.gz", "1" * 64)
    t1 = _template(a, "builder-1", f"dep-{d1.id[:24]}-aaaaaa", "one")
    t2 = _template(a, "builder-2", f"dep-{d2.id[:24]}-bbbbbb", "two")
    assert pa.publish(t1, d1.id)["template_id"] == t1.id and pa.publish(t2, d2.id)["template_id"] == t2.id
    ts.agents.update(agent.id, expected_version=agent.version, live_deployment=d2.id)
    # Ann's instance was forked from d1's template (before the redeploy to d2).
    ts.sandboxes.create(Scope.for_user("counter", "ann"), state="sleeping", template_ref=t1.id)

    def use():  # noqa: ANN202
        return template_use(store, grace_s=0)

    # A driver whose forks need their template (micro-VM): ann's row keeps t1.
    gc = BucketCollector(pa, host="h1", grace_s=0, settle_s=60, pins=lambda *_: True)
    rep = gc.collect(use, now=1e10)
    assert rep.kept == {"deployment": 1, "instance": 1} and rep.retired == 0
    assert pa.chosen(d1.id) is not None and _keys(object_store, f"templates/{t1.id}/")

    # Ann is forgotten: t1 is retired (no new fork uses it: its claim goes) but still whole and fetchable.
    ts.forget_user("ann", "counter")
    rep = gc.collect(use, now=1e10)
    assert rep.retired == 1 and rep.claims_deleted == 1 and rep.deleted == 0
    assert pa.chosen(d1.id) is None and pa.chosen(d2.id) is not None
    assert json.loads(object_store.get_bytes(f"templates/{t1.id}/{MARKER}"))["state"] == "retired"
    assert (pb.fetch(t1.id) / "layer" / "work" / "agent.txt").read_text() == "one"
    assert gc.collect(use, now=1e10 + 30).deleted == 0  # not before the settle time

    # An instance names it again before the settle time is up (a host that forked it just before it was
    # retired): it stays, marker gone.
    ts.sandboxes.create(Scope.for_user("counter", "bea"), state="provisioning", template_ref=t1.id)
    rep = gc.collect(use, now=1e10 + 61)
    assert rep.restored == 1 and rep.deleted == 0
    assert not object_store.exists(f"templates/{t1.id}/{MARKER}")
    ts.forget_user("bea", "counter")
    assert gc.collect(use, now=1e10 + 100).retired == 1
    rep = gc.collect(use, now=1e10 + 200)
    assert rep.deleted == 1 and rep.objects_deleted > 1
    assert _keys(object_store, f"templates/{t1.id}/") == [] and _keys(object_store, f"deployments/{d1.id}/") == []
    assert _keys(object_store, f"templates/{t2.id}/") and pa.chosen(d2.id)["template_id"] == t2.id
    assert gc.collect(use, now=1e10 + 300).any() is False  # idempotent: nothing left to do

    # Within the grace nothing is touched, even a template nobody names.
    t3 = _template(a, "builder-3", "dep-orphan-cccccc", "three")
    pa.publish(t3, "d-gone")
    young = BucketCollector(pa, grace_s=3600, settle_s=0)
    assert young.collect(use).any() is False and _keys(object_store, f"templates/{t3.id}/")


def _process_template_redeployed(store: Store, object_store: ObjectStore, tmp_path: Path, shared: bool):
    """Agent ``counter``'s deployment d1 with a published process template (``shared``: one whose forks bind its
    shared directory), and d2 live since: (publisher, tenant store, d1's template)."""
    pa = PublishedTemplates(object_store, ProcessDriver(tmp_path / "a", Config(data_dir=tmp_path / "cfg")))
    _, key = store.operator.create_tenant("acme")
    ts = store.tenant(store.authenticate(key.secret))
    agent = ts.agents.create("counter")
    d1 = ts.deployments.create(agent.id, {}, "packages/x.tar.gz", "0" * 64)
    d2 = ts.deployments.create(agent.id, {}, "packages/y.tar.gz", "1" * 64)
    t1 = _template(pa.driver, "builder-1", "dep-one-aaaaaa", "one", shared=shared)
    pa.publish(t1, d1.id)
    ts.agents.update(agent.id, expected_version=agent.version, live_deployment=d2.id)
    return pa, ts, t1


@pytest.mark.parametrize("shared", [False, True], ids=["copied", "shared-packages"])
def test_a_process_template_stays_for_its_instances_only_if_they_bind_its_shared_packages(
        store: Store, object_store: ObjectStore, tmp_path: Path, shared: bool) -> None:
    pa, ts, t1 = _process_template_redeployed(store, object_store, tmp_path, shared)
    rec = ts.sandboxes.create(Scope.for_user("counter", "ann"), state="sleeping", template_ref=t1.id)
    gc = BucketCollector(pa, grace_s=0, settle_s=0)
    if shared:
        # A fork binds its template's shared directory (an agent's packages; process_templates): the template
        # stays while an instance names it, on any host.
        rep = gc.collect(lambda: template_use(store, grace_s=0))
        assert rep.deleted == 0 and _keys(object_store, f"templates/{t1.id}/")
        ts.sandboxes.delete(rec.id, expected_version=rec.version)
    # Otherwise a process fork is a copy of its template's files: with settle 0 both steps happen in one run.
    rep = gc.collect(lambda: template_use(store, grace_s=0))
    assert rep.retired == 1 and rep.deleted == 1
    assert _keys(object_store, "templates/") == [] and _keys(object_store, "deployments/") == []


def test_a_template_an_instance_binds_since_a_redeploy_stays_while_its_record_names_it(
        store: Store, object_store: ObjectStore, tmp_path: Path) -> None:
    """A redeploy that changed an agent's packages moves an instance's sandbox to the new template's shared
    directories (runtime/instance_update.py) while its record still names the template it was forked from: the
    record's ``shared_template`` keeps the new one after it is retired by yet another deploy."""
    pa, ts, t1 = _process_template_redeployed(store, object_store, tmp_path, shared=True)
    rec = ts.sandboxes.create(Scope.for_user("counter", "ann"), state="sleeping", template_ref="dep-zero-aaaaaa",
                              meta={"template": "dep-zero-aaaaaa", "shared_template": t1.id})
    gc = BucketCollector(pa, grace_s=0, settle_s=0)
    rep = gc.collect(lambda: template_use(store, grace_s=0))
    assert rep.deleted == 0 and _keys(object_store, f"templates/{t1.id}/")
    ts.sandboxes.update(rec.id, expected_version=rec.version, meta={"template": "dep-zero-aaaaaa"})
    rep = gc.collect(lambda: template_use(store, grace_s=0))
    assert rep.retired == 1 and rep.deleted == 1 and _keys(object_store, "templates/") == []


def test_a_template_being_deleted_is_refused_by_fetchers(object_store: ObjectStore, tmp_path: Path) -> None:
    cfg = Config(data_dir=tmp_path / "cfg")
    pa, pb = (PublishedTemplates(object_store, ProcessDriver(tmp_path / n, cfg)) for n in ("a", "b"))
    t = _template(pa.driver, "builder", "dep-x-dddddd", "x")
    pa.publish(t, "dep-x")
    object_store.put_bytes(f"templates/{t.id}/{MARKER}", json.dumps({"state": "deleting", "at": 0}).encode())
    with pytest.raises(SnapshotUnavailable, match="being deleted"):
        pb.fetch(t.id)
    assert not pb.local_dir(t.id).exists() and not list((tmp_path / "b" / ".templates").glob(".fetch-*"))


def test_guest_images_go_once_no_template_names_them(store: Store, object_store: ObjectStore, tmp_path: Path) -> None:
    from moorage.sandbox.microvm import MicroVMDriver

    cfg = Config(data_dir=tmp_path / "cfg")
    vm = MicroVMDriver(tmp_path / "vm", cfg, images_dir=tmp_path / "images")
    pv = PublishedTemplates(object_store, vm)
    used = pv.publish_image(_image(tmp_path / "images" / "img1", "img1", b"A" * 300_000))
    unused = pv.publish_image(_image(tmp_path / "images" / "img2", "img2", b"B" * 300_000))
    # A published template made on img1 (its manifest names the image, as a micro-VM template's does).
    src = tmp_path / "tpl"
    (src / "x").mkdir(parents=True)
    (src / "x" / "f").write_text("t")
    pv.shipper.push(src, "templates/dep-vm-eeeeee", "template", include=lambda rel: True,
                    meta={"driver": "microvm", "deployment_id": "dep-vm", "image": used})
    store.operator.create_tenant("acme")

    def use():  # noqa: ANN202
        return template_use(store, grace_s=0)

    gc = BucketCollector(pv, grace_s=0, settle_s=10)
    gc.collect(use, now=1e10)  # retires the template (no deployment of that id is live) and img2
    assert object_store.exists(f"images/{unused['digest']}/{MARKER}")
    assert not object_store.exists(f"images/{used['digest']}/{MARKER}")
    rep = gc.collect(use, now=1e10 + 11)  # the template goes, then img2; img1 is retired in this run
    assert rep.deleted == 1 and rep.images_deleted == 1
    assert _keys(object_store, f"images/{unused['digest']}/") == []
    assert _keys(object_store, f"images/{used['digest']}/")
    gc.collect(use, now=1e10 + 12)
    rep = gc.collect(use, now=1e10 + 30)
    assert rep.images_deleted == 1 and _keys(object_store, "images/") == [] and _keys(object_store, "templates/") == []
    # A new template on img1 publishes the image again.
    assert pv.publish_image(_image(tmp_path / "images2" / "img1", "img1", b"A" * 300_000))["digest"] == used["digest"]
    assert object_store.exists(f"images/{used['digest']}/image.json")


def test_a_host_deletes_fetched_copies_nobody_names_never_templates_made_here(object_store: ObjectStore,
                                                                              tmp_path: Path) -> None:
    import asyncio

    from moorage.fleet.gc import TemplateUse
    from moorage.runtime.templates import Templates

    cfg = Config(data_dir=tmp_path / "cfg")
    a, b = ProcessDriver(tmp_path / "a", cfg), ProcessDriver(tmp_path / "b", cfg)
    pa, pb = PublishedTemplates(object_store, a), PublishedTemplates(object_store, b)
    t = _template(a, "builder", "dep-x-ffffff", "x")
    pa.publish(t, "dep-x")
    fetched = pb.fetch(t.id)  # for an instance's wake, say: no deployment meta names it on b
    mine = _template(b, "maker", "tt-made-here", "y")  # a fork in progress on b
    templates = Templates(tmp_path / "b-templates", b, tmp_path / "packages")
    pinned = TemplateUse(frozenset(), frozenset({t.id}), frozenset())
    assert asyncio.run(templates.collect(pinned, grace_s=0, pins=lambda *_: True)) == 0  # an instance names it
    assert asyncio.run(templates.collect(TemplateUse(frozenset(), frozenset(), frozenset()), grace_s=3600)) == 0
    assert asyncio.run(templates.collect(TemplateUse(frozenset(), frozenset(), frozenset()), grace_s=0)) == 1
    assert not fetched.exists() and Path(mine.path).exists()
    assert pb.fetch(t.id).exists()  # fetched again when needed


def test_a_build_a_crash_abandoned_goes_one_in_progress_stays(tmp_path: Path) -> None:
    import asyncio

    from moorage.fleet.gc import TemplateUse
    from moorage.runtime.templates import Templates

    driver = ProcessDriver(tmp_path / "h", Config(data_dir=tmp_path / "cfg"))
    templates = Templates(tmp_path / "templates", driver, tmp_path / "packages")
    dead, building, live = ("d" * 32, "b" * 32, "l" * 32)
    made = {d: _template(driver, f"builder-{d[:4]}", f"dep-{d[:24]}-abcdef", d) for d in (dead, building, live)}

    async def go() -> int:
        lock = templates._locks.setdefault(building, asyncio.Lock())
        async with lock:  # an ensure() of that deployment is building it right now
            return await templates.collect(TemplateUse(frozenset({live}), frozenset(), frozenset()), grace_s=0)

    assert asyncio.run(go()) == 1
    assert not Path(made[dead].path).exists()
    assert Path(made[building].path).exists() and Path(made[live].path).exists()


def test_a_time_travel_fork_template_a_crash_left_goes_one_in_progress_or_needed_stays(tmp_path: Path) -> None:
    """A time-travel fork makes a template of the checkpoint and deletes it once the forks are made; a host killed
    in between leaves it. The collection takes it (after the grace), not while a fork of this process uses it, and
    not while an instance forked from it names it (a micro-VM fork needs its template for life)."""
    import asyncio

    from moorage.fleet.gc import TemplateUse
    from moorage.runtime.templates import Templates

    driver = ProcessDriver(tmp_path / "h", Config(data_dir=tmp_path / "cfg"))
    templates = Templates(tmp_path / "templates", driver, tmp_path / "packages")

    with templates.fork_template() as busy_id:
        busy = _template(driver, "builder-busy", busy_id, "busy")
        left = _template(driver, "builder-left", "tt-" + "a" * 16, "left")
        needed = _template(driver, "builder-needed", "tt-" + "b" * 16, "needed")
        pinned = TemplateUse(frozenset(), frozenset({needed.id}), frozenset())
        assert asyncio.run(templates.collect(pinned, grace_s=3600, pins=lambda *_: True)) == 0
        assert asyncio.run(templates.collect(pinned, grace_s=0, pins=lambda *_: True)) == 1
        assert not Path(left.path).exists()
        assert Path(busy.path).exists() and Path(needed.path).exists()
    # The fork ended (without deleting it: as if its delete had failed) and nothing names the other any more.
    assert asyncio.run(templates.collect(TemplateUse(frozenset(), frozenset(), frozenset()), grace_s=0)) == 2
    assert not Path(busy.path).exists() and not Path(needed.path).exists()


def test_several_collectors_at_once_leave_exactly_what_is_needed(store: Store, object_store: ObjectStore,
                                                                tmp_path: Path) -> None:
    from concurrent.futures import ThreadPoolExecutor

    cfg = Config(data_dir=tmp_path / "cfg")
    pa = PublishedTemplates(object_store, ProcessDriver(tmp_path / "a", cfg))
    _, key = store.operator.create_tenant("acme")
    ts = store.tenant(store.authenticate(key.secret))
    agent = ts.agents.create("counter")
    deps = [ts.deployments.create(agent.id, {}, f"packages/{i}.tar.gz", f"{i}" * 64) for i in range(6)]
    tids = []
    for i, d in enumerate(deps):
        t = _template(pa.driver, f"builder-{i}", f"dep-{d.id[:24]}-{i:06d}", str(i))
        pa.publish(t, d.id)
        tids.append(t.id)
    ts.agents.update(agent.id, expected_version=agent.version, live_deployment=deps[-1].id)
    ts.sandboxes.create(Scope.for_user("counter", "ann"), state="sleeping", template_ref=tids[0])

    def use():  # noqa: ANN202
        return template_use(store, grace_s=0)

    def collector(i: int) -> None:
        gc = BucketCollector(pa, host=f"h{i}", grace_s=0, settle_s=0, pins=lambda *_: True)
        for _ in range(3):
            gc.collect(use)

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(collector, range(4)))  # re-raises any collector's error
    assert {k.split("/")[1] for k in _keys(object_store, "templates/")} == {tids[0], tids[-1]}
    assert {k.split("/")[1] for k in _keys(object_store, "deployments/")} == {deps[-1].id, deps[0].id}
    assert not [k for k in _keys(object_store, "templates/") if k.endswith(MARKER)]


def test_a_template_published_on_an_image_being_deleted_publishes_the_image_again(object_store: ObjectStore,
                                                                                 tmp_path: Path) -> None:
    import threading

    from moorage.sandbox import TemplateRef
    from moorage.sandbox.microvm import MicroVMDriver

    vm = MicroVMDriver(tmp_path / "vm", Config(data_dir=tmp_path / "cfg"), images_dir=tmp_path / "images")
    pv = PublishedTemplates(object_store, vm)
    img = _image(tmp_path / "images" / "img1", "img1", b"A" * 300_000)
    digest = pv.publish_image(img)["digest"]
    # A collection is deleting the image: marker first, then its files (image.json already gone).
    object_store.put_bytes(f"images/{digest}/{MARKER}", json.dumps({"state": "deleting", "at": 0}).encode())
    object_store.delete(f"images/{digest}/image.json")
    tdir = tmp_path / "tpl"
    tdir.mkdir()
    (tdir / "template.json").write_text(json.dumps({"id": "dep-y-000001", "image_id": "img1", "image_dir": str(img.dir)}))
    (tdir / "ram").write_bytes(b"r" * 1000)

    def collection_finishes() -> None:
        import time

        time.sleep(1.5)
        for o in list(object_store.iter(f"images/{digest}/")):
            if not o.key.endswith(MARKER):
                object_store.delete(o.key)
        object_store.delete(f"images/{digest}/{MARKER}")

    t = threading.Thread(target=collection_finishes)
    t.start()
    pv.publish(TemplateRef("dep-y-000001", "microvm", tdir, None, 0.0, True), "dep-y")
    t.join()
    # The template names its image, and the image is whole in the bucket again.
    assert object_store.exists(f"images/{digest}/image.json") and not object_store.exists(f"images/{digest}/{MARKER}")
    assert sorted(k.rsplit("/", 1)[1] for k in _keys(object_store, f"images/{digest}/")) == \
        ["image.json", "initrd.img", "rootfs.ext4", "vmlinuz"]
