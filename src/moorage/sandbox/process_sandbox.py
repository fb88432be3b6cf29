"""A process sandbox (process.py's driver makes and opens them): the guest supervisor in bubblewrap namespaces on
the host kernel, under an unprivileged uid on a root host, in a cgroup of its own; its start, sleep (the files only),
disk quota watchdog, checkpoints (process_checkpoints.py) and rollback (in place through its zygote where it can:
process_restart.py). Its parts: the start (process_launch.py), the running guest's watch and stop
(process_running.py), the checkpoint verbs (process_checkpointing.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, AsyncIterator

from moorage.log import get_logger
from moorage.sandbox import process_net, process_templates
from moorage.sandbox import process_limits as limits
from moorage.sandbox.base import Sandbox, SandboxSpec, SandboxState, SandboxStateError, SandboxStats, SnapshotInfo
from moorage.sandbox.channel import Channel
from moorage.sandbox.process_checkpointing import Checkpointing
from moorage.sandbox.process_fs import disk_usage, proc_starttime, write_json_durable
from moorage.sandbox.process_launch import (
    ETC_ALLOWLIST,
    GUEST_MOUNT,
    GUEST_UID,
    META_VERSION,
    SOCKET_NAME,
    STAGE,
    SUPERVISOR_PYTHON,
    Launching,
)
from moorage.sandbox.process_running import RunningGuest

if TYPE_CHECKING:
    from moorage.sandbox.process import ProcessDriver

#: The layout's names live in process_launch; named here for process.py.
__all__ = ["ETC_ALLOWLIST", "GUEST_MOUNT", "GUEST_UID", "META_VERSION", "SOCKET_NAME", "STAGE", "SUPERVISOR_PYTHON",
           "ProcessSandbox"]

log = get_logger(__name__)


class ProcessSandbox(Checkpointing, RunningGuest, Launching, Sandbox):
    def __init__(self, driver: "ProcessDriver", sandbox_id: str, meta: dict[str, Any]) -> None:
        self.driver = driver
        self.id = sandbox_id
        self.dir = driver.root / sandbox_id
        #: The data directory's sandboxes this one's processes are started under (recorded with their pid).
        self._root_key = str(Path(driver.root).resolve())
        self.meta = meta
        self.spec = SandboxSpec.from_json(meta.get("spec", {}))
        self._state = SandboxState(meta["state"])
        self._channel: Channel | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._pid: int | None = meta.get("pid")
        self._lock = asyncio.Lock()
        self._watchdog: asyncio.Task[None] | None = None
        #: The host's end of the zygote's control socket (process_restart), while the sandbox runs.
        self._zygote: Any = None
        #: A network agent's DNS address in the sandbox's namespace, bound by the host (process_net), while it runs.
        self._dns: process_net.SandboxDNS | None = None
        #: The thread copying the sandbox's output into supervisor.log (capped_log), since its last start.
        self._log_reader: threading.Thread | None = None
        self.cgroup = limits.SandboxCgroup(driver.limit_support, f"{driver.instance_tag}-{sandbox_id}")
        #: Set when the disk quota watchdog killed the sandbox's processes (cleared on the next start).
        self.quota_exceeded = False

    # --- paths -----------------------------------------------------------------------------------------------

    @property
    def layer(self) -> Path:
        return self.dir / "layer"

    @property
    def socket_path(self) -> Path:
        return self.dir / "run" / SOCKET_NAME

    def sources(self) -> dict[str, Path]:
        """The host directories bound into the sandbox, by name (a root host's launcher binds each under ``STAGE``
        by that name): its layer, run and etc directories, the guest package, then ``shared<i>``, the template's
        shared directories in the order of ``shared_targets``."""
        out = {"layer": self.layer, "run": self.dir / "run", "etc": self.dir / "etc", "guest": self.driver._guest_dir}
        for i, (host, _) in enumerate(process_templates.binds(self.meta, self.driver.template_dir)):
            out[f"shared{i}"] = host
        return out

    def shared_targets(self) -> list[tuple[str, str]]:
        """(source name, sandbox path) of each shared directory, bound read-only over the layer's mount point."""
        paths = (self.meta.get("shared") or {}).get("paths") or []
        return [(f"shared{i}", process_templates.sandbox_path(rel)) for i, rel in enumerate(paths)]

    # --- state -----------------------------------------------------------------------------------------------

    @property
    def state(self) -> SandboxState:
        if self._state is SandboxState.RUNNING and not self._alive():
            # The supervisor died under us (OOM, crash, killed): the layer is intact, memory is gone.
            self._state = SandboxState.STOPPED
        return self._state

    @property
    def channel(self) -> Channel:
        if self.state is not SandboxState.RUNNING or self._channel is None or self._channel.closed:
            raise SandboxStateError(
                f"sandbox {self.id} is {self.state.value}, not running",
                hint="call wake() (sleeping/stopped) or start() (created) first",
            )
        return self._channel

    def _alive(self) -> bool:
        if self._proc is not None:
            return self._proc.poll() is None
        if self._pid is None:
            return False
        if self.meta.get("started_under", self._root_key) != self._root_key:
            # Started by a host on another data directory, of which this is a copy (docs/operations.md): that
            # process is the original's sandbox, never this one, even while it runs.
            return False
        # A pid with no such process is not alive, also where the record no longer names its start time (a sleep
        # clears it): None == None read a gone supervisor as alive, and every destroy after a sleep waited the
        # whole stop timeout (5 s per forgotten user).
        started = proc_starttime(self._pid)
        return started is not None and started == self.meta.get("pid_starttime")

    def _save(self, **changes: Any) -> None:
        self.meta.update(changes)
        self.meta["state"] = self._state.value
        write_json_durable(self.dir / "meta.json", self.meta)

    def _require(self, *allowed: SandboxState, verb: str) -> None:
        st = self.state
        if st not in allowed:
            hints = {
                SandboxState.CREATED: "call start() first",
                SandboxState.SLEEPING: "call wake() first",
                SandboxState.STOPPED: "call wake() or start() first",
                SandboxState.RUNNING: "call sleep() or stop() first",
                SandboxState.DESTROYED: "create a new sandbox",
            }
            raise SandboxStateError(f"cannot {verb} sandbox {self.id}: it is {st.value}", hint=hints.get(st))

    # --- lifecycle -------------------------------------------------------------------------------------------

    async def start(self) -> None:
        async with self._lock:
            self._require(SandboxState.CREATED, SandboxState.STOPPED, SandboxState.SLEEPING, verb="start")
            await self._boot()

    async def wake(self) -> None:
        async with self._lock:
            self._require(SandboxState.SLEEPING, SandboxState.STOPPED, verb="wake")
            await self._boot()

    @contextlib.asynccontextmanager
    async def frozen(self) -> AsyncIterator[None]:
        """SIGSTOP the whole sandbox tree (its wrapper started a session: one process group) for the block."""
        async with self._lock:
            self._require(SandboxState.RUNNING, verb="freeze")
            os.killpg(self._pid, signal.SIGSTOP)
            try:
                yield
            finally:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self._pid, signal.SIGCONT)

    async def sleep(self) -> SnapshotInfo:
        async with self._lock:
            # A stopped sandbox (its supervisor exited or was killed, or the host stopped it) sleeps as it is: it
            # has no memory to keep, and its layer is what a sleep keeps.
            self._require(SandboxState.RUNNING, SandboxState.STOPPED, verb="sleep")
            await self._shutdown()
            self._state = SandboxState.SLEEPING
            self._save(pid=None, pid_starttime=None, slept_at=time.time())
            used = disk_usage(self.layer)
            log.info("sandbox slept", sandbox=self.id, disk_bytes=used)
            return SnapshotInfo(self.id, self.layer, used, time.time(), includes_memory=False)

    async def stop(self) -> None:
        async with self._lock:
            if self.state is SandboxState.DESTROYED:
                raise SandboxStateError(f"sandbox {self.id} is destroyed")
            await self._shutdown()
            if self._state is not SandboxState.CREATED:
                self._state = SandboxState.STOPPED
            self._save(pid=None, pid_starttime=None)

    async def destroy(self) -> None:
        async with self._lock:
            await self._kill()
            self._state = SandboxState.DESTROYED
            shutil.rmtree(self.dir, ignore_errors=True)
            self.driver._open.pop(self.id, None)
            shared = self.meta.get("shared")
            if shared:  # a deleted template it bound goes with its last fork
                process_templates.drop_child(process_templates.template_of(self.meta, self.driver.template_dir), self.id)
            log.info("sandbox destroyed", sandbox=self.id)

    async def stats(self) -> SandboxStats:
        st = self.state
        rss = 0
        if st is SandboxState.RUNNING and self._pid is not None:
            mem = self.cgroup.memory_bytes()
            rss = mem if mem is not None else limits.rss_bytes([self._pid, *limits.descendants(self._pid)])
        ck = self.dir / "checkpoints"
        return SandboxStats(
            state=st,
            host_rss_bytes=rss,
            disk_bytes=disk_usage(self.layer) if self.layer.exists() else 0,
            snapshot_bytes=0,  # the layer is the snapshot: no memory image exists
            checkpoint_bytes=disk_usage(ck) if ck.exists() else 0,
            pid=self._pid if st is SandboxState.RUNNING else None,
        )
