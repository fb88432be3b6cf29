"""The online backup: a copy of a running host's data directory in which every instance is at one point of its own
(its files and memory asleep, its store rows exactly as they were then), taken one instance at a time.

Per instance, with its gate closed (``LiveInstance.gate``: its new turns wait) and under its lifecycle lock
(``LiveInstance.op_lock``, which every wake takes): it is put to sleep after the turn in flight, if any, its
directory is copied at rest, and for a per-user instance the store half of a checkpoint (``summary.backup``)
records its rows at that moment. Each tenant's database is copied afterwards with SQLite's online backup API (one
read snapshot), and the copy's rows of each instance are then rolled back to that checkpoint, so turns that ran
after the instance was copied are not in the copy. Instances without such a checkpoint (one per session or
workflow run, zero-retention agents) stay held until their tenant's database is copied. A tenant is listed again
until no new instance turns up, and a last time with its new instances held back (``NewInstances``) until its
database is copied: every instance in the copied store is in the copy, and every one in the copy is in its store.
``DEST/moorage-backup.incomplete`` exists until everything is copied and synced; ``moorage up`` refuses such a
directory. docs/operations.md, "Online backup".
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sqlite3
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Awaitable, Callable

from moorage.errors import ConflictError, InvalidInput, MoorageError, NotFound
from moorage.log import get_logger
from moorage.runtime.backup_files import BackupFailed, copy_but_booted, copy_tree
from moorage.timetravel.holding import LINE_HOLDER

if TYPE_CHECKING:
    from moorage.lifecycle.manager import LiveInstance
    from moorage.store import SandboxRecord, TenantStore

log = get_logger(__name__)

#: Written first into DEST and removed once the whole copy is on disk: a directory holding it is not a backup.
INCOMPLETE = "moorage-backup.incomplete"
#: What the backup holds: each instance's point, written last (before the marker goes).
MANIFEST = "moorage-backup.json"
#: How long the backup waits for an instance's turn in flight before it moves on and comes back to it once the
#: tenant's other instances are copied (its gate open again meanwhile), and how long it waits then before giving up.
DEFER_S = 2.0
WAIT_S = 300.0
#: Instances read from the store at a time.
PAGE = 1000
#: Listings of a tenant's instances after the first, looking for new ones, before the last listing, which holds
#: its new instances back until its database is copied.
RELIST = 3
#: Tries of the last listing with new instances held back: one that finds an instance still in a turn after
#: ``DEFER_S`` lets them go, waits for it, and tries again; the last waits ``HELD_S`` under the hold, then fails.
HOLD_TRIES = 3
HELD_S = 60.0
#: States in which an instance's directory is at rest once its lifecycle lock is held.
AT_REST = ("sleeping", "archived", "failed", "waking")
#: Top-level entries of the data directory the backup copies its own way, or leaves out.
OWN_WAY = {"store", "sandboxes", "pool", "moorage-up.lock", "admin.sock", "moorage-up.json"}

Progress = Callable[[dict[str, Any]], Awaitable[None]]
#: The name of a per-user instance's backup point while its tenant's store is not copied yet (retention keeps
#: named checkpoints); unnamed afterwards, on the host and in the copy, so retention prunes it like a turn's.
POINT_NAME = "backup"


def _unname(ts: "TenantStore", checkpoint_ids: list[str]) -> None:
    with ts._tx() as c:
        for cid in checkpoint_ids:
            c.x("UPDATE checkpoints SET name = NULL WHERE id = ? AND name = ?", (cid, POINT_NAME))


class _StillBusy(Exception):
    """The instance's turn is still running after ``DEFER_S``: copied later."""


def refuse_incomplete(data_dir: Path) -> None:
    """Raise if ``data_dir`` is a backup that never finished (``moorage up`` calls this before it starts)."""
    from moorage.errors import ConfigError

    if (data_dir / INCOMPLETE).exists():
        raise ConfigError(f"{data_dir} is an online backup that did not finish ({INCOMPLETE} is there): it is not "
                          "a consistent copy", hint="remove it and take the backup again (moorage backup DEST)")


def copy_sqlite(src: Path, dst: Path) -> None:
    """A consistent copy of one SQLite database (WAL included) through SQLite's online backup API, in one step:
    one read snapshot, writers of the live database never blocked."""
    s = sqlite3.connect(str(src), timeout=60)
    try:
        os.close(os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))  # readable by the owner only
        d = sqlite3.connect(str(dst))
        try:
            s.backup(d)
            d.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        finally:
            d.close()
    finally:
        s.close()
    for extra in ("-wal", "-shm"):  # the copy is whole in its main file
        Path(str(dst) + extra).unlink(missing_ok=True)
    fd = os.open(dst, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def copy_control(src: Path, dst: Path, tenants: list[str]) -> None:
    """The operator database, with only ``tenants`` (those the backup copies) and their keys: a tenant created
    after they were listed has no database in the copy, and a restore would serve it empty."""
    copy_sqlite(src, dst)
    c = sqlite3.connect(str(dst))
    try:
        with c:
            c.execute("CREATE TEMP TABLE backed_up (id TEXT PRIMARY KEY)")
            c.executemany("INSERT INTO backed_up VALUES (?)", [(t,) for t in tenants])
            c.execute("DELETE FROM api_keys WHERE tenant_id NOT IN (SELECT id FROM backed_up)")
            c.execute("DELETE FROM tenants WHERE id NOT IN (SELECT id FROM backed_up)")
    finally:
        c.close()
    fd = os.open(dst, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass
class Copied:
    """One instance in the backup: its record as it was when copied, and its restore point."""

    tenant: str
    rec: "SandboxRecord"
    checkpoint: str | None
    at: float

    def entry(self) -> dict[str, Any]:
        return {"tenant": self.tenant, "instance": self.rec.id, "scope": self.rec.scope.key, "state": self.rec.state,
                "point": "checkpoint" if self.checkpoint else "held", "checkpoint": self.checkpoint,
                "copied_at": self.at}


@dataclass
class OnlineBackup:
    """One backup of ``host``'s data directory into ``dest`` (which must not exist)."""

    host: Any
    dest: Path
    progress: Progress
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    copied: list[Copied] = field(default_factory=list)
    left_out: list[dict[str, Any]] = field(default_factory=list)
    #: Instances to copy, as known so far (a tenant's later listings can add some).
    total: int = 0
    #: Per tenant, the scopes a fork was making as its database was copied (``_forks_under_way``).
    forking: dict[str, list[str]] = field(default_factory=dict)
    #: Seconds new instances were held back, all tenants together (first turns of new users waited that long).
    held_s: float = 0.0

    @property
    def data_dir(self) -> Path:
        return Path(self.host.config.data_dir)

    @property
    def mgr(self) -> Any:
        return self.host.manager

    def check(self) -> None:
        cfg = self.host.config
        if cfg.store_url not in ("sqlite", "") or self.mgr.fleet is not None:
            raise InvalidInput(f"this host's store is not in its data directory (store_url = {cfg.store_url})",
                               hint="back the database up with its own tools (pg_dump) and each host's data "
                                    "directory stopped (docs/fleet.md)")
        if not self.dest.is_absolute():
            raise InvalidInput(f"the destination {self.dest} is not an absolute path", hint="name it from /")
        if self.dest.exists() or self.dest.is_symlink():
            raise InvalidInput(f"{self.dest} already exists", hint="name a directory that does not exist yet")
        if not self.dest.parent.is_dir():
            raise InvalidInput(f"{self.dest.parent} is not a directory", hint="create it first")
        real, data = self.dest.parent.resolve() / self.dest.name, self.data_dir.resolve()
        if real == data or data in real.parents:
            raise InvalidInput(f"{self.dest} is inside the data directory {data}",
                               hint="back up to a directory outside it")

    async def run(self) -> dict[str, Any]:
        self.check()
        started = time.time()
        self.dest.mkdir(mode=0o700)
        (self.dest / INCOMPLETE).write_text(json.dumps({"backup": self.id, "started_at": started,
                                                        "pid": os.getpid()}) + "\n")
        for d in ("store", "store/tenants", "sandboxes"):  # private, as in the data directory
            (self.dest / d).mkdir(mode=0o700)
        store_root = self.data_dir / "store"
        # The tenants, then the operator database: every tenant backed up is in it, and one made since is not.
        tenants = await asyncio.to_thread(lambda: [t.tenant_id for t in self.host.store.operator.tenants()])
        await asyncio.to_thread(copy_control, store_root / "control.db", self.dest / "store" / "control.db", tenants)
        plan = {tid: await self._instances(tid) for tid in tenants}
        self.total = sum(len(v) for v in plan.values())
        await self.progress({"event": "start", "backup": self.id, "tenants": len(tenants), "total": self.total})
        phases: dict[str, float] = {}
        t = time.monotonic()
        for tid in tenants:
            await self._tenant(tid, plan[tid])
        phases["instances_s"], t = time.monotonic() - t, time.monotonic()
        await self._rest()
        phases["rest_s"], t = time.monotonic() - t, time.monotonic()
        await asyncio.to_thread(self._fix_copy)
        phases["fix_s"], t = time.monotonic() - t, time.monotonic()
        phases["new_instances_held_s"] = self.held_s
        manifest = {"format": 1, "backup": self.id, "host": self.mgr.host, "data_dir": str(self.data_dir),
                    "started_at": started, "finished_at": time.time(),
                    "instances": [c.entry() for c in self.copied], "left_out": self.left_out,
                    "phases": {k: round(v, 3) for k, v in phases.items()}}
        (self.dest / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        await asyncio.to_thread(os.sync)
        phases["sync_s"] = time.monotonic() - t
        (self.dest / INCOMPLETE).unlink()
        seconds = round(time.time() - started, 3)
        log.info("online backup finished", dest=str(self.dest), instances=len(self.copied), seconds=seconds)
        return {"event": "done", "backup": self.id, "dest": str(self.dest), "instances": len(self.copied),
                "left_out": len(self.left_out), "seconds": seconds,
                "phases": {k: round(v, 3) for k, v in phases.items()}}

    async def _instances(self, tid: str) -> list["SandboxRecord"]:
        ts = await asyncio.to_thread(self.mgr.system_tenant, tid)
        found: dict[str, "SandboxRecord"] = {}
        after: tuple[float, str] | None = None
        while True:  # page by page: activity only moves an instance later in this order, so none is missed
            page = await asyncio.to_thread(ts.sandboxes.list, limit=PAGE, after=after)
            found.update((r.id, r) for r in page)
            if len(page) < PAGE:
                break
            after = (page[-1].last_active, page[-1].id)
        recs = [r for r in found.values() if r.state != "deleted"]
        # Per-user instances first: each is let go as soon as it is copied. The others stay held to the end.
        return sorted(recs, key=lambda r: (r.scope.kind != "user", r.created_at))

    async def _tenant(self, tid: str, recs: list["SandboxRecord"]) -> None:
        """Copy every instance of one tenant, then its database: listed again until no new one is found (new
        users, forks), then once more and the database copied with the tenant's new instances held back (a first
        turn waits that long), so every instance in the copied database is one copied."""
        ts = await asyncio.to_thread(self.mgr.system_tenant, tid)
        held: list["LiveInstance"] = []
        seen: set[str] = set()
        try:
            for rec in await self._copy_all(ts, recs, held, seen):
                await self._one(ts, rec, held, WAIT_S)
            for _ in range(RELIST):
                if not await self._copy_new(ts, held, seen):
                    break
            for attempt in range(HOLD_TRIES):
                since, busy = time.monotonic(), []
                try:
                    async with self.mgr.new_instances.held(tid):
                        # Made since the last listing, before the hold. One in a long turn (a first turn may wait
                        # on the hold itself, through another instance): copied with the hold let go, then again.
                        busy = await self._copy_new(ts, held, seen, last=attempt == HOLD_TRIES - 1)
                        if not busy:
                            await self._copy_store(tid)
                            self.forking[tid] = self._forks_under_way(tid)
                finally:
                    self.held_s += time.monotonic() - since
                if not busy:
                    break
                for rec in busy:
                    await self._one(ts, rec, held, WAIT_S)
        finally:
            for li in held:
                self._let_go(li)
            mine = [c.checkpoint for c in self.copied if c.tenant == tid and c.checkpoint]
            try:
                await asyncio.to_thread(_unname, ts, mine)
            except MoorageError as e:  # costs a checkpoint kept for good, never the backup
                log.warning("the backup's checkpoints could not be unnamed", tenant=tid, error=str(e))

    async def _copy_store(self, tid: str) -> None:
        src = Path(self.host.store.backend.tenant_path(tid))
        dst = self.dest / "store" / "tenants" / src.name
        if src.exists():
            await asyncio.to_thread(copy_sqlite, src, dst)
            lg = src.with_suffix(".lg")  # LangGraph's large values: rows point below the log's recorded end
            if lg.exists():
                await copy_tree(lg, dst.with_suffix(".lg"))

    async def _copy_new(self, ts: "TenantStore", held: list["LiveInstance"], seen: set[str], *,
                        last: bool | None = None) -> list["SandboxRecord"]:
        """Copy the tenant's instances not seen yet. Not under the hold (``last`` None): all of them, those in a
        long turn after the others; returns them all. Under the hold: those in a long turn are returned uncopied
        (to be copied with the hold let go), or, on its ``last`` try, waited for ``HELD_S``."""
        recs = [r for r in await self._instances(ts.tenant_id) if r.id not in seen]
        self.total += len(recs)
        busy = await self._copy_all(ts, recs, held, seen)
        if last is None:
            for rec in busy:
                await self._one(ts, rec, held, WAIT_S)
            return recs
        if last:
            for rec in busy:
                try:
                    await self._one(ts, rec, held, HELD_S)
                except _StillBusy:
                    raise BackupFailed(f"the instance of {rec.scope} was still in a turn after {HELD_S:.0f} s while "
                                       "its tenant's new instances were held back",
                                       hint="take the backup again at a quieter moment") from None
            return []
        return busy

    async def _copy_all(self, ts: "TenantStore", recs: list["SandboxRecord"], held: list["LiveInstance"],
                        seen: set[str]) -> list["SandboxRecord"]:
        """Copy each instance unless it is still in a turn after ``DEFER_S``; those are returned."""
        later: list["SandboxRecord"] = []
        for rec in recs:
            seen.add(rec.id)
            try:
                await self._one(ts, rec, held, DEFER_S)
            except _StillBusy:
                later.append(rec)  # in a long turn: the others first
        return later

    def _forks_under_way(self, tid: str) -> list[str]:
        """Scopes (keys) of the tenant a fork is making as its database is copied: the fork copies the source's
        rows to its new user before that user's instance is made (held back now), so the copy may hold their rows
        without their instance; ``_fix_copy`` removes them (the fork is not in the copy, as if it failed)."""
        copied = {c.rec.scope.key for c in self.copied if c.tenant == tid}
        return [key for key, holder in self.host.runtime.router.holders(tid).items()
                if holder == LINE_HOLDER and key not in copied]

    async def _one(self, ts: "TenantStore", rec: "SandboxRecord", held: list["LiveInstance"], patience: float) -> None:
        copied = await self._instance(ts, rec, held, patience)
        if copied is not None:
            self.copied.append(copied)
        await self.progress({"event": "instance", "done": len(self.copied) + len(self.left_out),
                             "total": self.total, "instance": rec.scope.key})

    async def _instance(self, ts: "TenantStore", rec: "SandboxRecord", held: list["LiveInstance"],
                        patience: float) -> Copied | None:
        from moorage.lifecycle.config import AgentLifecycle
        from moorage.store import zero_retention
        from moorage.store.repos.checkpoints import checkpoints_of

        try:
            agent = await asyncio.to_thread(ts.agents.get, rec.scope.agent)
        except NotFound:
            self.left_out.append({"instance": rec.id, "scope": rec.scope.key, "why": "its agent was deleted"})
            return None
        lc = AgentLifecycle.of(agent)
        li = self.mgr._live_for(ts, rec.scope, lc)
        now = await self._asleep(ts, li, rec, patience)
        if now is None:
            self.left_out.append({"instance": rec.id, "scope": rec.scope.key, "why": "deleted during the backup"})
            return None
        keep = False
        try:
            checkpoint = None
            if rec.scope.kind == "user" and not zero_retention.is_zero(agent):
                # Named, so retention keeps it until its tenant's store is copied (then unnamed: ``_unname``); no
                # sandbox half on this host, so a rollback to it here is refused.
                ck = await asyncio.to_thread(checkpoints_of(ts).take, rec.scope.agent, rec.scope.user, kind="manual",
                                             name=POINT_NAME, sandbox_id=rec.id,
                                             sandbox_checkpoint=f"backup-{self.id}",
                                             summary={"backup": self.id, "dest": str(self.dest)})
                checkpoint = ck.id
            src = Path(self.mgr.driver.root) / rec.id
            if src.exists():
                await copy_tree(src, self.dest / "sandboxes" / rec.id)
            keep = checkpoint is None
            return Copied(ts.tenant_id, now, checkpoint, time.time())
        finally:
            if keep:
                held.append(li)  # let go once the tenant's database is copied
            else:
                self._let_go(li)

    async def _asleep(self, ts: "TenantStore", li: "LiveInstance", rec: "SandboxRecord",
                      patience: float) -> "SandboxRecord | None":
        """Close the instance's gate (its new turns wait), let its turn in flight end, put it to sleep and take its
        lifecycle lock, which every wake takes: nothing runs in it until ``_let_go``. Returns its record (None:
        deleted meanwhile, and it is let go). A turn still running after ``patience`` (below ``WAIT_S``): the gate
        opens again and ``_StillBusy`` says to come back later."""
        li.gate = asyncio.get_running_loop().create_future()
        deadline = time.monotonic() + patience
        try:
            while True:
                while li.activity.busy and time.monotonic() < deadline:
                    await asyncio.sleep(0.01)
                if li.activity.busy and patience < WAIT_S:
                    raise _StillBusy()
                if li.owned and li.awake and not li.activity.busy:
                    try:
                        await self.mgr.sleep(ts, rec.scope, reason="backup")
                    except MoorageError as e:
                        log.warning("sleep for the backup failed", instance=rec.id, error=str(e))
                await li.op_lock.acquire()
                try:
                    now = await asyncio.to_thread(ts.sandboxes.get, rec.id)
                except NotFound:
                    self._let_go(li)
                    return None
                if not li.awake and now.state in AT_REST:
                    return now
                li.op_lock.release()
                if time.monotonic() > deadline:
                    if patience < WAIT_S:
                        raise _StillBusy()
                    raise BackupFailed(f"the instance of {rec.scope} could not be put to sleep in {WAIT_S:.0f} s (a "
                                       f"turn ran that long, or it is {now.state})",
                                       hint="take the backup again at a quieter moment, or stop the host and back "
                                            "it up")
                await asyncio.sleep(0.02)
        except BaseException:
            self._let_go(li, locked=False)
            raise

    @staticmethod
    def _let_go(li: "LiveInstance", *, locked: bool = True) -> None:
        """Open the instance again: its lifecycle lock released, its waiting turns let in."""
        if locked:
            li.op_lock.release()
        gate, li.gate = li.gate, None
        if gate is not None and not gate.done():
            gate.set_result(None)

    async def _rest(self) -> None:
        """Everything else in the data directory: templates, images, packages, keys (none is written in place),
        without the booted templates (``runtime/backup_files.py``)."""
        for entry in sorted(self.data_dir.iterdir()):
            if entry.name in OWN_WAY or entry.name.endswith(".sock"):
                continue
            await copy_but_booted(entry, self.dest / entry.name, entry.name)
        root = Path(self.mgr.driver.root)
        for entry in sorted(root.iterdir()) if root.is_dir() else []:
            if entry.name.startswith("."):  # .templates: what every fork is a delta of
                await copy_but_booted(entry, self.dest / "sandboxes" / entry.name, f"sandboxes/{entry.name}")
        for entry in sorted((self.data_dir / "store").iterdir()):
            if entry.name not in ("control.db", "tenants") and not entry.name.startswith("control.db-"):
                await copy_tree(entry, self.dest / "store" / entry.name)

    def _fix_copy(self) -> None:
        """Make the copy's store say what its files hold: each instance asleep as it was copied, each per-user
        instance's rows those of its backup checkpoint, no instance whose directory is not in the copy, no
        directory whose instance is not in the copied store, and no rows of a fork's new user without their
        instance."""
        from moorage.config import Config
        from moorage.store import Scope, open_store
        from moorage.store.repos.checkpoints import checkpoints_of

        by_tenant: dict[str, list[Copied]] = {}
        for c in self.copied:
            by_tenant.setdefault(c.tenant, []).append(c)
        for path in sorted((self.dest / "store" / "tenants").glob("*.db")):
            items = by_tenant.get(path.stem, [])
            db = sqlite3.connect(str(path))
            try:
                with db:
                    states = dict(db.execute("SELECT id, state FROM sandboxes").fetchall())
                    for c in items:
                        if states.get(c.rec.id, "deleted") == "deleted":
                            self._drop(c)  # deleted (or its user forgotten) once copied: gone from the store copy
                            continue
                        meta = {k: v for k, v in c.rec.meta.items() if k not in ("claim", "owner", "awake_since")}
                        state = "sleeping" if c.rec.state == "waking" else c.rec.state
                        db.execute("UPDATE sandboxes SET state = ?, host = ?, snapshot_ref = ?, meta = ?, "
                                   "version = version + 1 WHERE id = ?",
                                   (state, c.rec.host, c.rec.snapshot_ref, json.dumps(meta), c.rec.id))
                    ids = {c.rec.id for c in self.copied if c.tenant == path.stem}
                    for (sid, scope) in db.execute("SELECT id, scope FROM sandboxes WHERE state != 'deleted'").fetchall():
                        if sid not in ids:  # listed but not copied (its agent deleted meanwhile)
                            db.execute("DELETE FROM sandboxes WHERE id = ?", (sid,))
                            if sid not in {x["instance"] for x in self.left_out}:
                                self.left_out.append({"instance": sid, "scope": scope, "why": "not copied"})
            finally:
                db.close()
        store = open_store(Config(data_dir=self.dest))
        try:
            for c in self.copied:
                if c.checkpoint is None:
                    continue
                ts = store.tenant(store.operator.principal(c.tenant))
                repo = checkpoints_of(ts)
                # Always: turns after the point may have left no checkpoint (an agent with them turned off).
                try:
                    repo.rollback(c.rec.scope.agent, c.rec.scope.user, c.checkpoint)  # type: ignore[arg-type]
                except (NotFound, ConflictError) as e:
                    raise BackupFailed(f"the copy of {c.rec.scope} could not be put back to its point: {e}",
                                       hint="take the backup again") from e
                _unname(ts, [c.checkpoint])
            for tid, keys in self.forking.items():
                ts = store.tenant(store.operator.principal(tid))
                for key in keys:
                    scope = Scope.parse(key)
                    if scope.user is not None and ts.forget_user(scope.user, scope.agent):
                        self.left_out.append({"instance": None, "scope": key,
                                              "why": "a fork was making this user as the store was copied"})
        finally:
            store.close()

    def _drop(self, c: Copied) -> None:
        self.copied.remove(c)
        shutil.rmtree(self.dest / "sandboxes" / c.rec.id, ignore_errors=True)
        self.left_out.append({"instance": c.rec.id, "scope": c.rec.scope.key,
                              "why": "deleted, or its user forgotten, after it was copied"})
