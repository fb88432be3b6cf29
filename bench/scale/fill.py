"""Fill a data directory's tenant store to a year of use: copies of what real turns wrote, one set per end-user.

A real ``moorage up`` first serves a few turns of one template user (``seed``); ``clone`` then copies every row
of that user, table by table, once per end-user wanted: the user's id, every random id (a run's, a span's, a
checkpoint's, a sandbox's) made new and consistent across tables, timestamps spread back over a year. The
store's own triggers run on every copy (row versions, owners, the full-text index), as they do for real rows.
"""

from __future__ import annotations

import random
import re
import sqlite3
import time
from pathlib import Path
from typing import Any

#: Tables the store keeps for itself (clocks, migrations; the full-text index and usage rollups its triggers fill).
_SKIP = {"schema_migrations", "row_clock", "checkpoint_floor", "sqlite_sequence", "agents", "deployments",
         "webhooks", "retention", "secrets", "api_keys", "usage_days", "usage_levels"}
# A random id or digest: 16 to 64 hex digits, at least one a letter, not inside a longer word or a number.
_HEX = re.compile(r"(?:(?<=\bck)|(?<=\bbr)|(?<![0-9A-Za-z.+-]))(?=[0-9]*[a-f])[0-9a-f]{16,64}(?![0-9A-Za-z.])")
YEAR_S = 365 * 86400.0


def tenant_db(data: Path) -> Path:
    (db,) = sorted((data / "store" / "tenants").glob("*.db"))
    return db


def _columns(con: sqlite3.Connection, table: str) -> list[tuple[str, str, int]]:
    """(name, declared type, part of an INTEGER PRIMARY KEY) of each column a copy writes."""
    cols = []
    for _, name, typ, _, _, pk in con.execute(f'PRAGMA table_info("{table}")'):
        if name in ("rv", "owner"):
            continue  # the store's triggers set them
        cols.append((name, typ.upper(), pk))
    return cols


def _autoid(con: sqlite3.Connection, table: str) -> str | None:
    sql = con.execute("SELECT sql FROM sqlite_master WHERE name = ?", (table,)).fetchone()[0] or ""
    m = re.search(r"(\w+) INTEGER PRIMARY KEY AUTOINCREMENT", sql)
    return m.group(1) if m else None


def template_rows(con: sqlite3.Connection, user: str) -> dict[str, tuple[list[str], list[tuple]]]:
    """Every row of the store that belongs to ``user`` (it names them in a text column), table by table."""
    out: dict[str, tuple[list[str], list[tuple]]] = {}
    tables = [r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'table' "
                                        "AND sql NOT LIKE 'CREATE VIRTUAL%' ORDER BY name")]
    for t in tables:
        if t in _SKIP or t.startswith(("events_fts", "lg_batch")):
            continue
        cols = _columns(con, t)
        auto = _autoid(con, t)
        names = [c[0] for c in cols if c[0] != auto]
        texts = [c[0] for c in cols if c[1] in ("TEXT", "JSON", "")]
        if not texts:
            continue
        where = " OR ".join(f'instr(CAST("{c}" AS TEXT), ?) > 0' for c in texts)
        rows = con.execute(f'SELECT {", ".join(chr(34) + n + chr(34) for n in names)} FROM "{t}" WHERE {where}',
                           [user] * len(texts)).fetchall()
        if rows:
            out[t] = (names, rows)
    # A delivery's attempts name the delivery, not the user.
    if "webhook_deliveries" in out:
        ids = [r[0] for r in out["webhook_deliveries"][1]]
        names = [c[0] for c in _columns(con, "webhook_attempts")]
        rows = con.execute(f"SELECT {', '.join(names)} FROM webhook_attempts WHERE delivery_id IN "
                           f"({', '.join('?' * len(ids))})", ids).fetchall()
        if rows:
            out["webhook_attempts"] = (names, rows)
    return out


def _shared_ids(con: sqlite3.Connection, tenant: str) -> set[str]:
    """Ids every user's rows name in common (the tenant, agents, deployments, webhooks): kept as they are."""
    shared = {tenant}
    for t in ("agents", "deployments", "webhooks"):
        for row in con.execute(f"SELECT * FROM {t}"):
            for v in row:
                if isinstance(v, str):
                    shared.update(re.findall(r"[0-9a-f]{16,64}", v))
    return shared


def clone(data: Path, user: str, n_users: int, *, first: int = 1, prefix: str = "u", batch: int = 2000,
          seed: int = 7, log: Any = print) -> dict[str, int]:
    """Copy ``user``'s rows ``n_users`` times as users ``<prefix>…<first>``, ``<prefix>…<first + 1>``… (ids as long
    as ``user``'s); returns the rows written per table."""
    db = tenant_db(data)
    tenant = db.stem
    width = len(user) - len(prefix)
    if width < 4 or first + n_users >= 10 ** width:
        raise ValueError(f"template user id {user!r} is too short for {n_users} users named {prefix}…")
    con = sqlite3.connect(db, isolation_level=None)
    con.execute("PRAGMA synchronous = OFF")  # a fill, not a product write: the run stops the host around it
    con.execute("PRAGMA journal_mode = WAL")
    tmpl = template_rows(con, user)
    shared_text = " ".join(_shared_ids(con, tenant))  # also a shorter id cut from one (a template's name)
    rng = random.Random(seed + first)
    now = time.time()
    written = {t: 0 for t in tmpl}
    t0 = time.perf_counter()
    last = first + n_users - 1
    for start in range(first, last + 1, batch):
        con.execute("BEGIN")
        for k in range(start, min(start + batch, last + 1)):
            new_user = f"{prefix}{k:0{width}d}"
            suffix = f"{k:06x}"
            shift = -rng.random() * YEAR_S

            def text(v: str) -> str:
                v = v.replace(user, new_user)
                return _HEX.sub(lambda m: m.group(0) if m.group(0) in shared_text else m.group(0)[:-6] + suffix, v)

            def value(v: Any) -> Any:
                if isinstance(v, str):
                    return text(v)
                if isinstance(v, float) and now - 2 * YEAR_S < v < now + YEAR_S:
                    return v + shift
                return v

            for t, (names, rows) in tmpl.items():
                con.executemany(f'INSERT INTO "{t}" ({", ".join(chr(34) + n + chr(34) for n in names)}) VALUES '
                                f'({", ".join("?" * len(names))})', [tuple(value(v) for v in r) for r in rows])
                written[t] += len(rows)
        con.execute("COMMIT")
        done = min(start + batch, last + 1) - first
        log(f"  {done}/{n_users} users copied ({time.perf_counter() - t0:.0f} s)")
    con.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    con.close()
    return written


def add_events(data: Path, scope: str, n: int, *, words: list[str], seed: int = 11) -> None:
    """``n`` more message events in ``scope`` (a user who talks a lot), the way a turn writes them."""
    db = tenant_db(data)
    con = sqlite3.connect(db, isolation_level=None)
    con.execute("PRAGMA synchronous = OFF")
    rng = random.Random(seed)
    start = time.time() - YEAR_S
    (emb,) = con.execute("SELECT embedding FROM events WHERE embedding IS NOT NULL LIMIT 1").fetchone() or (None,)
    con.execute("BEGIN")
    con.executemany("INSERT INTO events (scope, ts, kind, speaker, content, meta, embedding) VALUES "
                    "(?, ?, 'message', ?, ?, '{}', ?)",
                    [(scope, start + i * (YEAR_S / n), "user" if i % 2 == 0 else "assistant",
                      " ".join(rng.choice(words) for _ in range(12)), emb) for i in range(n)])
    con.execute("COMMIT")
    con.close()


def table_counts(data: Path) -> dict[str, int]:
    con = sqlite3.connect(tenant_db(data))
    out = {}
    for (t,) in con.execute("SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'events_fts%' "
                            "ORDER BY name"):
        out[t] = con.execute(f'SELECT COUNT(*) FROM "{t}"').fetchone()[0]
    con.close()
    return {t: n for t, n in out.items() if n}
