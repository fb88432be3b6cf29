"""Deployment templates in the object store: the first host to publish wins, others fetch that template by id;
a host whose guest image of the same id holds other bytes fetches the template's image by digest.

On local files and a real S3 server (SeaweedFS); process-driver templates and a micro-VM image directory (no VM is
started: the micro-VM path of fetching and adopting a template is covered by test_microvm_fleet.py).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from moorage.config import Config
from moorage.fleet.templates import PublishedTemplates
from moorage.objects import ObjectStore
from moorage.sandbox.image import GuestImage
from moorage.sandbox.microvm import MicroVMDriver
from moorage.sandbox.process import ProcessDriver


def _template(driver: ProcessDriver, sid: str, tid: str, text: str, *, shared: bool = False):  # noqa: ANN202
    async def go():  # noqa: ANN202
        sb = await driver.create(sid)
        (sb.layer / "work" / "agent.txt").write_text(text)
        if shared:  # packages its forks bind from it
            (sb.layer / "work" / "site").mkdir()
            (sb.layer / "work" / "site" / "pkg.py").write_text(text)
        return await driver.make_template(sb, tid, shared=["/work/site"] if shared else [])

    return asyncio.run(go())


def test_first_publisher_wins_and_the_other_host_fetches_its_template(object_store: ObjectStore, tmp_path: Path) -> None:
    cfg = Config(data_dir=tmp_path / "cfg")
    a, b = ProcessDriver(tmp_path / "a", cfg), ProcessDriver(tmp_path / "b", cfg)
    pa, pb = PublishedTemplates(object_store, a), PublishedTemplates(object_store, b)
    assert pa.chosen("dep1") is None
    ref_a = _template(a, "builder-a", "dep-dep1-aaaaaa", "built on A")
    ref_b = _template(b, "builder-b", "dep-dep1-bbbbbb", "built on B")
    claim = pa.publish(ref_a, "dep1")
    assert claim["template_id"] == ref_a.id
    # B built its own at the same time and publishes second: it is told A's, and fetches that one by id.
    lost = pb.publish(ref_b, "dep1")
    assert lost["template_id"] == ref_a.id and pb.chosen("dep1") == claim
    path = pb.fetch(ref_a.id)
    assert path == b.root / ".templates" / ref_a.id
    assert (path / "layer" / "work" / "agent.txt").read_text() == "built on A"
    assert json.loads((path / "template.json").read_text())["id"] == ref_a.id
    # What B fetched is a template B forks from, like one it made itself.
    child = asyncio.run(b.create("child", template=pb.ref_of(claim, path)))
    assert (child.layer / "work" / "agent.txt").read_text() == "built on A"
    assert pb.fetch(ref_a.id) == path  # already here: nothing fetched again
    # The loser's template is removed from the object store once it is not needed.
    assert pb.unpublish(ref_b.id) > 0
    assert not list(object_store.iter(f"templates/{ref_b.id}/"))
    assert list(object_store.iter(f"templates/{ref_a.id}/"))


def _image(d: Path, image_id: str, rootfs: bytes) -> GuestImage:
    d.mkdir(parents=True)
    (d / "vmlinuz").write_bytes(b"kernel " * 1000)
    (d / "initrd.img").write_bytes(b"initrd " * 1000)
    (d / "rootfs.ext4").write_bytes(rootfs)
    manifest = {"id": image_id, "dir": str(d), "kernel": str(d / "vmlinuz"), "initrd": str(d / "initrd.img"),
                "rootfs": str(d / "rootfs.ext4"), "kernel_version": "6.1", "recipe_key": "r", "guest_code_hash": "g",
                "disk_mib": 1, "built_at": 0.0}
    (d / "manifest.json").write_text(json.dumps(manifest))
    return GuestImage.load(d)


def test_a_host_whose_image_differs_fetches_the_templates_image_by_digest(object_store: ObjectStore, tmp_path: Path) -> None:
    cfg = Config(data_dir=tmp_path / "cfg")
    a = MicroVMDriver(tmp_path / "a", cfg, images_dir=tmp_path / "images-a")
    b = MicroVMDriver(tmp_path / "b", cfg, images_dir=tmp_path / "images-b")
    c = MicroVMDriver(tmp_path / "c", cfg, images_dir=tmp_path / "images-c")
    img_a = _image(tmp_path / "images-a" / "img1", "img1", b"A" * 300_000 + bytes(200_000))
    _image(tmp_path / "images-b" / "img1", "img1", b"B" * 300_000 + bytes(200_000))  # same id, other bytes
    img_c = _image(tmp_path / "images-c" / "img1", "img1", img_a.rootfs.read_bytes())  # same bytes
    pa, pb, pc = (PublishedTemplates(object_store, d) for d in (a, b, c))
    wanted = pa.publish_image(img_a)
    assert wanted["id"] == "img1" and wanted["digest"] == pb.image_digest(img_a)
    # C's own image has the same bytes: used as it is.
    assert pc.local_image(wanted).dir == img_c.dir
    # B's differs: the template's bytes are fetched into B's driver root, under their digest, verified.
    got = pb.local_image(wanted)
    assert got.dir == b.root / ".images" / wanted["digest"][:32]
    assert got.rootfs.read_bytes() == img_a.rootfs.read_bytes() and got.kernel.read_bytes() == img_a.kernel.read_bytes()
    assert got.id == "img1" and pb.image_digest(got) == wanted["digest"]
    assert pb.local_image(wanted).dir == got.dir  # fetched once
    # A digest nobody published is a clear error, not another image.
    from moorage.fleet.ship import SnapshotUnavailable

    with pytest.raises(SnapshotUnavailable):
        pb.local_image({"id": "img1", "digest": "0" * 64})
