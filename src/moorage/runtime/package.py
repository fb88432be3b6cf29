"""Agent packages: validate an agent directory, archive it reproducibly, unpack it again.

An agent is a folder with a ``moorage.toml`` (an ``[agent]`` table) and, optionally, Python modules:
an entry module with an ``on_message(ctx, message)`` handler, and tool functions.
"""

from __future__ import annotations

import hashlib
import io
import os
import tarfile
import tomllib
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from moorage.errors import InvalidInput
from moorage.store.model import check_id

MAX_PACKAGE_BYTES = 20 << 20
MAX_FILES = 2000
SCOPES = ("user", "session", "workflow")
_SKIP_DIRS = {"__pycache__", ".git", ".venv", "node_modules", ".mypy_cache", ".pytest_cache"}


class AgentPackageError(InvalidInput):
    """The agent folder cannot be deployed as it is; the message says which file and what to fix."""

    code = "agent-package"


@dataclass(frozen=True)
class AgentPackage:
    name: str
    manifest: dict[str, Any]
    archive: bytes
    sha256: str

    @property
    def scope(self) -> str:
        return self.manifest.get("scope", "user")


def _check_manifest(doc: dict[str, Any], files: dict[str, bytes]) -> dict[str, Any]:
    agent = doc.get("agent")
    if not isinstance(agent, dict):
        raise AgentPackageError("moorage.toml has no [agent] table", hint='add [agent] with at least name = "my-agent"')
    check_id(agent.get("name"), "agent name in moorage.toml")
    entry = agent.get("entry")
    if entry is not None and entry not in files:
        raise AgentPackageError(f"entry module {entry!r} named in moorage.toml is not in the package")
    if entry is None and not agent.get("system_prompt"):
        raise AgentPackageError(
            "moorage.toml names no entry module and no system_prompt",
            hint='set entry = "agent.py" (with async def on_message(ctx, message)) or system_prompt for the built-in loop',
        )
    tools = agent.get("tools", [])
    if not isinstance(tools, list) or not all(isinstance(t, str) and ":" in t for t in tools):
        raise AgentPackageError('tools must be a list of "file.py:function" strings')
    for t in tools:
        if t.split(":", 1)[0] not in files:
            raise AgentPackageError(f"tool {t!r}: file {t.split(':', 1)[0]!r} is not in the package")
    if agent.get("scope", "user") not in SCOPES:
        raise AgentPackageError(f"scope must be one of {', '.join(SCOPES)}, not {agent.get('scope')!r}")
    return agent


def _read_dir(root: Path) -> dict[str, bytes]:
    if not root.is_dir():
        raise AgentPackageError(f"{root} is not a directory", hint="pass the folder that holds moorage.toml")
    files: dict[str, bytes] = {}
    total = 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        for fn in sorted(filenames):
            p = Path(dirpath) / fn
            if p.is_symlink() or not p.is_file() or fn.endswith((".pyc", ".pyo")):
                continue
            rel = p.relative_to(root).as_posix()
            data = p.read_bytes()
            total += len(data)
            if total > MAX_PACKAGE_BYTES or len(files) >= MAX_FILES:
                raise AgentPackageError(f"the agent folder is over {MAX_PACKAGE_BYTES >> 20} MiB or {MAX_FILES} files",
                                        hint="keep data out of the agent package; the agent can fetch or create it in its sandbox")
            files[rel] = data
    return files


def _archive(files: dict[str, bytes]) -> bytes:
    # Reproducible: sorted names, zero mtimes, fixed owner, so the same folder always hashes the same.
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz", format=tarfile.PAX_FORMAT, compresslevel=6) as tar:
        for name in sorted(files):
            info = tarfile.TarInfo(name)
            info.size = len(files[name])
            info.mode = 0o644
            info.mtime = 0
            tar.addfile(info, io.BytesIO(files[name]))
    return buf.getvalue()


def validate_files(files: dict[str, bytes]) -> AgentPackage:
    if "moorage.toml" not in files:
        raise AgentPackageError("no moorage.toml in the agent folder", hint="create one with an [agent] table")
    try:
        doc = tomllib.loads(files["moorage.toml"].decode())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise AgentPackageError(f"moorage.toml is not valid TOML: {e}") from e
    agent = _check_manifest(doc, files)
    for name, data in files.items():
        if name.endswith(".py"):
            try:
                compile(data, name, "exec", dont_inherit=True)
            except SyntaxError as e:
                raise AgentPackageError(f"syntax error in {name} line {e.lineno}: {e.msg}",
                                        hint="fix the file and deploy again; nothing was changed") from e
    archive = _archive(files)
    return AgentPackage(agent["name"], agent, archive, hashlib.sha256(archive).hexdigest())


def load_dir(root: Path) -> AgentPackage:
    """Read, validate and archive an agent folder. Raises AgentPackageError with what to fix."""
    return validate_files(_read_dir(Path(root)))


def load_archive(archive: bytes) -> AgentPackage:
    """Validate an uploaded tar.gz of an agent folder (the API's deploy body)."""
    return validate_files(unpack(archive))


def unpack(archive: bytes) -> dict[str, bytes]:
    """The files of an archive, refusing anything that could escape the package folder."""
    if len(archive) > MAX_PACKAGE_BYTES:
        raise AgentPackageError(f"the package is over {MAX_PACKAGE_BYTES >> 20} MiB")
    files: dict[str, bytes] = {}
    total = 0
    try:
        with tarfile.open(fileobj=io.BytesIO(archive), mode="r:*") as tar:
            for m in tar:
                if not m.isfile():
                    continue
                p = PurePosixPath(m.name)
                if p.is_absolute() or ".." in p.parts:
                    raise AgentPackageError(f"unsafe path in package: {m.name!r}")
                f = tar.extractfile(m)
                data = f.read() if f else b""
                total += len(data)
                if total > 4 * MAX_PACKAGE_BYTES or len(files) >= MAX_FILES:
                    raise AgentPackageError("the package unpacks to too much data")
                files[p.as_posix()] = data
    except (tarfile.TarError, EOFError, OSError) as e:
        raise AgentPackageError(f"not a valid tar.gz agent package: {e}") from e
    return files
