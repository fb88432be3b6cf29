"""The store half of agent checkpoints: per instance (agent, end-user), manifests of its rows at one point,
row images by digest, the branch head, and the store side of rollback and of a fork into another end-user.

What a checkpoint holds (docs/decisions/0011): the event ids its lineage holds (episodic events are
append-only, so the events of a checkpoint are the instance's events in those id ranges; a rollback keeps the
events it takes off in ``checkpoint_events``) and a manifest of the instance's *mutable*
rows (state, facts, workflow runs, steps, journal, sessions): primary key -> digest of the row's image, the
images kept once per instance in ``checkpoint_rows``; a checkpoint reads only the rows written since the one
before and stores its manifest as a delta on it (``checkpoint_image``). Spans, usage and executions are history
of what happened and was said to the outside; they are never rolled back.
"""

from __future__ import annotations

import json
import time
import unicodedata
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Sequence

from moorage.errors import ConflictError, InvalidInput, NotFound
from moorage.store.model import Scope, check_id
from moorage.store.repos import checkpoint_image as ci
from moorage.store.repos.checkpoint_image import IMAGED as TABLES

if TYPE_CHECKING:
    from moorage.store.sql import Conn
    from moorage.store.tenant import TenantStore

KINDS = ("turn", "manual", "before-rollback", "fork")
#: A turn's automatic checkpoint that failed: listed where it would be, never a point to go back to.
MISSING = "missing"


_EVENT_COLS = ("scope", "ts", "kind", "speaker", "content", "meta", "embedding")


@dataclass(frozen=True)
class Checkpoint:
    id: str
    agent: str
    user: str
    seq: int
    branch: str
    parent_id: str | None
    kind: str
    name: str | None
    turn_id: str | None
    summary: dict[str, Any]
    event_mark: int
    event_ranges: list[list[int]]
    sandbox_id: str | None
    sandbox_checkpoint: str | None
    store_bytes: int
    created_at: float


@dataclass(frozen=True)
class Head:
    agent: str
    user: str
    branch: str
    head_id: str | None
    pending: dict[str, Any] | None
    version: int
    #: Event ids of the current lineage: closed intervals, the last one open (None).
    event_ranges: list[list[int | None]] = field(default_factory=lambda: [[0, None]])
    #: Since when the instance's rows may differ from the head checkpoint's manifest (None: read them whole).
    row_mark: str | None = None


_COLS = ("id, agent_id, user_id, seq, branch, parent_id, kind, name, turn_id, summary, event_mark, event_ranges, "
         "sandbox_id, sandbox_checkpoint, store_bytes, created_at")


def _checkpoint(r: tuple) -> Checkpoint:
    return Checkpoint(r[0], r[1], r[2], int(r[3]), r[4], r[5], r[6], r[7], r[8], json.loads(r[9]), int(r[10]),
                      json.loads(r[11]), r[12], r[13], int(r[14]), float(r[15]))


def _in_ranges(ranges: Sequence[Sequence[int | None]]) -> tuple[str, list[int]]:
    """SQL (on ``id``) and parameters: the id lies in one of the closed intervals (an open end: no bound)."""
    parts, params = [], []
    for lo, hi in ranges:
        if hi is None:
            parts.append("id >= ?")
            params.append(int(lo))  # type: ignore[arg-type]
        else:
            parts.append("id BETWEEN ? AND ?")
            params += [int(lo), int(hi)]  # type: ignore[arg-type]
    return ("(" + " OR ".join(parts) + ")" if parts else "(1 = 0)"), params


def _contains(ranges: Sequence[Sequence[int | None]], i: int) -> bool:
    return any(lo <= i and (hi is None or i <= hi) for lo, hi in ranges)  # type: ignore[operator]


class Checkpoints:
    """``Checkpoints(ts)``: the store half of agent checkpoints of one tenant (see the module docstring)."""

    def __init__(self, ts: "TenantStore") -> None:
        self._ts = ts

    # -- reading the instance ------------------------------------------------------------------------------

    @staticmethod
    def _event_mark(c: "Conn") -> int:
        # The table's highest id, not the instance's: one index probe. Only this instance's events above it are
        # ever deleted, and its own events are written by its turns, which do not run while a checkpoint is taken.
        r = c.one("SELECT MAX(id) FROM events")
        return int(r[0] or 0) if r else 0

    def head(self, agent: str, user: str) -> Head | None:
        check_id(agent, "agent id"), check_id(user, "user id")
        with self._ts._tx(write=False) as c:
            return self._head(c, agent, user)

    @staticmethod
    def _head(c: "Conn", agent: str, user: str) -> Head | None:
        r = c.one("SELECT branch, head_id, pending, version, event_ranges, row_mark FROM checkpoint_heads "
                  "WHERE agent_id = ? AND user_id = ?", (agent, user))
        return None if r is None else Head(agent, user, r[0], r[1], json.loads(r[2]) if r[2] else None, int(r[3]),
                                           json.loads(r[4]), r[5])

    def _set_head(self, c: "Conn", agent: str, user: str, branch: str, head_id: str | None,
                  pending: dict[str, Any] | None, ranges: Sequence[Sequence[int | None]], row_mark: str | None) -> None:
        now = time.time()
        pend = json.dumps(pending) if pending else None
        rj = json.dumps([list(r) for r in ranges])
        n = c.x("UPDATE checkpoint_heads SET branch = ?, head_id = ?, pending = ?, event_ranges = ?, row_mark = ?, "
                "version = version + 1, updated_at = ? WHERE agent_id = ? AND user_id = ?",
                (branch, head_id, pend, rj, row_mark, now, agent, user))
        if n == 0:
            c.x("INSERT INTO checkpoint_heads (agent_id, user_id, branch, head_id, pending, event_ranges, row_mark, "
                "version, updated_at) VALUES (?, ?, ?, ?, ?, ?, ?, 1, ?)",
                (agent, user, branch, head_id, pend, rj, row_mark, now))

    def _now(self, c: "Conn", agent: str, user: str, head: Head | None) -> ci.Image:
        """The instance's rows now: read against the head checkpoint's manifest when the head has a mark."""
        if head is None or head.head_id is None or head.row_mark is None or ci.below_floor(c, head.row_mark):
            return ci.read(c, agent, user)
        return ci.read(c, agent, user, ci.resolve(c, self._ts.tenant_id, head.head_id), head.row_mark)

    def pending(self) -> list[tuple[str, str]]:
        """Instances with an operation left half done (agent, user)."""
        with self._ts._tx(write=False) as c:
            return [(r[0], r[1]) for r in c.q("SELECT agent_id, user_id FROM checkpoint_heads WHERE pending IS NOT NULL")]

    def set_pending(self, agent: str, user: str, pending: dict[str, Any] | None) -> None:
        """Record (or clear) an operation whose sandbox half runs outside the store's transaction."""
        with self._ts._tx() as c:
            h = self._head(c, agent, user)
            if h is None:
                self._set_head(c, agent, user, _new_branch(), None, pending, [[0, None]], None)
            else:
                self._set_head(c, agent, user, h.branch, h.head_id, pending, h.event_ranges, h.row_mark)

    # -- taking --------------------------------------------------------------------------------------------

    def take(self, agent: str, user: str, *, kind: str = "turn", name: str | None = None, turn_id: str | None = None,
             sandbox_id: str | None = None, sandbox_checkpoint: str | None = None, checkpoint_id: str | None = None,
             summary: dict[str, Any] | None = None, writing: bool = False) -> Checkpoint:
        """Record the instance's store state now as a checkpoint on its current branch, in one transaction.
        ``writing``: its sandbox files are still being written (behind its turn), until ``written``."""
        check_id(agent, "agent id"), check_id(user, "user id")
        if kind not in KINDS:
            raise InvalidInput(f"unknown checkpoint kind {kind!r}", hint=f"one of {', '.join(KINDS)}")
        check_name(name)
        cid = checkpoint_id or new_checkpoint_id()
        with self._ts._tx() as c:
            head = self._head(c, agent, user)
            branch = head.branch if head else _new_branch()
            parent = head.head_id if head else None
            row_mark = ci.new_mark(c)  # before reading: a row written after this is read by the next checkpoint
            img = self._now(c, agent, user, head)
            known = ci.resolve(c, self._ts.tenant_id, parent).digests() if parent is not None and img.changed is None \
                else set()
            if img.changed is not None:
                # Read against the parent: only the rows read are new to it (their digests may still be known).
                fresh_d = {d for t in img.changed.values() for d in t.values()}
            else:
                fresh_d = set(img.bodies) - known
            fresh = [(agent, user, d, *img.bodies[d]) for d in sorted(fresh_d)]
            # ON CONFLICT: a body may be known from an earlier checkpoint (unchanged rows, or after a rollback).
            if fresh:
                c.many("INSERT INTO checkpoint_rows (agent_id, user_id, digest, tbl, body) VALUES (?, ?, ?, ?, ?) "
                       "ON CONFLICT DO NOTHING", fresh)
            manifest, stored = ci.pack(img, parent)
            seq_row = c.one("SELECT MAX(seq) FROM checkpoints WHERE agent_id = ? AND user_id = ?", (agent, user))
            seq = int(seq_row[0] or 0) + 1 if seq_row else 1
            summ = dict(summary or {})
            if turn_id is not None:
                summ.setdefault("turn", _turn_summary(c, turn_id))
            store_bytes = len(manifest) + sum(len(f[4]) for f in fresh)
            now, mark = time.time(), self._event_mark(c)
            lineage = head.event_ranges if head else [[0, None]]
            ranges = [[lo, mark if hi is None else hi] for lo, hi in lineage]
            ranges = [r for r in ranges if r[0] <= r[1]]  # type: ignore[operator]
            c.x(f"INSERT INTO checkpoints ({_COLS}, manifest, writing) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (cid, agent, user, seq, branch, parent, kind, name, turn_id, json.dumps(summ), mark,
                 json.dumps(ranges), sandbox_id, sandbox_checkpoint, store_bytes, now, c.blob(manifest),
                 1 if writing and sandbox_checkpoint else None))
            self._set_head(c, agent, user, branch, cid, head.pending if head else None, lineage, row_mark)
            if stored.depth == 0:  # every FULL_EVERY-th checkpoint of an instance: deletions no head needs go
                ci.prune_deletions(c, now)
        ci.CACHE.put((self._ts.tenant_id, cid), stored)
        return Checkpoint(cid, agent, user, seq, branch, parent, kind, name, turn_id, summ, mark, ranges,  # type: ignore[arg-type]
                          sandbox_id, sandbox_checkpoint, store_bytes, now)

    # -- reading -------------------------------------------------------------------------------------------

    def record_missing(self, agent: str, user: str, *, turn_id: str | None, error: str) -> Checkpoint:
        """Record that the turn's automatic checkpoint failed: a row of kind ``missing`` in the turn's place in the
        list (what the turn did, and why there is no checkpoint), which moves no head and holds nothing."""
        check_id(agent, "agent id"), check_id(user, "user id")
        cid = new_checkpoint_id()
        summary: dict[str, Any] = {"error": str(error)[:500]}
        with self._ts._tx() as c:
            head = self._head(c, agent, user)
            branch = head.branch if head else _new_branch()
            if turn_id is not None:
                turn: dict[str, Any] = {"id": turn_id}
                r = c.one("SELECT status, input FROM workflow_runs WHERE id = ?", (turn_id,))
                if r is not None:
                    inp = json.loads(r[1]) if r[1] else {}
                    turn.update(status=r[0], message=str((inp or {}).get("message", ""))[:200])
                summary["turn"] = turn
            seq_row = c.one("SELECT MAX(seq) FROM checkpoints WHERE agent_id = ? AND user_id = ?", (agent, user))
            seq = int(seq_row[0] or 0) + 1 if seq_row else 1
            now = time.time()
            c.x(f"INSERT INTO checkpoints ({_COLS}, manifest) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (cid, agent, user, seq, branch, head.head_id if head else None, MISSING, None, turn_id,
                 json.dumps(summary), 0, "[]", None, None, 0, now, c.blob(ci.pack_whole(ci.Manifest({})))))
        return Checkpoint(cid, agent, user, seq, branch, head.head_id if head else None, MISSING, None, turn_id,
                          summary, 0, [], None, None, 0, now)

    def written_behind(self) -> list[Checkpoint]:
        """The automatic checkpoints still marked as being written behind their turns (``take(writing=True)``):
        those whose sandbox files a host that died may not have written, and those written whose mark it had not
        cleared yet. Through their partial index (store migration 29): not every checkpoint."""
        with self._ts._tx(write=False) as c:
            rows = c.q(f"SELECT {_COLS} FROM checkpoints WHERE writing = 1")
        return [_checkpoint(r) for r in rows if r[6] == "turn" and r[13] is not None]

    def written(self, agent: str, user: str, checkpoint_id: str) -> None:
        """The sandbox files of a checkpoint taken with ``writing=True`` are on disk (or nothing can tell any more
        whether they are): its mark goes."""
        with self._ts._tx() as c:
            c.x("UPDATE checkpoints SET writing = NULL WHERE id = ? AND agent_id = ? AND user_id = ? AND writing = 1",
                (checkpoint_id, agent, user))

    def mark_unwritten(self, agent: str, user: str, checkpoint_id: str, error: str) -> bool:
        """An automatic checkpoint whose sandbox files were never written becomes ``missing``: listed as what its
        turn did, never a point to go back to, a branch's tip or one retention keeps in its place. Its store half
        stays (the head may name it: the next checkpoint builds on it). Whether it was changed."""
        with self._ts._tx() as c:
            r = c.one("SELECT summary FROM checkpoints WHERE id = ? AND agent_id = ? AND user_id = ? AND kind = 'turn'",
                      (checkpoint_id, agent, user))
            if r is None:
                return False
            summary = {**json.loads(r[0]), "error": str(error)[:500]}
            c.x("UPDATE checkpoints SET kind = ?, summary = ?, writing = NULL WHERE id = ? AND agent_id = ? "
                "AND user_id = ?", (MISSING, json.dumps(summary), checkpoint_id, agent, user))
        return True

    def list(self, agent: str, user: str, *, limit: int = 1000) -> list[Checkpoint]:
        check_id(agent, "agent id"), check_id(user, "user id")
        with self._ts._tx(write=False) as c:
            rows = c.q(f"SELECT {_COLS} FROM checkpoints WHERE agent_id = ? AND user_id = ? ORDER BY seq DESC LIMIT ?",
                       (agent, user, limit))
        return [_checkpoint(r) for r in rows]

    def get(self, agent: str, user: str, checkpoint_id: str) -> Checkpoint:
        check_id(agent, "agent id"), check_id(user, "user id")
        if not isinstance(checkpoint_id, str) or not checkpoint_id:
            raise NotFound("no such checkpoint")
        with self._ts._tx(write=False) as c:
            r = c.one(f"SELECT {_COLS} FROM checkpoints WHERE id = ? AND agent_id = ? AND user_id = ?",
                      (checkpoint_id, agent, user))
        if r is None:
            raise NotFound(f"user {user!r} of agent {agent!r} has no checkpoint {checkpoint_id!r}",
                           hint=f"list them with GET /v1/agents/{agent}/users/{user}/checkpoints")
        return _checkpoint(r)

    def by_ref(self, agent: str, user: str, ref: str) -> Checkpoint:
        """The checkpoint whose id is ``ref``, else the newest one named ``ref``."""
        check_id(agent, "agent id"), check_id(user, "user id")
        if not isinstance(ref, str) or not ref:
            raise NotFound("no such checkpoint")
        with self._ts._tx(write=False) as c:
            r = c.one(f"SELECT {_COLS} FROM checkpoints WHERE agent_id = ? AND user_id = ? AND (id = ? OR name = ?) "
                      "ORDER BY (id = ?) DESC, seq DESC LIMIT 1", (agent, user, ref, ref, ref))
        if r is None:
            raise NotFound(f"user {user!r} of agent {agent!r} has no checkpoint with the id or name {ref!r}",
                           hint=f"list them with GET /v1/agents/{agent}/users/{user}/checkpoints")
        return _checkpoint(r)

    def restorable(self, agent: str, user: str, checkpoint_id: str) -> Checkpoint:
        """``get``, refusing a ``missing`` one (a failed automatic checkpoint holds nothing to go back to)."""
        ck = self.get(agent, user, checkpoint_id)
        if ck.kind == MISSING:
            raise ConflictError(f"checkpoint {checkpoint_id!r} is missing: the automatic checkpoint after that turn "
                                f"failed ({ck.summary.get('error', 'no reason recorded')})",
                                hint="roll back to the checkpoint before or after it")
        return ck

    def storage_bytes(self, agent: str, user: str) -> int:
        """Bytes the store keeps for this instance's checkpoints (manifests and row images)."""
        with self._ts._tx(write=False) as c:
            a = c.one("SELECT COALESCE(SUM(LENGTH(manifest)), 0) FROM checkpoints WHERE agent_id = ? AND user_id = ?",
                      (agent, user))
            b = c.one("SELECT COALESCE(SUM(LENGTH(body)), 0) FROM checkpoint_rows WHERE agent_id = ? AND user_id = ?",
                      (agent, user))
        return int((a or (0,))[0]) + int((b or (0,))[0])

    # -- rollback ------------------------------------------------------------------------------------------

    def rollback(self, agent: str, user: str, checkpoint_id: str) -> str:
        """Make the instance's rows exactly those of the checkpoint, in one transaction; the instance continues
        on a new branch growing from it (returned). What came after stays in the checkpoints taken of it.

        A checkpoint taken during a turn (``ctx.checkpoint``) holds that turn's run as running; the rollback ends it
        as failed (nothing runs it on from there: the agent process that ran it is not the one that continues)."""
        target = self.restorable(agent, user, checkpoint_id)
        with self._ts._tx() as c:
            head = self._head(c, agent, user)
            row_mark = ci.new_mark(c)  # before reading and writing: the rows written here are read again next time
            want = ci.resolve(c, self._ts.tenant_id, target.id).rows
            have_all = self._now(c, agent, user, head).manifest.rows
            adds = {t.name: [d for k, d in want.get(t.name, {}).items() if have_all.get(t.name, {}).get(k) != d]
                    for t in TABLES}
            bodies = self._bodies(c, agent, user, {d for ds in adds.values() for d in ds})
            for t in TABLES:
                have, goal = have_all.get(t.name, {}), want.get(t.name, {})
                gone = [k for k, d in have.items() if goal.get(k) != d]
                for k in gone:
                    c.x(f"DELETE FROM {t.name} WHERE {' AND '.join(f'{p} = ?' for p in t.pk)}", json.loads(k))
                add = [ci.row_of(t, bodies[d]) for d in adds[t.name]]
                if add:
                    c.many(f"INSERT INTO {t.name} ({', '.join(t.cols)}) VALUES ({', '.join('?' * len(t.cols))})", add)
            self._rewind_events(c, agent, user, target.event_ranges)
            during = target.summary.get("during_turn")
            if isinstance(during, str):
                c.x("UPDATE workflow_runs SET status = 'failed', error = ?, updated_at = ?, version = version + 1 "
                    "WHERE id = ? AND status IN ('running', 'pending')",
                    (f"rolled back to checkpoint {target.id}, taken during this turn", time.time(), during))
            branch = _new_branch()
            # The new branch's events get ids above every id given out so far (ids are never reused).
            lineage = [*target.event_ranges, [self._event_mark(c) + 1, None]]
            self._set_head(c, agent, user, branch, target.id, None, lineage, row_mark)
        return branch

    def _rewind_events(self, c: "Conn", agent: str, user: str, ranges: list[list[int]]) -> None:
        """Make the instance's events exactly those whose ids lie in ``ranges``: others are moved aside (kept for
        a rollback to their branch), and those moved aside earlier that lie in ``ranges`` come back."""
        sp = ci.scope_params(c.dialect, agent, user)
        s = ci.scope_sql(c.dialect)
        inside, rp = _in_ranges(ranges)
        pg = self._ts.dialect == "postgres"
        c.x(f"INSERT INTO checkpoint_events (agent_id, user_id, id, {', '.join(_EVENT_COLS)}) "
            f"SELECT ?, ?, id, {', '.join(_EVENT_COLS)} FROM events WHERE {s} AND NOT {inside} "
            "ON CONFLICT DO NOTHING", (agent, user, *sp, *rp))
        c.x(f"DELETE FROM events WHERE {s} AND NOT {inside}", (*sp, *rp))
        back = f"SELECT id, {', '.join(_EVENT_COLS)} FROM checkpoint_events WHERE agent_id = ? AND user_id = ? AND {inside}"
        c.x(f"INSERT INTO events (id, {', '.join(_EVENT_COLS)}) {'OVERRIDING SYSTEM VALUE ' if pg else ''}{back}",
            (agent, user, *rp))
        c.x(f"DELETE FROM checkpoint_events WHERE agent_id = ? AND user_id = ? AND {inside}", (agent, user, *rp))

    @staticmethod
    def _bodies(c: "Conn", agent: str, user: str, digests: set[str]) -> dict[str, str]:
        out: dict[str, str] = {}
        ds = sorted(digests)
        for i in range(0, len(ds), 500):
            part = ds[i:i + 500]
            for d, body in c.q(f"SELECT digest, body FROM checkpoint_rows WHERE agent_id = ? AND user_id = ? "
                               f"AND digest IN ({','.join('?' * len(part))})", (agent, user, *part)):
                out[d] = body
        missing = digests - out.keys()
        if missing:
            raise ConflictError(f"{len(missing)} row images of a checkpoint of {agent}/{user} are missing",
                                hint="the checkpoint is damaged; roll back to another one")
        return out

    # -- fork ----------------------------------------------------------------------------------------------

    def copy_to_user(self, agent: str, user: str, checkpoint_id: str, to_user: str) -> int:
        """Copy the instance's rows as of the checkpoint to a new end-user of the same agent (new ids, scopes
        renamed). Journal entries under an explicit idempotency key (a side effect outside) are not copied: the
        effect happened once, and the key stays with the instance that did it. Returns the rows written."""
        check_id(to_user, "user id")
        if to_user == user:
            raise InvalidInput("a fork needs another user id", hint="roll back to stay on the same user")
        target = self.restorable(agent, user, checkpoint_id)
        ts = self._ts
        with ts._tx() as c:
            if c.one("SELECT 1 FROM scopes WHERE agent_id = ? AND user_id = ?", (agent, to_user)) or \
                    c.one("SELECT 1 FROM checkpoint_heads WHERE agent_id = ? AND user_id = ?", (agent, to_user)):
                raise ConflictError(f"user {to_user!r} of agent {agent!r} already has data",
                                    hint="fork into a new user id (or forget that user first)")
            want = ci.resolve(c, ts.tenant_id, target.id).rows
            bodies = self._bodies(c, agent, user, {d for rows in want.values() for d in rows.values()})
            rows = {t.name: [ci.row_of(t, bodies[d]) for d in want.get(t.name, {}).values()] for t in TABLES}
            sub = _Renamer(agent, user, to_user)
            during = target.summary.get("during_turn")
            for run in rows.get("workflow_runs", []):
                sub.ids[run[0]] = uuid.uuid4().hex
                if run[0] == during and run[3] in ("running", "pending"):
                    # The turn a ``ctx.checkpoint`` was taken in: the fork does not run it on (as for rollback).
                    run[3], run[8] = "failed", f"forked from checkpoint {target.id}, taken during this turn"
            for f in rows.get("facts", []):
                sub.ids[f[0]] = uuid.uuid4().hex
            n = 0
            # Events first: facts name the events they came from (provenance) by id.
            ev_map: dict[str, str] = {}
            cols = ", ".join(_EVENT_COLS)
            inside, rp = _in_ranges(target.event_ranges)
            s = ci.scope_sql(c.dialect)
            live = c.q(f"SELECT id, {cols} FROM events WHERE {inside} AND {s}",
                       (*rp, *ci.scope_params(c.dialect, agent, user)))
            aside = c.q(f"SELECT id, {cols} FROM checkpoint_events WHERE agent_id = ? AND user_id = ? AND {inside}",
                        (agent, user, *rp))
            for old_id, *vals in sorted(live + aside, key=lambda r: r[0]):
                vals[0] = sub.text(vals[0])
                # fetchall: SQLite finishes a RETURNING statement only when every row was read.
                (new,) = c.q(f"INSERT INTO events ({cols}) VALUES (?, ?, ?, ?, ?, ?, ?) RETURNING id", vals)
                ev_map[str(old_id)] = str(new[0])
                n += 1
            for t in TABLES:
                out = []
                for r in rows.get(t.name, []):
                    if t.name == "journal" and r[2] is not None and r[2] not in r[0]:
                        continue  # an explicit key: see the docstring
                    r = [sub.text(v) if isinstance(v, str) else v for v in r]
                    if t.name == "sessions":
                        r[2] = to_user
                    if t.name == "facts":
                        prov = json.loads(r[13]) if r[13] else []
                        if isinstance(prov, list):
                            r[13] = json.dumps([ev_map.get(p, p) if isinstance(p, str) else p for p in prov])
                    out.append(r)
                if out:
                    c.many(f"INSERT INTO {t.name} ({', '.join(t.cols)}) VALUES ({', '.join('?' * len(t.cols))})", out)
                    n += len(out)
            now = time.time()
            scopes = {r[1] for t in ("state", "facts", "workflow_runs") for r in rows.get(t, [])}
            scopes |= {r[0] for r in c.q(f"SELECT DISTINCT scope FROM events WHERE {s}",
                                         ci.scope_params(c.dialect, agent, to_user))}
            for key in sorted(scopes):
                if key.startswith(("user:", "session:", "workflow:")):
                    ts._touch(c, Scope.parse(sub.text(key)), now)
            # The new user is a user of the agent like any other, with the source's metadata and limits (caps); one
            # the product registered before (PUT .../users/{u}) keeps the metadata and limits it was given there.
            if ts.agent_users.find(agent, to_user) is None:
                src = ts.agent_users.find(agent, user)
                ts.agent_users.put(agent, to_user, meta=src.meta if src else None, limits=src.limits if src else None)
        return n

    # -- retention and forgetting --------------------------------------------------------------------------

    def prune(self, agent: str, user: str, keep: Iterable[str]) -> list[Checkpoint]:
        """Delete every checkpoint of the instance not in ``keep`` (never the head) and the row images no kept
        checkpoint needs; returns the deleted ones (their sandbox checkpoints are the caller's to delete)."""
        keep = set(keep)
        with self._ts._tx() as c:
            head = self._head(c, agent, user)
            if head and head.head_id:
                keep.add(head.head_id)
            rows = c.q(f"SELECT {_COLS} FROM checkpoints WHERE agent_id = ? AND user_id = ?", (agent, user))
            gone = [_checkpoint(r) for r in rows if r[0] not in keep]
            if not gone:
                return []
            gone_ids = {g.id for g in gone}
            live: set[str] = set()
            for (cid, blob) in c.q("SELECT id, manifest FROM checkpoints WHERE agent_id = ? AND user_id = ?",
                                   (agent, user)):
                if cid in gone_ids:
                    continue
                m = ci.resolve(c, self._ts.tenant_id, cid)  # before any checkpoint it builds on is deleted
                live |= m.digests()
                if ci.base_of(blob) in gone_ids:
                    # Its chain would lose a link: it is stored whole from now on (same rows, same cache entry).
                    c.x("UPDATE checkpoints SET manifest = ? WHERE id = ?", (c.blob(ci.pack_whole(m)), cid))
            for i in range(0, len(gone), 500):
                part = [g.id for g in gone[i:i + 500]]
                c.x(f"DELETE FROM checkpoints WHERE id IN ({','.join('?' * len(part))})", part)
            dead = [d for (d,) in c.q("SELECT digest FROM checkpoint_rows WHERE agent_id = ? AND user_id = ?",
                                      (agent, user)) if d not in live]
            for i in range(0, len(dead), 500):
                part = dead[i:i + 500]
                c.x(f"DELETE FROM checkpoint_rows WHERE agent_id = ? AND user_id = ? AND digest IN "
                    f"({','.join('?' * len(part))})", (agent, user, *part))
            kept = [json.loads(r[0]) for r in c.q("SELECT event_ranges FROM checkpoints WHERE agent_id = ? AND "
                                                  "user_id = ?", (agent, user))]
            unused = [i for (i,) in c.q("SELECT id FROM checkpoint_events WHERE agent_id = ? AND user_id = ?",
                                        (agent, user)) if not any(_contains(r, int(i)) for r in kept)]
            for i in range(0, len(unused), 500):
                part = unused[i:i + 500]
                c.x(f"DELETE FROM checkpoint_events WHERE agent_id = ? AND user_id = ? AND id IN "
                    f"({','.join('?' * len(part))})", (agent, user, *part))
        return gone

    def drop(self, agent: str, user: str, checkpoint_id: str) -> Checkpoint | None:
        """Delete one checkpoint a verb took before it failed (the sandbox verb fork refused after its checkpoint):
        the instance is left as if it had never been taken. As the head, the head goes back to its parent and the
        next checkpoint reads the instance whole. Returns it (its sandbox checkpoint is the caller's to delete), or
        None when it is gone already."""
        with self._ts._tx() as c:
            r = c.one(f"SELECT {_COLS} FROM checkpoints WHERE id = ? AND agent_id = ? AND user_id = ?",
                      (checkpoint_id, agent, user))
            if r is None:
                return None
            ck = _checkpoint(r)
            head = self._head(c, agent, user)
            if head is not None and head.head_id == ck.id:
                self._set_head(c, agent, user, head.branch, ck.parent_id, head.pending, head.event_ranges, None)
            others = [i for (i,) in c.q("SELECT id FROM checkpoints WHERE agent_id = ? AND user_id = ? AND id != ?",
                                        (agent, user, ck.id))]
        self.prune(agent, user, others)
        return ck

    def delete_user(self, agent: str, user: str) -> int:
        """Forget every checkpoint of the instance (with the user)."""
        return self.forget_user(user, agent)

    def forget_user(self, user: str, agent: str | None = None) -> int:
        """Forget every checkpoint of ``user``'s instances (of one agent, or of all)."""
        where, params = ("user_id = ?", (user,)) if agent is None else ("agent_id = ? AND user_id = ?", (agent, user))
        with self._ts._tx() as c:
            n = 0
            for t in ("checkpoints", "checkpoint_rows", "checkpoint_heads", "checkpoint_events"):
                n += c.x(f"DELETE FROM {t} WHERE {where}", params)
            # The keys of their rows deleted since their last checkpoint (state keys, ids) go too.
            if agent is not None:
                n += c.x("DELETE FROM row_deletions WHERE owner = ?", (ci.owner(agent, user),))
            else:
                tail = "split_part(owner, '/', 2)" if c.dialect == "postgres" else "substr(owner, instr(owner, '/') + 1)"
                n += c.x(f"DELETE FROM row_deletions WHERE {tail} = ?", (user,))
        return n


class _Renamer:
    """Rewrites a copied row's strings from one user to another: scope keys, and run and fact ids."""

    def __init__(self, agent: str, user: str, to_user: str) -> None:
        self.prefixes = [(f"{k}:{agent}/{user}/", f"{k}:{agent}/{to_user}/") for k in ("session", "workflow")]
        self.user_key = (Scope.for_user(agent, user).key, Scope.for_user(agent, to_user).key)
        self.ids: dict[str, str] = {}

    def text(self, v: str) -> str:
        if v == self.user_key[0]:
            return self.user_key[1]
        for old, new in self.prefixes:
            if v.startswith(old):
                v = new + v[len(old):]
        for old, new in self.ids.items():
            if old in v:
                v = v.replace(old, new)
        return v


def _turn_summary(c: "Conn", turn_id: str) -> dict[str, Any]:
    """What the turn did: its message, reply, status and the steps it journaled."""
    out: dict[str, Any] = {"id": turn_id}
    run = c.one("SELECT status, input, result FROM workflow_runs WHERE id = ?", (turn_id,))
    if run is not None:
        inp = json.loads(run[1]) if run[1] else {}
        res = json.loads(run[2]) if run[2] else {}
        out["status"] = run[0]
        out["message"] = str((inp or {}).get("message", ""))[:200]
        reply = (res or {}).get("reply") if isinstance(res, dict) else None
        out["reply"] = reply[:200] if isinstance(reply, str) else reply if reply is None else str(reply)[:200]
    steps = c.q("SELECT name, status FROM steps WHERE run_id = ? ORDER BY seq LIMIT 50", (turn_id,))
    out["steps"] = [{"name": n, "status": st} for n, st in steps]
    return out


def forget_instances(c: "Conn", scope_keys: Sequence[str]) -> int:
    """Delete the checkpoints of every instance (agent, user) one of ``scope_keys`` belongs to, in ``c``."""
    pairs = set()
    for key in scope_keys:
        try:
            sc = Scope.parse(key)
        except InvalidInput:
            continue
        if sc.user is not None:
            pairs.add((sc.agent, sc.user))
    n = 0
    for agent, user in sorted(pairs):
        for t in ("checkpoints", "checkpoint_rows", "checkpoint_heads", "checkpoint_events"):
            n += c.x(f"DELETE FROM {t} WHERE agent_id = ? AND user_id = ?", (agent, user))
        n += c.x("DELETE FROM row_deletions WHERE owner = ?", (ci.owner(agent, user),))
    return n


def check_name(name: str | None) -> None:
    """Refuse a checkpoint name the store would not record (callers check it before the sandbox half is taken), or
    that would not print as one line (listings, the CLI's table, logs): control characters (newlines, tabs, escape
    sequences), line separators, bidirectional overrides, lone surrogates. Other Unicode (emoji sequences too) is fine."""
    if name is not None and (not isinstance(name, str) or not 1 <= len(name) <= 100 or "\x00" in name):
        raise InvalidInput("a checkpoint name is 1-100 characters", hint="name it again, shorter (or leave it out)")
    bad = next((ch for ch in name or "" if unicodedata.category(ch) in ("Cc", "Cs", "Zl", "Zp")
                or "\u202a" <= ch <= "\u202e" or "\u2066" <= ch <= "\u2069"), None)
    if bad is not None:
        what = {"\n": "a newline", "\t": "a tab", "\r": "a carriage return", "\x1b": "an escape"}.get(bad) or \
            unicodedata.name(bad, "a control character").lower()
        raise InvalidInput(f"a checkpoint name is one line of printable text; this one holds U+{ord(bad):04X} "
                           f"({what})",
                           hint="name it again without newlines, tabs or other control characters")


def new_checkpoint_id() -> str:
    return "ck" + uuid.uuid4().hex[:18]


def _new_branch() -> str:
    return "br" + uuid.uuid4().hex[:10]


def checkpoints_of(ts: "TenantStore") -> Checkpoints:
    """The tenant's checkpoints repository (``ts.checkpoints`` where TenantStore binds it)."""
    repo = getattr(ts, "checkpoints", None)
    return repo if isinstance(repo, Checkpoints) else Checkpoints(ts)
