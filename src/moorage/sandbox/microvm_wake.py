"""A micro-VM sandbox's wake from a snapshot (a part of ``MicroVMSandbox``): validate it while QEMU starts, load
RAM and device state, the first reply that sets the guest's clock; and a sleeping sandbox prepared (paused) ahead."""

from __future__ import annotations

import asyncio
import base64
import os
import secrets
import time
from pathlib import Path
from typing import Any

from moorage.log import get_logger
from moorage.sandbox import microvm_ram as ram
from moorage.sandbox import microvm_snapshots as snapshots
from moorage.sandbox.base import (
    RemoteError,
    SandboxError,
    SandboxState,
    SandboxStateError,
    SnapshotCorrupt,
    SnapshotIncompatible,
)
from moorage.sandbox.microvm_process import WAKE_TIMEOUT_S, BootError
from moorage.sandbox.qmp import QMPError

log = get_logger("moorage.sandbox.microvm_sandbox")


class Waking:
    """``MicroVMSandbox``'s wake from a snapshot and its prepared wakes (it holds the state they use: the QEMU
    process and QMP client, the lock, the directory and meta)."""

    def _validate_snapshot(self, snap_dir: Path, record: dict[str, Any] | None) -> dict[str, Any]:
        return snapshots.validate(self.id, self.dir, snap_dir, record, self._vm_config().layout_id())

    @property
    def prepared(self) -> bool:
        return self._prepared and self._proc is not None and self._proc.poll() is None

    async def prepare(self) -> bool:
        """Start QEMU for this sleeping sandbox and load its snapshot with the guest held paused, so the next
        ``wake`` only resumes it (no process start, no state to load). Costs a QEMU process (its RSS) while
        prepared, no guest CPU. Returns False when there is nothing to prepare or the snapshot is unusable (the
        wake then takes its usual path, cold-boot fallback included)."""
        async with self._lock:
            if self.state is not SandboxState.SLEEPING or self.prepared or not self._meta.get("snapshot"):
                return False
            snap_dir = self.dir / "snapshot"
            ph = snapshots.Phases()
            launch = asyncio.create_task(self._launch(incoming=True, paused=True))
            try:
                record = await asyncio.to_thread(self._validate_snapshot, snap_dir, self._meta.get("snapshot"))
                ph.mark("validate")
            except BaseException as e:
                await asyncio.gather(launch, return_exceptions=True)
                await self._teardown()
                if isinstance(e, (SnapshotCorrupt, SnapshotIncompatible)):
                    return False
                raise
            try:
                await self._restore(snap_dir, record, launch, ph, paused=True)
            except (SnapshotCorrupt, SnapshotIncompatible):
                return False
            self._prepared = True
            self._save_meta()  # its pid: a host that restarts kills this QEMU instead of leaving it behind
            log.info("prepared", sandbox=self.id, kind=record["kind"], ms=ph.total(), **ph.ms)
            return True

    async def unprepare(self) -> None:
        """Stop the paused QEMU of a prepared sandbox; it stays asleep on disk, its snapshot untouched."""
        async with self._lock:
            if self._prepared and self.state is SandboxState.SLEEPING:
                await self._teardown()
                self._save_meta()

    async def _wake_locked(self) -> None:
        if self.state is SandboxState.RUNNING:
            return
        if self.state is SandboxState.DESTROYED:
            raise SandboxStateError(f"sandbox {self.id} is destroyed")
        self.last_wake_fallback = None
        if self._prepared:
            self._prepared = False
            if await self._resume_prepared():
                return
        from_disk = self.state in (SandboxState.CREATED, SandboxState.STOPPED) or \
            (self.state is SandboxState.SLEEPING and self._meta.get("slept_stopped"))  # asleep as its disk
        if from_disk and not self._meta.get("snapshot"):
            await self._cold_boot()
            return
        snap_dir = self.dir / "snapshot"
        ph = snapshots.Phases()
        try:
            # QEMU starts while the snapshot's checksums are verified (both take tens of ms).
            launch = asyncio.create_task(self._launch(incoming=True))
            try:
                record = await asyncio.to_thread(self._validate_snapshot, snap_dir, self._meta.get("snapshot"))
                ph.mark("validate")
            except BaseException:
                try:
                    await launch
                except BaseException:
                    pass
                await self._teardown()
                raise
            await self._restore(snap_dir, record, launch, ph)
        except (SnapshotCorrupt, SnapshotIncompatible) as e:
            log.warning("snapshot unusable, cold boot from disk", sandbox=self.id, error=str(e))
            self.last_wake_fallback = e
            await self._cold_boot()

    async def _resume_prepared(self) -> bool:
        """Wake a prepared sandbox: resume its paused guest. False (QEMU torn down) if that QEMU is gone."""
        ph = snapshots.Phases()
        if self._qmp is None or self._proc is None or self._proc.poll() is not None:
            await self._teardown()
            return False
        try:
            await self._qmp.execute("cont")
            await self._qmp.next_event("RESUME", timeout=WAKE_TIMEOUT_S)
        except QMPError as e:
            log.warning("prepared QEMU did not resume; waking the usual way", sandbox=self.id, error=str(e))
            await self._teardown()
            return False
        ph.mark("resume")
        await self._run_restored(ph, bool(self._meta.get("fresh_fork")), str(self._meta["snapshot"]["kind"]))
        return True

    async def _restore(self, snap_dir: Path, record: dict[str, Any], launch: "asyncio.Task[None]", ph: snapshots.Phases,
                       *, paused: bool = False) -> None:
        fresh_fork = bool(self._meta.get("fresh_fork"))
        try:
            if record["kind"] == "delta":
                # The delta goes into QEMU's private RAM mapping as soon as it exists, while QEMU finishes starting.
                results = await asyncio.gather(launch, self._apply_delta_when_mapped(snap_dir), return_exceptions=True)
                for r in results:
                    if isinstance(r, BaseException):
                        raise r
            else:
                await launch
            ph.mark("qemu_start_and_ram")
            assert self._qmp is not None and self._proc is not None
            fd = os.open(snap_dir / "dev.state", os.O_RDONLY)
            try:
                await self._qmp.execute("getfd", {"fdname": "devstate"}, fds=[fd])
            finally:
                os.close(fd)
            await self._qmp.execute("migrate-incoming", {"uri": "fd:devstate"})
            try:
                if paused:
                    await self._incoming_done()
                else:
                    await self._qmp.next_event("RESUME", timeout=WAKE_TIMEOUT_S)
            except QMPError as e:
                raise SnapshotCorrupt(f"QEMU could not load the snapshot of {self.id}: {self._log_tail()}", hint="it cold-boots from its disk") from e
            ph.mark("device_state")
        except SnapshotCorrupt:
            await self._teardown()
            raise
        except BaseException:
            await self._teardown()
            self._set_state(SandboxState.SLEEPING)  # the guest never ran: the snapshot is still good
            raise
        if paused:
            return  # loaded, guest not running: the snapshot is still the sandbox's state
        await self._run_restored(ph, fresh_fork, record["kind"])

    async def _incoming_done(self) -> None:
        """Wait until a paused (-S) QEMU has loaded the incoming state (it then stays paused, no RESUME event)."""
        assert self._qmp is not None
        deadline = time.monotonic() + WAKE_TIMEOUT_S
        while True:
            status = (await self._qmp.execute("query-status")).get("status")
            if status != "inmigrate":
                if status != "paused":
                    raise QMPError(f"incoming state ended in status {status!r}")
                return
            if time.monotonic() > deadline:
                raise QMPError(f"QEMU did not load the state within {WAKE_TIMEOUT_S:.0f} s")
            await asyncio.sleep(0.002)

    async def _run_restored(self, ph: snapshots.Phases, fresh_fork: bool, kind: str) -> None:
        """The restored guest runs: record it running and wait for its first reply (which fixes clock and CRNG)."""
        # The guest runs from here, so the snapshot is spent: a shared RAM file no longer matches the old device
        # state and the disk moves on. A crash while awake re-adopts the live QEMU or cold-boots from disk, never
        # resumes an older memory image.
        persist = asyncio.create_task(asyncio.to_thread(self._set_state, SandboxState.RUNNING, snapshot=None, fresh_fork=False))
        try:
            await self._first_reply_after_wake(fresh_fork)
            ph.mark("first_reply")
            await persist
        except BaseException:
            await asyncio.gather(persist, return_exceptions=True)
            await self._teardown()
            self._set_state(SandboxState.STOPPED, snapshot=None)
            raise
        self.last_wake_mode = "snapshot"
        self.last_wake_phases = dict(ph.ms)
        log.info("woke", sandbox=self.id, kind=kind, ms=ph.total(), **ph.ms)
        # The first reply's clock was read on the host before the cold guest got to it (tens of ms under TCG): set
        # once more now that the guest is warm, off the wake's path.
        self._clock_again = asyncio.get_running_loop().create_task(self._set_guest_clock(), name=f"clock-{self.id}")

    async def _apply_delta_when_mapped(self, snap_dir: Path) -> None:
        """Write a fork's saved RAM delta into the starting QEMU's private mapping of the template RAM.

        QEMU maps guest RAM early in its start-up and does not write it before the incoming migration, so the
        delta can go in while the rest of QEMU initialises (the monitor answers only after that).
        """
        size = self._vm_config().memory_mib << 20
        deadline = time.monotonic() + 10
        while True:
            proc = self._proc
            if proc is not None:
                if proc.poll() is not None:
                    return  # QEMU exited at start: the launch reports why
                try:
                    m = ram.find_mapping(proc.pid, self._ram_path())
                    if m.end - m.start >= size:
                        break
                except (ram.RamError, OSError):
                    pass
            if time.monotonic() > deadline:
                raise BootError("QEMU did not map the guest RAM within 10 s", hint="the host may be overloaded")
            await asyncio.sleep(0.001)
        await asyncio.to_thread(ram.apply_delta, proc.pid, m, snap_dir)

    async def _first_reply_after_wake(self, fresh_fork: bool) -> None:
        """The first call to a woken guest sets its clock (it stood still while asleep) and, for a new fork, reseeds
        its kernel CRNG so forks of one template never share a random stream. One RPC to the image's VM extension,
        no process start; its answer is the wake's first channel reply."""
        seed = base64.b64encode(secrets.token_bytes(64)).decode() if fresh_fork else None

        def after_wake() -> tuple[str, dict[str, Any]]:
            params: dict[str, Any] = {"time": time.time()}
            if seed is not None:
                params["seed"] = seed
            return "vm.after_wake", params

        try:
            await self._connect_channel(WAKE_TIMEOUT_S, first=after_wake)
        except RemoteError as e:
            if fresh_fork:
                raise SandboxError(f"could not reseed the random generator of fork {self.id}: {e}", hint="rebuild the image (`moorage image build`) and re-make the template") from e
            log.warning("could not set the guest clock after wake", sandbox=self.id, error=str(e))
