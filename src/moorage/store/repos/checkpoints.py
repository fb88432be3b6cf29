"""The store half of agent checkpoints: per instance (agent, end-user), manifests of its rows at one point,
row images by digest, the branch head, and the store side of rollback and of a fork into another end-user.

What a checkpoint holds (docs/decisions/0011): the event ids its lineage holds (episodic events are
append-only, so the events of a checkpoint are the instance's events in those id ranges; a rollback keeps the
events it takes off in ``checkpoint_events``) and a manifest of the instance's *mutable*
rows (state, facts, workflow runs, steps, journal, sessions): primary key -> digest of the row's image, the
images kept once per instance in ``checkpoint_rows``. Spans, usage and executions are history of what
happened and was said to the outside; they are never rolled back.
"""

from __future__ import annotations

import hashlib
import json
import time
import uuid
import zlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Sequence

from moorage.errors import ConflictError, InvalidInput, NotFound
from moorage.store.model import Scope, check_id

if TYPE_CHECKING:
    from moorage.store.sql import Conn
    from moorage.store.tenant import TenantStore

KINDS = ("turn", "manual", "before-rollback", "fork")
#: A turn's automatic checkpoint that failed: listed where it would be, never a point to go back to.
MISSING = "missing"


@dataclass(frozen=True)
class _Table:
    name: str
    cols: tuple[str, ...]
    pk: tuple[str, ...]
    #: WHERE clause selecting the instance's rows; ``{S}`` is the instance-scope condition.
    where: str


# ``{S}``: the row's scope is the instance's user scope or one of its session / workflow scopes. Prefixes are
# compared with substr, not LIKE: ids may contain "_", which LIKE would read as a wildcard (another user).
_S = "(scope = ? OR substr(scope, 1, ?) = ? OR substr(scope, 1, ?) = ?)"
_RUNS = f"SELECT id FROM workflow_runs WHERE {_S}"
TABLES: tuple[_Table, ...] = (
    _Table("state", ("scope", "key", "value", "version", "updated_at"), ("scope", "key"), _S),
    _Table("facts", ("id", "scope", "subject", "attribute", "value", "text", "valid_from", "valid_to", "recorded_at",
                     "superseded_at", "superseded_by", "trust", "status", "provenance", "source", "version"),
           ("id",), _S),
    _Table("workflow_runs", ("id", "scope", "name", "status", "input", "state", "current_step", "result", "error",
                             "created_at", "updated_at", "version"), ("id",), _S),
    _Table("steps", ("run_id", "seq", "name", "status", "attempts", "result", "error", "started_at", "finished_at"),
           ("run_id", "seq"), f"run_id IN ({_RUNS})"),
    _Table("journal", ("key", "scope", "run_id", "step", "status", "result", "error", "created_at", "updated_at",
                       "version"), ("key",), f"({_S} OR run_id IN ({_RUNS}))"),
    _Table("sessions", ("id", "agent_id", "user_id", "created_at", "last_active", "meta", "version"),
           ("agent_id", "user_id", "id"), "agent_id = ? AND user_id = ?"),
)
_BY_NAME = {t.name: t for t in TABLES}
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


@dataclass
class _Image:
    """The instance's mutable rows now: table -> primary key (JSON) -> (digest, body)."""

    rows: dict[str, dict[str, tuple[str, str]]] = field(default_factory=dict)

    def manifest(self) -> dict[str, dict[str, str]]:
        return {t: {k: d for k, (d, _) in rows.items()} for t, rows in self.rows.items()}


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


def _scope_params(agent: str, user: str) -> tuple[Any, ...]:
    sp, wp = f"session:{agent}/{user}/", f"workflow:{agent}/{user}/"
    return (Scope.for_user(agent, user).key, len(sp), sp, len(wp), wp)


def _params(t: _Table, agent: str, user: str) -> tuple[Any, ...]:
    if t.name == "sessions":
        return (agent, user)
    if t.name == "journal":
        return _scope_params(agent, user) * 2
    return _scope_params(agent, user)


def _digest(table: str, body: str) -> str:
    return hashlib.sha256(f"{table}\x00{body}".encode()).hexdigest()[:32]


def _pack(manifest: dict[str, dict[str, str]]) -> bytes:
    return zlib.compress(json.dumps(manifest, separators=(",", ":"), sort_keys=True).encode(), 6)


def _unpack(blob: Any) -> dict[str, dict[str, str]]:
    return json.loads(zlib.decompress(bytes(blob)))


class Checkpoints:
    """``Checkpoints(ts)``: the store half of agent checkpoints of one tenant (see the module docstring)."""

    def __init__(self, ts: "TenantStore") -> None:
        self._ts = ts

    # -- reading the instance ------------------------------------------------------------------------------

    @staticmethod
    def _image(c: "Conn", agent: str, user: str) -> _Image:
        img = _Image()
        for t in TABLES:
            rows = c.q(f"SELECT {', '.join(t.cols)} FROM {t.name} WHERE {t.where}", _params(t, agent, user))
            out: dict[str, tuple[str, str]] = {}
            npk = [t.cols.index(k) for k in t.pk]
            for r in rows:
                body = json.dumps(list(r), separators=(",", ":"))
                out[json.dumps([r[i] for i in npk], separators=(",", ":"))] = (_digest(t.name, body), body)
            img.rows[t.name] = out
        return img

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
        r = c.one("SELECT branch, head_id, pending, version, event_ranges FROM checkpoint_heads "
                  "WHERE agent_id = ? AND user_id = ?", (agent, user))
        return None if r is None else Head(agent, user, r[0], r[1], json.loads(r[2]) if r[2] else None, int(r[3]),
                                           json.loads(r[4]))

    def _set_head(self, c: "Conn", agent: str, user: str, branch: str, head_id: str | None,
                  pending: dict[str, Any] | None, ranges: Sequence[Sequence[int | None]]) -> None:
        now = time.time()
        pend = json.dumps(pending) if pending else None
        rj = json.dumps([list(r) for r in ranges])
        n = c.x("UPDATE checkpoint_heads SET branch = ?, head_id = ?, pending = ?, event_ranges = ?, "
                "version = version + 1, updated_at = ? WHERE agent_id = ? AND user_id = ?",
                (branch, head_id, pend, rj, now, agent, user))
        if n == 0:
            c.x("INSERT INTO checkpoint_heads (agent_id, user_id, branch, head_id, pending, event_ranges, version, "
                "updated_at) VALUES (?, ?, ?, ?, ?, ?, 1, ?)", (agent, user, branch, head_id, pend, rj, now))

    def pending(self) -> list[tuple[str, str]]:
        """Instances with an operation left half done (agent, user)."""
        with self._ts._tx(write=False) as c:
            return [(r[0], r[1]) for r in c.q("SELECT agent_id, user_id FROM checkpoint_heads WHERE pending IS NOT NULL")]

    def set_pending(self, agent: str, user: str, pending: dict[str, Any] | None) -> None:
        """Record (or clear) an operation whose sandbox half runs outside the store's transaction."""
        with self._ts._tx() as c:
            h = self._head(c, agent, user)
            if h is None:
                self._set_head(c, agent, user, _new_branch(), None, pending, [[0, None]])
            else:
                self._set_head(c, agent, user, h.branch, h.head_id, pending, h.event_ranges)

    # -- taking --------------------------------------------------------------------------------------------

    def take(self, agent: str, user: str, *, kind: str = "turn", name: str | None = None, turn_id: str | None = None,
             sandbox_id: str | None = None, sandbox_checkpoint: str | None = None, checkpoint_id: str | None = None,
             summary: dict[str, Any] | None = None) -> Checkpoint:
        """Record the instance's store state now as a checkpoint on its current branch, in one transaction."""
        check_id(agent, "agent id"), check_id(user, "user id")
        if kind not in KINDS:
            raise InvalidInput(f"unknown checkpoint kind {kind!r}", hint=f"one of {', '.join(KINDS)}")
        if name is not None and (not isinstance(name, str) or not 1 <= len(name) <= 100 or "\x00" in name):
            raise InvalidInput("a checkpoint name is 1-100 characters")
        cid = checkpoint_id or new_checkpoint_id()
        with self._ts._tx() as c:
            head = self._head(c, agent, user)
            branch = head.branch if head else _new_branch()
            parent = head.head_id if head else None
            img = self._image(c, agent, user)
            known: set[str] = set()
            if parent is not None:
                prev = c.one("SELECT manifest FROM checkpoints WHERE id = ?", (parent,))
                if prev is not None:
                    known = {d for rows in _unpack(prev[0]).values() for d in rows.values()}
            fresh = [(agent, user, d, t, body) for t, rows in img.rows.items() for d, body in rows.values()
                     if d not in known]
            # ON CONFLICT: a body may be known from a checkpoint older than the parent (after a rollback).
            if fresh:
                c.many("INSERT INTO checkpoint_rows (agent_id, user_id, digest, tbl, body) VALUES (?, ?, ?, ?, ?) "
                       "ON CONFLICT DO NOTHING", fresh)
            manifest = _pack(img.manifest())
            seq_row = c.one("SELECT MAX(seq) FROM checkpoints WHERE agent_id = ? AND user_id = ?", (agent, user))
            seq = int(seq_row[0] or 0) + 1 if seq_row else 1
            summ = dict(summary or {})
            if turn_id is not None:
                summ.setdefault("turn", _turn_summary(img, turn_id))
            store_bytes = len(manifest) + sum(len(f[4]) for f in fresh)
            now, mark = time.time(), self._event_mark(c)
            lineage = head.event_ranges if head else [[0, None]]
            ranges = [[lo, mark if hi is None else hi] for lo, hi in lineage]
            ranges = [r for r in ranges if r[0] <= r[1]]  # type: ignore[operator]
            c.x(f"INSERT INTO checkpoints ({_COLS}, manifest) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (cid, agent, user, seq, branch, parent, kind, name, turn_id, json.dumps(summ), mark,
                 json.dumps(ranges), sandbox_id, sandbox_checkpoint, store_bytes, now, c.blob(manifest)))
            self._set_head(c, agent, user, branch, cid, head.pending if head else None, lineage)
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
                 json.dumps(summary), 0, "[]", None, None, 0, now, c.blob(_pack({}))))
        return Checkpoint(cid, agent, user, seq, branch, head.head_id if head else None, MISSING, None, turn_id,
                          summary, 0, [], None, None, 0, now)

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
                           hint="list them with GET /v1/agents/{agent}/users/{user}/checkpoints")
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
            r = c.one("SELECT manifest FROM checkpoints WHERE id = ?", (target.id,))
            assert r is not None
            want = _unpack(r[0])
            bodies = self._bodies(c, agent, user, {d for rows in want.values() for d in rows.values()})
            now_img = self._image(c, agent, user)
            for t in TABLES:
                have, goal = now_img.rows.get(t.name, {}), want.get(t.name, {})
                gone = [k for k, (d, _) in have.items() if goal.get(k) != d]
                for k in gone:
                    c.x(f"DELETE FROM {t.name} WHERE {' AND '.join(f'{p} = ?' for p in t.pk)}", json.loads(k))
                add = [json.loads(bodies[d]) for k, d in goal.items() if have.get(k, (None,))[0] != d]
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
            self._set_head(c, agent, user, branch, target.id, None, lineage)
        return branch

    def _rewind_events(self, c: "Conn", agent: str, user: str, ranges: list[list[int]]) -> None:
        """Make the instance's events exactly those whose ids lie in ``ranges``: others are moved aside (kept for
        a rollback to their branch), and those moved aside earlier that lie in ``ranges`` come back."""
        sp = _scope_params(agent, user)
        inside, rp = _in_ranges(ranges)
        pg = self._ts.dialect == "postgres"
        c.x(f"INSERT INTO checkpoint_events (agent_id, user_id, id, {', '.join(_EVENT_COLS)}) "
            f"SELECT ?, ?, id, {', '.join(_EVENT_COLS)} FROM events WHERE {_S} AND NOT {inside} "
            "ON CONFLICT DO NOTHING", (agent, user, *sp, *rp))
        c.x(f"DELETE FROM events WHERE {_S} AND NOT {inside}", (*sp, *rp))
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
            r = c.one("SELECT manifest FROM checkpoints WHERE id = ?", (target.id,))
            assert r is not None
            want = _unpack(r[0])
            bodies = self._bodies(c, agent, user, {d for rows in want.values() for d in rows.values()})
            rows = {t: [json.loads(bodies[d]) for d in m.values()] for t, m in want.items()}
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
            live = c.q(f"SELECT id, {cols} FROM events WHERE {inside} AND {_S}", (*rp, *_scope_params(agent, user)))
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
            scopes |= {r[0] for r in c.q(f"SELECT DISTINCT scope FROM events WHERE {_S}", _scope_params(agent, to_user))}
            for key in sorted(scopes):
                if key.startswith(("user:", "session:", "workflow:")):
                    ts._touch(c, Scope.parse(sub.text(key)), now)
            # The new user is a user of the agent like any other, with the source's metadata and limits (caps).
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
            for i in range(0, len(gone), 500):
                part = [g.id for g in gone[i:i + 500]]
                c.x(f"DELETE FROM checkpoints WHERE id IN ({','.join('?' * len(part))})", part)
            live: set[str] = set()
            for (m,) in c.q("SELECT manifest FROM checkpoints WHERE agent_id = ? AND user_id = ?", (agent, user)):
                live |= {d for t in _unpack(m).values() for d in t.values()}
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


def _turn_summary(img: _Image, turn_id: str) -> dict[str, Any]:
    """What the turn did, from the rows just read: its message, reply, status and the steps it journaled."""
    run_body = next((b for k, (_, b) in img.rows.get("workflow_runs", {}).items() if json.loads(k) == [turn_id]), None)
    out: dict[str, Any] = {"id": turn_id}
    if run_body is not None:
        run = json.loads(run_body)
        inp = json.loads(run[4]) if run[4] else {}
        res = json.loads(run[7]) if run[7] else {}
        out["status"] = run[3]
        out["message"] = str((inp or {}).get("message", ""))[:200]
        reply = (res or {}).get("reply") if isinstance(res, dict) else None
        out["reply"] = reply[:200] if isinstance(reply, str) else reply if reply is None else str(reply)[:200]
    steps = [json.loads(b) for k, (_, b) in img.rows.get("steps", {}).items() if json.loads(k)[0] == turn_id]
    out["steps"] = [{"name": s[2], "status": s[3]} for s in sorted(steps, key=lambda s: s[1])][:50]
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
    return n


def new_checkpoint_id() -> str:
    return "ck" + uuid.uuid4().hex[:18]


def _new_branch() -> str:
    return "br" + uuid.uuid4().hex[:10]


def checkpoints_of(ts: "TenantStore") -> Checkpoints:
    """The tenant's checkpoints repository (``ts.checkpoints`` where TenantStore binds it)."""
    repo = getattr(ts, "checkpoints", None)
    return repo if isinstance(repo, Checkpoints) else Checkpoints(ts)
