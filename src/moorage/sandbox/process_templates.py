"""A process template's shared parts: paths in the sandbox that every fork of the template sees, read-only, as the
template's own files instead of a copy in its layer (``make_template(..., shared=[...])``: an agent's deploy-time
packages, ~80 MB and 3,400 files for LangGraph, that each new user would otherwise copy, each checkpoint walk and
each fleet sleep ship).

On disk:

- ``template.json`` ``"shared"``: the layer paths (``work/...``) its forks bind from ``<template>/layer``;
- a fork's ``meta.json`` ``"shared"``: ``{"template": id, "paths": [...]}``, and in its layer an empty directory at
  each path (the mount point);
- ``<template>/children/<sandbox>``: the forks on this host that bind it. A template deleted while it has some is
  marked ``deleted`` (no new forks) and its files go with the last of them.

A template made from a fork carries its shared files (hard links to the template it came from: the files are never
written, through the read-only bind or otherwise) and shares them with its own forks in turn, so a template never
depends on another. Everything here blocks except ``copy_layer``.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import stat
import subprocess
import time
from pathlib import Path, PurePosixPath
from typing import Any, Iterable, Sequence

from moorage.errors import InvalidInput
from moorage.sandbox.base import SandboxError

#: The sandbox path of the layer's only shareable top directory (the layer's ``tmp`` is scratch space).
WORK = PurePosixPath("/work")
#: At most this many shared paths per template: each is one more directory the root launcher binds (fds 3-9).
MAX_SHARED = 3
#: The marker of a template deleted while forks still bind it.
DELETED = "deleted"
CHILDREN = "children"


def layer_paths(paths: Iterable[str]) -> list[str]:
    """Sandbox paths (``/work/...``) as layer paths (``work/...``), checked: absolute, normalised, strictly under
    /work, none inside another. Raises ``InvalidInput``."""
    out: list[PurePosixPath] = []
    for p in paths:
        path = PurePosixPath(str(p))
        if (not path.is_absolute() or ".." in path.parts or str(path) != os.path.normpath(str(p))
                or WORK not in path.parents):
            raise InvalidInput(f"shared path {p!r} is not a normalised path under {WORK}",
                               hint="share directories such as /work/.moorage/site")
        out.append(path)
    for a in out:
        for b in out:
            if a != b and a in b.parents:
                raise InvalidInput(f"shared paths {str(a)!r} and {str(b)!r} overlap", hint="share the outer one")
    if len(set(out)) > MAX_SHARED:
        raise InvalidInput(f"at most {MAX_SHARED} shared paths per template")
    return sorted({str(p.relative_to("/")) for p in out})


def sandbox_path(rel: str) -> str:
    return "/" + rel


def of_template(tdir: Path) -> list[str]:
    """The layer paths a template shares with its forks ([] for one made before sharing, or without any)."""
    try:
        shared = json.loads((tdir / "template.json").read_text()).get("shared") or []
    except (OSError, ValueError):
        return []
    return [str(s) for s in shared]


def real_dir(layer: Path, rel: str, *, parents_only: bool = False) -> bool:
    """Whether every component of ``layer/rel`` (its parents only, with ``parents_only``) is a directory and none
    a symbolic link: a guest may leave a link to a host path there, which the host must never bind or write
    through."""
    parts = rel.split("/")
    for i in range(1, len(parts) + (0 if parents_only else 1)):
        try:
            if not stat.S_ISDIR(os.lstat(layer.joinpath(*parts[:i])).st_mode):
                return False
        except OSError:
            return False
    return True


def _mkdir_like(src: Path, dst: Path) -> None:
    st = src.lstat()
    dst.mkdir(mode=0o700)
    if os.geteuid() == 0 or st.st_uid == os.geteuid():
        os.lchown(dst, st.st_uid, st.st_gid)
    os.chmod(dst, st.st_mode & 0o7777)


async def _cp(entries: list[Path], dst: Path) -> None:
    for i in range(0, len(entries), 256):  # bounded argument lists
        proc = await asyncio.create_subprocess_exec(
            "cp", "-a", "--reflink=auto", "--", *map(str, entries[i:i + 256]), str(dst),
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
        _, err = await proc.communicate()
        if proc.returncode != 0:
            raise SandboxError(f"copying into {dst} failed: {err.decode(errors='replace').strip()}",
                               hint="check free disk space under the sandboxes directory")


async def copy_layer(src: Path, dst: Path, shared: Sequence[str]) -> None:
    """Copy the layer ``src`` to the new path ``dst`` like ``cp -a``, except the ``shared`` layer paths, each left
    as an empty directory with its original owner and mode (a fork's mount point)."""
    skip = {PurePosixPath(s) for s in shared}
    descend = {p for s in skip for p in s.parents if str(p) != "."}

    async def walk(rel: PurePosixPath) -> None:
        here = src / rel
        _mkdir_like(here, dst / rel)
        plain: list[Path] = []
        for name in sorted(os.listdir(here)):
            r = rel / name
            is_dir = (here / name).is_dir() and not (here / name).is_symlink()
            if r in skip and is_dir:
                _mkdir_like(here / name, dst / r)
                shutil.copystat(here / name, dst / r, follow_symlinks=False)
            elif r in descend and is_dir:
                await walk(r)
            else:
                plain.append(here / name)
        await _cp(plain, dst / rel)
        shutil.copystat(here, dst / rel, follow_symlinks=False)

    await walk(PurePosixPath("."))


def link_tree(src: Path, dst: Path) -> None:
    """``dst`` made a tree of hard links to the files under ``src`` (directories and symlinks made anew, owners and
    modes kept): a template's copy of shared files that are never written. Whatever was at ``dst`` (a fork's mount
    point, or what its guest left there) goes first; the caller checked ``dst``'s parents (``real_dir``)."""
    if dst.is_dir() and not dst.is_symlink():
        shutil.rmtree(dst)
    elif os.path.lexists(dst):
        dst.unlink()
    p = subprocess.run(["cp", "-a", "--link", "--", str(src), str(dst)], capture_output=True, text=True)
    if p.returncode != 0:  # another filesystem (no hard links across): a copy
        shutil.rmtree(dst, ignore_errors=True)
        p = subprocess.run(["cp", "-a", "--", str(src), str(dst)], capture_output=True, text=True)
    if p.returncode != 0:
        raise SandboxError(f"copying {src} to {dst} failed: {p.stderr.strip() or p.returncode}",
                           hint="check free disk space under the sandboxes directory")


# -- forks that bind a template -------------------------------------------------------------------------------

def add_child(tdir: Path, sandbox_id: str) -> None:
    (tdir / CHILDREN).mkdir(exist_ok=True)
    (tdir / CHILDREN / sandbox_id).write_text("")


def has_children(tdir: Path) -> bool:
    children = tdir / CHILDREN
    return children.is_dir() and any(children.iterdir())


def drop_child(tdir: Path, sandbox_id: str) -> None:
    """Fork ``sandbox_id`` is gone: a deleted template goes with its last fork."""
    (tdir / CHILDREN / sandbox_id).unlink(missing_ok=True)
    collect(tdir)


def collect(tdir: Path) -> None:
    if (tdir / DELETED).exists() and not has_children(tdir):
        shutil.rmtree(tdir, ignore_errors=True)


def delete(tdir: Path) -> None:
    """No new forks from the template; its files go now, or with the last fork that binds them."""
    if of_template(tdir) and has_children(tdir):
        (tdir / DELETED).write_text(str(time.time()))
        return
    shutil.rmtree(tdir, ignore_errors=True)


def mount_point(layer: Path, rel: str) -> None:
    """An empty directory at ``layer/rel`` to bind a template's shared directory over. What the guest left on the
    way goes: a file or link where a directory belongs is removed (never followed), and so is the directory's
    content; missing directories are made owned like ``layer/work``."""
    owner = (layer / "work").lstat()
    parts = rel.split("/")
    for i in range(1, len(parts) + 1):
        p = layer.joinpath(*parts[:i])
        try:
            st = os.lstat(p)
        except FileNotFoundError:
            st = None
        if st is not None and (not stat.S_ISDIR(st.st_mode) or i == len(parts)):
            if stat.S_ISDIR(st.st_mode):
                shutil.rmtree(p)  # does not follow links inside
            else:
                p.unlink()
            st = None
        if st is None:
            p.mkdir(mode=0o755)
            if os.geteuid() == 0 or owner.st_uid == os.geteuid():
                os.lchown(p, owner.st_uid, owner.st_gid)


def rebind(meta: dict[str, Any], layer: Path, tdir: Path, template_id: str, sandbox_id: str) -> list[str]:
    """Make the fork whose ``meta`` and ``layer`` these are bind template ``tdir``'s shared directories (none, if it
    shares none) from its next start; returns their layer paths. The caller saves ``meta`` and then drops the fork
    from the template it bound before (``drop_child``)."""
    paths = of_template(tdir)
    for rel in paths:
        mount_point(layer, rel)
    if paths:
        add_child(tdir, sandbox_id)
        meta["shared"] = {"template": template_id, "dir": str(tdir), "paths": paths}
    else:
        meta.pop("shared", None)
    return paths


def template_of(meta: dict[str, Any], template_dir: Any) -> Path:
    """The directory of the template a fork binds (``meta["shared"]``): found by its id under this driver's root,
    never by the path recorded with it (a copied or moved data directory would bind the original's files)."""
    return Path(template_dir(meta["shared"]["template"]))


def binds(meta: dict[str, Any], template_dir: Any) -> list[tuple[Path, str]]:
    """(host directory, sandbox path) of each shared path a sandbox binds read-only; raises ``SandboxError`` when
    its template's copy is missing (deleted by hand, or not fetched to this host)."""
    shared = meta.get("shared") or {}
    out = []
    for rel in shared.get("paths") or []:
        layer = template_of(meta, template_dir) / "layer"
        src = layer / rel
        if not real_dir(layer, rel):
            raise SandboxError(f"sandbox {meta.get('id')} shares {sandbox_path(rel)} with template "
                               f"{shared['template']}, which is not on this host",
                               hint="in a fleet the template is fetched from the object store when the sandbox "
                                    "arrives; publish it, or fork the user again")
        out.append((src, sandbox_path(rel)))
    return out
