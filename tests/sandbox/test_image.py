"""Guest image builder and KVM probe: real mmdebstrap, real kernel package, real QEMU boots (TCG here)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

import pytest

from moorage.config import Config
from moorage.sandbox import image_guest
from moorage.sandbox.accel import accel_args, choose_accel, probe_kvm
from moorage.sandbox.image import GuestImage, ImageBuilder, ImageRecipe, _module_load_order
from moorage.sandbox.microvm_qemu import kernel_cmdline

#: Shared across test sessions so only the first run on a machine pays for debootstrap.
IMAGES_DIR = Path(os.environ.get("MOORAGE_TEST_IMAGES_DIR", "/var/tmp/moorage-images"))


@pytest.fixture(scope="session")
def guest_image() -> GuestImage:
    for tool in ("mmdebstrap", "mkfs.ext4", "cpio", "qemu-img", "qemu-system-x86_64", "apt-get"):
        if shutil.which(tool) is None:
            pytest.fail(f"prerequisite missing: {tool} (run scripts/bootstrap.sh)")
    return ImageBuilder(IMAGES_DIR).build()


def test_recipe_key_is_stable_and_follows_every_field() -> None:
    base = ImageRecipe()
    assert base.key() == ImageRecipe().key()
    assert ImageRecipe(packages=("python3", "curl")).key() != base.key()
    assert ImageRecipe(disk_mib=2048).key() != base.key()
    # The debootstrap cache depends only on what debootstrap sees.
    assert ImageRecipe(disk_mib=2048).rootfs_key() == base.rootfs_key()
    assert ImageRecipe(modules=("virtio_ring",)).rootfs_key() == base.rootfs_key()
    assert ImageRecipe(modules=("virtio_ring",)).kernel_key() != base.kernel_key()


def test_image_has_kernel_initramfs_and_read_only_root(guest_image: GuestImage) -> None:
    assert guest_image.kernel.stat().st_size > 1 << 20
    assert guest_image.initrd.stat().st_size > 100 << 10
    assert guest_image.rootfs.stat().st_size == guest_image.disk_mib << 20
    assert not (guest_image.rootfs.stat().st_mode & 0o222), "the base disk must be read-only"
    listing = subprocess.run(["cpio", "-it"], stdin=open(guest_image.initrd, "rb"), capture_output=True, text=True).stdout.split()
    for mod in ("virtio_ring", "virtio", "virtio_mmio", "virtio_blk", "virtio_console"):
        assert f"lib/modules/{mod}.ko" in listing
    assert "init" in listing and "bin/busybox" in listing
    # The guest runtime is inside the root filesystem.
    out = subprocess.run(["debugfs", "-R", f"cat {image_guest.GUEST_DIR_IN_VM}/supervisor.py", str(guest_image.rootfs)], capture_output=True, text=True)
    assert "def main" in out.stdout


def test_second_build_reuses_the_cache(guest_image: GuestImage) -> None:
    steps: list[str] = []
    img = ImageBuilder(IMAGES_DIR, progress=lambda step, detail: steps.append(step)).build()
    assert img.id == guest_image.id
    assert steps == ["cached"]


def test_a_cached_image_is_found_where_it_lies_not_where_its_manifest_was_written(guest_image: GuestImage,
                                                                                   tmp_path: Path) -> None:
    """A host whose data dir links the shared image cache writes manifests with paths through that link; once the
    data dir is gone, another user of the cache still finds the image's files."""
    d = json.loads((guest_image.dir / "manifest.json").read_text())
    for k in ("dir", "kernel", "initrd", "rootfs"):
        d[k] = "/gone/data/images/" + d["id"] + ("" if k == "dir" else "/" + Path(d[k]).name)
    here = tmp_path / guest_image.id
    here.mkdir()
    (here / "manifest.json").write_text(json.dumps(d))
    img = GuestImage.load(here)
    assert (img.dir, img.kernel, img.initrd, img.rootfs) == (
        here, here / "vmlinuz", here / "initrd.img", here / "rootfs.ext4")
    assert (img.id, img.guest_code_hash) == (guest_image.id, guest_image.guest_code_hash)


def test_the_image_id_follows_the_building_hosts_python(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its byte code is in the image only when the host's Python is the guest's: two versions, two images."""
    builder = ImageBuilder(IMAGES_DIR)
    mine = builder.image_id()
    assert builder.image_id() == mine
    monkeypatch.setattr(sys, "version_info", (3, 99, 0, "final", 0))
    assert builder.image_id() != mine


def test_the_root_tree_is_made_by_mmdebstrap_else_debootstrap(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from moorage.errors import UnavailableError
    from moorage.sandbox import image

    recipe, tree = ImageRecipe(), tmp_path / "tree"
    argv = image.bootstrap_argv(recipe, tree)
    # The test machine has both (scripts/bootstrap.sh installs them): mmdebstrap, with debootstrap's merged /usr.
    assert argv[0] == "mmdebstrap" and f"--hook-dir={image.MERGED_USR_HOOK}" in argv, argv
    assert argv[-3:] == [recipe.suite, str(tree), recipe.mirror] and "--include=python3,python3-pip,iproute2" in argv
    real = shutil.which
    monkeypatch.setattr(image.shutil, "which", lambda tool: None if tool == "mmdebstrap" else real(tool))
    assert image.bootstrap_argv(recipe, tree)[0] == "debootstrap"
    monkeypatch.setattr(image.shutil, "which", lambda tool: None)
    with pytest.raises(UnavailableError, match="neither mmdebstrap nor debootstrap"):
        image.bootstrap_argv(recipe, tree)


def test_changed_guest_code_relayers_without_debootstrap(guest_image: GuestImage, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from moorage.sandbox import guest_source_dir

    src = tmp_path / "guest"
    shutil.copytree(guest_source_dir(), src, ignore=shutil.ignore_patterns("__pycache__"))
    (src / "extra_marker.py").write_text("MARKER = 'relayered'\n")
    monkeypatch.setattr(image_guest, "guest_source_dir", lambda: src)
    steps: list[tuple[str, str]] = []
    builder = ImageBuilder(IMAGES_DIR, progress=lambda step, detail: steps.append((step, detail)))
    assert builder.image_id() != guest_image.id
    img = builder.build()
    try:
        assert ("rootfs", "cached debootstrap tree") in steps and ("kernel", "cached") in steps
        out = subprocess.run(["debugfs", "-R", f"cat {image_guest.GUEST_DIR_IN_VM}/extra_marker.py", str(img.rootfs)], capture_output=True, text=True)
        assert "relayered" in out.stdout
        # Compiled into the image when this host's Python is the guest's (Debian 12's 3.11), as here.
        out = subprocess.run(["debugfs", "-R", f"ls {image_guest.GUEST_DIR_IN_VM}/__pycache__", str(img.rootfs)],
                             capture_output=True, text=True)
        assert ("extra_marker.cpython-311.pyc" in out.stdout) is (sys.version_info[:2] == (3, 11)), out.stdout
    finally:
        shutil.rmtree(img.dir, ignore_errors=True)


def test_guest_modules_are_compiled_for_the_guests_python_and_checked_against_their_source(tmp_path: Path) -> None:
    """The image carries the guest's byte code (a supervisor start under TCG does not compile it again), only for
    the Python the tree has, and a source changed after the build is what runs."""
    root = tmp_path / "root"
    lib = root / "usr" / "lib" / ("python%d.%d" % sys.version_info[:2])
    lib.mkdir(parents=True)
    (lib / "os.py").write_text("")
    pkg = root / "opt" / "moorage" / "demo"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "m.py").write_text("X = 1\n")
    image_guest._precompile(root, root / "opt" / "moorage")
    assert (pkg / "__pycache__" / f"m.{sys.implementation.cache_tag}.pyc").is_file()
    (pkg / "m.py").write_text("X = 2\n")
    out = subprocess.run([sys.executable, "-B", "-c", "import demo.m; print(demo.m.X)"], capture_output=True,
                         text=True, cwd=root / "opt" / "moorage", timeout=60)
    assert out.stdout.strip() == "2", out.stderr
    # A tree of another Python: nothing compiled (this host's byte code would not be its).
    other = tmp_path / "other"
    (other / "usr" / "lib" / "python3.99").mkdir(parents=True)
    (other / "usr" / "lib" / "python3.99" / "os.py").write_text("")
    shutil.copytree(pkg, other / "opt" / "moorage" / "demo", ignore=shutil.ignore_patterns("__pycache__"))
    image_guest._precompile(other, other / "opt" / "moorage")
    assert not (other / "opt" / "moorage" / "demo" / "__pycache__").exists()


def test_image_boots_to_its_python_under_tcg(guest_image: GuestImage, tmp_path: Path) -> None:
    disk = tmp_path / "disk.qcow2"
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", "-b", str(guest_image.rootfs), "-F", "raw", str(disk)], check=True)
    argv = [
        "qemu-system-x86_64", "-M", "microvm,x-option-roms=off", *accel_args("tcg"), "-m", "256", "-nodefaults",
        "-no-user-config", "-display", "none", "-no-reboot", "-serial", "stdio",
        "-kernel", str(guest_image.kernel), "-initrd", str(guest_image.initrd),
        "-append", kernel_cmdline(guest_image.cmdline, "tcg") + " moorage.bootcheck",
        "-drive", f"id=d,file={disk},format=qcow2,if=none", "-device", "virtio-blk-device,drive=d",
    ]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=240).stdout
    assert f"{image_guest.BOOTCHECK_MARKER} [3, 11]" in out, out[-2000:]


def test_module_order_puts_dependencies_first(guest_image: GuestImage) -> None:
    listing = subprocess.run(["cpio", "-i", "--to-stdout", "lib/modules/order"], stdin=open(guest_image.initrd, "rb"), capture_output=True, text=True).stdout.split()
    assert listing.index("virtio_ring") < listing.index("virtio") < listing.index("virtio_mmio")
    assert listing.index("virtio") < listing.index("virtio_blk")


def test_module_order_rejects_unknown_modules(tmp_path: Path) -> None:
    from moorage.sandbox.image import ImageBuildError

    with pytest.raises(ImageBuildError, match="not found"):
        _module_load_order(("no_such_module",), {})


def test_kvm_probe_boots_a_guest_or_explains_why_not(guest_image: GuestImage, tmp_path: Path) -> None:
    # This data directory reaches the shared images by a link, as every test host's does: the probe boots their
    # kernel, and choose_accel (which finds the kernel there) reads the verdict the probe left, with no second boot.
    (tmp_path / "images").symlink_to(IMAGES_DIR)
    cfg = Config(data_dir=tmp_path, accel="auto")
    res = probe_kvm(cfg, use_cache=False)  # the kernel a host boots its guests with, found in its images
    assert isinstance(res.usable, bool) and res.detail
    if not res.usable:
        assert res.fix, "an unusable KVM must come with a fix"
    # Cached per host boot: the second answer is the same and needs no boot.
    assert (tmp_path / "images" / ".kvm-probe.json").exists()
    with mock.patch("moorage.sandbox.accel._boot_probe", side_effect=AssertionError("booted again")):
        assert probe_kvm(cfg) == res
        assert choose_accel(cfg) == ("kvm" if res.usable else "tcg")
    assert choose_accel(cfg.with_(accel="tcg")) == "tcg"


def test_data_directories_that_share_images_probe_kvm_once(guest_image: GuestImage, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The verdict was kept per data directory: each new one (every test's, every bench host's) booted the probe
    again, which on a host whose KVM hangs a guest (nested PVM, here) waits out its 10 s timeout. It is kept beside
    the kernel it booted, in the images directory, for every data directory that shares it."""
    from moorage.sandbox import accel

    images = tmp_path / "shared-images"
    boots: list[Path] = []
    verdict = accel.ProbeResult(False, "probe stand-in", "a fix")

    def boot(exe: str, kernel: Path, initrd: Path) -> accel.ProbeResult:
        boots.append(kernel)
        return verdict

    monkeypatch.setattr(accel, "_boot_probe", boot)
    for data in ("host-a", "host-b", "host-c"):
        cfg = Config(data_dir=tmp_path / data, accel="auto")
        assert probe_kvm(cfg, kernel=guest_image.kernel, initrd=guest_image.initrd, images_dir=images) == verdict
    assert len(boots) == 1 and (images / ".kvm-probe.json").exists()
    # The same kernel elsewhere (the image's copy of it beside the kernel layer's, which doctor boots; a data
    # directory whose images directory is a link to the shared one) is the same verdict: no boot.
    (images / "k").mkdir()
    kernel = images / "k" / "vmlinuz"
    kernel.write_bytes(guest_image.kernel.read_bytes())
    linked = tmp_path / "host-e" / "images"
    linked.parent.mkdir()
    linked.symlink_to(images)
    for dirs in (images, linked):
        assert probe_kvm(Config(data_dir=linked.parent), kernel=dirs / "k" / "vmlinuz", initrd=guest_image.initrd,
                         images_dir=dirs) == verdict
    assert boots == [guest_image.kernel], boots
    # Another kernel is another verdict.
    other = tmp_path / "vmlinuz-other"
    other.write_bytes(b"k")
    probe_kvm(Config(data_dir=tmp_path / "host-d"), kernel=other, initrd=guest_image.initrd, images_dir=images)
    assert boots == [guest_image.kernel, other]


def test_the_kvm_probe_runs_beside_the_image_build_and_once(guest_image: GuestImage, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A new host's first micro-VM built the image, then probed KVM (on this host 10 s of waiting out the probe's
    timeout), then booted. The probe needs only the kernel: it starts as soon as the kernel layer is there, and
    the driver's own probe after the build waits for that one's verdict instead of booting another."""
    from moorage.sandbox import accel, image
    from moorage.sandbox.microvm import MicroVMDriver

    images = tmp_path / "images"
    kdir = ImageBuilder(IMAGES_DIR).kernel_layer()
    shutil.copytree(kdir, images / "cache" / kdir.name)  # this images directory has the kernel layer, no image
    order: list[str] = []

    def boot(exe: str, kernel: Path, initrd: Path) -> accel.ProbeResult:
        order.append("probe started")
        time.sleep(1.0)
        order.append("probe done")
        return accel.ProbeResult(False, "probe stand-in", "a fix")

    def tree(self: ImageBuilder, force: bool) -> Path:
        order.append("root tree")
        time.sleep(0.3)
        return tmp_path / "tree"

    monkeypatch.setattr(accel, "_boot_probe", boot)
    monkeypatch.setattr(image.ImageBuilder, "_rootfs_tree", tree)
    built: list[GuestImage] = []
    monkeypatch.setattr(image.ImageBuilder, "_final_image", lambda self, kdir, tree: built.append(guest_image) or
                        guest_image)
    monkeypatch.setattr(image.ImageBuilder, "cached", lambda self: built[0] if built else None)
    driver = MicroVMDriver(tmp_path / "sandboxes", Config(data_dir=tmp_path, accel="auto"), images_dir=images)
    assert driver.image() == guest_image
    order.append("image built")
    assert driver.accel == "tcg"
    # On a host with /dev/kvm the probe began during the build, which did not wait for it; the driver's own probe
    # then waited for its verdict. Without /dev/kvm there is nothing to probe.
    if os.path.exists("/dev/kvm"):
        assert sorted(order[:2]) == ["probe started", "root tree"] and order[2:] == ["image built", "probe done"], order
    else:
        assert order == ["root tree", "image built"], order


def test_concurrent_probes_of_one_cache_boot_once(guest_image: GuestImage, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    from moorage.sandbox import accel

    if not os.path.exists("/dev/kvm"):
        pytest.fail("this test needs /dev/kvm (the probe is not run without it)")
    boots: list[float] = []

    def boot(exe: str, kernel: Path, initrd: Path) -> accel.ProbeResult:
        boots.append(time.monotonic())
        time.sleep(0.5)
        return accel.ProbeResult(True, "probe stand-in")

    monkeypatch.setattr(accel, "_boot_probe", boot)
    results: list[accel.ProbeResult] = []
    threads = [threading.Thread(target=lambda: results.append(probe_kvm(
        Config(data_dir=tmp_path), kernel=guest_image.kernel, initrd=guest_image.initrd, images_dir=tmp_path / "i")))
        for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(boots) == 1 and results == [accel.ProbeResult(True, "probe stand-in")] * 3


def test_cli_image_build_reports_the_cached_image(guest_image: GuestImage, tmp_path: Path) -> None:
    import json

    from typer.testing import CliRunner

    from moorage.cli.main import app

    r = CliRunner().invoke(app, ["--data-dir", str(tmp_path), "image", "build", "--images-dir", str(IMAGES_DIR), "--json"])
    assert r.exit_code == 0, r.output
    manifest = json.loads(r.stdout[r.stdout.index("{") :])
    assert manifest["id"] == guest_image.id and manifest["kernel_version"] == guest_image.kernel_version
    r = CliRunner().invoke(app, ["--data-dir", str(tmp_path), "image", "list", "--images-dir", str(IMAGES_DIR)])
    assert r.exit_code == 0 and guest_image.id in r.stdout
