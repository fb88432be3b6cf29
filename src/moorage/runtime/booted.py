"""Booted templates: a deploy's builder resumes a booted guest instead of booting one.

Every deployment's template is built in a sandbox of the agent's size (``templates.Templates._build``). On the
micro-VM driver its start is a kernel boot: 4.1 s of a 4.9 s redeploy on the 2-core development machine under
TCG, about 11 s under load. What a boot produces depends only on the machine's shape (image, memory, vCPUs, disk, the
kernel's command line: the driver's ``boot_key``), so the first build of a shape keeps its builder's state right
after the boot as a template (before anything of the agent is in it), and every later build of that shape on
this host forks that template and resumes it from its snapshot instead (a wake: ~0.2 s). The deployment's
template is then made ``standalone`` (its disk carries what it had of the booted template's), so it is published
and collected as one made from a boot, and the booted template can go at any time.

A driver with nothing to gain (``boot_key`` None: the process driver's start costs what a fork does) boots every
builder as before. Records: ``<templates>/booted/<key>.json``; the ``KEPT`` most recently used shapes stay, the
others are deleted (a template's files go with the last sandbox forked from it). Their RAM is not held in memory
between builds (``cool_template``). A failure here never fails a deploy: the builder boots as it did before.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
import uuid
from pathlib import Path
from typing import Any, Callable

from moorage.errors import MoorageError
from moorage.log import get_logger
from moorage.runtime.private_files import private_dir, write_private
from moorage.sandbox import Sandbox, SandboxDriver, SandboxSpec, SandboxState, TemplateRef

log = get_logger(__name__)

#: Booted templates kept per host (shapes: an agent's memory, vCPUs, disk and boot environment).
KEPT = 3
#: Their ids: ``boot-<16 hex of the key>-<6 hex>`` (the collector deletes one no record names: a crash's).
PREFIX = "boot-"


class BootedTemplates:
    def __init__(self, root: Path, driver: SandboxDriver, ref_json: Callable[[TemplateRef], dict[str, Any]],
                 ref_of: Callable[[dict[str, Any]], TemplateRef]) -> None:
        self.dir = root / "booted"
        self.driver = driver
        self._ref_json, self._ref_of = ref_json, ref_of
        self._locks: dict[str, asyncio.Lock] = {}
        #: Ids being made now (no record names them yet).
        self._making: set[str] = set()

    async def start_builder(self, sandbox_id: str, spec: SandboxSpec, say: Callable[[str], None]) -> Sandbox:
        """Sandbox ``sandbox_id`` of ``spec``, running: forked from the booted template of its shape where this
        host has one, else booted (and its state kept as that template for the next build). A sandbox this made
        and could not start is destroyed before the error is raised."""
        key = await self._key(spec)
        if key is None:
            return await self._boot(sandbox_id, spec)
        lock = self._locks.setdefault(key, asyncio.Lock())
        async with lock:  # a build of the same shape meanwhile waits for the first one's boot, then forks it
            ref = await self._recorded(key)
            if ref is None:
                sb = await self._boot(sandbox_id, spec)
                started = time.monotonic()
                if await self._keep(key, sb) is not None:
                    say(f"kept the booted sandbox for this host's next builds of this size "
                        f"({round((time.monotonic() - started) * 1000)} ms)")
                return sb
        started = time.monotonic()
        try:
            sb = await self.driver.create(sandbox_id, template=ref)
        except (MoorageError, OSError) as e:
            log.warning("could not fork the booted template; booting", template=ref.id, error=str(e))
            await self._forget(key, ref)
            return await self._boot(sandbox_id, spec)
        try:
            await (sb.start() if sb.state is SandboxState.CREATED else sb.wake())
        except (MoorageError, OSError) as e:
            log.warning("could not resume the booted template; booting", template=ref.id, error=str(e))
            await sb.destroy()
            await self._forget(key, ref)
            return await self._boot(sandbox_id, spec)
        except BaseException:
            await sb.destroy()
            raise
        finally:
            await asyncio.to_thread(self.driver.cool_template, ref)  # its running fork maps what it needs
        say(f"resumed this host's booted sandbox of this size ({round((time.monotonic() - started) * 1000)} ms)")
        return sb

    def names(self) -> set[str]:
        """Ids of the booted templates a record names, and of those being made."""
        out = set(self._making)
        for record in self._records():
            with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
                out.add(str(json.loads(record.read_text())["template"]["id"]))
        return out

    async def _boot(self, sandbox_id: str, spec: SandboxSpec) -> Sandbox:
        sb = await self.driver.create(sandbox_id, spec)
        try:
            await sb.start()
        except BaseException:
            await sb.destroy()
            raise
        return sb

    async def _key(self, spec: SandboxSpec) -> str | None:
        try:
            return await self.driver.boot_key(spec)
        except (MoorageError, OSError) as e:  # the boot itself will say what is wrong
            log.warning("no boot key for the builder's spec", error=str(e))
            return None

    def _record(self, key: str) -> Path:
        return self.dir / f"{key}.json"

    def _records(self) -> list[Path]:
        return sorted(self.dir.glob("*.json")) if self.dir.is_dir() else []

    async def _recorded(self, key: str) -> TemplateRef | None:
        """The booted template of ``key`` when it is on this host and forkable (marked used now), else None."""
        try:
            ref = self._ref_of(json.loads(self._record(key).read_text())["template"])
        except (OSError, ValueError, KeyError, TypeError):
            return None
        outdated = getattr(self.driver, "template_outdated", None)
        why = outdated(ref) if callable(outdated) else None
        if ref.driver != self.driver.name or not (Path(ref.path) / "template.json").exists() \
                or (Path(ref.path) / "deleted").exists() or why is not None:
            log.info("booted template unusable; the builder boots", template=ref.id, reason=why or "gone")
            await self._forget(key, ref)
            return None
        with contextlib.suppress(OSError):
            os.utime(self._record(key))
        return ref

    async def _keep(self, key: str, sandbox: Sandbox) -> TemplateRef | None:
        """``sandbox``'s state (just booted) as the booted template of ``key``, recorded; the least recently used
        beyond ``KEPT`` deleted. None, having logged why, where it could not be made."""
        tid = f"{PREFIX}{key[:16]}-{uuid.uuid4().hex[:6]}"
        self._making.add(tid)
        try:
            try:
                ref = await self.driver.make_template(sandbox, tid)
            except (MoorageError, OSError) as e:
                log.warning("could not keep the booted sandbox as a template", sandbox=sandbox.id, error=str(e))
                return None
            await asyncio.to_thread(self.driver.cool_template, ref)
            record = {"key": key, "template": self._ref_json(ref)}
            try:
                private_dir(self.dir)
                write_private(self._record(key), json.dumps(record).encode())
            except OSError as e:
                log.warning("could not record the booted template", template=tid, error=str(e))
                await self._delete(ref)
                return None
        finally:
            self._making.discard(tid)
        log.info("booted template kept", template=tid, key=key[:16])
        await self._evict()
        return ref

    async def _evict(self) -> None:
        records = sorted(self._records(), key=lambda p: p.stat().st_mtime, reverse=True)
        for record in records[KEPT:]:
            try:
                ref = self._ref_of(json.loads(record.read_text())["template"])
            except (OSError, ValueError, KeyError, TypeError):
                record.unlink(missing_ok=True)
                continue
            record.unlink(missing_ok=True)
            await self._delete(ref)
            log.info("booted template of a shape not built lately deleted", template=ref.id)

    async def _forget(self, key: str, ref: TemplateRef) -> None:
        self._record(key).unlink(missing_ok=True)
        await self._delete(ref)

    async def _delete(self, ref: TemplateRef) -> None:
        with contextlib.suppress(MoorageError, OSError):
            await self.driver.delete_template(ref)
