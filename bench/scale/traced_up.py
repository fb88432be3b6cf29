"""``moorage up`` with every SQL statement its SQLite store runs appended to ``$MOORAGE_SCALE_SQL_LOG``.

One line per statement: the database file, a tab, the statement as run (parameters bound). The scale run
reads the lines a request added to count its queries and to ask SQLite for each one's plan.
"""

from __future__ import annotations

import os
import sqlite3
import threading

import moorage.store.sqlite as backend

_log = open(os.environ["MOORAGE_SCALE_SQL_LOG"], "a", buffering=1)
_lock = threading.Lock()
_connect = backend._connect


def _traced(path: str) -> sqlite3.Connection:
    conn = _connect(path)

    def trace(sql: str) -> None:
        with _lock:
            _log.write(path + "\t" + " ".join(sql.split()) + "\n")

    conn.set_trace_callback(trace)
    return conn


backend._connect = _traced

if __name__ == "__main__":
    from moorage.cli.main import run

    run()
