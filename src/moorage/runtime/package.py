"""Agent packages: validate an agent directory, archive it reproducibly, unpack it again.

An agent is a folder with a ``moorage.toml`` (an ``[agent]`` table) and, optionally, Python modules:
an entry module with an ``on_message(ctx, message)`` handler, and tool functions.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import tarfile
import tomllib
import zlib
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from moorage.errors import InvalidInput
from moorage.runtime.private_files import private_dir, write_private
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


#: The longest a turn may run (``[agent.limits] turn_timeout_s`` bounds it lower; runtime/turn_execution.py).
MAX_TURN_TIMEOUT_S = 600


def turn_timeout_s(manifest: dict[str, Any]) -> float:
    """How long one turn of the agent with ``manifest`` may run: its ``[agent.limits] turn_timeout_s``, else
    MAX_TURN_TIMEOUT_S (the deploy checked it)."""
    bound = (manifest.get("limits") or {}).get("turn_timeout_s")
    return float(bound) if isinstance(bound, (int, float)) and not isinstance(bound, bool) else MAX_TURN_TIMEOUT_S


#: The agent's own tables: a top-level one of these names is a misplaced [agent.NAME], not something to ignore.
_AGENT_TABLES = ("lifecycle", "retention", "timetravel", "egress", "network", "secrets", "mcp", "limits")

#: Every setting the [agent] table has (docs: README, app.md, egress.md, lifecycle.md, timetravel.md, mcp.md,
#: api.md): one that is not here is misspelt or misplaced, and would be ignored, so the deploy refuses it.
AGENT_SETTINGS = frozenset({
    "name", "entry", "handler", "scope", "system_prompt", "tools", "model", "max_tokens",  # code, built-in loop
    "memory_mib", "vcpus", "disk_mib", "ports", "apt",                                     # the sandbox
    *_AGENT_TABLES,
})

#: The keys of the tables that are read leniently where they are used (a wrong one is checked here instead).
_TABLE_SETTINGS = {"egress": ("allow",), "network": ("allow", "packages"), "timetravel": ("auto", "keep", "daily", "named")}


def _check_manifest(doc: dict[str, Any], files: dict[str, bytes]) -> dict[str, Any]:
    agent = doc.get("agent")
    if not isinstance(agent, dict):
        raise AgentPackageError("moorage.toml has no [agent] table", hint='add [agent] with at least name = "my-agent"')
    for name in _AGENT_TABLES:
        if isinstance(doc.get(name), dict):
            raise AgentPackageError(f"moorage.toml has a top-level [{name}] table: it would be ignored",
                                    hint=f"write it as [agent.{name}]; nothing was changed")
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
    _check_settings(agent)
    _check_egress(agent)
    _check_sizing(agent)
    _retention(agent)
    return agent


def _meant(name: str, known: Any) -> str:
    """" (did you mean 'ports'?)" for a misspelt setting close to a known one, else nothing."""
    import difflib

    close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _check_settings(agent: dict[str, Any]) -> None:
    """Settings the deploy would otherwise take and then ignore (or trip over at every turn) fail it instead."""
    from moorage.store.agent_users import check_limits

    unknown = sorted(set(agent) - AGENT_SETTINGS)
    if unknown:
        raise AgentPackageError(f"moorage.toml: unknown [agent] setting {unknown[0]!r}{_meant(unknown[0], AGENT_SETTINGS)}:"
                                " it would be ignored",
                                hint=f"known settings: {', '.join(sorted(AGENT_SETTINGS))}; nothing was changed")
    for table, keys in _TABLE_SETTINGS.items():
        value = agent.get(table)
        if value is None:
            continue
        if not isinstance(value, dict):
            raise AgentPackageError(f"moorage.toml: [agent.{table}] must be a table", hint=f"it takes {', '.join(keys)}")
        wrong = sorted(set(value) - set(keys))
        if wrong:
            raise AgentPackageError(f"moorage.toml: unknown [agent.{table}] setting {wrong[0]!r}{_meant(wrong[0], keys)}:"
                                    " it would be ignored",
                                    hint=f"[agent.{table}] takes {', '.join(keys)}; nothing was changed")
    tt = agent.get("timetravel") or {}
    if "auto" in tt and not isinstance(tt["auto"], bool):
        raise AgentPackageError(f"moorage.toml: [agent.timetravel] auto must be true or false, not {tt['auto']!r}",
                                hint="auto = true checkpoints after every turn, false only when asked; nothing was changed")
    for key, least in (("keep", 1), ("daily", 0), ("named", 0)):
        if key in tt and (isinstance(tt[key], bool) or not isinstance(tt[key], int) or tt[key] < least):
            raise AgentPackageError(f"moorage.toml: [agent.timetravel] {key} must be a whole number of at least {least},"
                                    f" not {tt[key]!r}", hint="e.g. keep = 20, daily = 30, named = 20 (docs/timetravel.md); "
                                                              "nothing was changed")
    mcp = agent.get("mcp") or {}
    if not isinstance(mcp, dict):
        raise AgentPackageError("moorage.toml: [agent.mcp] must be a table of servers",
                                hint='e.g. [agent.mcp.docs] url = "https://docs.example.com/mcp"')
    for name, spec in mcp.items():
        if not isinstance(spec, dict) or set(spec) != {"url"} or not str(spec["url"]).startswith(("http://", "https://")):
            raise AgentPackageError(f"moorage.toml: [agent.mcp.{name}] must have only url = \"http(s)://...\"",
                                    hint="credentials go in the host's mcp.toml (docs/mcp.md), never in the package")
    limits = agent.get("limits", {})
    if isinstance(limits, dict) and "turn_timeout_s" in limits:
        limits = dict(limits)
        bound = limits.pop("turn_timeout_s")
        if isinstance(bound, bool) or not isinstance(bound, (int, float)) or not 1 <= bound <= MAX_TURN_TIMEOUT_S:
            raise AgentPackageError(f"moorage.toml: [agent.limits] turn_timeout_s must be a number of seconds from 1 "
                                    f"to {MAX_TURN_TIMEOUT_S}, not {bound!r}",
                                    hint="e.g. turn_timeout_s = 60: a turn that runs longer is stopped and answered "
                                         "504 turn-timeout; nothing was changed")
    try:
        check_limits(limits)
    except InvalidInput as e:
        hint = f"{e.hint} (per user), or turn_timeout_s (each turn)" if e.hint and e.hint.startswith("one of") else e.hint
        raise AgentPackageError(f"moorage.toml: [agent.limits]: {e.message}",
                                hint=f"{hint}; nothing was changed" if hint else "nothing was changed") from e


def retention_ttl_s(agent: dict[str, Any]) -> float | None:
    """The ``[agent.retention] ttl_s`` of a manifest (None when absent); malformed, it fails the deploy."""
    return _retention(agent)[0]


def retention_zero(agent: dict[str, Any]) -> bool | None:
    """The ``[agent.retention] zero_retention`` of a manifest: None when it sets neither that nor ``ttl_s`` (a deploy
    then leaves the setting as it was), else whether the agent keeps nothing of its turns (default false)."""
    return _retention(agent)[1]


def retention_keep_deployments(agent: dict[str, Any]) -> int | None:
    """The ``[agent.retention] keep_deployments`` of a manifest: how many of the agent's newest deployments a deploy
    that goes live keeps (older ones are deleted, their packages with them); None: all of them."""
    return _retention(agent)[2]


#: The settings of ``[agent.retention]``.
RETENTION_SETTINGS = frozenset({"ttl_s", "zero_retention", "keep_deployments"})


def _retention(agent: dict[str, Any]) -> tuple[float | None, bool | None, int | None]:
    table = agent.get("retention")
    if table is None:
        return None, None, None
    hint = ("[agent.retention] takes ttl_s = <seconds> (an idle session, user or workflow of this agent is deleted "
            "after it) or zero_retention = true (nothing of a turn is kept once it ends), and keep_deployments = <n> "
            "(the agent's newest n deployments are kept, older ones deleted)")
    if not isinstance(table, dict):
        raise AgentPackageError("moorage.toml: [agent.retention] must be a table", hint=hint)
    unknown = sorted(set(table) - RETENTION_SETTINGS)
    if unknown:
        raise AgentPackageError(f"moorage.toml: unknown [agent.retention] setting {unknown[0]!r}", hint=hint)
    keep = table.get("keep_deployments")
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        raise AgentPackageError(f"moorage.toml: [agent.retention] keep_deployments must be a whole number of at least "
                                f"1, not {keep!r}", hint="e.g. keep_deployments = 10: the live one and the 9 before it")
    zero = table.get("zero_retention", False)
    if not isinstance(zero, bool):
        raise AgentPackageError(f"moorage.toml: [agent.retention] zero_retention must be true or false, not {zero!r}",
                                hint=hint)
    if "ttl_s" not in table:
        if not zero and keep is None:
            raise AgentPackageError("moorage.toml: [agent.retention] sets nothing", hint=hint)
        return None, (zero if "zero_retention" in table else None), keep
    if zero:
        raise AgentPackageError("moorage.toml: [agent.retention] sets both ttl_s and zero_retention = true",
                                hint="zero retention keeps nothing after a turn, so a TTL has nothing to expire: keep one")
    ttl = table.get("ttl_s")
    if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or ttl <= 0:
        raise AgentPackageError(f"moorage.toml: [agent.retention] ttl_s must be a positive number of seconds, not {ttl!r}",
                                hint=hint)
    return float(ttl), False, keep


def _check_sizing(agent: dict[str, Any]) -> None:
    """memory_mib, vcpus, disk_mib and ports fail the deploy when malformed (the host's own limits are
    checked when the template is built: runtime/sizing.py)."""
    from moorage.runtime.sizing import check_manifest_sizing

    try:
        check_manifest_sizing(agent)
    except InvalidInput as e:
        raise AgentPackageError(e.message, hint=e.hint) from e


def _check_egress(agent: dict[str, Any]) -> None:
    """[agent.egress], [agent.network] and [agent.secrets] fail the deploy, not the agent's first request."""
    from moorage.egress import EgressPolicy
    from moorage.secrets import Bindings

    try:
        EgressPolicy.from_manifest(agent)
        Bindings.from_manifest(agent)
    except InvalidInput as e:
        raise AgentPackageError(f"moorage.toml: {e.message}", hint=e.hint or "fix the file and deploy again; nothing was changed") from e


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
            total += p.stat().st_size  # checked before reading, so a huge file is refused unread
            if total > MAX_PACKAGE_BYTES or len(files) >= MAX_FILES:
                raise AgentPackageError(f"the agent folder is over {MAX_PACKAGE_BYTES >> 20} MiB or {MAX_FILES} files",
                                        hint="keep data out of the agent package; the agent can fetch or create it in its sandbox")
            files[rel] = p.read_bytes()
    return files


def _archive(files: dict[str, bytes]) -> bytes:
    # Reproducible: sorted names, zero mtimes (the gzip header's too: tarfile's "w:gz" writes the time of the
    # call there, so the same folder hashed differently a second later), fixed owner: the same folder always
    # hashes the same, and a redeploy of it is the same package (``Deployments.has_package``).
    buf = io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb", compresslevel=6, mtime=0) as gz, \
            tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar:
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


def save_archive(packages: Path, pkg: AgentPackage) -> Path:
    """Store ``pkg``'s archive as ``<packages>/<sha256>.tar.gz``, private (0600 in a 0700 folder), atomically."""
    return write_private(private_dir(packages) / f"{pkg.sha256}.tar.gz", pkg.archive)


def load_archive(archive: bytes) -> AgentPackage:
    """Validate an uploaded tar.gz of an agent folder (the API's deploy body)."""
    return validate_files(unpack(archive))


#: What an archive may unpack to in all (the same bound as an agent folder); checked from the tar headers
#: before any member is read.
MAX_UNPACKED_BYTES = MAX_PACKAGE_BYTES
#: Entries of every kind (files, directories) an archive may hold; each costs a header parse and a record.
MAX_ENTRIES = 2 * MAX_FILES
#: Decompressed bytes an archive may yield in all: the files plus their headers (PAX and long-name records
#: are read whole by ``tarfile``, so they too must come out of a bounded stream).
MAX_TAR_STREAM_BYTES = MAX_UNPACKED_BYTES + MAX_ENTRIES * 4 * 512 + (1 << 20)
_READ_CHUNK = 1 << 16


class _BoundedTarStream:
    """A read-only stream of an archive's tar bytes (gunzipped if gzip) that refuses to yield more than ``limit``.

    ``tarfile`` reads header records whole, whatever size they claim; decompressing here, bounded, is
    what keeps a small gzip from becoming gigabytes in host memory.
    """

    def __init__(self, archive: bytes, limit: int) -> None:
        self._src = archive
        self._pos = 0
        self._inflate = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS) if archive[:2] == b"\x1f\x8b" else None
        self._pending = b""
        self._yielded = 0
        self._limit = limit

    def read(self, size: int = -1) -> bytes:
        if size is None or size < 0:
            size = _READ_CHUNK
        if self._inflate is None:
            out = self._src[self._pos:self._pos + size]
            self._pos += len(out)
        else:
            out = self._pending[:size]
            self._pending = self._pending[size:]
            while len(out) < size and not self._inflate.eof:
                data = self._inflate.unconsumed_tail
                if not data:
                    data = self._src[self._pos:self._pos + _READ_CHUNK]
                    self._pos += len(data)
                chunk = self._inflate.decompress(data, size - len(out))
                if not chunk and not data:
                    break  # input exhausted and nothing left inside the decompressor
                out += chunk
        self._yielded += len(out)
        if self._yielded > self._limit:
            raise AgentPackageError("the package unpacks to too much data",
                                    hint="keep data out of the agent package; the agent can fetch or create it in its sandbox")
        return out


def _member_path(m: tarfile.TarInfo) -> str:
    p = PurePosixPath(m.name)
    if not m.name or p.is_absolute() or ".." in p.parts or "\\" in m.name or "\0" in m.name or len(m.name) > 1024:
        raise AgentPackageError(f"unsafe path in package: {m.name!r}", hint="package only relative paths inside the agent folder")
    return p.as_posix()


def _read_member(tar: tarfile.TarFile, m: tarfile.TarInfo, budget: int) -> bytes:
    """A regular member's bytes, read in chunks and never more than its header said or the budget left."""
    f = tar.extractfile(m)
    if f is None:
        return b""
    out = bytearray()
    while len(out) < m.size:
        chunk = f.read(min(_READ_CHUNK, m.size - len(out)))
        if not chunk:
            raise AgentPackageError(f"package member {m.name!r} is shorter than its header says")
        out += chunk
        if len(out) > budget:
            raise AgentPackageError("the package unpacks to too much data")
    return bytes(out)


def unpack(archive: bytes) -> dict[str, bytes]:
    """The files of an archive, refusing anything that could escape the package folder or exhaust the host.

    Sizes come from each member's header and are checked before the member is read; every entry counts
    towards the entry limit; links, devices, FIFOs and sparse files are refused. Memory stays within
    ``MAX_UNPACKED_BYTES`` whatever the archive claims or compresses to.
    """
    if len(archive) > MAX_PACKAGE_BYTES:
        raise AgentPackageError(f"the package is over {MAX_PACKAGE_BYTES >> 20} MiB")
    files: dict[str, bytes] = {}
    total = entries = 0
    too_much = AgentPackageError(
        f"the package unpacks to more than {MAX_UNPACKED_BYTES >> 20} MiB or {MAX_FILES} files",
        hint="keep data out of the agent package; the agent can fetch or create it in its sandbox")
    try:
        # Stream mode: members are visited once, in order; the bytes come from the bounded stream.
        stream = _BoundedTarStream(archive, MAX_TAR_STREAM_BYTES)
        with tarfile.open(fileobj=stream, mode="r|") as tar:  # type: ignore[call-overload]
            for m in tar:
                entries += 1
                if entries > MAX_ENTRIES:
                    raise too_much
                name = _member_path(m)
                if m.isdir():
                    continue
                if not m.isreg() or m.issparse():
                    raise AgentPackageError(f"package member {m.name!r} is not a regular file or directory",
                                            hint="links, devices and FIFOs cannot be deployed; copy the file itself")
                if m.size < 0 or total + m.size > MAX_UNPACKED_BYTES or len(files) >= MAX_FILES:
                    raise too_much
                if name in files:
                    raise AgentPackageError(f"package member {name!r} appears twice", hint="pack each file once")
                files[name] = _read_member(tar, m, MAX_UNPACKED_BYTES - total)
                total += len(files[name])
    except (tarfile.TarError, EOFError, OSError, zlib.error) as e:
        raise AgentPackageError(f"not a valid tar.gz agent package: {e}") from e
    return files
