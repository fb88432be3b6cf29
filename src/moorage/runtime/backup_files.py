"""How a backup copies files: ``cp -a`` (modes, hard links among what one ``cp`` copies, holes; reflinks where the
filesystem has them), leaving out the booted templates (``runtime/booted.py``: what a builder resumes instead of
booting, a cache of a boot of ~100 MiB or more each; the copy's first deploy of each size boots its builder and keeps
one). Used by the online backup (``runtime/backup.py``) and by ``moorage backup`` of a stopped host."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Callable

from moorage.errors import MoorageError
from moorage.runtime.booted import PREFIX as BOOTED_PREFIX

#: Under ``templates/``: the booted templates' records; under the driver's ``.templates``: their files.
BOOTED_RECORDS, TEMPLATES = "booted", ".templates"
#: What a copy leaves out, by the directory it is in (relative to the data directory).
LEFT_OUT: dict[str, Callable[[str], bool]] = {
    "templates": lambda name: name == BOOTED_RECORDS,
    f"sandboxes/{TEMPLATES}": lambda name: name.startswith(BOOTED_PREFIX),
}
_HINT = "free space at the destination (or fix its permissions) and take the backup again"


class BackupFailed(MoorageError):
    """The backup stopped; an online backup's DEST stays marked incomplete."""

    code = "backup-failed"


async def copy_tree(src: Path, dst: Path) -> None:
    """``cp -a`` of one file or directory: modes, hard links (checkpoints share files) and holes kept, reflinked
    where the filesystem can."""
    await _cp([str(src), str(dst)], src)


async def copy_tree_but(src: Path, dst: Path, left_out: Callable[[str], bool]) -> None:
    """``copy_tree`` of directory ``src`` without the entries whose names ``left_out`` picks (its own mode kept,
    and the hard links among the others: one ``cp``)."""
    try:
        dst.mkdir(parents=True, exist_ok=True)
        os.chmod(dst, src.stat().st_mode & 0o7777)
    except OSError as e:
        raise BackupFailed(f"copying {src} failed: {dst}: {e.strerror or e}", hint=_HINT) from None
    subs = [str(sub) for sub in sorted(src.iterdir()) if not left_out(sub.name)]
    if subs:
        await _cp([*subs, str(dst)], src)


async def copy_but_booted(src: Path, dst: Path, rel: str = "") -> None:
    """``copy_tree`` of ``src``, the directory ``rel`` of a data directory (``""``: the data directory itself),
    without what ``LEFT_OUT`` names at any depth below it. A directory on the way there is copied entry by entry;
    one that is a link is copied as the link."""
    prefix = f"{rel}/" if rel else ""
    if not src.is_dir() or src.is_symlink() or not any(path == rel or path.startswith(prefix) for path in LEFT_OUT):
        await copy_tree(src, dst)  # nothing to leave out there: the directory whole, as it is
        return
    leave = LEFT_OUT.get(rel, lambda name: False)
    deeper = {path[len(prefix):].split("/")[0] for path in LEFT_OUT if path.startswith(prefix) and path != rel}
    deeper = {name for name in deeper if (src / name).is_dir() and not (src / name).is_symlink()}
    await copy_tree_but(src, dst, lambda name: leave(name) or name in deeper)
    for name in sorted(deeper):
        await copy_but_booted(src / name, dst / name, f"{prefix}{name}")


async def _cp(args: list[str], what: Path) -> None:
    proc = await asyncio.create_subprocess_exec("cp", "-a", "--reflink=auto", "--sparse=always", "--", *args,
                                                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
    _, err = await proc.communicate()
    if proc.returncode != 0:
        raise BackupFailed(f"copying {what} failed: {err.decode(errors='replace').strip()[:500]}", hint=_HINT)
