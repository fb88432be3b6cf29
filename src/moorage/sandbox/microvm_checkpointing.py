"""A micro-VM sandbox's snapshots of its running guest (a part of ``MicroVMSandbox``): the snapshot writer a sleep,
a checkpoint and a live snapshot share (``_snapshot_to``: the guest paused for its device state, disk snapshot and
changed pages only), a checkpoint's files written behind it, and the checkpoint verbs (take, roll back, delete,
list). The files themselves: ``microvm_snapshots`` and ``microvm_ram_chain``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable

from moorage.errors import DiskFull, InvalidInput
from moorage.log import get_logger
from moorage.sandbox import microvm_ram as ram
from moorage.sandbox import microvm_ram_chain as ram_chain
from moorage.sandbox import microvm_snapshots as snapshots
from moorage.sandbox import microvm_user
from moorage.sandbox.base import (
    ChannelError,
    CheckpointInfo,
    SandboxError,
    SandboxNotFound,
    SandboxState,
    SandboxStateError,
    SnapshotInfo,
    validate_id,
)
from moorage.fsync import fsync_dir
from moorage.sandbox.microvm_files import allocated, sparse_copy, write_json
from moorage.sandbox.microvm_diskfull import nearly_full
from moorage.sandbox.qmp import QMPError

log = get_logger(__name__)


class Checkpointing:
    """``MicroVMSandbox``'s snapshots of its running guest and its checkpoint verbs (it holds the state they use:
    the QMP client, the lock, the directory and meta)."""

    async def _snapshot_to(self, target: Path, *, keep_running: bool, ram_base: Path | None = None,
                           disk_tag: str | None = None, behind: bool = False) -> SnapshotInfo:
        """Pause, save device state + RAM (+ flush disk) into ``target``, then resume or kill QEMU. ``disk_tag`` (a
        checkpoint): the disk's qcow2 internal snapshot of that name is taken in the same pause, and the RAM is
        stored as the pages changed since the checkpoint ``ram_base`` (``microvm_ram_chain``), read while paused
        and written after the guest runs again: before this returns, or with ``behind`` by a task the sandbox's
        lock waits for (``_VerbLock``), so the caller goes on once the guest runs."""
        assert self._qmp is not None and self.pid is not None
        ph = snapshots.Phases()
        new = target.with_name(target.name + ".new")
        making: int | None = snapshots.begin(new)  # its lock: held until ``new`` is in place or removed
        cap: ram_chain.Capture | None = None
        # The channel stays connected through the pause: the guest then never sees its port close, and after a
        # wake it simply reads the new connection's frames (no reopen, no frames dropped in between).
        await self._qmp.execute("stop")  # also drains and flushes the disk
        paused = True
        clock: asyncio.Task[None] | None = None
        done = disk_snapped = False
        try:
            await self._qmp.save_device_state(new / "dev.state")  # by descriptor: QEMU cannot reach the path
            if disk_tag is not None:
                await self._disk_snapshot(disk_tag)  # the disk at the same instant as memory and devices
                disk_snapped = True
            ph.mark("pause_and_device_state")
            record = snapshots.new_record(self.ram_mode, self._vm_config().layout_id(), self._meta["image_id"])
            # The file work below runs on worker threads: on the event loop it held every other request of the host
            # (and a reply just handed over, a checkpoint being taken right after the turn's reply) for its duration.
            if self.ram_mode == "delta" and disk_tag is not None:
                m = ram.find_mapping(self.pid, self._ram_path())
                # In the pause only the guest's private pages are copied; they are compared with the template and
                # hashed once it runs again. Many of them (more than ram.COPY_MAX_BYTES) are read in the pause, as
                # before, so host memory stays flat.
                dirty = await asyncio.to_thread(ram.copy_dirty, self.pid, m)
                capture = functools.partial(ram_chain.capture, self.pid, m, self._ram_path(), ram_base, new, dirty)
                if dirty is None:
                    cap = await asyncio.to_thread(capture)
                ph.mark("ram_capture")
                await self._qmp.execute("cont")  # the guest runs on while its pages are compressed and stored
                paused = False
                clock = asyncio.create_task(self._set_guest_clock())
                if behind:
                    self.last_snapshot_phases = dict(ph.ms)  # the pause's steps; the write's once it is done
                    self._lock.behind = asyncio.get_running_loop().create_task(
                        self._write_behind(cap if cap is not None else capture, new, target, record, ph, clock,
                                           making),
                        name=f"checkpoint-write-{self.id}")
                    self._behind_named = (target.name, self._lock.behind)  # for ``writing_behind``
                    clock = making = None
                    done = True  # ``new`` is the write-behind's now
                    return SnapshotInfo(self.id, target, 0, record["created_at"], True)
                if cap is None:
                    cap = await asyncio.to_thread(capture)
                    ph.mark("ram_compare")
            elif self.ram_mode == "delta":
                m = ram.find_mapping(self.pid, self._ram_path())
                record["delta_bytes"] = await asyncio.to_thread(ram.save_delta, self.pid, m, self._ram_path(), new)
                record["delta_xxh3"] = await asyncio.to_thread(ram.delta_digest, new / "ram.delta")
                ph.mark("ram_delta")
            elif keep_running:
                await asyncio.to_thread(sparse_copy, self.dir / "ram", new / "ram")  # a checkpoint's own copy of shared RAM
                record["ram_checksum"] = await asyncio.to_thread(ram.file_digest, new / "ram")
            else:
                await asyncio.to_thread(ram.fsync_path, self.dir / "ram")
                record["ram_checksum"] = await asyncio.to_thread(ram.file_digest, self.dir / "ram")
            ph.mark("ram")
            await asyncio.to_thread(snapshots.commit, cap, new, target, record, self.dir / "disk.qcow2",
                                    keep_running=keep_running, ph=ph)
            done = True
        except QMPError as e:
            if nearly_full(self.dir):  # QEMU's write found no room: "An IO error has occurred"
                raise DiskFull("the host is out of disk space: the snapshot did not fit on the disk") from e
            raise
        finally:
            if not done:
                # Half of a snapshot is never used (only a renamed whole one is) and must not hold the space it
                # took: a sleep or checkpoint that failed on a full disk leaves the room it found, and its disk
                # snapshot (nothing lists one without its files) does not keep the clusters it shares.
                await asyncio.to_thread(shutil.rmtree, new, True)
                if disk_snapped and self._qmp is not None:
                    with contextlib.suppress(QMPError):
                        await self._qmp.execute("blockdev-snapshot-delete-internal-sync",
                                                {"device": "disk", "name": disk_tag})
            if making is not None:
                os.close(making)
            if paused and self._qmp is not None and (keep_running or not done):
                # A checkpoint, or a sleep that failed (its disk full, say), leaves the guest running, as it was;
                # a sleep that failed and left it paused had every later call to it wait out its timeout.
                try:
                    await self._qmp.execute("cont")
                except QMPError:
                    if keep_running:
                        raise
                else:
                    paused = False
                    clock = asyncio.create_task(self._set_guest_clock())
            if clock is not None:
                await clock
        if not keep_running:
            # QEMU quits rather than being killed: it closes the disk cleanly (its refcounts written, the image
            # no longer marked dirty), so the wake and anything that ships the directory find a clean image.
            await self._teardown(quit=True)
            self._set_state(SandboxState.SLEEPING, snapshot=record)
        ph.mark("commit")
        log.info("snapshot", sandbox=self.id, kind=record["kind"], keep_running=keep_running, ms=ph.total(), **ph.ms)
        self.last_snapshot_phases = dict(ph.ms)
        size = allocated(target) + (0 if self.ram_mode == "delta" or keep_running else allocated(self.dir / "ram"))
        return SnapshotInfo(self.id, target, size, record["created_at"], True)

    async def _write_behind(self, cap: "ram_chain.Capture | Callable[[], ram_chain.Capture]", new: Path, target: Path,
                            record: dict[str, Any], ph: snapshots.Phases, clock: "asyncio.Task[None]",
                            making: int) -> str | None:
        """A checkpoint's files, written while the guest runs on (``checkpoint(durable=False)``); ``cap`` is its
        RAM capture, or what makes it from the pages copied in the pause; ``making`` holds ``new``'s lock (closed
        here). A failure leaves no checkpoint of that name (it is logged; a rollback to it is refused as to any
        missing one) and is returned, as the reason (``writing_behind``); None once the files are written."""
        try:
            if callable(cap):
                cap = await asyncio.to_thread(cap)
                ph.mark("ram_compare")
            await asyncio.to_thread(snapshots.commit, cap, new, target, record, self.dir / "disk.qcow2",
                                    keep_running=True, ph=ph)
            ph.mark("commit")
            log.info("snapshot", sandbox=self.id, kind=record["kind"], keep_running=True, behind=True,
                     ms=ph.total(), **ph.ms)
            self.last_snapshot_phases = dict(ph.ms)
            return None
        except Exception as e:  # noqa: BLE001 - the guest runs on; only this checkpoint is lost
            log.warning("checkpoint not written", sandbox=self.id, checkpoint=target.name, error=str(e))
            shutil.rmtree(new, ignore_errors=True)
            if self._qmp is not None:  # its disk snapshot would keep clusters that nothing lists
                with contextlib.suppress(QMPError):
                    await self._qmp.execute("blockdev-snapshot-delete-internal-sync",
                                            {"device": "disk", "name": f"ckpt-{target.name}"})
            return f"{type(e).__name__}: {e}"
        finally:
            os.close(making)
            await clock

    def writing_behind(self, name: str) -> "asyncio.Task[str | None] | None":
        """The task writing the files of checkpoint ``name``, the last one taken with ``durable=False`` (else None):
        its result is why they could not be written, or None once they are on disk."""
        named = getattr(self, "_behind_named", None)
        return named[1] if named is not None and named[0] == name else None

    async def _set_guest_clock(self) -> None:
        """After a pause the guest runs on from (a checkpoint, a freeze): its clock stood still through the pause,
        so it is set again, as a wake sets it (no seed). Each checkpoint would otherwise leave it ~25 ms behind. A
        failure is logged; the guest runs on with its clock behind."""
        channel = self._channel
        if channel is None or channel.closed:
            return
        try:
            await channel.call("vm.after_wake", {"time": time.time()}, timeout=10)
        except ChannelError as e:
            if not channel.closed:  # one closed meanwhile (a sleep, a stop) has no clock left to set
                log.warning("could not set the guest clock after a pause", sandbox=self.id, error=str(e))

    async def _disk_snapshot(self, tag: str) -> None:
        """The disk's qcow2 internal snapshot ``tag`` of a paused guest (one of that name replaced)."""
        assert self._qmp is not None
        try:
            await self._qmp.execute("blockdev-snapshot-delete-internal-sync", {"device": "disk", "name": tag})
        except QMPError:
            pass
        await self._qmp.execute("blockdev-snapshot-internal-sync", {"device": "disk", "name": tag})

    async def _live_snapshot(self) -> None:
        """Write ``snapshot/`` of the paused guest, marked live (see ``frozen``)."""
        assert self._qmp is not None and self.pid is not None
        target = self.dir / "snapshot"
        new = target.with_name(target.name + ".new")
        making = snapshots.begin(new)
        try:
            await self._qmp.save_device_state(new / "dev.state")
            record = snapshots.new_record(self.ram_mode, self._vm_config().layout_id(), self._meta["image_id"],
                                          live=True)
            if self.ram_mode == "delta":
                m = ram.find_mapping(self.pid, self._ram_path())
                record["delta_bytes"] = await asyncio.to_thread(ram.save_delta, self.pid, m, self._ram_path(), new)
                record["delta_xxh3"] = ram.delta_digest(new / "ram.delta")
            else:
                record["ram_checksum"] = ram.file_digest(self.dir / "ram")
            record["dev_sha256"] = ram.sha256_file(new / "dev.state")
            write_json(new / "snapshot.json", record)
            snapshots.swap_in(new, target)
        finally:
            os.close(making)

    async def _sweep_unfinished(self) -> None:
        """After a host restart (``MicroVMDriver.open``): the snapshots a crash left half made go
        (``snapshots.sweep_unfinished``), and with a checkpoint's the disk snapshot taken for it, which no
        checkpoint names (a running QEMU deletes it itself, the image being locked by it); so does the disk
        snapshot of a checkpoint whose deletion a crash cut short (its record gone). A failure is logged: only
        space is lost."""
        gone = await asyncio.to_thread(snapshots.sweep_unfinished, self.dir)
        cps = self.dir / "checkpoints"
        if not any(d.parent == cps for d in gone) and not await asyncio.to_thread(snapshots.unrecorded, cps):
            return
        disk = self.dir / "disk.qcow2"
        try:
            if self.state is SandboxState.RUNNING and self._qmp is not None:
                block = next(b for b in await self._qmp.execute("query-block") if b.get("device") == "disk")
                tags = [s["name"] for s in block.get("inserted", {}).get("image", {}).get("snapshots", [])]
                for tag in snapshots.stray_disk_snapshots(cps, tags):
                    await self._qmp.execute("blockdev-snapshot-delete-internal-sync", {"device": "disk", "name": tag})
            elif disk.exists():
                # qemu-img opens the backing file the header names (as root): only the one the host gave this disk.
                microvm_user.check_backing(disk, self.dir)
                tags = await asyncio.to_thread(snapshots.disk_snapshots, disk)
                for tag in snapshots.stray_disk_snapshots(cps, tags):
                    await asyncio.to_thread(snapshots.drop_disk_snapshot, self.id, disk, tag)
        except (QMPError, SandboxError, OSError, StopIteration) as e:
            log.warning("could not delete the disk snapshots of checkpoints a crash cut short", sandbox=self.id,
                        error=str(e))

    async def checkpoint(self, name: str, *, durable: bool = True) -> CheckpointInfo:
        validate_id(name, "checkpoint name")
        if name.endswith((".new", ".old")):  # one being made or replaced: a restarted host settles those
            raise InvalidInput(f"invalid checkpoint name {name!r}", hint="use a name that does not end in .new or .old")
        async with self._lock:
            if self.state is not SandboxState.RUNNING or self._qmp is None:
                raise SandboxStateError(f"sandbox {self.id} is {self.state.value}; checkpoints are taken of a running sandbox", hint="call wake() first")
            cps = self.dir / "checkpoints"
            target = cps / name
            cps.mkdir(exist_ok=True)
            # RAM as the pages changed since the checkpoint this guest last passed (taken or rolled back to).
            base = snapshots.chain_base(cps, self._meta.get("ram_tip"), name)
            await asyncio.to_thread(ram_chain.set_aside, cps, name)
            # The disk's state at the same instant, as a qcow2 internal snapshot taken in the same pause.
            info = await self._snapshot_to(target, keep_running=True, ram_base=base, disk_tag=f"ckpt-{name}",
                                           behind=not durable)
            # The next checkpoint's base (under this lock, so once the files are written; one that failed to be
            # written is then missing, and the next is a whole one).
            self._meta["ram_tip"] = name
            self._save_meta()
            return CheckpointInfo(name, self.id, target, info.bytes, info.created_at, True)

    async def rollback(self, name: str) -> None:
        validate_id(name, "checkpoint name")
        async with self._lock:
            src = self.dir / "checkpoints" / name
            if not (src / "snapshot.json").exists():
                raise SandboxNotFound(f"sandbox {self.id} has no checkpoint {name!r}", hint="list them with checkpoints()")
            # qemu-img opens the backing file the header names (as root): only the one the host gave this disk
            # (checked first here, before any work).
            microvm_user.check_backing(self.dir / "disk.qcow2", self.dir)
            # The memory image first, while the guest still runs: a checkpoint whose RAM cannot be put together
            # (a base's pages gone or changed) is refused here and leaves the sandbox as it was.
            staged = self.dir / "snapshot.rollback"
            record = await asyncio.to_thread(snapshots.stage_rollback, src, staged)
            await self._teardown()
            try:
                # Again now that its QEMU (which can write the header) is gone: this is the check qemu-img relies on.
                microvm_user.check_backing(self.dir / "disk.qcow2", self.dir)
                await asyncio.to_thread(snapshots.revert_disk, self.dir / "disk.qcow2", name)
            except BaseException:
                # Its memory went with its QEMU and its disk is where it was: the next wake boots from that disk.
                shutil.rmtree(staged, ignore_errors=True)
                self._set_state(SandboxState.STOPPED, snapshot=None)
                raise
            snap = self.dir / "snapshot"
            shutil.rmtree(snap, ignore_errors=True)
            os.rename(staged, snap)
            if record["kind"] != "delta":
                sparse_copy(src / "ram", self.dir / "ram")
            self._meta["ram_mode"] = record["kind"]
            self._meta["ram_tip"] = name
            self._set_state(SandboxState.SLEEPING, snapshot=record)
            await self._wake_locked()

    async def delete_checkpoint(self, name: str) -> None:
        """Remove one checkpoint (retention): its RAM delta and device state, and the disk's internal snapshot,
        whose clusters qcow2 frees (a running QEMU deletes it itself, the image being locked by it)."""
        validate_id(name, "checkpoint name")
        async with self._lock:
            src = self.dir / "checkpoints" / name
            if not (src / "snapshot.json").exists():
                raise SandboxNotFound(f"sandbox {self.id} has no checkpoint {name!r}", hint="list them with checkpoints()")
            # Its record first: a crash mid-removal leaves no half checkpoint that lists or restores, only disk.
            (src / "snapshot.json").unlink()
            fsync_dir(src)
            tag = f"ckpt-{name}"
            if self.state is SandboxState.RUNNING and self._qmp is not None:
                try:
                    await self._qmp.execute("blockdev-snapshot-delete-internal-sync", {"device": "disk", "name": tag})
                except QMPError as e:
                    log.warning("could not delete a checkpoint's disk snapshot", sandbox=self.id, error=str(e))
            else:
                # qemu-img opens the backing file the header names (as root): only the one the host gave this disk.
                microvm_user.check_backing(self.dir / "disk.qcow2", self.dir)
                await asyncio.to_thread(snapshots.drop_disk_snapshot, self.id, self.dir / "disk.qcow2", tag)
            # Its RAM goes unless a later checkpoint builds on it (then with the last of those).
            await asyncio.to_thread(ram_chain.collect, src.parent)

    async def checkpoints(self) -> list[CheckpointInfo]:
        await self._lock.caught_up()
        return await asyncio.to_thread(snapshots.listing, self.id, self.dir / "checkpoints")
