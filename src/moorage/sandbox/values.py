"""The sandbox interface's value types: a sandbox's states, a driver's capabilities, what to create (specs, template
refs, ids), the results of its verbs (exec, files, snapshots, checkpoints, stats) and the guest operations' limits."""

from __future__ import annotations

import enum
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable, Mapping


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
