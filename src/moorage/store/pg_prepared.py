"""One statement, one round trip, without holding the GIL: ``PostgresBackend.tenant_call``'s execution path.

psycopg's ``Connection.execute`` drives the round trip from Python (a cursor, the query's conversion,
a generator stepped through a wait loop that gives the GIL up and takes it back around each ``poll``).
For the group-committed checkpoint batch, a statement run thousands of times a second by one committer
thread while writer threads compete for the GIL, that Python was most of the call's client CPU: 100-136
µs of user CPU per 4-checkpoint batch against 43-50 µs for the same batch through ``PGconn.exec_prepared``
(measured on 1 KiB checkpoints), which sends, waits and reads the result inside libpq with the GIL released.

Each connection prepares a statement once (a named, protocol-level prepared statement, as psycopg's own
automatic preparation makes after a few executions) and then executes it by name. The parameters are
adapted by psycopg's ``Transformer``, so they are dumped exactly as ``execute`` would dump them.
"""

from __future__ import annotations

import re
import weakref
from typing import Any, Sequence

import psycopg
from psycopg import errors, pq
from psycopg.adapt import PyFormat, Transformer

_PLACEHOLDER = re.compile(rb"%(.?)", re.DOTALL)
_FORMATS = {b"s": PyFormat.AUTO, b"b": PyFormat.BINARY, b"t": PyFormat.TEXT}
_BINARY = pq.Format.BINARY
#: Statements prepared per connection at most; beyond that a statement runs unnamed (parsed each time).
_MAX_PREPARED = 16
#: Converted queries kept (query text -> libpq form); the callers' statements are few and fixed.
_MAX_QUERIES = 256


class _Query:
    __slots__ = ("raw", "formats")

    def __init__(self, raw: bytes, formats: list[PyFormat]) -> None:
        self.raw = raw
        self.formats = formats


def convert(sql: str) -> _Query:
    """``sql`` with psycopg's positional placeholders (``%s``, ``%b``, ``%t``; ``%%`` for a literal ``%``)
    turned into libpq's ``$1, $2, ...``, and the format each parameter is to be dumped in."""
    formats: list[PyFormat] = []

    def repl(m: re.Match[bytes]) -> bytes:
        c = m.group(1)
        if c == b"%":
            return b"%"
        fmt = _FORMATS.get(c)
        if fmt is None:
            raise psycopg.ProgrammingError(
                f"unsupported placeholder %{c.decode(errors='replace')} (only %s, %b, %t and %% for a literal %)")
        formats.append(fmt)
        return b"$%d" % len(formats)

    return _Query(_PLACEHOLDER.sub(repl, sql.encode()), formats)


class PreparedCalls:
    """Runs single statements on pooled connections by prepared name; one instance per backend."""

    def __init__(self) -> None:
        self._queries: dict[str, _Query] = {}
        # connection -> {(query, parameter types): statement name}; a connection that is closed and
        # collected takes its entry with it.
        self._names: weakref.WeakKeyDictionary[psycopg.Connection, dict[tuple[bytes, tuple[int, ...]], bytes]] = \
            weakref.WeakKeyDictionary()

    def _query(self, sql: str) -> _Query:
        q = self._queries.get(sql)
        if q is None:
            q = convert(sql)
            if len(self._queries) >= _MAX_QUERIES:
                self._queries.clear()
            self._queries[sql] = q
        return q

    def run(self, conn: psycopg.Connection, sql: str, params: Sequence[Any]) -> list[tuple]:
        """Execute ``sql`` with ``params`` on ``conn`` (autocommit, idle) as one round trip and return its rows
        (in binary, loaded by psycopg's loaders); raises the psycopg error for the statement's failure, as
        ``conn.execute`` would."""
        q = self._query(sql)
        if len(params) != len(q.formats):
            raise psycopg.ProgrammingError(f"the query has {len(q.formats)} placeholders but {len(params)} parameters were passed")
        tx = Transformer(conn)
        values = tx.dump_sequence(params, q.formats)
        types, formats = tuple(tx.types), list(tx.formats)
        pg = conn.pgconn
        with conn.lock:
            for attempt in (0, 1):
                name = self._name(conn, pg, q.raw, types)
                if name is None:
                    res = pg.exec_params(q.raw, values, types, formats, _BINARY)
                else:
                    res = pg.exec_prepared(name, values, formats, _BINARY)
                if res.status == pq.ExecStatus.TUPLES_OK:
                    tx.set_pgresult(res)
                    return tx.load_rows(0, res.ntuples, tuple)
                if res.status == pq.ExecStatus.COMMAND_OK:
                    return []
                err = _error(conn, res)
                if name is not None and attempt == 0 and isinstance(err, errors.InvalidSqlStatementName):
                    # The server forgot the statement (DEALLOCATE, DISCARD ALL, a pooler's other server
                    # connection): nothing ran, so prepare it again and run it once more.
                    self._names.pop(conn, None)
                    continue
                raise err
        raise AssertionError("unreachable")  # the second attempt returns or raises

    def _name(self, conn: psycopg.Connection, pg: Any, raw: bytes, types: tuple[int, ...]) -> bytes | None:
        """The name ``raw`` with these parameter types is prepared under on ``conn`` (preparing it now if
        needed), or None where the connection already holds its share of statements."""
        names = self._names.get(conn)
        if names is None:
            names = self._names[conn] = {}
        key = (raw, types)
        name = names.get(key)
        if name is None:
            if len(names) >= _MAX_PREPARED:
                return None
            name = b"moorage_call_%d" % len(names)
            res = pg.prepare(name, raw, types)
            if res.status != pq.ExecStatus.COMMAND_OK:
                err = _error(conn, res)
                if not isinstance(err, errors.DuplicatePreparedStatement):
                    raise err
                # Left on the server by an earlier cache of this connection (after a retry above):
                # replace it, since the same name may now stand for another statement.
                pg.exec_(b"DEALLOCATE " + name)
                res = pg.prepare(name, raw, types)
                if res.status != pq.ExecStatus.COMMAND_OK:
                    raise _error(conn, res)
            names[key] = name
        return name


def _error(conn: psycopg.Connection, res: Any) -> psycopg.Error:
    """The psycopg exception (its class by SQLSTATE, with diagnostics) for a failed result; a connection
    lost on the way is an ``OperationalError``, as ``execute`` reports it (the pool then discards it)."""
    if conn.pgconn.status == pq.ConnStatus.BAD:
        msg = res.error_message.decode(conn.info.encoding, "replace").strip() or "connection lost"
        return psycopg.OperationalError(f"the connection to the server was lost: {msg}")
    return errors.error_from_result(res, encoding=conn.info.encoding)
