"""Guest images for the micro-VM driver: kernel, initramfs and a read-only ext4 root, built from Debian packages.

Images are cached by recipe hash; the slow debootstrap tree is cached separately so that changing guest code only
re-layers the final ext4 (seconds). ``ImageBuilder.build()`` returns a ready ``GuestImage``.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from moorage.errors import ConfigError, MoorageError, UnavailableError
from moorage.log import get_logger
from moorage.sandbox import image_guest

log = get_logger(__name__)

#: Bump when the build steps change in a way the recipe fields do not capture.
BUILDER_VERSION = "3"
#: Bump when the final layer (guest runtime + root filesystem) is made differently; names images, not the caches.
FINAL_LAYER_VERSION = "3"  # 2: the root filesystem is shrunk to its contents; each sandbox grows it to its disk
# 3: the guest's modules are compiled in the image

#: Progress callback: (step, detail). The CLI renders these with rich; tests ignore them.
Progress = Callable[[str, str], None]


class ImageBuildError(MoorageError):
    """A step of the guest image build failed; the message names the step and the tool's output."""

    code = "image-build"


@dataclass(frozen=True)
class ImageRecipe:
    """Everything that decides the bytes of an image. Its hash names the cache entries."""

    suite: str = "bookworm"
    mirror: str = "http://deb.debian.org/debian"
    variant: str = "minbase"
    #: Extra Debian packages for the root filesystem (python3-minimal alone lacks json; pip installs wheels).
    packages: tuple[str, ...] = ("python3", "python3-pip", "iproute2")
    kernel_package: str = "linux-image-cloud-amd64"
    #: Loaded by the initramfs in this order (their dependencies first, resolved from the .ko files).
    # virtio_net: the NIC of network agents' VMs (sandbox/microvm_net.py); VMs without one just do not use it.
    modules: tuple[str, ...] = ("virtio_ring", "virtio", "virtio_mmio", "virtio_blk", "virtio_console", "virtio_net")
    #: Size the root filesystem is made at (then shrunk to its contents; each sandbox's disk adds its own space).
    disk_mib: int = 1024

    def rootfs_key(self) -> str:
        return _digest({"v": BUILDER_VERSION, "suite": self.suite, "mirror": self.mirror, "variant": self.variant, "packages": sorted(self.packages)})

    def kernel_key(self) -> str:
        return _digest({"v": BUILDER_VERSION, "suite": self.suite, "kernel": self.kernel_package, "modules": list(self.modules), "init": image_guest.INITRAMFS_INIT})

    def key(self) -> str:
        return _digest(asdict(self) | {"v": BUILDER_VERSION})


@dataclass(frozen=True)
class GuestImage:
    """A built image on disk. ``rootfs`` is a raw ext4 file used read-only as the backing file of agent disks."""

    id: str
    dir: Path
    kernel: Path
    initrd: Path
    rootfs: Path
    kernel_version: str
    recipe_key: str
    guest_code_hash: str
    disk_mib: int
    built_at: float
    cmdline: str = field(default=image_guest.KERNEL_CMDLINE)

    def to_json(self) -> dict[str, object]:
        d = asdict(self)
        for k in ("dir", "kernel", "initrd", "rootfs"):
            d[k] = str(d[k])
        return d

    @classmethod
    def load(cls, image_dir: Path) -> "GuestImage":
        """The image in ``image_dir``, its files found there: not at the paths the manifest was written with,
        which may be another path to a shared cache (a host's data dir linking it), gone since."""
        d = json.loads((image_dir / "manifest.json").read_text())
        d["dir"] = Path(image_dir)
        for k in ("kernel", "initrd", "rootfs"):
            d[k] = Path(image_dir) / Path(d[k]).name
        return cls(**d)


def _digest(obj: object) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


#: mmdebstrap's hook that makes /bin, /lib and /sbin links into /usr as debootstrap does (without it, apt picks
#: ``usrmerge`` over ``usr-is-merged`` and brings perl into the image).
MERGED_USR_HOOK = Path("/usr/share/mmdebstrap/hooks/merged-usr")


def bootstrap_argv(recipe: ImageRecipe, tree: Path) -> list[str]:
    """The command that makes the root tree: mmdebstrap where installed (the same packages and versions as
    debootstrap, in about half its time: apt fetches in parallel and unpacks in one go; 20 s against 40 s on the
    development machine), else debootstrap."""
    include = ",".join(recipe.packages)
    if shutil.which("mmdebstrap") is not None and MERGED_USR_HOOK.is_dir():
        return ["mmdebstrap", "--mode=root", f"--variant={recipe.variant}", f"--include={include}",
                f"--hook-dir={MERGED_USR_HOOK}", recipe.suite, str(tree), recipe.mirror]
    if shutil.which("debootstrap") is not None:
        return ["debootstrap", f"--variant={recipe.variant}", f"--include={include}", recipe.suite, str(tree),
                recipe.mirror]
    raise UnavailableError("neither mmdebstrap nor debootstrap is installed",
                           hint="apt-get install mmdebstrap (or run scripts/bootstrap.sh)")


def _run(step: str, argv: list[str], *, cwd: Path | None = None, timeout: float = 1800) -> str:
    try:
        r = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError as e:
        raise UnavailableError(f"{step}: {argv[0]} is not installed", hint="run scripts/bootstrap.sh (apt-get install mmdebstrap busybox-static cpio e2fsprogs qemu-utils)") from e
    except subprocess.TimeoutExpired as e:
        raise ImageBuildError(f"{step}: {argv[0]} did not finish in {timeout:.0f} s") from e
    if r.returncode != 0:
        tail = (r.stderr or r.stdout).strip()[-2000:]
        raise ImageBuildError(f"{step} failed ({' '.join(argv[:3])} ... exit {r.returncode}): {tail}", hint="check network access to the Debian mirror and free disk space, then rerun `moorage image build`")
    return r.stdout


class ImageBuilder:
    """Builds (or finds in the cache) the guest image for a recipe and the current guest code."""

    def __init__(self, images_dir: Path, recipe: ImageRecipe | None = None, *, progress: Progress | None = None) -> None:
        self.images_dir = Path(images_dir)
        self.recipe = recipe or ImageRecipe()
        self._progress = progress or (lambda step, detail: None)

    # --- public -------------------------------------------------------------------------------------------------

    def image_id(self) -> str:
        # The building host's Python version too: its image holds the guest modules' byte code only when it is the
        # guest's (image_guest._precompile), so two hosts' builds of one recipe and code may differ.
        return _digest({"recipe": self.recipe.key(), "guest": image_guest.guest_code_hash(), "final": FINAL_LAYER_VERSION,
                        "built_by": "python%d.%d" % sys.version_info[:2]})

    def cached(self) -> GuestImage | None:
        d = self.images_dir / self.image_id()
        if (d / "manifest.json").exists():
            return GuestImage.load(d)
        return None

    def build(self, *, force: bool = False, on_kernel: Callable[[Path], None] | None = None) -> GuestImage:
        """Return the image for this recipe and guest code, building only the missing layers. ``on_kernel`` is
        called with the kernel layer's directory once it is there, if the image has to be built (the KVM probe
        needs only the kernel: it runs beside the root tree's build)."""
        if not force and (img := self.cached()) is not None:
            self._progress("cached", f"image {img.id}")
            return img
        self.images_dir.mkdir(parents=True, exist_ok=True)
        # One builder at a time per images dir (hosts or test workers sharing a cache): the others wait, then
        # find the image the first one built instead of racing it layer by layer.
        with open(self.images_dir / ".build.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not force and (img := self.cached()) is not None:
                self._progress("cached", f"image {img.id}")
                return img
            started = time.monotonic()
            kdir = self.kernel_layer(force=force)
            if on_kernel is not None:
                on_kernel(kdir)
            tree = self._rootfs_tree(force)
            img = self._final_image(kdir, tree)
        log.info("image built", image=img.id, seconds=round(time.monotonic() - started, 1))
        return img

    # --- layers -------------------------------------------------------------------------------------------------

    def kernel_layer(self, *, force: bool = False) -> Path:
        """Kernel from the Debian package plus a busybox initramfs that loads the virtio modules (no root needed)."""
        self.images_dir.mkdir(parents=True, exist_ok=True)
        key = self.recipe.kernel_key()
        out = self.images_dir / "cache" / f"kernel-{key}"
        if (out / "done").exists() and not force:
            self._progress("kernel", "cached")
            return out
        with tempfile.TemporaryDirectory(dir=self.images_dir, prefix=".kernel-") as tmp:
            t = Path(tmp)
            self._progress("kernel", f"downloading {self.recipe.kernel_package}")
            _run("apt-get download", ["apt-get", "download", "-q", self.recipe.kernel_package, "busybox-static"], cwd=t)
            meta = next(t.glob(f"{self.recipe.kernel_package}_*.deb"))
            depends = _run("dpkg-deb", ["dpkg-deb", "-f", str(meta), "Depends"]).strip()
            real = depends.split(",")[0].split()[0]
            if real != self.recipe.kernel_package:  # a metapackage: fetch the versioned image it points to
                _run("apt-get download", ["apt-get", "download", "-q", real], cwd=t)
            for deb in t.glob("*.deb"):
                _run("dpkg -x", ["dpkg", "-x", str(deb), str(t / "x")])
            vmlinuz = sorted((t / "x" / "boot").glob("vmlinuz-*"))
            if not vmlinuz:
                raise ImageBuildError(f"{real} contains no /boot/vmlinuz-*", hint="set ImageRecipe.kernel_package to a linux-image-* package")
            version = vmlinuz[-1].name.removeprefix("vmlinuz-")
            self._progress("initramfs", f"kernel {version}")
            initrd = self._initramfs(t, t / "x", version)
            staging = t / "out"
            staging.mkdir()
            shutil.copy2(vmlinuz[-1], staging / "vmlinuz")
            shutil.copy2(initrd, staging / "initrd.img")
            (staging / "version").write_text(version)
            (staging / "done").write_text(json.dumps({"built_at": time.time()}))
            if out.exists():
                shutil.rmtree(out)
            out.parent.mkdir(parents=True, exist_ok=True)
            os.rename(staging, out)
        return out

    def _initramfs(self, work: Path, pkgroot: Path, version: str) -> Path:
        root = work / "initramfs"
        for d in ("bin", "dev", "proc", "sys", "newroot", "lib/modules"):
            (root / d).mkdir(parents=True, exist_ok=True)
        shutil.copy2(pkgroot / "bin" / "busybox", root / "bin" / "busybox")
        moddir = pkgroot / "lib" / "modules" / version / "kernel"
        index = {p.stem: p for p in moddir.rglob("*.ko")}
        order = _module_load_order(self.recipe.modules, index)
        for name in order:
            shutil.copy2(index[name], root / "lib" / "modules" / f"{name}.ko")
        (root / "lib" / "modules" / "order").write_text("\n".join(order) + "\n")
        init = root / "init"
        init.write_text(image_guest.INITRAMFS_INIT)
        init.chmod(0o755)
        files = sorted(str(p.relative_to(root)) for p in root.rglob("*"))
        cpio = work / "initrd.img"
        with open(cpio, "wb") as f:
            r = subprocess.run(["cpio", "-o", "-H", "newc", "--quiet", "-R", "0:0"], input="\n".join(files).encode(), cwd=root, stdout=f, stderr=subprocess.PIPE)
        if r.returncode != 0:
            raise ImageBuildError(f"cpio failed: {r.stderr.decode(errors='replace')[-500:]}")
        return cpio

    def _rootfs_tree(self, force: bool) -> Path:
        """The root tree (mmdebstrap, else debootstrap), the slow part (≈ 20-90 s), cached by the recipe's package
        set."""
        key = self.recipe.rootfs_key()
        out = self.images_dir / "cache" / f"rootfs-{key}"
        if (out / "done").exists() and not force:
            self._progress("rootfs", "cached debootstrap tree")
            return out / "tree"
        if os.geteuid() != 0:
            raise ConfigError("building the guest root filesystem needs root (debootstrap creates device nodes and root-owned files)", hint="run `sudo moorage image build` once; the image is cached for every user of this data directory")
        argv = bootstrap_argv(self.recipe, out / "tree")
        if out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True)
        self._progress("rootfs", f"{argv[0]} {self.recipe.suite} {self.recipe.variant} +{','.join(self.recipe.packages)} "
                                 f"({'about half a minute' if argv[0] == 'mmdebstrap' else 'a minute or two'})")
        _run(argv[0], argv)
        # Trim what a sandbox never needs: apt lists and caches, docs, man pages (tens of MB less to map).
        for rel in ("var/cache/apt/archives", "var/lib/apt/lists", "usr/share/doc", "usr/share/man", "usr/share/info"):
            p = out / "tree" / rel
            if p.exists():
                shutil.rmtree(p)
                p.mkdir()
        (out / "done").write_text(json.dumps({"built_at": time.time()}))
        return out / "tree"

    def _final_image(self, kdir: Path, tree: Path) -> GuestImage:
        """Hard-link the cached tree, add the guest runtime and make the ext4 (seconds, no debootstrap)."""
        image_id = self.image_id()
        out = self.images_dir / image_id
        self._progress("layer", "adding the moorage guest runtime")
        with tempfile.TemporaryDirectory(dir=self.images_dir, prefix=".image-") as tmp:
            t = Path(tmp)
            staging = t / "root"
            # cp -al shares every file with the cache; layered files are unlinked before being written.
            _run("cp -al", ["cp", "-a", "--link", str(tree), str(staging)])
            image_guest.layer_guest_runtime(staging)
            self._progress("ext4", f"mkfs.ext4 {self.recipe.disk_mib} MiB")
            final = t / "final"
            final.mkdir()
            rootfs = final / "rootfs.ext4"
            with open(rootfs, "wb") as f:
                f.truncate(self.recipe.disk_mib << 20)
            _run("mkfs.ext4", ["mkfs.ext4", "-q", "-F", "-L", "moorage-root", "-m", "0", "-E", "root_owner=0:0", "-d", str(staging), str(rootfs)])
            self._progress("ext4", "shrinking the root filesystem to its contents")
            root_mib = _shrink_ext4(rootfs)
            shutil.copy2(kdir / "vmlinuz", final / "vmlinuz")
            shutil.copy2(kdir / "initrd.img", final / "initrd.img")
            img = GuestImage(
                id=image_id,
                dir=out,
                kernel=out / "vmlinuz",
                initrd=out / "initrd.img",
                rootfs=out / "rootfs.ext4",
                kernel_version=(kdir / "version").read_text().strip(),
                recipe_key=self.recipe.key(),
                guest_code_hash=image_guest.guest_code_hash(),
                disk_mib=root_mib,
                built_at=time.time(),
            )
            for p in final.iterdir():
                p.chmod(0o444)  # agents' disks are overlays; the base must never be written
            (final / "manifest.json").write_text(json.dumps(img.to_json(), indent=2))
            if out.exists():
                shutil.rmtree(out)
            os.rename(final, out)
        self._progress("done", f"image {image_id}")
        return img


#: Free space left in the shrunk root filesystem (a booting guest writes a little before it grows the filesystem).
_ROOT_SLACK_MIB = 32


def _shrink_ext4(path: Path) -> int:
    """Shrink the ext4 image at ``path`` to its contents plus a little slack; return its new size in MiB.

    An agent's disk is an overlay sized to the image plus the sandbox's ``disk_mib`` and the guest grows the
    filesystem to it at boot, so ``disk_mib`` is the agent's own space on the micro-VM as on the process driver.
    """
    _run("e2fsck", ["e2fsck", "-f", "-p", str(path)])
    header = _run("dumpe2fs", ["dumpe2fs", "-h", str(path)])
    block = int(re.search(r"^Block size:\s+(\d+)", header, re.M).group(1))  # type: ignore[union-attr]
    minimum = int(re.search(r"(\d+)\s*$", _run("resize2fs -P", ["resize2fs", "-P", str(path)]).strip()).group(1))  # type: ignore[union-attr]
    mib = -(-(minimum * block) // (1 << 20)) + _ROOT_SLACK_MIB
    _run("resize2fs", ["resize2fs", str(path), f"{mib}M"])
    os.truncate(path, mib << 20)
    return mib


def _module_load_order(wanted: tuple[str, ...], index: dict[str, Path]) -> list[str]:
    """Topological order of the wanted modules and their dependencies, read from each .ko's modinfo."""
    order: list[str] = []

    def visit(name: str, stack: tuple[str, ...]) -> None:
        if name in order:
            return
        if name in stack:
            raise ImageBuildError(f"module dependency cycle: {' -> '.join(stack + (name,))}")
        path = index.get(name) or index.get(name.replace("_", "-"))
        if path is None:
            raise ImageBuildError(f"kernel module {name} not found in the kernel package", hint="the kernel may have it built in: remove it from ImageRecipe.modules")
        for dep in _ko_depends(path.read_bytes()):
            visit(dep, stack + (name,))
        order.append(path.stem)

    for m in wanted:
        visit(m, ())
    return order


def _ko_depends(blob: bytes) -> list[str]:
    """The ``depends=`` entry of a module's .modinfo section (NUL-separated key=value strings)."""
    i = blob.find(b"\x00depends=")
    if i < 0:
        return []
    end = blob.index(b"\x00", i + 1)
    value = blob[i + len(b"\x00depends=") : end].decode()
    return [d for d in value.split(",") if d]

