"""What the usage rollups' triggers (store migration 28) add to a ledger write, a turn and a sleep.

1. One ledger row in its own transaction (as a sleep writes its measurements), the median of 1,500, with the
   triggers and with them dropped, on SQLite and PostgreSQL: a token count (one rollup row) and an instance's
   disk level (its rollups and levels).
2. Through ``moorage up`` (process driver, SQLite): a turn's and a sleep's latency, then the same with the
   triggers dropped, and the ledger rows each wrote (a turn without an LLM call writes none; one with writes its
   token counts and cost; a sleep its compute and the instance's two levels).

    .venv/bin/python bench/store/ledger_triggers.py
"""

from __future__ import annotations

import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from moorage.devservices.postgres import free_port, start_cluster  # noqa: E402
from moorage.store import Scope, Store, TenantStore  # noqa: E402
from moorage.store.postgres import PostgresBackend  # noqa: E402
from moorage.store.sqlite import SQLiteBackend  # noqa: E402
from tests.lifecycle.crash_up import Up, stop_sandboxes  # noqa: E402
from tests.lifecycle.test_crash_operations import GZ, _archive  # noqa: E402

AGENT = 'async def on_message(ctx, message):\n    return "ok " + message\n'
_DROP = {"sqlite": "SELECT name FROM sqlite_master WHERE type = 'trigger' AND tbl_name IN ('usage', 'usage_levels')",
         "postgres": "SELECT tgname || ' ON ' || tgrelid::regclass FROM pg_trigger WHERE NOT tgisinternal "
                     "AND tgrelid::regclass::text IN ('usage', 'usage_levels')"}


def per_row(ts: TenantStore) -> dict[str, float]:
    out = {}
    for kind in ("input_tokens", "disk_bytes"):
        took = []
        for i in range(1500):
            scope = Scope.for_user("echo", f"u{i % 50}")
            t0 = time.perf_counter()
            ts.usage.add(kind, 100.0 + i, agent_id="echo", user_id=f"u{i % 50}", scope=scope)
            took.append(time.perf_counter() - t0)
        out[kind] = round(statistics.median(took) * 1e6)
    return out


def rows(store: Store, dialect: str) -> None:
    ts = store.tenant(store.operator.principal(store.operator.create_tenant("acme")[0].id))
    per_row(ts)  # warm
    with_t = per_row(ts)
    if dialect == "sqlite":
        with ts._tx() as c:
            for (name,) in c.q(_DROP["sqlite"]):
                c.x(f"DROP TRIGGER {name}")
    else:
        import psycopg

        with psycopg.connect(store.backend.owner_url, autocommit=True) as owner:  # type: ignore[attr-defined]
            for (name,) in owner.execute(_DROP["postgres"]).fetchall():
                owner.execute(f"DROP TRIGGER {name}")
    per_row(ts)
    without = per_row(ts)
    print(f"{dialect}: one ledger row, median us: with triggers {with_t}, without {without}", flush=True)


def ledger_dbs(data: Path) -> Iterator[Path]:
    for p in (data / "store").rglob("*"):
        if not p.is_file() or p.name.endswith(("-wal", "-shm")) or p.read_bytes()[:16] != b"SQLite format 3\x00":
            continue
        try:
            with sqlite3.connect(p) as c:
                found = c.execute("SELECT 1 FROM sqlite_master WHERE name = 'usage'").fetchone()
        except sqlite3.DatabaseError:  # a file being written (a WAL's checkpoint), not a database to read
            continue
        if found:
            yield p


def through_up(up: Up, label: str, deploy: bool, n_turns: int = 300, n_sleeps: int = 25) -> None:
    up.start()
    with up.client() as c:
        if deploy:
            toml = '[agent.timetravel]\nauto = false\n[agent.lifecycle]\nusers = "auto"\n'
            assert c.post("/v1/agents/e/deployments", content=_archive("e", AGENT, toml), headers=GZ).status_code == 201
        for _ in range(30):
            c.post("/v1/agents/e/invoke", json={"message": "w", "user": "ada"})
        turns: list[float] = []
        for i in range(n_turns):
            t0 = time.perf_counter()
            assert c.post("/v1/agents/e/invoke", json={"message": str(i), "user": "ada"}).status_code == 200
            turns.append(time.perf_counter() - t0)
        sid = c.get("/v1/agents/e/users/ada").json()["instance"]["sandbox_id"]
        sleeps: list[float] = []
        for _ in range(n_sleeps):
            t0 = time.perf_counter()
            assert c.post(f"/v1/sandboxes/{sid}/sleep").status_code == 200
            sleeps.append(time.perf_counter() - t0)
            c.post("/v1/agents/e/invoke", json={"message": "wake", "user": "ada"})
    up.stop()
    kinds: dict[str, Any] = {}
    if deploy:  # what the turns and sleeps above wrote (the 30 + 300 turns: none)
        for p in ledger_dbs(up.data):
            with sqlite3.connect(p) as c:
                kinds.update(dict(c.execute("SELECT kind, COUNT(*) FROM usage GROUP BY kind").fetchall()))
    print(f"moorage up, {label}: turn p50 {statistics.median(turns) * 1000:.2f} ms, sleep p50 "
          f"{statistics.median(sleeps) * 1000:.1f} ms" + (f"; the ledger's rows {kinds}" if deploy else ""), flush=True)


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        rows(Store(SQLiteBackend(Path(tmp) / "store")), "sqlite")
    cluster = start_cluster()
    try:
        rows(Store(PostgresBackend(cluster.create_database("bench"))), "postgres")
    finally:
        cluster.stop()
    with tempfile.TemporaryDirectory() as tmp:
        up = Up(Path(tmp) / "data", free_port(), "process")
        try:
            through_up(up, "with triggers", deploy=True)
            for p in ledger_dbs(up.data):
                with sqlite3.connect(p) as c:
                    for (name,) in c.execute(_DROP["sqlite"]).fetchall():
                        c.execute(f"DROP TRIGGER {name}")
            through_up(up, "triggers dropped", deploy=False)
            through_up(up, "triggers dropped, again", deploy=False)
        finally:
            up.stop()
            stop_sandboxes(up.data)


if __name__ == "__main__":
    main()
