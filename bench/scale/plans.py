"""The SQLite plans of the statements a scale run's host ran, and the run's Markdown report.

Each distinct statement (literals taken out) of the SQL log is asked ``EXPLAIN QUERY PLAN`` on the big store; a
plan that scans a whole table (``SCAN t`` with no index) or sorts for its order (``USE TEMP B-TREE``) is listed.
"""

from __future__ import annotations

import re
import sqlite3
from pathlib import Path
from typing import Any

_STR = re.compile(r"'(?:[^']|'')*'")
_NUM = re.compile(r"(?<![\w.])-?\d+(?:\.\d+)?(?:e[+-]?\d+)?(?![\w.])", re.I)
_LIST = re.compile(r"\(\s*\?(?:\s*,\s*\?)+\s*\)")
_WRITES_ONLY = ("INSERT INTO", "CREATE", "ANALYZE", "VACUUM")
#: Tables a host keeps a handful of rows in, whatever its users: a scan of them is not a finding.
SMALL = {"agents", "deployments", "webhooks", "retention", "schema_migrations", "row_clock", "checkpoint_floor",
         "tenants", "api_keys", "hosts", "secrets", "sqlite_master", "sqlite_sequence", "lg_log"}


def shape(sql: str) -> str:
    s = _NUM.sub("?", _STR.sub("?", sql))
    return _LIST.sub("(?…)", s)


def read(data: Path, sql_log: Path) -> list[dict[str, Any]]:
    """One entry per distinct statement shape run on a tenant database: how often, an example, its plan, and
    what in the plan is a finding."""
    seen: dict[str, dict[str, Any]] = {}
    for line in sql_log.read_text(errors="replace").splitlines():
        path, _, sql = line.partition("\t")
        if "/tenants/" not in path or not sql or sql.upper().startswith(
                ("BEGIN", "COMMIT", "ROLLBACK", "PRAGMA", "SAVEPOINT", "RELEASE")):
            continue
        k = shape(sql)
        e = seen.setdefault(k, {"shape": k, "n": 0, "example": sql, "path": path})
        e["n"] += 1
    out: list[dict[str, Any]] = []
    few: dict[str, set[str]] = {}  # per database: its partial indexes of few rows
    for e in seen.values():
        if e["shape"].upper().startswith(_WRITES_ONLY) and " SELECT " not in e["shape"].upper():
            continue
        try:
            con = sqlite3.connect(f"file:{e['path']}?mode=ro", uri=True)
            rows = con.execute("EXPLAIN QUERY PLAN " + e["example"]).fetchall()
            if e["path"] not in few:
                few[e["path"]] = _few_rows(con)
            con.close()
        except sqlite3.Error as err:
            e["plan"], e["findings"] = [f"(not explained: {err})"], []
            out.append(e)
            continue
        e["plan"] = [r[3] for r in rows]
        e["findings"] = [d for d in e["plan"] if _finding(e["example"], d, few[e["path"]])]
        out.append(e)
    out.sort(key=lambda e: (not e["findings"], -e["n"]))
    return out


def _few_rows(con: sqlite3.Connection) -> set[str]:
    """Partial indexes that hold under 1 % of their table's rows (e.g. the heads with an operation left half
    done): walking one whole reads only what its condition names."""
    out = set()
    for name, table, sql in con.execute("SELECT name, tbl_name, sql FROM sqlite_master WHERE type = 'index' "
                                        "AND sql LIKE '% WHERE %'").fetchall():
        cond = sql.split(" WHERE ", 1)[1]
        few = con.execute(f'SELECT COUNT(*) FROM "{table}" WHERE {cond}').fetchone()[0]
        if few * 100 < max(con.execute(f'SELECT COUNT(*) FROM "{table}"').fetchone()[0], 1):
            out.add(name)
    return out


def _finding(sql: str, detail: str, partial: set[str] | tuple[str, ...] = ()) -> bool:
    """A plan step that reads every row of a big table (a scan; an index walked from its start, unless the
    statement stops after a page and seeks no position, or the index is a partial one of few rows), or sorts
    what it read for its order."""
    m = re.match(r"SCAN (\w+)( USING (?:COVERING )?INDEX (\w+))?$", detail)
    if m and m.group(1) not in SMALL and m.group(3) not in partial:
        return not m.group(2) or not (" LIMIT " in sql and not re.search(r"[<>]=? ", sql.split(" ORDER BY")[0]))
    return "USE TEMP B-TREE FOR ORDER BY" in detail


def _ms(x: float | None) -> str:
    return "–" if x is None else (f"{x * 1e3:.1f}" if x < 10 else f"{x:.1f} s")


def report(out: dict[str, Any]) -> str:
    ph = out["phases"]
    cols = [p for p in ("small", "big-before", "big") if p in ph]
    names = {"small": f"small store ({ph['small']['users']} users)",
             "big-before": "big store, code before the fixes", "big": "big store, this code"}
    lines = ["# Scale audit: a host whose store holds a year of use", "",
             "Written by `bench/scale/run.py` (see its docstring). A real `moorage up` (process driver, SQLite store) "
             "served one template user's turns (sync and async, with a webhook delivered to a local receiver and a "
             "checkpoint); that user's rows were then copied to every end-user (bench/scale/fill.py), the store's "
             "triggers running on each copy. Times are milliseconds through HTTP and the SDK (median of "
             f"{out['args']['reps']} unless one), queries the SQL statements the host ran for it (background loops "
             "included).", "",
             f"Store: {out.get('store_bytes', 0) / 1e9:.2f} GB; filled in {out.get('fill_s', 0):.0f} s, then swept once "
             f"(what a year of five-minute sweeps leaves: {out.get('pre_sweep', {}).get('rows', 0):,} copied rows past "
             "their retention deleted). Rows: "
             + ", ".join(f"{t} {n:,}" for t, n in sorted(out.get("tables", {}).items(), key=lambda x: -x[1])[:14]) + ".",
             "", "| | " + " | ".join(names[c] for c in cols) + " |", "|---|" + "---|" * len(cols),
             "| `moorage up` until it serves (first start of this code) | " + " | ".join(_ms(ph[c]["up_s"]) for c in cols)
             + " |",
             "| `moorage up` until it serves (again) | " + " | ".join(_ms(ph[c].get("up_again_s")) for c in cols) + " |"]
    for name in ph["big"]["requests"]:
        cells = []
        for c in cols:
            r = ph[c]["requests"].get(name)
            cells.append("–" if r is None else f"{_ms(r['median_s'])} ({r['queries']} q)")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines.append("| `moorage backup` (stopped host) | " + " | ".join(_ms(ph[c]["backup_s"]) for c in cols) + " |")
    lines.append("| retention sweep (`moorage store sweep`, a copy) | " + " | ".join(
        f"{_ms(ph[c]['sweep_s'])} ({ph[c]['sweep']['rows']:,} rows)" for c in cols) + " |")
    for key, title in (("plans_before", "code before the fixes"), ("plans", "this code")):
        if key not in out:
            continue
        found = [e for e in out[key] if e["findings"]]
        lines += ["", f"## Statements whose plan scans or sorts a big table ({title})", "",
                  f"{len(found)} of {len(out[key])} distinct statements run on the big store.", ""]
        for e in found:
            lines += [f"- ran {e['n']}×: `{e['shape'][:300]}`", f"  - plan: {'; '.join(e['plan'])}"]
    return "\n".join(lines) + "\n"
