"""A process sandbox's checkpoint verbs (a part of ``ProcessSandbox``): take, list, delete, and roll back, in
place through its zygote while it runs (``process_restart``), else by swapping in a copy of the checkpoint's layer.
The directories themselves: ``process_checkpoints``."""

from __future__ import annotations

import asyncio
import os
import shutil
import uuid
from pathlib import Path

from moorage.errors import ConflictError
from moorage.log import get_logger
from moorage.sandbox import process_checkpoints, process_restart, process_templates
from moorage.sandbox.base import CheckpointInfo, SandboxNotFound, SandboxState, SnapshotCorrupt, validate_id
from moorage.sandbox.process_fs import copy_tree
from moorage.sandbox.process_launch import START_TIMEOUT_S, background, is_guest, own_tree

log = get_logger("moorage.sandbox.process_sandbox")


class Checkpointing:
    """``ProcessSandbox``'s checkpoint verbs (it holds the state they use: the directory, lock, zygote, process and
    meta)."""

    async def checkpoint(self, name: str, *, durable: bool = True) -> CheckpointInfo:  # always written first
        validate_id(name, "checkpoint name")
        async with self._lock:
            self._require(SandboxState.RUNNING, SandboxState.SLEEPING, SandboxState.STOPPED, SandboxState.CREATED,
                          verb="checkpoint")
            if self._state is SandboxState.RUNNING:
                await self.channel.call("sys.sync", timeout=30)
            dest = self.dir / "checkpoints" / name
            if dest.exists():
                raise ConflictError(f"checkpoint {name!r} already exists in sandbox {self.id}",
                                    hint="pick another name or roll back to it")
            # All of it off the event loop (the host's one loop serves every tenant): the copy and the fsyncs.
            return await asyncio.to_thread(process_checkpoints.take, self.dir, self.id, name)

    async def checkpoints(self) -> list[CheckpointInfo]:
        """Each checkpoint's bytes are what it added to the older ones (files it shares with an older checkpoint
        count there), so their sum is the disk all of them take."""
        return await asyncio.to_thread(process_checkpoints.listing, self.dir, self.id)

    async def delete_checkpoint(self, name: str) -> None:
        validate_id(name, "checkpoint name")
        async with self._lock:
            src = self.dir / "checkpoints" / name
            if not src.exists():
                raise SandboxNotFound(f"sandbox {self.id} has no checkpoint {name!r}", hint="list them with checkpoints()")
            # Renamed aside first: a crash mid-removal never leaves a half checkpoint under its name.
            gone = self.dir / "checkpoints" / f".{name}.deleting-{uuid.uuid4().hex[:8]}"
            os.rename(src, gone)
        await asyncio.to_thread(shutil.rmtree, gone, True)  # no longer a checkpoint: removed outside the lock

    async def rollback(self, name: str) -> None:
        validate_id(name, "checkpoint name")
        async with self._lock:
            self._require(SandboxState.RUNNING, SandboxState.SLEEPING, SandboxState.STOPPED, SandboxState.CREATED,
                          verb="roll back")
            src = self.dir / "checkpoints" / name
            if not (src / "checkpoint.json").exists():
                raise SandboxNotFound(f"sandbox {self.id} has no checkpoint {name!r}", hint="list them with checkpoints()")
            if not (src / "layer").is_dir():
                raise SnapshotCorrupt(f"checkpoint {name!r} of sandbox {self.id} has no layer directory")
            was_running = self._state is SandboxState.RUNNING
            if was_running and self._zygote is not None and self._alive():
                try:
                    await self._rollback_in_place(src)
                    return
                except process_restart.ZygoteGone as e:
                    log.warning("restart in place failed; restarting the sandbox", sandbox=self.id, error=str(e))
            # Swap in a copy so the checkpoint itself stays reusable; the old layer is removed only after the swap.
            # The copy is made while the processes are killed (processes and memory are not part of a
            # process-driver checkpoint): the checkpoint does not change, and nothing uses the copy until the swap.
            # One token names the copy and the layer it replaces: a host killed between the two renames below
            # leaves both, and the next boot finishes the swap with that copy (``_sweep_layer_leftovers``).
            token = uuid.uuid4().hex[:8]
            fresh = self.dir / f".layer-rollback-{token}"
            copied, killed = await asyncio.gather(copy_tree(src / "layer", fresh),
                                                  self._kill() if was_running else asyncio.sleep(0),
                                                  return_exceptions=True)
            for err in (killed, copied):
                if isinstance(err, BaseException):
                    shutil.rmtree(fresh, ignore_errors=True)
                    raise err
            await asyncio.to_thread(self._mount_points, fresh)
            old = self.dir / f".layer-old-{token}"
            if self.layer.exists():  # none when a rollback killed here before was not booted since
                os.rename(self.layer, old)
            os.rename(fresh, self.layer)
            try:
                if was_running:
                    await self._boot()
                else:
                    self._save()
            finally:
                # Not on the rollback's path: a layer with installed packages is thousands of files. A host that
                # stops before this is done leaves the directory to the next boot's sweep (_sweep_layer_leftovers).
                background(asyncio.to_thread(shutil.rmtree, old, True), f"rm-layer-{self.id}")

    def _mount_points(self, layer: Path) -> None:
        """A checkpoint's copy of the layer made ready for the shared directories the sandbox binds now: one taken
        before it bound them (a redeploy changed its packages since) has no mount point there, or files of its
        own. Blocking."""
        for rel in (self.meta.get("shared") or {}).get("paths") or []:
            process_templates.mount_point(layer, rel)

    async def _rollback_in_place(self, src: Path) -> None:
        """Rollback of a running sandbox through its zygote (process_restart): the agent's processes are killed
        while the checkpoint's layer is copied, the copy's files are moved into the layer the sandbox has bound,
        and the zygote forks a fresh supervisor. The sandbox itself (bubblewrap, its namespaces) stays."""
        await self._let_go()
        fresh = self.dir / f".layer-rollback-{uuid.uuid4().hex[:8]}"
        trash = self.dir / f".layer-old-{uuid.uuid4().hex[:8]}"
        assert self._pid is not None
        try:
            copied, killed = await asyncio.gather(copy_tree(src / "layer", fresh),
                                                  process_restart.kill_agent(self._zygote, self._pid, is_guest),
                                                  return_exceptions=True)
            for err in (killed, copied):
                if isinstance(err, BaseException):
                    raise err
            uid = self.driver.host_uid
            if uid is not None:
                own_tree(fresh, uid)
            self._mount_points(fresh)
            process_restart.swap_contents(self.layer, fresh, trash,
                                          tuple((self.meta.get("shared") or {}).get("paths") or ()))
            if self.socket_path.exists():
                self.socket_path.unlink()
            self.quota_exceeded = False
            await process_restart.start_agent(self._zygote)
            self._channel = await self._connect(START_TIMEOUT_S)
            self._serve_dns()
        except process_restart.ZygoteGone:
            raise  # the caller restarts the sandbox the slow way, from the checkpoint again
        except BaseException:
            # No agent running and the layer maybe half swapped: stopped; the next start begins from the layer
            # (the caller's intent, recorded before, finishes the rollback).
            await self._kill()
            self._state = SandboxState.STOPPED
            self._save(pid=None, pid_starttime=None)
            raise
        finally:
            background(asyncio.to_thread(shutil.rmtree, fresh, True), f"rm-layer-{self.id}")
            background(asyncio.to_thread(shutil.rmtree, trash, True), f"rm-layer-{self.id}")
        self._save(boot_count=self.meta.get("boot_count", 0) + 1)
        self._start_watchdog()
        log.info("sandbox rolled back in place", sandbox=self.id)
