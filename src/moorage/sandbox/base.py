"""The sandbox driver interface: states, specs, results, typed errors and the two ABCs.

Every driver (``microvm``, ``process``) implements ``SandboxDriver`` and ``Sandbox``; guest operations
(exec, files) are implemented once in guest_ops.py on top of the channel because every driver runs the same guest.
The errors are in errors.py and the value types in values.py; this module still names them all.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Mapping, Sequence

from moorage.sandbox.errors import (
    ChannelClosed,
    ChannelError,
    ChannelTimeout,
    GuestFileNotFound,
    GuestFileTooLarge,
    GuestProtocolError,
    RemoteError,
    SandboxError,
    SandboxNotFound,
    SandboxStateError,
    SnapshotCorrupt,
    SnapshotIncompatible,
)
from moorage.sandbox.guest_ops import GuestOperations
from moorage.sandbox.values import (
    _EXEC_GRACE_S,
    EXEC_CAPTURE_BYTES,
    FILE_CHUNK_BYTES,
    READ_FILE_MAX_BYTES,
    Capabilities,
    CheckpointInfo,
    ExecResult,
    FileInfo,
    OutputCallback,
    SandboxSpec,
    SandboxState,
    SandboxStats,
    SnapshotInfo,
    TemplateRef,
    validate_id,
)

if TYPE_CHECKING:  # channel.py imports the errors below; avoid the import cycle at runtime
    from moorage.config import Config
    from moorage.sandbox.channel import Channel


# ---------------------------------------------------------------------------------------------------------------
# Interfaces


class Sandbox(GuestOperations, ABC):
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
        """Stop using compute. Durable on return: a host crash right after still wakes to this state.

        Allowed from RUNNING and from STOPPED (a sandbox whose guest exited, was killed, or that the host stopped):
        a stopped sandbox has no memory left to keep, so it sleeps as its disk alone and its next ``wake`` is a
        cold boot from that disk. Any other state raises ``SandboxStateError``."""

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
                            shared: Sequence[str] = (), standalone: bool = False) -> TemplateRef:
        """Snapshot a booted, warmed sandbox so it can be forked. The sandbox keeps its state. ``shared``: paths
        under /work that forks never write (an agent's deploy-time packages): a driver whose forks copy files may
        let every fork read the template's own instead. ``standalone``: the template needs nothing of the template
        ``sandbox`` was itself forked from (which may then be deleted; a fleet can publish it), where a driver
        would otherwise chain onto it."""

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

    def guest_code_behind(self, sandbox: Sandbox) -> bool:
        """Whether the running ``sandbox``'s guest code is an older moorage's that ``update_guest_code`` can replace
        (a driver whose sandboxes start from the host's guest code each time never has one)."""
        return False

    async def update_guest_code(self, sandbox: Sandbox) -> bool:
        """Put this host's guest code in place of the running ``sandbox``'s older one and restart its processes onto
        it (files kept); returns False, having changed nothing, where it cannot."""
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

    async def boot_key(self, spec: SandboxSpec) -> str | None:
        """A digest of everything a sandbox created from ``spec`` on this host boots with (its image, its machine,
        its kernel's command line), where a fork of a template made right after such a boot can stand in for the
        boot itself and is much faster (a micro-VM's kernel boot against a wake from its snapshot): equal keys,
        interchangeable boots. None where a start costs about what a fork does (nothing to gain)."""
        return None

    def cool_template(self, template: TemplateRef) -> None:
        """Let go of what this process holds in memory to fork ``template`` quickly (``warm_template``'s, or what its
        last fork made), for a template forked rarely; its next fork makes it again. Blocking."""

    def warm_template(self, template: TemplateRef) -> bool:
        """Make ahead what the first fork of ``template`` in this process would make itself (a fleet host that
        fetched the template ahead of any wake: ``fleet/prefetch.py``), where the host can spare it. Blocking.
        Returns whether anything was made; drivers with nothing to make ahead return False."""
        return False

    def adopt_fetched(self, sandbox_id: str) -> None:
        """Make a sleeping sandbox's directory, just fetched from the fleet's object store, refer to this host's
        files (its template, image, disk backing) instead of those of the host that shipped it. Blocking. Drivers
        whose sandbox directories are self-contained need nothing."""


__all__ = [
    "ChannelClosed", "ChannelError", "ChannelTimeout", "GuestFileNotFound", "GuestFileTooLarge", "GuestProtocolError",
    "RemoteError", "SandboxError", "SandboxNotFound", "SandboxStateError", "SnapshotCorrupt", "SnapshotIncompatible",
    "_EXEC_GRACE_S", "EXEC_CAPTURE_BYTES", "FILE_CHUNK_BYTES", "READ_FILE_MAX_BYTES", "Capabilities", "CheckpointInfo",
    "ExecResult", "FileInfo", "OutputCallback", "SandboxSpec", "SandboxState", "SandboxStats", "SnapshotInfo",
    "TemplateRef", "validate_id", "Sandbox", "SandboxDriver", "GuestOperations",
]
