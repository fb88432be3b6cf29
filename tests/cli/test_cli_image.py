"""`moorage image list` over a cache directory (no image is built here: the manifests are written by hand)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from typer.testing import CliRunner

from moorage.cli.main import app
from moorage.sandbox.image import ImageBuilder


def _manifest(images: Path, image_id: str, built_at: float) -> None:
    d = images / image_id
    d.mkdir(parents=True)
    (d / "manifest.json").write_text(json.dumps({
        "id": image_id, "dir": str(d), "kernel": str(d / "vmlinuz"), "initrd": str(d / "initrd.img"),
        "rootfs": str(d / "rootfs.ext4"), "kernel_version": "6.1.0-test", "recipe_key": "r", "guest_code_hash": "g",
        "disk_mib": 512, "built_at": built_at}))


def test_image_list_json_gives_each_manifest_and_which_is_current(tmp_path: Path) -> None:
    images = tmp_path / "images"
    current = ImageBuilder(images).image_id()
    _manifest(images, "0ld1mage", time.time() - 3600)
    _manifest(images, current, time.time())
    r = CliRunner().invoke(app, ["--data-dir", str(tmp_path), "image", "list", "--images-dir", str(images), "--json"])
    assert r.exit_code == 0, r.output
    listed = json.loads(r.stdout)["data"]
    assert {i["id"]: i["current"] for i in listed} == {"0ld1mage": False, current: True}
    assert all(i["kernel_version"] == "6.1.0-test" and i["dir"].startswith(str(images)) for i in listed)
    empty = CliRunner().invoke(app, ["--data-dir", str(tmp_path), "image", "list", "--images-dir",
                                     str(tmp_path / "none"), "--json"])
    assert empty.exit_code == 0 and json.loads(empty.stdout) == {"data": []}
