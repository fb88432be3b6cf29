"""Raw semantic fact rows, bi-temporal (valid and recorded time); their lifecycle fields change by
compare-and-set, their content never."""

from __future__ import annotations

import hashlib
from typing import Any, Callable, Sequence

from moorage.errors import ConflictError, InvalidInput, NotFound
from moorage.store.model import FACT_STATUS, FACT_TRUST, Fact, Scope
from moorage.store.repos.common import _check_version, _new_id, _now, _Repo
from moorage.store.sql import loads


_FACT_COLS = (
    "id, scope, subject, attribute, value, text, valid_from, valid_to, recorded_at, superseded_at, "
    "superseded_by, trust, status, provenance, source, version, confirmed_at"
)

#: When moorage came to believe a fact: when it was confirmed, if it waited for that (migration 20), else when it
#: was recorded. What ``known_at`` compares.
_BELIEVED = "COALESCE(confirmed_at, recorded_at)"

# The facts of one subject's attribute in one status that are not closed: what the index of current facts
# (migration 17: scope, status, subject, attribute, value_key WHERE valid_to IS NULL) holds.
_CURRENT = "facts WHERE scope = ? AND subject = ? AND attribute = ? AND status = ? AND valid_to IS NULL"


#: The index of current facts holds each fact's subject, attribute and value key; PostgreSQL refuses an index entry
#: over 2,704 bytes (a 500 for a fact of a few KiB). Subject and attribute are names, held to this many bytes; a
#: longer value key is stored as its digest (equal keys, equal digests: the comparison stays exact).
NAME_MAX_BYTES = 500
VALUE_KEY_MAX_BYTES = 512


def _stored_key(key: str) -> str:
    raw = key.encode()
    return key if len(raw) <= VALUE_KEY_MAX_BYTES else "sha256:" + hashlib.sha256(raw).hexdigest()


def _name(value: str, what: str) -> str:
    if len(value.encode()) > NAME_MAX_BYTES:
        raise InvalidInput(f"a fact's {what} is longer than {NAME_MAX_BYTES} bytes",
                           hint=f"name the {what} in a few words; the value holds the rest")
    return value


def _fact(r: tuple) -> Fact:
    return Fact(r[0], Scope.parse(r[1]), r[2], r[3], r[4], r[5], r[6], r[7], r[8], r[9], r[10], r[11], r[12],
                tuple(loads(r[13])), r[14], r[15], r[16])


class Facts(_Repo):
    """Raw fact rows; the supersede/merge rules live in ``moorage.memory.semantic``."""

    def insert(
        self, scope: Scope, subject: str, attribute: str, value: str, text: str, *, valid_from: float | None = None,
        trust: str = "user_stated", status: str = "active", provenance: Sequence[str] = (), source: str = "user",
        value_key: str | None = None,
    ) -> Fact:
        """A new fact row; ``value_key`` is the value's comparable form, if the caller has one (see
        ``current_matching``)."""
        if trust not in FACT_TRUST:
            raise InvalidInput(f"unknown trust {trust!r}", hint=f"one of {', '.join(FACT_TRUST)}")
        if status not in FACT_STATUS:
            raise InvalidInput(f"unknown fact status {status!r}", hint=f"one of {', '.join(FACT_STATUS)}")
        now = _now()
        f = Fact(
            _new_id(), scope, _name(self._text(subject, "subject"), "subject"),
            _name(self._text(attribute, "attribute"), "attribute"),
            self._text(value, "value"), self._text(text, "text"), now if valid_from is None else valid_from, None, now,
            None, None, trust, status, tuple(str(p) for p in provenance), self._text(source, "source"), 1,
        )
        with self._ts._tx() as c:
            c.x(
                f"INSERT INTO facts ({_FACT_COLS}, value_key) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (f.id, scope.key, f.subject, f.attribute, f.value, f.text, f.valid_from, None, now, None, None, trust,
                 status, self._json(list(f.provenance), "provenance"), f.source, 1, None,
                 None if value_key is None else _stored_key(self._text(value_key, "value key"))),
            )
            self._ts._touch(c, scope, now)
        return f

    def lock(self, scope: Scope) -> None:
        """Hold ``scope``'s row in ``scopes`` until the caller's transaction ends, so the fact writes of one scope
        run one at a time: two first values of an attribute written at once on PostgreSQL both found no current
        value and both became current (SQLite's writers already take turns). The same row every write of the
        scope touches, so this adds no lock a transaction could take in another order."""
        with self._ts._tx() as c:
            self._ts._touch(c, scope, _now())

    def get(self, fact_id: str) -> Fact:
        with self._ts._tx(write=False) as c:
            r = c.one(f"SELECT {_FACT_COLS} FROM facts WHERE id = ?", (fact_id,))
        if r is None:
            raise NotFound(f"no fact {fact_id!r}")
        return _fact(r)

    def update(
        self, fact_id: str, *, expected_version: int, valid_to: float | None = None, superseded_by: str | None = None,
        status: str | None = None, provenance: Sequence[str] | None = None, trust: str | None = None,
        superseded_at: float | None = None, confirmed_at: float | None = None,
    ) -> Fact:
        """Compare-and-set change of a fact's lifecycle fields (its content never changes). With ``superseded_by``,
        ``superseded_at`` (default: now) is when moorage stopped believing it: the recording time of what replaced
        it, so at no recorded instant are both believed. ``confirmed_at``: when a pending fact was confirmed (from
        then on it counts as known)."""
        _check_version(expected_version)
        with self._ts._tx() as c:
            cur = c.one(f"SELECT {_FACT_COLS} FROM facts WHERE id = ?", (fact_id,))
            if cur is None:
                raise NotFound(f"no fact {fact_id!r}")
            f = _fact(cur)
            now = _now()
            new = Fact(
                f.id, f.scope, f.subject, f.attribute, f.value, f.text, f.valid_from,
                f.valid_to if valid_to is None else valid_to, f.recorded_at,
                f.superseded_at if superseded_by is None else (now if superseded_at is None else superseded_at),
                f.superseded_by if superseded_by is None else superseded_by,
                f.trust if trust is None else trust, f.status if status is None else status,
                f.provenance if provenance is None else tuple(provenance), f.source, expected_version + 1,
                f.confirmed_at if confirmed_at is None else confirmed_at,
            )
            if new.status not in FACT_STATUS or new.trust not in FACT_TRUST:
                raise InvalidInput("unknown fact status or trust")
            n = c.x(
                "UPDATE facts SET valid_to = ?, superseded_at = ?, superseded_by = ?, trust = ?, status = ?, provenance = ?, "
                "confirmed_at = ?, version = version + 1 WHERE id = ? AND version = ?",
                (new.valid_to, new.superseded_at, new.superseded_by, new.trust, new.status,
                 self._json(list(new.provenance), "provenance"), new.confirmed_at, fact_id, expected_version),
            )
            if n != 1:
                raise ConflictError(f"fact {fact_id} changed (now version {f.version})", current_version=f.version)
        return new

    def close(self, fact_id: str, *, expected_version: int, valid_to: float, superseded_by: str | None = None,
              superseded_at: float | None = None) -> Fact:
        return self.update(fact_id, expected_version=expected_version, valid_to=valid_to, superseded_by=superseded_by,
                           superseded_at=superseded_at)

    def list(
        self, scope: Scope, *, subject: str | None = None, attribute: str | None = None, valid_at: float | None = None,
        known_at: float | None = None, include_closed: bool = False, statuses: Sequence[str] = ("active",),
        limit: int | None = 1000,
    ) -> list[Fact]:
        """Facts of a scope. ``valid_at``: true at that time; ``known_at``: as believed then (bi-temporal: recorded,
        or for a fact that waited for confirmation, confirmed, by then, and not yet superseded).
        ``limit``: the first that many in order; None: all of them."""
        where = "scope = ?"
        params: list[Any] = [scope.key]
        if subject is not None:
            where += " AND subject = ?"
            params.append(subject)
        if attribute is not None:
            where += " AND attribute = ?"
            params.append(attribute)
        if statuses:
            where += f" AND status IN ({','.join('?' * len(statuses))})"
            params += list(statuses)
        if known_at is not None:
            where += f" AND {_BELIEVED} <= ? AND (superseded_at IS NULL OR superseded_at > ?)"
            params += [known_at, known_at]
        if valid_at is not None:
            where += " AND valid_from <= ? AND (valid_to IS NULL OR valid_to > ?)"
            params += [valid_at, valid_at]
        elif not include_closed and known_at is None:
            where += " AND valid_to IS NULL"
            # The facts true now: the index of current facts holds exactly those (migration 17). Sorted here, as
            # in ``current``: with an ORDER BY, SQLite reads through the (scope, subject, attribute, valid_from)
            # index instead, walking every closed and pending row of the scope.
            with self._ts._tx(write=False) as c:
                rows = c.q(f"SELECT {_FACT_COLS} FROM facts WHERE {where}", params)
            return sorted((_fact(r) for r in rows), key=lambda f: (f.valid_from, f.recorded_at, f.id))[:limit]  # None: all
        with self._ts._tx(write=False) as c:
            # The id breaks ties, so the order is the same on every read (pages of a listing neither repeat nor skip).
            rows = c.q(f"SELECT {_FACT_COLS} FROM facts WHERE {where} ORDER BY valid_from, recorded_at, id"
                       + ("" if limit is None else " LIMIT ?"), (*params, *(() if limit is None else (limit,))))
        return [_fact(r) for r in rows]

    def waiting(self, scope: Scope, *, after: tuple[float, str] | None = None, limit: int = 100) -> list[Fact]:
        """The scope's pending facts (waiting for confirmation) in the order they were recorded, the first ``limit``
        after ``after`` (the ``(recorded_at, id)`` of the last one of the page before): read through the index of
        pending facts (migration 20), so a page costs its own rows however many wait or were ever decided."""
        where, params = "scope = ? AND status = 'pending'", [scope.key]
        if after is not None:
            where += " AND (recorded_at > ? OR (recorded_at = ? AND id > ?))"
            params += [after[0], after[0], after[1]]
        with self._ts._tx(write=False) as c:
            rows = c.q(f"SELECT {_FACT_COLS} FROM facts WHERE {where} ORDER BY recorded_at, id LIMIT ?",
                       (*params, limit))
        return [_fact(r) for r in rows]

    def current(self, scope: Scope, subject: str, attribute: str, *, status: str = "active") -> list[Fact]:
        """The facts of one subject's attribute in ``status`` that are not closed, oldest first: read through the
        index of current facts (migration 17), so closed values do not count, however many there were."""
        with self._ts._tx(write=False) as c:
            rows = c.q(f"SELECT {_FACT_COLS} FROM {_CURRENT}", (scope.key, subject, attribute, status))
        # Sorted here: an ORDER BY in SQL makes SQLite prefer the (scope, subject, attribute, valid_from) index,
        # which walks the closed values too.
        return sorted((_fact(r) for r in rows), key=lambda f: (f.valid_from, f.recorded_at))

    def current_matching(
        self, scope: Scope, subject: str, attribute: str, *, status: str, key: str, keyer: Callable[[str], str],
    ) -> list[Fact]:
        """The facts ``current`` returns whose value's comparable form ``keyer(value)`` is ``key``, oldest first.

        The form is stored with the row (``value_key``), so this reads only the rows with that form. Rows written
        without it (before migration 17, by a caller that had none, or restored from a checkpoint image) are read
        too and get theirs written here, once: a write transaction.
        """
        raw, key = key, _stored_key(key)
        # A long key stored whole before digests (on SQLite, which took it) is looked for too.
        keys = (key,) if key == raw else (key, raw)
        with self._ts._tx() as c:
            # Two probes of the index (an OR of the two would walk every key of the attribute).
            where, marks = (scope.key, subject, attribute, status), ", ".join("?" * len(keys))
            rows = c.q(f"SELECT {_FACT_COLS}, value_key FROM {_CURRENT} AND value_key IN ({marks}) "
                       f"UNION ALL SELECT {_FACT_COLS}, value_key FROM {_CURRENT} AND value_key IS NULL",
                       (*where, *keys, *where))
            out = []
            for r in rows:
                have = r[-1]
                if have is None:
                    have = _stored_key(keyer(r[4]))
                    # Not a change of the fact (its version stays): the form is derived from its value, which never
                    # changes.
                    c.x("UPDATE facts SET value_key = ? WHERE id = ? AND value_key IS NULL",
                        (self._text(have, "value key"), r[0]))
                if _stored_key(have) == key:  # one stored whole before digests (SQLite) still matches its own
                    out.append(_fact(r[:-1]))
        return sorted(out, key=lambda f: (f.valid_from, f.recorded_at))
