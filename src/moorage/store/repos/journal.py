"""The side-effect journal: each effect keyed by an idempotency key, claimed as pending and then
completed exactly once (or released for a retry)."""

from __future__ import annotations

from typing import Any

from moorage.errors import ConflictError, NotFound
from moorage.store.model import JournalEntry, Scope
from moorage.store.repos.common import _check_key, _check_version, _now, _Repo
from moorage.store.sql import loads


_JOURNAL_COLS = "key, run_id, step, status, result, error, created_at, updated_at, version"
#: HTTP replay entries (an Idempotency-Key's stored answer) are keyed ``http:<sha256>``: ``HTTP_KEYS`` selects them
#: by key range (the primary key's index), and their ``step`` names the end-user the request was about
#: (``replay_mark``), so forgetting the user removes them.
HTTP_KEYS = "key >= 'http:' AND key < 'http;'"
#: How long a request's stored answer is replayed for its Idempotency-Key (the sweeper deletes older ones).
HTTP_REPLAY_TTL_S = 24 * 3600.0
#: A claim still pending after this long was left by a process that died before ``take_over`` could apply (no
#: request runs that long: a synchronous exec ends within 24 h); the sweeper deletes it.
HTTP_PENDING_TTL_S = 48 * 3600.0


def replay_mark(agent: str | None, user: str) -> str:
    """How an HTTP replay entry names the end-user its request was about (``agent`` None: not known)."""
    return f"http-user:{agent or '-'}/{user}"


def _journal(r: tuple) -> JournalEntry:
    return JournalEntry(r[0], r[1], r[2], r[3], loads(r[4]), r[5], r[6], r[7], r[8])


class Journal(_Repo):
    """Side effects keyed by idempotency key: claimed, then completed exactly once."""

    def get(self, key: str) -> JournalEntry | None:
        _check_key(key)
        with self._ts._tx(write=False) as c:
            r = c.one(f"SELECT {_JOURNAL_COLS} FROM journal WHERE key = ?", (key,))
        return None if r is None else _journal(r)

    def claim(self, key: str, *, run_id: str | None = None, step: str | None = None, scope: Scope | None = None,
              claimer: dict[str, Any] | None = None) -> tuple[JournalEntry, bool]:
        """Return the entry for ``key``, creating it as ``pending``; the bool says whether this call created it.
        ``claimer``: who holds a new claim (kept as the pending entry's result until it completes), so another
        process can tell a claim whose holder died (``take_over``)."""
        _check_key(key)
        now = _now()
        held = None if claimer is None else self._json(claimer, "journal claimer")
        with self._ts._tx() as c:
            n = c.x(
                "INSERT INTO journal (key, scope, run_id, step, status, result, error, created_at, updated_at, version) "
                "VALUES (?, ?, ?, ?, 'pending', ?, NULL, ?, ?, 1) ON CONFLICT DO NOTHING",
                (key, scope.key if scope else None, run_id, step, held, now, now),
            )
            if n != 1:
                r = c.one(f"SELECT {_JOURNAL_COLS} FROM journal WHERE key = ?", (key,))
                return _journal(r), False
            if scope is not None:
                self._ts._touch(c, scope, now)
        return JournalEntry(key, run_id, step, "pending", claimer, None, now, now, 1), True

    def take_over(self, key: str, *, expected_version: int, claimer: dict[str, Any]) -> JournalEntry | None:
        """Make a pending claim whose holder died this caller's (compare-and-set on its version); None when it
        changed meanwhile (completed, released, or taken over by another)."""
        _check_version(expected_version)
        now = _now()
        with self._ts._tx() as c:
            n = c.x("UPDATE journal SET result = ?, updated_at = ?, version = version + 1 "
                    "WHERE key = ? AND version = ? AND status = 'pending'",
                    (self._json(claimer, "journal claimer"), now, key, expected_version))
            if n != 1:
                return None
            r = c.one(f"SELECT {_JOURNAL_COLS} FROM journal WHERE key = ?", (key,))
        return _journal(r)

    def complete(self, key: str, *, expected_version: int, result: Any = None, error: str | None = None,
                 step: str | None = None) -> JournalEntry:
        """Record the outcome of a claimed entry (``step``: what it names now, if it changes; an HTTP replay entry
        names the end-user its request turned out to be about, ``replay_mark``)."""
        _check_version(expected_version)
        status = "failed" if error is not None else "done"
        now = _now()
        with self._ts._tx() as c:
            n = c.x(
                "UPDATE journal SET status = ?, result = ?, error = ?, updated_at = ?, step = COALESCE(?, step), "
                "version = version + 1 WHERE key = ? AND version = ? AND status = 'pending'",
                (status, None if result is None else self._json(result, "journal result"), error, now, step, key,
                 expected_version),
            )
            if n != 1:
                cur = c.one(f"SELECT {_JOURNAL_COLS} FROM journal WHERE key = ?", (key,))
                if cur is None:
                    raise NotFound(f"no journal entry {key!r}")
                raise ConflictError(f"journal entry {key!r} is {cur[3]} at version {cur[8]}", current_version=cur[8])
            r = c.one(f"SELECT {_JOURNAL_COLS} FROM journal WHERE key = ?", (key,))
        return _journal(r)

    def release(self, key: str, *, expected_version: int) -> None:
        """Drop a pending claim whose side effect failed before it happened, so a retry may claim it again."""
        with self._ts._tx() as c:
            c.x("DELETE FROM journal WHERE key = ? AND version = ? AND status = 'pending'", (key, expected_version))

    def list(self, *, run_id: str | None = None, limit: int = 1000) -> list[JournalEntry]:
        with self._ts._tx(write=False) as c:
            if run_id is None:
                rows = c.q(f"SELECT {_JOURNAL_COLS} FROM journal ORDER BY created_at LIMIT ?", (limit,))
            else:
                rows = c.q(f"SELECT {_JOURNAL_COLS} FROM journal WHERE run_id = ? ORDER BY created_at LIMIT ?", (run_id, limit))
        return [_journal(r) for r in rows]

    def forget_http(self, user: str, agent: str | None = None) -> int:
        """Delete the stored answers of requests about ``user`` (of ``agent``, or of every agent). Claims still
        pending stay: their requests are running (the forget request itself among them) and complete them."""
        with self._ts._tx() as c:
            if agent is not None:
                return c.x(f"DELETE FROM journal WHERE {HTTP_KEYS} AND status != 'pending' AND step IN (?, ?)",
                           (replay_mark(agent, user), replay_mark(None, user)))
            keys = [k for k, step in c.q(f"SELECT key, step FROM journal WHERE {HTTP_KEYS} AND status != 'pending' "
                                         "AND step IS NOT NULL")
                    if step.startswith("http-user:") and step.endswith(f"/{user}")]
            return sum(c.x("DELETE FROM journal WHERE key = ?", (k,)) for k in keys)

    def sweep_http(self, now: float, *, batch: int | None = None) -> int:
        """Delete stored answers older than ``HTTP_REPLAY_TTL_S`` and claims abandoned for ``HTTP_PENDING_TTL_S``,
        ``batch`` per transaction (``_delete_batched``)."""
        return self._delete_batched("journal", "key", f"{HTTP_KEYS} AND ((status != 'pending' AND updated_at < ?) OR "
                                    "updated_at < ?)", (now - HTTP_REPLAY_TTL_S, now - HTTP_PENDING_TTL_S), batch)
