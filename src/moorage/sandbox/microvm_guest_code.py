"""A micro-VM whose guest code is an older moorage's brought onto this host's (a part of ``MicroVMDriver``).

The guest package lives in the guest image a VM's disk is an overlay on, so a VM made before an upgrade (re-adopted
after ``moorage up --detach``, woken from an older snapshot, or forked from an older template) runs the older guest
code for good: what its agent calls that the newer ``ctx`` added (``ctx.spawn``, ``memory.facts(as_of=)``) failed
with an AttributeError or TypeError. Before the agent's code is loaded into such a guest, the host's guest package is
written over the one on its disk and its processes are restarted in place, executing the new code (its files,
packages and disk stay; its processes and their memory do not, as at any restart). Only where the VM's image was
built from the same recipe as this host's (the same Debian, the same Python): another recipe's guest keeps its code.
"""

from __future__ import annotations

import functools
import io
import tarfile
import time
from pathlib import Path
from typing import Any

from moorage.log import get_logger
from moorage.sandbox import guest_source_dir, image_guest
from moorage.sandbox.image import GuestImage, ImageBuilder

log = get_logger(__name__)

#: The sandbox's meta key naming the guest code written onto its disk since it was made (absent: its image's).
META_KEY = "guest_code"
#: Set in the restarted supervisor's environment: a variable of this prefix makes the guest's holder execute a fresh
#: interpreter (guest/restart.py, ``STARTUP_PREFIXES``) instead of forking one with the old modules imported.
ENV_KEY = "MOORAGE_GUEST_CODE"

#: Run in the guest with the package as a gzipped tar on stdin (and the package's directory as its argument):
#: unpacked beside the old one, compiled as the image's is, flushed to the disk, and swapped with the old one by one
#: ``renameat2(RENAME_EXCHANGE)`` (Linux 3.15, ext4): the directory's name always holds a whole package, the old or
#: the new, at every point a VM may be stopped hard. Before, two renames (the old one aside, the new one in) left
#: the guest's init no guest code at all in a VM killed between them before its journal committed the second.
_INSTALL = r"""
import compileall, ctypes, io, os, py_compile, shutil, sys, tarfile
dst = sys.argv[1]
new = dst + ".new"
shutil.rmtree(new, ignore_errors=True)  # an install cut short: its half-written package, or the one it swapped out
shutil.rmtree(dst + ".old", ignore_errors=True)  # an older moorage's install's leftover
with tarfile.open(fileobj=io.BytesIO(sys.stdin.buffer.read()), mode="r:gz") as t:
    t.extractall(new)
if not compileall.compile_dir(new, quiet=1, invalidation_mode=py_compile.PycInvalidationMode.CHECKED_HASH):
    sys.exit("the guest package did not compile")
os.sync()  # its files on the disk before its name is: an exchange committed first would name unwritten files
libc = ctypes.CDLL(None, use_errno=True)
AT_FDCWD, RENAME_EXCHANGE = -100, 2
if libc.renameat2(AT_FDCWD, new.encode(), AT_FDCWD, dst.encode(), RENAME_EXCHANGE) != 0:
    sys.exit("renameat2(RENAME_EXCHANGE) failed: " + os.strerror(ctypes.get_errno()))
os.sync()
shutil.rmtree(new, ignore_errors=True)  # the old package, under the name the new one had
"""


@functools.lru_cache(maxsize=1)
def _package() -> tuple[str, bytes]:
    """This host's guest code: its hash (as images name it) and the package as a gzipped tar."""
    buf = io.BytesIO()
    src = guest_source_dir()
    with tarfile.open(fileobj=buf, mode="w:gz") as t:
        for p in image_guest._guest_files():
            info = t.gettarinfo(str(p), arcname=str(p.relative_to(src)))
            info.uid = info.gid = 0
            info.uname = info.gname = "root"
            info.mode = 0o644
            with p.open("rb") as f:
                t.addfile(info, f)
    return image_guest.guest_code_hash(), buf.getvalue()


@functools.lru_cache(maxsize=64)
def _image_of(image_dir: str) -> tuple[str, str] | None:
    """(guest code hash, recipe key) of the image in ``image_dir``; None when its manifest cannot be read."""
    try:
        img = GuestImage.load(Path(image_dir))
    except (OSError, ValueError, TypeError, KeyError):
        return None
    return img.guest_code_hash, img.recipe_key


#: Sandboxes whose guest code could not be replaced (said once in the log): not tried again by this process.
_gave_up: set[str] = set()


def behind(sandbox: Any, images_dir: Path) -> bool:
    """Whether the running ``sandbox``'s guest code is not this host's while its image has this host's recipe.
    Read from its record in memory (and its image's manifest, read once): cheap enough for every turn."""
    if sandbox.id in _gave_up:
        return False
    meta = sandbox._meta
    image = _image_of(str(meta.get("image_dir") or ""))
    if image is None:
        return False
    have = meta.get(META_KEY) or image[0]
    if have == _package()[0]:
        return False
    return image[1] == _recipe_key(str(images_dir))


@functools.lru_cache(maxsize=4)
def _recipe_key(images_dir: str) -> str:
    return ImageBuilder(Path(images_dir)).recipe.key()


async def bring_up_to_date(driver: Any, sandbox: Any) -> bool:
    """Write this host's guest code onto the running ``sandbox``'s disk and restart its processes onto it (see the
    module). Returns False, having changed nothing, when it is not ``behind`` or its guest cannot restart in place
    (one from before ``sys.restart``)."""
    if not behind(sandbox, driver.images_dir):
        return False
    before = await sandbox.channel.call("ping", {}, timeout=30)
    if "sys.restart" not in (before.get("methods") or []):
        _gave_up.add(sandbox.id)
        log.warning("this instance's guest code is an older moorage's and cannot be replaced while it runs",
                    sandbox=sandbox.id, image=sandbox._meta.get("image_id"))
        return False
    code, package = _package()
    was = sandbox._meta.get(META_KEY) or (_image_of(str(sandbox._meta["image_dir"])) or ("?",))[0]
    started = time.monotonic()
    r = await sandbox.exec(["python3", "-c", _INSTALL, image_guest.GUEST_DIR_IN_VM], stdin=package, timeout=120)
    if r.exit_code != 0:
        _gave_up.add(sandbox.id)
        log.warning("the guest code could not be written into the instance; it keeps its older one",
                    sandbox=sandbox.id, error=(r.stderr or r.stdout)[-500:])
        return False
    env = {**dict(sandbox._meta["spec"].get("env") or {}), ENV_KEY: code}
    if not await driver.restart_in_place(sandbox, env, this_run_only=True):
        _gave_up.add(sandbox.id)
        return False
    sandbox._meta[META_KEY] = code
    sandbox._save_meta()
    log.warning("instance restarted onto this moorage's guest code (it ran an older moorage's; its files are kept, "
                "its processes were restarted)", sandbox=sandbox.id, was=was, now=code,
                ms=round((time.monotonic() - started) * 1000))
    return True
