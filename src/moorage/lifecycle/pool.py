"""The warm pool: a few already-forked sandboxes per live template (paused in a started QEMU where the driver can), so
a new user is a bind plus a resume.

Pool members belong to no tenant's records (they are never counted as users); a manifest per template under
``<data_dir>/pool`` lists them, so a restarted host finds its pool again and a crash never binds one twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import uuid
from pathlib import Path
from typing import Callable

from moorage.log import FailingRounds, get_logger
from moorage.sandbox import Sandbox, SandboxDriver, SandboxNotFound, SandboxState, TemplateRef

log = get_logger(__name__)

#: The most pooled sandboxes one template may ask for (each is a fork on disk: a few MiB, no compute).
MAX_POOL = 64


class WarmPool:
    """Pre-forked sleeping sandboxes per template id; ``take`` hands one out, a background task refills."""

    def __init__(self, driver: SandboxDriver, root: Path) -> None:
        self.driver = driver
        self.root = root
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._want: dict[str, tuple[TemplateRef, int]] = {}
        self._lock = asyncio.Lock()  # one manifest change at a time (take, add, drain)
        self._refill: asyncio.Task[None] | None = None
        self._wakeup = asyncio.Event()
        self._closed = False
        #: Called with no arguments after every refill pass (tests wait on it).
        self.on_refilled: Callable[[], None] | None = None

    # --- the manifest ----------------------------------------------------------------------------------------

    def _manifest(self, template_id: str) -> Path:
        return self.root / f"{template_id}.json"

    def members(self, template_id: str) -> list[str]:
        try:
            return list(json.loads(self._manifest(template_id).read_text()))
        except (FileNotFoundError, ValueError):
            return []

    def _forking(self, template_id: str) -> Path:
        """Names the fork being made for the template's pool before it exists (one at a time per template)."""
        return self.root / f"{template_id}.forking"

    def _handing(self, sandbox_id: str) -> Path:
        """Names a member ``take`` handed out until its user's instance row names it (``handed``)."""
        return self.root / f"{sandbox_id}.handing"

    def _draining(self, template_id: str) -> Path:
        """Names the members a drain took out of the manifest until they are destroyed."""
        return self.root / f"{template_id}.draining"

    async def _drop_unlisted(self, marker: Path) -> None:
        """Forks a crash left outside the manifest (no tenant's record names a pool member either, so they stayed on
        disk for ever): one cut short before it joined the pool, members a drain had not destroyed yet. Destroyed,
        except any the manifest lists after all."""
        try:
            ids = (await asyncio.to_thread(marker.read_text)).split()
        except FileNotFoundError:
            return
        listed = set(self.members(marker.stem))
        for sid in ids:
            if sid not in listed:
                with contextlib.suppress(Exception):
                    await _destroy(await self.driver.open(sid))
                    log.info("warm pool fork a crash left outside the pool removed", template=marker.stem, sandbox=sid)
        marker.unlink(missing_ok=True)

    def _write(self, template_id: str, ids: list[str]) -> None:
        path = self._manifest(template_id)
        if not ids:
            path.unlink(missing_ok=True)
            return
        tmp = path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(ids, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    # --- what the manager calls ------------------------------------------------------------------------------

    def want(self, template: TemplateRef, size: int) -> None:
        """Keep ``size`` sleeping forks of ``template`` ready (0 stops refilling it; ``drain`` empties it)."""
        size = max(0, min(int(size), MAX_POOL))
        if size:
            self._want[template.id] = (template, size)
        else:
            self._want.pop(template.id, None)
        self._kick()

    async def take(self, template: TemplateRef) -> str | None:
        """The id of a pooled sleeping fork of ``template``, removed from the pool (durably) before it is returned;
        None when the pool is empty. The caller owns the sandbox from here."""
        async with self._lock:
            ids = self.members(template.id)
            while ids:
                sid = ids.pop(0)
                # Named until the user's row names it (``handed``): a crash between the manifest and the row left
                # a fork nothing names, on disk for ever. The next start removes it (``drop_left_by_crash``).
                await asyncio.to_thread(self._handing(sid).write_text, template.id)
                await asyncio.to_thread(self._write, template.id, ids)
                try:
                    sb = await self.driver.open(sid)
                except SandboxNotFound:
                    self.handed(sid)
                    continue
                if sb.state in (SandboxState.SLEEPING, SandboxState.CREATED):
                    self._kick()
                    return sid
                await _destroy(sb)
                self.handed(sid)
        self._kick()
        return None

    def handed(self, sandbox_id: str) -> None:
        """A member ``take`` handed out is now named by its user's instance row (or was destroyed)."""
        self._handing(sandbox_id).unlink(missing_ok=True)

    async def _drop_handed_over(self, marker: Path) -> None:
        """A member a crash cut short in its hand-over: out of the manifest, perhaps named by a user's instance row
        left ``provisioning`` by the dead process. Such a row is reclaimed on its next bring-up, which destroys its
        sandbox and forks the template again, so the member is removed either way (unless the manifest lists it)."""
        template_id = (await asyncio.to_thread(marker.read_text)).strip()
        sid = marker.name.removesuffix(".handing")
        if sid not in self.members(template_id):
            with contextlib.suppress(Exception):
                await _destroy(await self.driver.open(sid))
                log.info("warm pool member a crash cut short in its hand-over removed", template=template_id,
                         sandbox=sid)
        marker.unlink(missing_ok=True)

    async def drain(self, template_id: str) -> int:
        """Destroy every pooled fork of a template (a redeploy made it stale); returns how many."""
        self._want.pop(template_id, None)
        async with self._lock:
            ids = self.members(template_id)
            if ids:  # named until destroyed: a crash meanwhile leaves none that nothing names
                await asyncio.to_thread(self._draining(template_id).write_text, "\n".join(ids))
            await asyncio.to_thread(self._write, template_id, [])
        for sid in ids:
            with contextlib.suppress(SandboxNotFound):
                await _destroy(await self.driver.open(sid))
        if ids:
            self._draining(template_id).unlink(missing_ok=True)
            log.info("warm pool drained", template=template_id, count=len(ids))
        return len(ids)

    async def drop_left_by_crash(self) -> None:
        """At start, before any refill (a refill's fork names itself in ``<template>.forking``, over a crash's):
        remove the forks a crash cut short before they joined a pool, left a drain or were handed over."""
        for marker in sorted([*self.root.glob("*.forking"), *self.root.glob("*.draining")]):
            await self._drop_unlisted(marker)
        for marker in sorted(self.root.glob("*.handing")):
            await self._drop_handed_over(marker)

    async def drain_except(self, keep: set[str]) -> int:
        """Drain every template's pool whose id is not in ``keep`` (startup: templates no longer live; after
        ``drop_left_by_crash``, not again here: by now a refill's marker names a fork being made)."""
        n = 0
        for p in sorted(self.root.glob("*.json")):
            if p.stem not in keep:
                n += await self.drain(p.stem)
        return n

    # --- refilling -------------------------------------------------------------------------------------------

    def start(self) -> None:
        if self._refill is None:
            self._refill = asyncio.create_task(self._refill_loop(), name="warm-pool-refill")

    async def close(self) -> None:
        """Stop refilling and stop the paused QEMUs of prepared members (they stay in the pool, asleep on disk)."""
        self._closed = True
        if self._refill is not None:
            self._refill.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._refill
            self._refill = None
        for tid in list(self._want):
            for sid in self.members(tid):
                with contextlib.suppress(Exception):
                    sb = await self.driver.open(sid)
                    unprepare = getattr(sb, "unprepare", None)
                    if unprepare is not None:
                        await unprepare()

    def _kick(self) -> None:
        self._wakeup.set()

    async def fill_once(self) -> int:
        """Fork what is missing in every wanted pool, one fork at a time (refilling must not starve turns), and
        prepare each member where the driver can: its QEMU started with the template's state loaded and the guest
        paused, so binding a new user is a resume, not a process start."""
        made = 0
        for tid, (template, size) in list(self._want.items()):
            for sid in self.members(tid):
                if self._closed:
                    return made
                await self._prepare(sid)
            while not self._closed and len(self.members(tid)) < size and self._want.get(tid, (None, 0))[1] == size:
                sid = uuid.uuid4().hex  # the id it keeps once bound to a user: binding is a record, not a rename
                marker = self._forking(tid)
                await asyncio.to_thread(marker.write_text, sid)  # a crash from here to the manifest: removed at start
                try:
                    (sb,) = await self.driver.fork(template, [sid])
                except Exception as e:  # a deleted or damaged template: stop wanting it, the next deploy asks again
                    log.warning("warm pool fork failed", template=tid, error=str(e))
                    self._want.pop(tid, None)
                    await self._drop_unlisted(marker)
                    break
                async with self._lock:
                    if tid not in self._want:  # drained while forking
                        await _destroy(sb)
                        marker.unlink(missing_ok=True)
                        break
                    await asyncio.to_thread(self._write, tid, self.members(tid) + [sid])
                    marker.unlink(missing_ok=True)
                made += 1
                await self._prepare(sid)
        return made

    async def _prepare(self, sid: str) -> None:
        try:
            sb = await self.driver.open(sid)
            prepare = getattr(sb, "prepare", None)
            if prepare is not None and not getattr(sb, "prepared", False):
                await prepare()
        except Exception as e:  # an unprepared member still works: its bind is a plain wake
            log.warning("warm pool member not prepared", sandbox=sid, error=str(e))

    async def _refill_loop(self) -> None:
        failures = FailingRounds(log, "warm pool refill")
        while not self._closed:
            await self._wakeup.wait()
            self._wakeup.clear()
            try:
                await self.fill_once()
                failures.ok()
            except Exception as e:  # the loop outlives one bad pass
                failures.failed(e)
            if self.on_refilled is not None:
                self.on_refilled()


async def _destroy(sb: Sandbox) -> None:
    with contextlib.suppress(Exception):
        await sb.destroy()
