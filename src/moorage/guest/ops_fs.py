"""File methods: ``fs.read``, ``fs.write``, ``fs.rename``, ``fs.list``, ``fs.stat``, ``fs.remove``.

Relative paths resolve against the work directory. Data is base64; writes can be atomic (temp file + rename).
"""

from __future__ import annotations

import base64
import os
import shutil
import stat as stat_mod
from typing import Any, Dict, Optional

from .rpc import Context, Registry, RpcError, INVALID_PARAMS

_MAX_READ = 4 << 20


class FileService:
    def __init__(self, workdir: str) -> None:
        self.workdir = workdir

    def _path(self, params: Any, key: str = "path") -> str:
        p = params.get(key)
        if not isinstance(p, str) or not p or "\0" in p:
            raise RpcError("%s must be a non-empty string" % key, INVALID_PARAMS)
        return os.path.normpath(os.path.join(self.workdir, p))

    async def read(self, params: Any, ctx: Context) -> Dict[str, Any]:
        path = self._path(params)
        offset = int(params.get("offset", 0))
        length = min(int(params.get("length", _MAX_READ)), _MAX_READ)
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            f.seek(offset)
            data = f.read(length)
        return {"data": base64.b64encode(data).decode(), "eof": offset + len(data) >= size, "size": size}

    async def write(self, params: Any, ctx: Context) -> Dict[str, Any]:
        path = self._path(params)
        data = base64.b64decode(params.get("data", ""))
        mode = int(params.get("mode", 0o644)) & 0o7777
        parent = os.path.dirname(path)
        if parent:
            os.makedirs(parent, exist_ok=True)
        if params.get("append"):
            with open(path, "ab") as f:
                f.write(data)
            return {"size": os.path.getsize(path)}
        target = path + ".moorage-tmp" if params.get("atomic") else path
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.chmod(target, mode)
            if target != path:
                os.replace(target, path)
        except BaseException:
            if target != path and os.path.exists(target):
                os.unlink(target)
            raise
        return {"size": len(data)}

    async def rename(self, params: Any, ctx: Context) -> Dict[str, Any]:
        os.replace(self._path(params, "src"), self._path(params, "dst"))
        return {}

    async def list(self, params: Any, ctx: Context) -> Dict[str, Any]:
        path = self._path(params)
        entries = []
        with os.scandir(path) as it:
            for e in it:
                info = _info(e.path, e.name)
                if info is not None:
                    entries.append(info)
        entries.sort(key=lambda i: i["name"])
        return {"entries": entries}

    async def stat(self, params: Any, ctx: Context) -> Dict[str, Any]:
        path = self._path(params)
        return {"info": _info(path, os.path.basename(path.rstrip("/")) or "/")}

    async def remove(self, params: Any, ctx: Context) -> Dict[str, Any]:
        path = self._path(params)
        if os.path.isdir(path) and not os.path.islink(path):
            if params.get("recursive"):
                shutil.rmtree(path)
            else:
                os.rmdir(path)
        else:
            os.unlink(path)
        return {}


def _info(path: str, name: str) -> Optional[Dict[str, Any]]:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if stat_mod.S_ISREG(st.st_mode):
        kind = "file"
    elif stat_mod.S_ISDIR(st.st_mode):
        kind = "dir"
    elif stat_mod.S_ISLNK(st.st_mode):
        kind = "symlink"
    else:
        kind = "other"
    return {"name": name, "path": path, "type": kind, "size": st.st_size, "mode": stat_mod.S_IMODE(st.st_mode), "mtime": st.st_mtime}


def register(registry: Registry, workdir: str) -> None:
    svc = FileService(workdir)
    registry.add("fs.read", svc.read)
    registry.add("fs.write", svc.write)
    registry.add("fs.rename", svc.rename)
    registry.add("fs.list", svc.list)
    registry.add("fs.stat", svc.stat)
    registry.add("fs.remove", svc.remove)
