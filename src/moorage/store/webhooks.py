"""Async executions, per-agent webhooks and their durable delivery outbox (with every attempt recorded).

Reached as ``TenantStore.executions``, ``.webhooks`` and ``.deliveries``. A delivery is written in the same
transaction as the decision to send it and is claimed by compare-and-set, so no restart loses or doubles one.
"""

from __future__ import annotations

import base64
import secrets
import uuid
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

from moorage import clock
from moorage.errors import ConflictError, InvalidInput, NotFound
from moorage.store.model import check_id
from moorage.store.sql import loads
from moorage.store.repos import common
from moorage.store.repos.common import _Repo

#: Events a webhook can subscribe to. ``interrupt.waiting``: a turn stopped for a human answer (approval);
#: ``fact.pending``: a fact the agent learned (or a tool said) waits for confirmation (``webhooks.facts``).
WEBHOOK_EVENTS: tuple[str, ...] = ("execution.succeeded", "execution.failed", "execution.cancelled", "interrupt.waiting",
                                   "fact.pending")
#: Streamed events kept per execution (the oldest go first): output is bounded, not a log of everything.
MAX_EXECUTION_EVENTS = 500
SECRET_PREFIX = "whsec_"


def new_secret() -> str:
    """A Standard Webhooks signing secret: ``whsec_`` + base64 of 24 random bytes."""
    return SECRET_PREFIX + base64.b64encode(secrets.token_bytes(24)).decode()


# -- executions -------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Execution:
    id: str
    agent: str
    user: str
    session: str
    input: dict[str, Any]
    events: list[Any]
    #: The last run status announced to webhooks (None: none yet).
    announced: str | None
    created_at: float
    updated_at: float
    version: int
    #: The API key that started it (for an end-user token, the key that issued the token); None: the operator's,
    #: or written before store migration 30. Revoking that key cancels it (``runtime/revoked_work.py``).
    key_id: str | None = None


_EXEC_COLS = "id, agent_id, user_id, session, input, events, announced, created_at, updated_at, version, key_id"


def _execution(r: tuple) -> Execution:
    return Execution(r[0], r[1], r[2], r[3], loads(r[4]) or {}, loads(r[5]) or [], r[6], r[7], r[8], r[9], r[10])


class Executions(_Repo):
    def create(self, execution_id: str, agent: str, user: str, session: str, input: dict[str, Any],
               key_id: str | None = None) -> tuple[Execution, bool]:
        """Record an async turn (True when new; the same id again returns the first one), started by API key
        ``key_id``."""
        now = clock.now()
        with self._ts._tx() as c:
            n = c.x(f"INSERT INTO executions ({_EXEC_COLS}) VALUES (?, ?, ?, ?, ?, '[]', NULL, ?, ?, 1, ?) "
                    "ON CONFLICT DO NOTHING",
                    (execution_id, agent, user, session, self._json(input, "execution input"), now, now, key_id))
            r = c.one(f"SELECT {_EXEC_COLS} FROM executions WHERE id = ?", (execution_id,))
        return _execution(r), n == 1

    def queued_of_key(self, key_id: str, *, after: str = "", limit: int = 1000) -> list[Execution]:
        """The async turns API key ``key_id`` started that have no run yet and were not announced (queued, or
        refused or cancelled before they started: their ``error`` event says so), at most ``limit``, in the order
        of their ids from the first after ``after`` (the last id of the page before)."""
        with self._ts._tx(write=False) as c:
            rows = c.q(f"SELECT {', '.join('e.' + col for col in _EXEC_COLS.split(', '))} FROM executions e "
                       "LEFT JOIN workflow_runs r ON r.id = e.id "
                       "WHERE e.key_id = ? AND e.announced IS NULL AND r.id IS NULL AND e.id > ? "
                       "ORDER BY e.id LIMIT ?", (key_id, after, limit))
        return [_execution(r) for r in rows]

    def keys_of(self, execution_ids: Sequence[str]) -> dict[str, str | None]:
        """The key that started each of ``execution_ids`` that is an execution (others are left out)."""
        out: dict[str, str | None] = {}
        with self._ts._tx(write=False) as c:
            for execution_id in dict.fromkeys(execution_ids):  # one probe of the key each (a list of ids is few)
                r = c.one("SELECT key_id FROM executions WHERE id = ?", (execution_id,))
                if r is not None:
                    out[execution_id] = r[0]
        return out

    def get(self, execution_id: str) -> Execution:
        with self._ts._tx(write=False) as c:
            r = c.one(f"SELECT {_EXEC_COLS} FROM executions WHERE id = ?", (execution_id,))
        if r is None:
            raise NotFound(f"no execution {execution_id!r}", hint="execution ids come from a 202 answer's `id`")
        return _execution(r)

    def add_events(self, execution_id: str, events: Sequence[Any]) -> None:
        """Append streamed events, keeping the newest ``MAX_EXECUTION_EVENTS``."""
        if not events:
            return
        with self._ts._tx() as c:
            r = c.one("SELECT events FROM executions WHERE id = ?", (execution_id,))
            if r is None:
                return
            kept = ((loads(r[0]) or []) + list(events))[-MAX_EXECUTION_EVENTS:]
            c.x("UPDATE executions SET events = ?, updated_at = ?, version = version + 1 WHERE id = ?",
                (self._json(kept, "execution events"), clock.now(), execution_id))

    def unsettled(self, *, limit: int = 200, after: Execution | None = None) -> list[Execution]:
        """Executions not yet announced as finished (none announced, or only an interrupt), oldest first; ``after``
        (the last of the previous page) reads the next page, so turns waiting for an answer never hide newer ones."""
        where, args = "(announced IS NULL OR announced = 'waiting')", ()
        if after is not None:
            where += " AND (created_at > ? OR (created_at = ? AND id > ?))"
            args = (after.created_at, after.created_at, after.id)
        with self._ts._tx(write=False) as c:
            rows = c.q(f"SELECT {_EXEC_COLS} FROM executions WHERE {where} ORDER BY created_at, id LIMIT ?",
                       (*args, limit))
        return [_execution(r) for r in rows]

    def unsettled_to_act_on(self, statuses: Sequence[str], *, page: int = 200) -> Iterator[tuple[Execution, str | None]]:
        """The unsettled executions (``unsettled``) something may still be done about, oldest first, page by page,
        each with its run's status: those with no run yet (queued, or refused before it began: their events say),
        and those whose run's status is one of ``statuses`` and not the one already announced. The rest (a turn
        still running, or still waiting for the answer it was announced waiting for) are passed over in the
        database: each webhook round read every unsettled execution's run, one query each, and sorted them all
        for every page (2 to 4 s a round with 10,000 turns waiting for a human, on a busy machine)."""
        changed = (f"r.status IN ({', '.join('?' * len(statuses))}) AND r.status <> COALESCE(e.announced, '')"
                   if statuses else "0 = 1")
        cols = ", ".join("e." + col for col in _EXEC_COLS.split(", "))
        last: Execution | None = None
        while True:
            where, args = "", ()
            if last is not None:
                where, args = " AND (e.created_at > ? OR (e.created_at = ? AND e.id > ?))", (last.created_at,
                                                                                            last.created_at, last.id)
            with self._ts._tx(write=False) as c:
                rows = c.q(f"SELECT {cols}, r.status FROM executions e LEFT JOIN workflow_runs r ON r.id = e.id "
                           f"WHERE (e.announced IS NULL OR e.announced = 'waiting') AND (r.id IS NULL OR ({changed}))"
                           f"{where} ORDER BY e.created_at, e.id LIMIT ?", (*statuses, *args, page))
            for r in rows:
                yield _execution(r[:-1]), r[-1]
            if len(rows) < page:
                return
            last = _execution(rows[-1][:-1])

    def delete_user(self, user: str, agent: str | None = None) -> int:
        """Forget one end-user's executions (their messages, streamed events and exec output), of one agent or all;
        joins the caller's transaction. Nothing is left to show as ``queued`` or to submit again after a restart."""
        with self._ts._tx() as c:
            if agent is None:
                return c.x("DELETE FROM executions WHERE user_id = ?", (user,))
            return c.x("DELETE FROM executions WHERE agent_id = ? AND user_id = ?", (agent, user))

    def mark_announced(self, execution_id: str, status: str, *, expected_version: int) -> bool:
        with self._ts._tx() as c:
            return c.x("UPDATE executions SET announced = ?, updated_at = ?, version = version + 1 "
                       "WHERE id = ? AND version = ?", (status, clock.now(), execution_id, expected_version)) == 1


# -- webhooks ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Webhook:
    id: str
    agent: str
    url: str
    events: tuple[str, ...]
    secret: str
    enabled: bool
    created_at: float
    version: int


_HOOK_COLS = "id, agent_id, url, events, secret, enabled, created_at, version"


def _webhook(r: tuple) -> Webhook:
    return Webhook(r[0], r[1], r[2], tuple(loads(r[3]) or ()), r[4], bool(r[5]), r[6], r[7])


def check_url(url: object) -> str:
    if not isinstance(url, str) or not url.startswith(("http://", "https://")) or len(url) > 2048 or any(
            ch.isspace() for ch in url):
        raise InvalidInput(f"webhook url must be an http(s) URL, got {url!r}", hint="e.g. https://example.com/hooks/moorage")
    return url


def check_events(events: object) -> tuple[str, ...]:
    if events is None:
        return WEBHOOK_EVENTS
    if not isinstance(events, list) or not events or not all(isinstance(e, str) for e in events):
        raise InvalidInput("events must be a non-empty list of event names", hint=f"from {', '.join(WEBHOOK_EVENTS)}")
    unknown = [e for e in events if e not in WEBHOOK_EVENTS]
    if unknown:
        raise InvalidInput(f"unknown webhook events {unknown}", hint=f"from {', '.join(WEBHOOK_EVENTS)}")
    return tuple(dict.fromkeys(events))


class Webhooks(_Repo):
    def create(self, agent: str, url: str, events: Sequence[str] | None = None, secret: str | None = None) -> Webhook:
        check_id(agent, "agent name")
        ev = check_events(None if events is None else list(events))
        if secret is not None and (not isinstance(secret, str) or not secret.startswith(SECRET_PREFIX)):
            raise InvalidInput("a webhook secret must start with whsec_", hint="omit it to have one generated")
        hook = Webhook("wh_" + uuid.uuid4().hex[:24], agent, check_url(url), ev, secret or new_secret(), True,
                       clock.now(), 1)
        with self._ts._tx() as c:
            c.x(f"INSERT INTO webhooks ({_HOOK_COLS}) VALUES (?, ?, ?, ?, ?, 1, ?, 1)",
                (hook.id, agent, hook.url, self._json(list(ev)), hook.secret, hook.created_at))
        return hook

    def get(self, webhook_id: str) -> Webhook:
        with self._ts._tx(write=False) as c:
            r = c.one(f"SELECT {_HOOK_COLS} FROM webhooks WHERE id = ?", (webhook_id,))
        if r is None:
            raise NotFound(f"no webhook {webhook_id!r}")
        return _webhook(r)

    def list(self, agent: str | None = None) -> list[Webhook]:
        with self._ts._tx(write=False) as c:
            if agent is None:
                rows = c.q(f"SELECT {_HOOK_COLS} FROM webhooks ORDER BY created_at, id")
            else:
                rows = c.q(f"SELECT {_HOOK_COLS} FROM webhooks WHERE agent_id = ? ORDER BY created_at, id", (agent,))
        return [_webhook(r) for r in rows]

    def delete(self, webhook_id: str) -> None:
        """Delete the webhook and its deliveries (nobody can list them once it is gone; pending ones never go)."""
        with self._ts._tx() as c:
            if c.x("DELETE FROM webhooks WHERE id = ?", (webhook_id,)) != 1:
                raise NotFound(f"no webhook {webhook_id!r}")
            _delete_deliveries(c, "webhook_id = ?", (webhook_id,))

    def subscribed(self, agent: str, event: str) -> list[Webhook]:
        return [h for h in self.list(agent) if h.enabled and event in h.events]


# -- deliveries (the outbox) and their attempts -----------------------------------------------------------

@dataclass(frozen=True)
class Delivery:
    id: str
    webhook_id: str
    event: str
    payload: dict[str, Any]
    status: str  # pending | delivered | failed
    attempts: int
    next_at: float | None
    created_at: float
    updated_at: float
    version: int


@dataclass(frozen=True)
class Attempt:
    delivery_id: str
    seq: int
    at: float
    status_code: int | None
    error: str | None
    duration_ms: float


_DLV_COLS = "id, webhook_id, event, payload, status, attempts, next_at, created_at, updated_at, version"


def _delivery(r: tuple) -> Delivery:
    return Delivery(r[0], r[1], r[2], loads(r[3]) or {}, r[4], r[5], r[6], r[7], r[8], r[9])


def _about(data: dict[str, Any]) -> tuple[str | None, str | None]:
    """The end-user (and agent) a delivery is about, as its ``user_id``/``agent_id`` columns hold them (migration
    25): what forgetting that user finds it by."""
    user, agent = data.get("user"), data.get("agent")
    if not isinstance(user, str):
        return None, None
    return user, agent if isinstance(agent, str) else None


def _delete_deliveries(c: Any, where: str, params: Sequence[Any]) -> int:
    """Delete the deliveries matching ``where`` and their attempts; rows deleted."""
    n = c.x(f"DELETE FROM webhook_attempts WHERE delivery_id IN (SELECT id FROM webhook_deliveries WHERE {where})",
            tuple(params))
    return n + c.x(f"DELETE FROM webhook_deliveries WHERE {where}", tuple(params))


class Deliveries(_Repo):
    def forget_user(self, user: str, agent: str | None = None) -> int:
        """Delete every delivery about ``user`` (of ``agent``, or of every agent), sent or not, with its attempts:
        a forgotten user's replies and facts leave the outbox too; joins the caller's transaction."""
        with self._ts._tx() as c:
            if agent is None:
                return _delete_deliveries(c, "user_id = ?", (user,))
            return _delete_deliveries(c, "user_id = ? AND (agent_id = ? OR agent_id IS NULL)", (user, agent))

    def sweep(self, older_than: float, *, batch: int | None = None) -> int:
        """Delete settled deliveries (delivered, or failed for good) last changed before ``older_than``, with their
        attempts, ``batch`` deliveries per transaction (``_delete_batched``)."""
        size, n = batch or common.SWEEP_BATCH, 0
        while True:
            with self._ts._tx() as c:
                ids = [r[0] for r in c.q("SELECT id FROM webhook_deliveries WHERE status <> 'pending' AND updated_at < ? "
                                         "LIMIT ?", (older_than, size))]
                if ids:
                    n += _delete_deliveries(c, f"id IN ({','.join('?' * len(ids))})", ids)
            if len(ids) < size:
                return n

    def enqueue(self, agent: str, event: str, data: dict[str, Any], *, at: float | None = None) -> list[Delivery]:
        """One pending delivery per webhook of ``agent`` subscribed to ``event``; joins the caller's transaction."""
        now = clock.now() if at is None else at
        out = []
        with self._ts._tx() as c:
            for hook in self._ts.webhooks.subscribed(agent, event):
                payload = {"type": event, "timestamp": now, "data": data}
                d = Delivery("msg_" + uuid.uuid4().hex, hook.id, event, payload, "pending", 0, now, now, now, 1)
                c.x(f"INSERT INTO webhook_deliveries ({_DLV_COLS}, user_id, agent_id) "
                    "VALUES (?, ?, ?, ?, 'pending', 0, ?, ?, ?, 1, ?, ?)",
                    (d.id, hook.id, event, self._json(payload, "webhook payload"), now, now, now, *_about(data)))
                out.append(d)
        return out

    def get(self, delivery_id: str) -> Delivery:
        with self._ts._tx(write=False) as c:
            r = c.one(f"SELECT {_DLV_COLS} FROM webhook_deliveries WHERE id = ?", (delivery_id,))
        if r is None:
            raise NotFound(f"no webhook delivery {delivery_id!r}")
        return _delivery(r)

    def list(self, webhook_id: str, *, limit: int = 50, before: float | None = None,
             before_id: str | None = None) -> list[Delivery]:
        """Newest first; those before (``before``, ``before_id``) in that order, or made before ``before``."""
        with self._ts._tx(write=False) as c:
            if before is not None and before_id is not None:
                rows = c.q(f"SELECT {_DLV_COLS} FROM webhook_deliveries WHERE webhook_id = ? AND "
                           "(created_at < ? OR (created_at = ? AND id < ?)) ORDER BY created_at DESC, id DESC LIMIT ?",
                           (webhook_id, before, before, before_id, limit))
            else:
                rows = c.q(f"SELECT {_DLV_COLS} FROM webhook_deliveries WHERE webhook_id = ? AND created_at < ? "
                           "ORDER BY created_at DESC, id DESC LIMIT ?", (webhook_id, before or float("inf"), limit))
        return [_delivery(r) for r in rows]

    def attempts(self, delivery_id: str) -> list[Attempt]:
        with self._ts._tx(write=False) as c:
            rows = c.q("SELECT delivery_id, seq, at, status_code, error, duration_ms FROM webhook_attempts "
                       "WHERE delivery_id = ? ORDER BY seq", (delivery_id,))
        return [Attempt(*r) for r in rows]

    def claim_due(self, now: float, lease_s: float, *, limit: int = 50) -> list[Delivery]:
        """Pending deliveries whose time has come, each claimed by moving ``next_at`` out by ``lease_s``
        (compare-and-set): another host skips them, and a host that dies mid-attempt leaves them due again."""
        with self._ts._tx(write=False) as c:
            rows = c.q(f"SELECT {_DLV_COLS} FROM webhook_deliveries WHERE status = 'pending' AND next_at <= ? "
                       "ORDER BY next_at LIMIT ?", (now, limit))
        out = []
        for d in map(_delivery, rows):
            with self._ts._tx() as c:
                n = c.x("UPDATE webhook_deliveries SET next_at = ?, version = version + 1 WHERE id = ? AND version = ?",
                        (now + lease_s, d.id, d.version))
            if n == 1:
                out.append(Delivery(d.id, d.webhook_id, d.event, d.payload, d.status, d.attempts, now + lease_s,
                                    d.created_at, d.updated_at, d.version + 1))
        return out

    def release(self, claims: dict[str, int], now: float) -> int:
        """Make due at ``now`` the deliveries claimed as ``{id: version after the claim}`` by a sender that died
        mid-attempt, unless anything moved them on since (an attempt recorded, another sender's claim after the
        lease ran out); how many were released."""
        n = 0
        with self._ts._tx() as c:
            for delivery_id, version in claims.items():
                n += c.x("UPDATE webhook_deliveries SET next_at = ?, version = version + 1 "
                         "WHERE id = ? AND version = ? AND status = 'pending'", (now, delivery_id, version))
        return n

    def record_attempt(self, d: Delivery, *, at: float, status_code: int | None, error: str | None,
                       duration_ms: float, delivered: bool, retry_at: float | None) -> Delivery:
        """Record one attempt and move the delivery on: delivered, retried at ``retry_at``, or failed (None)."""
        status = "delivered" if delivered else ("pending" if retry_at is not None else "failed")
        seq = d.attempts + 1
        with self._ts._tx() as c:
            n = c.x("UPDATE webhook_deliveries SET status = ?, attempts = ?, next_at = ?, updated_at = ?, "
                    "version = version + 1 WHERE id = ? AND version = ?",
                    (status, seq, None if status != "pending" else retry_at, at, d.id, d.version))
            if n != 1:
                raise ConflictError(f"delivery {d.id} was claimed by another sender", hint="nothing to do")
            c.x("INSERT INTO webhook_attempts (delivery_id, seq, at, status_code, error, duration_ms) "
                "VALUES (?, ?, ?, ?, ?, ?)", (d.id, seq, at, status_code, (error or "")[:500] or None, duration_ms))
        return Delivery(d.id, d.webhook_id, d.event, d.payload, status, seq, retry_at if status == "pending" else None,
                        d.created_at, at, d.version + 1)

    def replay(self, delivery_id: str) -> Delivery:
        """Send a delivery again now (same id, so a receiver can tell it is the same message)."""
        now = clock.now()
        with self._ts._tx() as c:
            r = c.one(f"SELECT {_DLV_COLS} FROM webhook_deliveries WHERE id = ?", (delivery_id,))
            if r is None:
                raise NotFound(f"no webhook delivery {delivery_id!r}")
            c.x("UPDATE webhook_deliveries SET status = 'pending', next_at = ?, updated_at = ?, version = version + 1 "
                "WHERE id = ?", (now, now, delivery_id))
        return self.get(delivery_id)
