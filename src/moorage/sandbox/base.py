"""The sandbox driver interface: states, specs, results, typed errors and the two ABCs.

Every driver (``microvm``, ``process``) implements ``SandboxDriver`` and ``Sandbox``; guest operations
(exec, files) are implemented once here on top of the channel because every driver runs the same guest.
"""

from __future__ import annotations

import base64
import contextlib
import enum
import inspect
import re
import time
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Awaitable, Callable, ClassVar, Mapping, Sequence

from moorage.errors import MoorageError, NotFound

if TYPE_CHECKING:  # channel.py imports the errors below; avoid the import cycle at runtime
    from moorage.config import Config
    from moorage.sandbox.channel import Channel


# ---------------------------------------------------------------------------------------------------------------
# Errors


class SandboxError(MoorageError):
    """Something went wrong operating a sandbox (the host is fine; the sandbox may need a restart)."""

    code = "sandbox"
    http_status = 500


class SandboxNotFound(SandboxError, NotFound):
    code = "sandbox-not-found"
    http_status = 404


class SandboxStateError(SandboxError):
    """The verb is not allowed in the sandbox's current state; the hint says which verb to call first."""

    code = "sandbox-state"
    http_status = 409


class SnapshotIncompatible(SandboxError):
    """A snapshot was taken by another driver, binary or device layout and cannot be restored here."""

    code = "snapshot-incompatible"
    http_status = 409


class SnapshotCorrupt(SandboxError):
    """A snapshot is missing files or fails its integrity check."""

    code = "snapshot-corrupt"
    http_status = 500


class ChannelError(SandboxError):
    """The host<->guest channel failed (I/O error, timeout, or an error answer from the peer)."""

    code = "sandbox-channel"
    http_status = 502


class ChannelClosed(ChannelError):
    """The channel is closed: the guest exited, the sandbox slept, or the connection dropped."""

    code = "sandbox-channel-closed"


class ChannelTimeout(ChannelError):
    code = "sandbox-channel-timeout"
    http_status = 504


class GuestProtocolError(ChannelError):
    """The guest sent a malformed frame. It is logged and rejected; the host keeps running."""

    code = "sandbox-guest-protocol"


class RemoteError(ChannelError):
    """The peer answered a call with an error object (``code``, ``message``, optional ``data``)."""

    code = "sandbox-remote"

    def __init__(self, message: str, *, rpc_code: int, data: Any = None, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.rpc_code = rpc_code
        self.data = data


class GuestFileTooLarge(SandboxError):
    """``read_file`` stopped at its byte cap: the file is larger, or the guest never said end-of-file."""

    code = "sandbox-file-too-large"
    http_status = 413


class GuestFileNotFound(SandboxError, NotFound):
    """A path asked for through ``read_file``/``list_files`` does not exist inside the sandbox."""

    code = "sandbox-file-not-found"
    http_status = 404


# ---------------------------------------------------------------------------------------------------------------
# Value types


class SandboxState(str, enum.Enum):
    CREATED = "created"  # on disk, never started
    RUNNING = "running"  # guest supervisor up, channel connected
    SLEEPING = "sleeping"  # durable snapshot on disk, no compute
    STOPPED = "stopped"  # no compute, no memory snapshot (crash, host restart, explicit stop)
    DESTROYED = "destroyed"  # nothing left on disk


@dataclass(frozen=True)
class Capabilities:
    """What a driver guarantees, so callers and the conformance suite can gate behaviour on it."""

    keeps_processes_across_sleep: bool
    memory_snapshot: bool
    cow_fork: bool
    network_isolated: bool
    own_kernel: bool = False
    #: Resource limits actually enforced, e.g. {"processes", "memory", "file_size", "disk"}.
    enforced_limits: frozenset[str] = frozenset()
    #: Whether a running sandbox outlives the host process that started it (a micro-VM's QEMU does; a
    #: process sandbox is killed with it), so a host that shuts down cleanly knows to put them to sleep.
    survives_host_exit: bool = True
    #: Whether forks bind their template's shared directories (``make_template(shared=...)``) rather than own a copy
    #: of them (``bind_shared`` moves a fork to another template's).
    shares_template_dirs: bool = False


_ID_RE = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,62}$")


def validate_id(value: str, what: str = "sandbox id") -> str:
    """Ids become directory names; accept only a safe subset so no id can escape the root directory."""
    if not isinstance(value, str) or not _ID_RE.fullmatch(value) or ".." in value:
        from moorage.errors import InvalidInput

        raise InvalidInput(
            f"invalid {what} {value!r}",
            hint="use 1-63 characters from a-z, 0-9, '_', '.', '-', starting with a letter or digit",
        )
    return value


@dataclass(frozen=True)
class SandboxSpec:
    """What to create. Drivers enforce the limits they declare in ``Capabilities.enforced_limits``."""

    image: str = "default"
    memory_mib: int = 256
    vcpus: int = 1
    disk_mib: int = 1024
    max_processes: int = 256
    #: Largest single file a process may write (RLIMIT_FSIZE).
    max_file_mib: int = 512
    #: Extra environment for every process in the guest (the host's own environment never leaks in).
    env: Mapping[str, str] = field(default_factory=dict)
    labels: Mapping[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["env"] = dict(self.env)
        d["labels"] = dict(self.labels)
        return d

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "SandboxSpec":
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in d.items() if k in known})


@dataclass(frozen=True)
class TemplateRef:
    """A prepared snapshot that new sandboxes are created or forked from."""

    id: str
    driver: str
    path: Path
    source_sandbox: str | None = None
    created_at: float = 0.0
    includes_memory: bool = False


@dataclass(frozen=True)
class ExecResult:
    exit_code: int
    stdout: bytes
    stderr: bytes
    timed_out: bool = False
    #: True when output beyond the capture limit was dropped (it was still streamed to ``on_output``).
    truncated: bool = False
    duration_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out

    @property
    def stdout_text(self) -> str:
        return self.stdout.decode("utf-8", "replace")

    @property
    def stderr_text(self) -> str:
        return self.stderr.decode("utf-8", "replace")


@dataclass(frozen=True)
class FileInfo:
    name: str
    path: str
    type: str  # "file" | "dir" | "symlink" | "other"
    size: int
    mode: int
    mtime: float


@dataclass(frozen=True)
class SnapshotInfo:
    sandbox_id: str
    path: Path
    bytes: int
    created_at: float
    includes_memory: bool


@dataclass(frozen=True)
class CheckpointInfo:
    name: str
    sandbox_id: str
    path: Path
    bytes: int
    created_at: float
    includes_memory: bool


@dataclass(frozen=True)
class SandboxStats:
    state: SandboxState
    host_rss_bytes: int
    disk_bytes: int
    snapshot_bytes: int
    checkpoint_bytes: int = 0
    pid: int | None = None


#: Callback for streamed exec output: ``(stream, chunk)`` with stream "stdout" or "stderr".
OutputCallback = Callable[[str, bytes], "Awaitable[None] | None"]

#: Raw bytes per fs.read / fs.write frame; base64 makes it 4/3 larger, well under the frame limit.
FILE_CHUNK_BYTES = 1 << 20
#: Most bytes ``read_file`` returns by default; a guest that never says end-of-file is cut off here.
READ_FILE_MAX_BYTES = 64 << 20
#: Output kept in ExecResult per stream; the rest is only streamed to ``on_output``.
EXEC_CAPTURE_BYTES = 16 << 20
#: Extra seconds the host waits beyond an exec timeout for the guest's own kill to be reported.
_EXEC_GRACE_S = 10.0


# ---------------------------------------------------------------------------------------------------------------
# Interfaces


class Sandbox(ABC):
    """One sandbox. Lifecycle verbs are driver-specific; guest operations go through ``channel``."""

    id: str

    @property
    @abstractmethod
    def state(self) -> SandboxState: ...

    @property
    @abstractmethod
    def channel(self) -> "Channel":
        """The connected host side of the channel. Raises ``SandboxStateError`` unless running."""

    @abstractmethod
    async def start(self) -> None:
        """Boot a created or stopped sandbox (cold start)."""

    @abstractmethod
    async def sleep(self) -> SnapshotInfo:
        """Stop using compute. Durable on return: a host crash right after still wakes to this state."""

    @abstractmethod
    async def wake(self) -> None:
        """Resume a sleeping (or stopped) sandbox; returns once the guest answers on the channel."""

    @abstractmethod
    async def stop(self) -> None:
        """Shut down without a memory snapshot; the disk is kept."""

    @abstractmethod
    async def checkpoint(self, name: str, *, durable: bool = True) -> CheckpointInfo:
        """The sandbox's state now (files, and memory where the driver has it), kept under ``name`` while the
        sandbox runs on. ``durable=False``: return once that state is captured and the guest runs again, its files
        written behind; every other verb of the sandbox (``checkpoints()`` included) waits for them, and a host
        that dies before they are written has no such checkpoint (a driver may always write them first)."""

    @abstractmethod
    async def rollback(self, name: str) -> None: ...

    @abstractmethod
    async def checkpoints(self) -> list[CheckpointInfo]: ...

    def frozen(self) -> "contextlib.AbstractAsyncContextManager[None]":
        """While the block runs, nothing in the sandbox runs, so its directory is one point in time (a fleet ships
        an awake instance's copy inside it). A driver that cannot freeze a running sandbox says so."""
        raise SandboxError(f"the {type(self).__name__} driver cannot freeze a running sandbox",
                           hint="its state is shipped when it sleeps")

    async def delete_checkpoint(self, name: str) -> None:
        """Remove one checkpoint (retention). A driver that cannot says so; its checkpoints stay until destroy."""
        raise SandboxError(f"the {type(self).__name__} driver cannot delete a checkpoint",
                           hint="checkpoints go with the sandbox when it is destroyed")

    @abstractmethod
    async def destroy(self) -> None:
        """Stop everything and remove every byte this sandbox has on disk."""

    @abstractmethod
    async def stats(self) -> SandboxStats: ...

    # --- guest operations, identical for every driver -------------------------------------------------------

    async def ping(self, timeout: float = 10.0) -> dict[str, Any]:
        return await self.channel.call("ping", {}, timeout=timeout)

    async def exec(
        self,
        argv: Sequence[str],
        *,
        timeout: float = 60.0,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        stdin: bytes | None = None,
        on_output: OutputCallback | None = None,
    ) -> ExecResult:
        """Run ``argv`` in the guest. A timeout kills the process group and sets ``timed_out``; never raises for it."""
        if not argv or not all(isinstance(a, str) for a in argv):
            from moorage.errors import InvalidInput

            raise InvalidInput("exec needs a non-empty list of string arguments")
        params: dict[str, Any] = {"argv": list(argv), "timeout": timeout}
        if cwd is not None:
            params["cwd"] = cwd
        if env:
            params["env"] = dict(env)
        if stdin is not None:
            params["stdin"] = base64.b64encode(stdin).decode()
        out = {"stdout": bytearray(), "stderr": bytearray()}
        truncated = False
        started = time.monotonic()
        stream = self.channel.stream("exec", params, timeout=timeout + _EXEC_GRACE_S)
        try:
            async for ev in stream:
                if ev.event not in out:
                    continue
                chunk = base64.b64decode(ev.data)
                buf = out[ev.event]
                room = EXEC_CAPTURE_BYTES - len(buf)
                if len(chunk) > room:
                    truncated = True
                buf += chunk[: max(room, 0)]
                if on_output is not None:
                    r = on_output(ev.event, chunk)
                    if inspect.isawaitable(r):
                        await r
        except ChannelTimeout:
            # The guest did not report its own kill in time; the stream already sent $cancel.
            return ExecResult(-1, bytes(out["stdout"]), bytes(out["stderr"]), True, truncated, time.monotonic() - started)
        except RemoteError as e:
            from moorage.errors import InvalidInput
            from moorage.sandbox.channel import INVALID_PARAMS

            if e.rpc_code == INVALID_PARAMS:  # what the caller asked for cannot run (a cwd that is no directory)
                raise InvalidInput(str(e), hint="a relative cwd is taken in the sandbox's working directory") from None
            raise
        res = stream.result or {}
        return ExecResult(
            exit_code=int(res.get("exit_code", -1)),
            stdout=bytes(out["stdout"]),
            stderr=bytes(out["stderr"]),
            timed_out=bool(res.get("timed_out", False)),
            truncated=truncated or bool(res.get("truncated", False)),
            duration_s=time.monotonic() - started,
        )

    async def _fs(self, method: str, params: dict[str, Any]) -> Any:
        try:
            return await self.channel.call(method, params, timeout=60)
        except RemoteError as e:
            if isinstance(e.data, dict) and e.data.get("type") in ("FileNotFoundError", "NotADirectoryError"):
                raise GuestFileNotFound(f"{params.get('path')}: no such file in sandbox {self.id}") from e
            raise

    async def read_file(self, path: str, *, max_bytes: int = READ_FILE_MAX_BYTES) -> bytes:
        """The whole file, up to ``max_bytes``: the guest decides when a file ends, so the host bounds it."""
        data = bytearray()
        while True:
            want = min(FILE_CHUNK_BYTES, max_bytes + 1 - len(data))
            r = await self._fs("fs.read", {"path": path, "offset": len(data), "length": want})
            if not isinstance(r, dict) or not isinstance(r.get("data"), str) or len(r["data"]) > (want + 2) // 3 * 4:
                raise GuestProtocolError(f"sandbox {self.id} answered fs.read of {path} with more than it was asked for",
                                         hint="the guest may be compromised; destroy it or roll it back")
            try:
                chunk = base64.b64decode(r["data"], validate=True)
            except ValueError as e:
                raise GuestProtocolError(f"sandbox {self.id} sent invalid base64 for {path}: {e}") from e
            data += chunk
            if len(data) > max_bytes:
                raise GuestFileTooLarge(
                    f"{path} in sandbox {self.id} is larger than {max_bytes} bytes (or never ends)",
                    hint="read it in parts with exec (e.g. head -c) or raise max_bytes",
                )
            if r.get("eof") or not chunk:
                return bytes(data)

    async def write_file(self, path: str, data: bytes, mode: int = 0o644) -> None:
        """Write atomically: chunks go to a temporary file that is renamed over ``path`` at the end."""
        if len(data) <= FILE_CHUNK_BYTES:
            await self.channel.call(
                "fs.write", {"path": path, "data": base64.b64encode(data).decode(), "mode": mode, "atomic": True}, timeout=60
            )
            return
        part = f"{path}.moorage-part"
        for off in range(0, len(data), FILE_CHUNK_BYTES):
            chunk = data[off : off + FILE_CHUNK_BYTES]
            await self.channel.call(
                "fs.write",
                {"path": part, "data": base64.b64encode(chunk).decode(), "mode": mode, "append": off > 0},
                timeout=60,
            )
        await self.channel.call("fs.rename", {"src": part, "dst": path}, timeout=60)

    async def list_files(self, path: str) -> list[FileInfo]:
        r = await self._fs("fs.list", {"path": path})
        return [FileInfo(**e) for e in r["entries"]]

    async def remove(self, path: str, *, recursive: bool = False) -> None:
        """Delete a file (or a directory tree with ``recursive``), done by the supervisor, not a guest process."""
        await self._fs("fs.remove", {"path": path, "recursive": recursive})

    async def stat(self, path: str) -> FileInfo | None:
        r = await self.channel.call("fs.stat", {"path": path}, timeout=60)
        return FileInfo(**r["info"]) if r.get("info") else None


class SandboxDriver(ABC):
    """Creates and re-adopts sandboxes under ``root`` (one subdirectory per sandbox id)."""

    name: ClassVar[str]
    capabilities: Capabilities

    def __init__(self, root: Path, config: "Config") -> None:
        self.root = Path(root)
        self.config = config

    @abstractmethod
    async def create(self, sandbox_id: str, spec: SandboxSpec | None = None, template: TemplateRef | None = None) -> Sandbox:
        """Create (not start) a sandbox from the spec's image, or from ``template`` when given."""

    @abstractmethod
    async def open(self, sandbox_id: str) -> Sandbox:
        """Re-adopt from on-disk metadata: a live guest is re-attached, otherwise it is sleeping/stopped."""

    @abstractmethod
    async def fork(self, template: TemplateRef, ids: Sequence[str]) -> list[Sandbox]:
        """Create ``len(ids)`` independent copy-on-write children of ``template`` (not started)."""

    @abstractmethod
    async def make_template(self, sandbox: Sandbox, template_id: str | None = None, *,
                            shared: Sequence[str] = ()) -> TemplateRef:
        """Snapshot a booted, warmed sandbox so it can be forked. The sandbox keeps its state. ``shared``: paths
        under /work that forks never write (an agent's deploy-time packages): a driver whose forks copy files may
        let every fork read the template's own instead."""

    @abstractmethod
    def boot_env(self, sandbox: Sandbox) -> dict[str, str]:
        """The environment the sandbox's processes get at its next start (its spec's: the template's, for a fork)."""

    @abstractmethod
    async def set_boot_env(self, sandbox: Sandbox, env: Mapping[str, str]) -> None:
        """From its next start, the stopped ``sandbox``'s processes get ``env`` instead (a redeploy's instance
        follows the new deployment: its network, its packages' path). Raises ``InvalidInput`` for an environment
        the driver cannot pass."""

    async def restart_in_place(self, sandbox: Sandbox, env: Mapping[str, str] | None = None) -> bool:
        """Restart the running ``sandbox``'s processes without restarting the sandbox: all of them end, its guest
        supervisor starts afresh (with ``env`` as its environment from now on, as ``set_boot_env`` would give it
        from the next start, when given) and ``sandbox.channel`` is a new one. Returns False, having changed nothing,
        when this driver (or this change) cannot: the caller then stops and starts the sandbox."""
        return False

    async def bind_shared(self, sandbox: Sandbox, template: TemplateRef) -> list[str]:
        """From its next start, the stopped ``sandbox`` binds ``template``'s shared directories (``make_template``)
        in place of those it binds now (a redeploy's instance takes the new deployment's packages); returns their
        sandbox paths. A driver whose forks own all their files shares nothing and returns [] (the caller puts
        new files into the sandbox itself)."""
        return []

    @abstractmethod
    async def delete_template(self, template: TemplateRef) -> None: ...

    @abstractmethod
    async def list(self) -> list[str]:
        """Ids of the sandboxes on disk under ``root``."""

    async def close(self) -> None:
        """Detach from every open sandbox (channels closed). Does not sleep or stop them."""

    def forget_handle(self, sandbox_id: str) -> None:
        """Drop the cached handle of a sleeping sandbox whose directory was replaced (fetched from the fleet's
        object store), so the next ``open`` reads it again."""
        cache = getattr(self, "_open", None)
        if isinstance(cache, dict):
            cache.pop(sandbox_id, None)

    def warm_template(self, template: TemplateRef) -> bool:
        """Make ahead what the first fork of ``template`` in this process would make itself (a fleet host that
        fetched the template ahead of any wake: ``fleet/prefetch.py``), where the host can spare it. Blocking.
        Returns whether anything was made; drivers with nothing to make ahead return False."""
        return False

    def adopt_fetched(self, sandbox_id: str) -> None:
        """Make a sleeping sandbox's directory, just fetched from the fleet's object store, refer to this host's
        files (its template, image, disk backing) instead of those of the host that shipped it. Blocking. Drivers
        whose sandbox directories are self-contained need nothing."""

