"""The instance's rows as the store half of a checkpoint sees them: which rows are the instance's, their images and
digests, manifests (full, or a delta on the checkpoint before), and the rows written since a *mark*.

Every imaged row carries ``rv``, set by triggers on each insert and update (migration 16): on SQLite the value of
a per-database clock that each checkpoint moves on; on PostgreSQL the id of the writing transaction. A mark is
the clock's value (SQLite: rows with ``rv >= mark`` came after) or a transaction snapshot (PostgreSQL: rows whose
transaction the snapshot does not see came after, so a writer that committed late is not missed). Every imaged
row also names its instance (``owner``, "agent/user", set on insert: migration 18), and a deleted one leaves a
row in ``row_deletions`` with the same ``rv``. A checkpoint then reads, by (owner, rv), only the rows written and
deleted since the head's mark: its cost follows what changed, not the instance's history (docs/decisions/0011).
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
import zlib
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from moorage.errors import ConflictError
from moorage.store.model import Scope

if TYPE_CHECKING:
    from moorage.store.sql import Conn

#: Deltas in a row before a checkpoint's manifest is written whole again (bounds the chain a read walks).
FULL_EVERY = 32


@dataclass(frozen=True)
class Table:
    name: str
    cols: tuple[str, ...]
    pk: tuple[str, ...]
    #: WHERE clause selecting the instance's rows: ``{S}`` is the instance-scope condition, ``{RUNS}`` its runs.
    where: str


IMAGED: tuple[Table, ...] = (
    Table("state", ("scope", "key", "value", "version", "updated_at"), ("scope", "key"), "{S}"),
    Table("facts", ("id", "scope", "subject", "attribute", "value", "text", "valid_from", "valid_to", "recorded_at",
                    "superseded_at", "superseded_by", "trust", "status", "provenance", "source", "version",
                    "confirmed_at"),
          ("id",), "{S}"),
    Table("workflow_runs", ("id", "scope", "name", "status", "input", "state", "current_step", "result", "error",
                            "created_at", "updated_at", "version"), ("id",), "{S}"),
    Table("steps", ("run_id", "seq", "name", "status", "attempts", "result", "error", "started_at", "finished_at"),
          ("run_id", "seq"), "run_id IN ({RUNS})"),
    Table("journal", ("key", "scope", "run_id", "step", "status", "result", "error", "created_at", "updated_at",
                      "version"), ("key",), "({S} OR run_id IN ({RUNS}))"),
    Table("sessions", ("id", "agent_id", "user_id", "created_at", "last_active", "meta", "version"),
          ("agent_id", "user_id", "id"), "agent_id = ? AND user_id = ?"),
)

# Primary-key columns that are integers (by position): a deletion records every key column as text.
_INT_PK: dict[str, tuple[int, ...]] = {"steps": (1,)}

# The row's scope is the instance's user scope or one of its session / workflow scopes. SQLite compares bytes, so
# a prefix is a key range its indexes serve; PostgreSQL's collation may not order by bytes, so there the prefix is
# compared with substr. Never LIKE: ids may contain "_", which LIKE reads as a wildcard (another user).
_S_SQLITE = "(scope = ? OR (scope >= ? AND scope < ?) OR (scope >= ? AND scope < ?))"
_S_POSTGRES = "(scope = ? OR substr(scope, 1, ?) = ? OR substr(scope, 1, ?) = ?)"


def scope_sql(dialect: str) -> str:
    """The instance-scope condition (on a ``scope`` column); its parameters are ``scope_params``."""
    return _S_POSTGRES if dialect == "postgres" else _S_SQLITE


def scope_params(dialect: str, agent: str, user: str) -> tuple[Any, ...]:
    sp, wp = f"session:{agent}/{user}/", f"workflow:{agent}/{user}/"
    if dialect == "postgres":
        return (Scope.for_user(agent, user).key, len(sp), sp, len(wp), wp)
    # "/" + 1 is "0": the strings from "<p>/" up to (not including) "<p>0" are exactly those starting with "<p>/".
    return (Scope.for_user(agent, user).key, sp, sp[:-1] + "0", wp, wp[:-1] + "0")


def where(t: Table, dialect: str, agent: str, user: str) -> tuple[str, tuple[Any, ...]]:
    """SQL selecting the instance's rows of ``t``, and its parameters."""
    s = scope_sql(dialect)
    runs = f"SELECT id FROM workflow_runs WHERE {s}"
    sp = scope_params(dialect, agent, user)
    if t.name == "sessions":
        return t.where, (agent, user)
    if t.name == "journal":
        return t.where.format(S=s, RUNS=runs), sp * 2
    return t.where.format(S=s, RUNS=runs), sp


def row_of(t: Table, body: str) -> list[Any]:
    """An imaged row's values in ``t.cols`` order. An image taken before a column was added (``facts.confirmed_at``,
    migration 20) is shorter: the columns it lacks are NULL."""
    r = json.loads(body)
    return r + [None] * (len(t.cols) - len(r))


def digest(table: str, body: str) -> str:
    return hashlib.sha256(f"{table}\x00{body}".encode()).hexdigest()[:32]


_DUMPS = json.JSONEncoder(separators=(",", ":")).encode


@dataclass
class Manifest:
    """The instance's rows at one checkpoint: table -> primary key (JSON) -> digest of the row's image."""

    rows: dict[str, dict[str, str]]
    depth: int = 0
    _keys: dict[str, dict[tuple, str]] | None = field(default=None, repr=False)
    _digests: frozenset[str] | None = field(default=None, repr=False)

    def keys(self, table: str) -> dict[tuple, str]:
        """Primary key as a tuple -> its JSON, made once per manifest (a scan's keys are compared as tuples)."""
        if self._keys is None:
            self._keys = {}
        got = self._keys.get(table)
        if got is None:
            got = self._keys[table] = {tuple(json.loads(k)): k for k in self.rows.get(table, {})}
        return got

    def digests(self) -> frozenset[str]:
        """Every row image the manifest names (made once: a manifest does not change once built)."""
        if self._digests is None:
            self._digests = frozenset(d for rows in self.rows.values() for d in rows.values())
        return self._digests


@dataclass
class Image:
    """The instance's rows now: the manifest, the bodies read (digest -> body; every row's when read whole), and
    what changed against the base manifest (None when read whole)."""

    manifest: Manifest
    bodies: dict[str, tuple[str, str]]
    changed: dict[str, dict[str, str]] | None = None
    deleted: dict[str, list[str]] | None = None


# -- marks -----------------------------------------------------------------------------------------------------

def new_mark(c: "Conn") -> str:
    """A mark for now, taken before reading: what is written after it is read by the next checkpoint."""
    if c.dialect == "postgres":
        r = c.one("SELECT pg_current_snapshot()::text")
        assert r is not None
        return str(r[0])
    # Rows written from here on carry the clock's new value; those before carry a lower one.
    (r,) = c.q("UPDATE row_clock SET n = n + 1 WHERE id = 1 RETURNING n")
    return str(r[0])


def _since(dialect: str, mark: str) -> tuple[str, tuple[Any, ...]]:
    if dialect == "postgres":
        xmin = int(mark.split(":", 1)[0])
        # Transactions below the snapshot's xmin had ended when it was taken: the index range cuts to the rest.
        return "rv >= ? AND NOT pg_visible_in_snapshot(rv::text::xid8, CAST(? AS pg_snapshot))", (xmin, mark)
    return "rv >= ?", (int(mark),)


# -- reading the instance --------------------------------------------------------------------------------------

def owner(agent: str, user: str) -> str:
    """The instance as imaged rows name it (their ``owner`` column)."""
    return f"{agent}/{user}"


def read(c: "Conn", agent: str, user: str, base: Manifest | None = None, mark: str | None = None) -> Image:
    """The instance's rows now: every row's body (``base`` None), or the base manifest with the rows deleted since
    ``mark`` dropped and the rows written since re-read. The caller checks the mark is not below the floor."""
    if base is None or mark is None:
        return _read_whole(c, agent, user)
    since, sparams = _since(c.dialect, mark)
    who = owner(agent, user)
    gone: dict[str, set[tuple[str, ...]]] = {}
    for tbl, *ks in c.q(f"SELECT tbl, k1, k2, k3 FROM row_deletions WHERE owner = ? AND {since}", (who, *sparams)):
        gone.setdefault(tbl, set()).add(tuple(k for k in ks if k is not None))
    rows: dict[str, dict[str, str]] = {}
    keys: dict[str, dict[tuple, str]] = {}
    bodies: dict[str, tuple[str, str]] = {}
    changed: dict[str, dict[str, str]] = {}
    deleted: dict[str, list[str]] = {}
    for t in IMAGED:
        known = base.keys(t.name)
        now = dict(base.rows.get(t.name, {}))
        now_keys = dict(known)
        npk = [t.cols.index(k) for k in t.pk]
        # Deleted first: a row deleted and written again since the mark is read again below.
        if t.name in gone:
            ints = _INT_PK.get(t.name, ())
            typed = (tuple(int(v) if i in ints else v for i, v in enumerate(k)) for k in gone[t.name])
            hit = [pk for pk in typed if pk in known]
            if hit:
                deleted[t.name] = [now_keys.pop(pk) for pk in hit]
                for k in deleted[t.name]:
                    del now[k]
        # Rows written since the mark: their bodies, digests and keys.
        ch: dict[str, str] = {}
        for r in c.q(f"SELECT {', '.join(t.cols)} FROM {t.name} WHERE owner = ? AND {since}", (who, *sparams)):
            pk = tuple(r[i] for i in npk)
            key = now_keys.get(pk)
            if key is None:
                key = now_keys[pk] = _DUMPS(list(pk))
            body = _DUMPS(list(r))
            d = digest(t.name, body)
            bodies[d] = (t.name, body)
            if now.get(key) != d:
                now[key] = ch[key] = d
        # A row deleted since the mark and written again is not deleted: it was set again above.
        if t.name in deleted:
            deleted[t.name] = [k for k in deleted[t.name] if k not in now]
            if not deleted[t.name]:
                del deleted[t.name]
        rows[t.name], keys[t.name] = now, now_keys
        if ch:
            changed[t.name] = ch
    return Image(Manifest(rows, base.depth + 1, keys), bodies, changed, deleted)


# -- deletions kept for checkpoints ----------------------------------------------------------------------------

#: Deletions are kept for the heads updated within this long; an older head reads its instance whole once.
DELETIONS_KEPT_S = 7 * 86400


def _lowest(dialect: str, mark: str) -> int:
    """The lowest ``rv`` a checkpoint from ``mark`` still needs to see."""
    return int(mark.split(":", 1)[0]) if dialect == "postgres" else int(mark)


def below_floor(c: "Conn", mark: str) -> bool:
    """Whether deletions a checkpoint from ``mark`` needs may have been removed (then it reads the instance whole)."""
    r = c.one("SELECT rv FROM checkpoint_floor WHERE id = 1")
    return r is not None and _lowest(c.dialect, mark) < int(r[0])


def prune_deletions(c: "Conn", now: float) -> int:
    """Remove the deletions no recent head needs and raise the floor to match; returns how many went."""
    if c.dialect == "postgres":
        low = c.one("SELECT MIN(split_part(row_mark, ':', 1)::bigint) FROM checkpoint_heads "
                    "WHERE row_mark IS NOT NULL AND updated_at > ?", (now - DELETIONS_KEPT_S,))
        cur = c.one("SELECT pg_snapshot_xmin(pg_current_snapshot())::text::bigint")
    else:
        low = c.one("SELECT MIN(CAST(row_mark AS INTEGER)) FROM checkpoint_heads "
                    "WHERE row_mark IS NOT NULL AND updated_at > ?", (now - DELETIONS_KEPT_S,))
        cur = c.one("SELECT n FROM row_clock WHERE id = 1")
    floor = int(low[0]) if low is not None and low[0] is not None else int(cur[0])  # type: ignore[index]
    old = c.one("SELECT rv FROM checkpoint_floor WHERE id = 1")
    if old is not None and int(old[0]) >= floor:
        return 0
    n = c.x("DELETE FROM row_deletions WHERE rv < ?", (floor,))
    if old is None:
        c.x("INSERT INTO checkpoint_floor (id, rv) VALUES (1, 0) ON CONFLICT DO NOTHING")
    # Only ever up: on PostgreSQL two prunes may race, and the one with the lower floor must not undo the other's.
    c.x("UPDATE checkpoint_floor SET rv = ? WHERE id = 1 AND rv < ?", (floor, floor))
    return n


def _read_whole(c: "Conn", agent: str, user: str) -> Image:
    rows: dict[str, dict[str, str]] = {}
    bodies: dict[str, tuple[str, str]] = {}
    for t in IMAGED:
        w, p = where(t, c.dialect, agent, user)
        out: dict[str, str] = {}
        npk = [t.cols.index(k) for k in t.pk]
        for r in c.q(f"SELECT {', '.join(t.cols)} FROM {t.name} WHERE {w}", p):
            body = _DUMPS(list(r))
            d = digest(t.name, body)
            out[_DUMPS([r[i] for i in npk])] = d
            bodies[d] = (t.name, body)
        rows[t.name] = out
    return Image(Manifest(rows), bodies)


# -- manifests on disk -----------------------------------------------------------------------------------------

def pack(img: Image, base_id: str | None) -> tuple[bytes, Manifest]:
    """The manifest blob for a checkpoint of ``img`` whose parent is ``base_id``: a delta on it when the image
    was read against it and the chain is short, else whole. Returns the blob and the manifest as stored."""
    m = img.manifest
    if base_id is None or img.changed is None or m.depth >= FULL_EVERY:
        m = Manifest(m.rows, 0, m._keys)
        return pack_whole(m), m
    return _compress({"v": 2, "base": base_id, "depth": m.depth, "set": img.changed, "del": img.deleted or {}}), m


def pack_whole(m: Manifest) -> bytes:
    return _compress({"v": 2, "base": None, "depth": 0, "set": m.rows})


def _compress(doc: dict[str, Any]) -> bytes:
    # Level 1: a manifest is mostly digests, which do not compress; level 6 took twice as long for 6% less.
    return zlib.compress(json.dumps(doc, separators=(",", ":"), sort_keys=True).encode(), 1)


def _unpack(blob: Any) -> dict[str, Any]:
    doc = json.loads(zlib.decompress(bytes(blob)))
    # Before migration 16 a manifest was the table map itself, always whole.
    return doc if "v" in doc else {"v": 1, "base": None, "depth": 0, "set": doc}


class _Cache:
    """Resolved manifests by (tenant, checkpoint id): a checkpoint's manifest never changes once written."""

    def __init__(self, size: int = 64) -> None:
        self._d: OrderedDict[tuple[str, str], Manifest] = OrderedDict()
        self._size = size
        self._lock = threading.Lock()

    def get(self, key: tuple[str, str]) -> Manifest | None:
        with self._lock:
            m = self._d.get(key)
            if m is not None:
                self._d.move_to_end(key)
            return m

    def put(self, key: tuple[str, str], m: Manifest) -> None:
        with self._lock:
            self._d[key] = m
            self._d.move_to_end(key)
            while len(self._d) > self._size:
                self._d.popitem(last=False)


CACHE = _Cache()


def resolve(c: "Conn", tenant: str, checkpoint_id: str) -> Manifest:
    """The whole manifest of a checkpoint: its own, or the chain of deltas down to a whole one applied in order."""
    chain: list[tuple[str, dict[str, Any]]] = []
    cur: str | None = checkpoint_id
    m: Manifest | None = None
    while cur is not None:
        m = CACHE.get((tenant, cur))
        if m is not None:
            break
        r = c.one("SELECT manifest FROM checkpoints WHERE id = ?", (cur,))
        if r is None:
            raise ConflictError(f"checkpoint {cur} that checkpoint {checkpoint_id} builds on is missing",
                                hint="the checkpoint is damaged; roll back to another one")
        doc = _unpack(r[0])
        chain.append((cur, doc))
        cur = doc["base"]
    for cid, doc in reversed(chain):
        if doc["base"] is None:
            m = Manifest({t: dict(rows) for t, rows in doc["set"].items()}, 0)
        else:
            assert m is not None
            rows = {t: dict(r) for t, r in m.rows.items()}
            for t, keys in doc.get("del", {}).items():
                for k in keys:
                    rows.get(t, {}).pop(k, None)
            for t, ch in doc["set"].items():
                rows.setdefault(t, {}).update(ch)
            m = Manifest(rows, int(doc["depth"]))
        CACHE.put((tenant, cid), m)
    assert m is not None
    return m


_BASE = re.compile(rb'\{"base":(null|"([^"\\]+)")[,}]')


def base_of(blob: Any) -> str | None:
    """The checkpoint a stored manifest is a delta on (None: stored whole)."""
    # Keys are written sorted, so "base" comes first: a whole manifest need not be inflated and parsed to say so
    # (retention asks this of every kept checkpoint).
    head = zlib.decompressobj().decompress(bytes(blob), 256)
    m = _BASE.match(head)
    if m is not None:
        return m.group(2).decode() if m.group(2) is not None else None
    return _unpack(blob)["base"]  # written before migration 16 (no "base"), or not as expected: read it all
