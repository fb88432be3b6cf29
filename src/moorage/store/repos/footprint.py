"""What the store keeps for one end-user's instance of an agent, in bytes: the measure of the per-user
``store_mib`` cap (usage/store_cap.py).

Counted, by part: ``memory`` (episodic events with their embeddings), ``facts``, ``state`` (working memory and
a LangGraph graph's checkpoints, which are state records of the user), ``workflows`` (runs, steps, the journal,
interrupts and corrections), ``sessions`` and ``checkpoints`` (agent checkpoints: manifests, row images and the
events another branch holds). What is counted is the content of each row (text, JSON, embeddings); keys, indexes
and the database's pages are not, so the file on disk is larger than the sum. Not counted: the tenant's records
about the user (the usage ledger, async turns' messages, traces, webhook deliveries), which retention removes by
age, and the sandbox's own disk (``disk_mib``).

Each part is read through an index on the instance (``owner``, the event scopes, ``agent_id, user_id``), but
summing lengths reads every row of the user: a measurement costs what the user holds, so callers cache it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from moorage.store.tenant import TenantStore

#: Binary columns (PostgreSQL ``bytea``): their length is their size; every other column is measured as text.
_BINARY = frozenset({"embedding", "manifest"})

#: (part, table, content columns, which rows, their parameters: the instance's ``owner`` or its agent and user).
#: Events are found by the user's scopes as their registry lists them (what forgetting the user deletes): a prefix
#: of ``scope`` is not an index range on PostgreSQL.
_PARTS: tuple[tuple[str, str, tuple[str, ...], str, str], ...] = (
    ("memory", "events", ("content", "meta", "embedding"), "scope IN ({SCOPES})", "scopes"),
    ("facts", "facts", ("subject", "attribute", "value", "text", "provenance"), "owner = ?", "owner"),
    ("state", "state", ("key", "value"), "owner = ?", "owner"),
    ("workflows", "workflow_runs", ("name", "input", "state", "result", "error"), "owner = ?", "owner"),
    ("workflows", "steps", ("name", "result", "error"), "owner = ?", "owner"),
    ("workflows", "journal", ("key", "step", "result", "error"), "owner = ?", "owner"),
    ("sessions", "sessions", ("id", "meta"), "agent_id = ? AND user_id = ?", "pair"),
    ("checkpoints", "checkpoints", ("summary", "event_ranges", "manifest"), "agent_id = ? AND user_id = ?", "pair"),
    ("checkpoints", "checkpoint_rows", ("body",), "agent_id = ? AND user_id = ?", "pair"),
    ("checkpoints", "checkpoint_events", ("content", "meta", "embedding"), "agent_id = ? AND user_id = ?", "pair"),
)

#: The user's scopes named in one statement (each a parameter; a user may have thousands of sessions).
_SCOPES_PER_READ = 500

PARTS: tuple[str, ...] = tuple(dict.fromkeys(p[0] for p in _PARTS))


def _length(dialect: str, col: str) -> str:
    if dialect == "postgres":
        return f"COALESCE(OCTET_LENGTH({col}{'' if col in _BINARY else '::text'}), 0)"
    return f"COALESCE(LENGTH(CAST({col} AS BLOB)), 0)"


class Footprint:
    """``Footprint(ts)``: the bytes one tenant's store keeps per end-user instance (``ts.footprint``)."""

    def __init__(self, ts: "TenantStore") -> None:
        self._ts = ts

    def user_bytes(self, agent: str, user: str) -> dict[str, int]:
        """Bytes of content the store keeps for ``user``'s instance of ``agent``, by part (see the module
        docstring), read in one transaction."""
        dialect = self._ts.dialect
        out = dict.fromkeys(PARTS, 0)
        with self._ts._tx(write=False) as c:
            scopes = [r[0] for r in c.q("SELECT scope FROM scopes WHERE agent_id = ? AND user_id = ?", (agent, user))]
            for part, table, cols, where, named in _PARTS:
                size = " + ".join(_length(dialect, col) for col in cols)
                if named == "scopes":
                    batches = [tuple(scopes[i:i + _SCOPES_PER_READ]) for i in range(0, len(scopes), _SCOPES_PER_READ)]
                else:
                    batches = [(f"{agent}/{user}",) if named == "owner" else (agent, user)]
                for params in batches:
                    cond = where.replace("{SCOPES}", ", ".join("?" * len(params)))
                    row = c.one(f"SELECT COALESCE(SUM({size}), 0) FROM {table} WHERE {cond}", params)
                    out[part] += int(row[0]) if row and row[0] is not None else 0
        return out

    def tenant_bytes(self) -> int:
        """What the whole tenant keeps in the store, in bytes: on SQLite the pages of its own file in use (free
        pages not counted; indexes are), on PostgreSQL the bytes of its rows in every tenant table as
        ``pg_column_size`` counts them (indexes and dead rows not counted: they are shared with other tenants).
        SQLite reads three numbers; PostgreSQL reads every row of the tenant, so callers cache it
        (usage/tenant_cap.py)."""
        with self._ts._tx(write=False) as c:
            if self._ts.dialect != "postgres":
                pages, free, size = (int(c.one(f"PRAGMA {p}")[0])
                                     for p in ("page_count", "freelist_count", "page_size"))
                return (pages - free) * size
            from moorage.store.schema import TENANT_MIGRATIONS

            tables = list(dict.fromkeys(t for m in TENANT_MIGRATIONS for t in m.tenant_tables))
            sums = " UNION ALL ".join(f"SELECT COALESCE(SUM(pg_column_size(t.*)), 0) FROM {t} t" for t in tables)
            return sum(int(r[0]) for r in c.q(sums))
