"""The per-agent-instance state machine: its states, the table of allowed (from, verb, to) transitions.

Every transition is one compare-and-set on the instance's row in the store's ``sandboxes`` table plus a Span,
in one transaction: placement and state live in the store, never only in a process's memory.
"""

from __future__ import annotations

import enum
import os
import time
import uuid
from dataclasses import dataclass
from typing import Any

from moorage import clock
from moorage.errors import ConflictError
from moorage.sandbox.process_fs import proc_starttime
from moorage.store import SandboxRecord, Span, TenantStore
from moorage.usage import ledger as usage_ledger


class InstanceState(str, enum.Enum):
    PROVISIONING = "provisioning"  # record claimed; sandbox being forked from the template and started
    RUNNING = "running"  # awake on ``host``; turns are forwarded to it
    WAKING = "waking"  # a manager holds the wake claim (``meta.claim``); everyone else waits for it
    SUSPENDING = "suspending"  # the owning manager is snapshotting it; requests wait, then wake it again
    SLEEPING = "sleeping"  # snapshot on disk, no compute
    ARCHIVED = "archived"  # asleep past the agent's archive TTL; still wakes on request
    DELETED = "deleted"  # past the delete TTL: disks and snapshots are being removed, then the row goes
    FAILED = "failed"  # provisioning or wake failed; the next request retries, the delete TTL removes it


S = InstanceState

#: States whose claim (``meta.claim``) names the manager that must move them on.
CLAIMED_STATES = frozenset({S.PROVISIONING, S.WAKING, S.SUSPENDING, S.DELETED})


class Verb(str, enum.Enum):
    PROVISIONED = "provisioned"
    CLAIM_WAKE = "claim_wake"
    WOKE = "woke"
    CLAIM_SLEEP = "claim_sleep"
    SLEPT = "slept"
    ARCHIVE = "archive"
    DELETE = "delete"
    FAIL = "fail"
    REPROVISION = "reprovision"
    RECLAIM = "reclaim"  # take over a claim whose owner died or timed out
    ADOPT = "adopt"  # host restart: the sandbox is still alive, keep it running
    RECOVER = "recover"  # host restart: the sandbox's processes are gone, its disk is the snapshot


V = Verb

#: The whole machine. Creation (no row → provisioning) is the store's ``create``; the row is removed only from
#: ``deleted``. Anything not listed here raises ``IllegalTransition``.
TRANSITIONS: dict[tuple[InstanceState, Verb], InstanceState] = {
    (S.PROVISIONING, V.PROVISIONED): S.RUNNING,
    (S.PROVISIONING, V.FAIL): S.FAILED,
    (S.PROVISIONING, V.RECLAIM): S.PROVISIONING,
    (S.SLEEPING, V.CLAIM_WAKE): S.WAKING,
    (S.ARCHIVED, V.CLAIM_WAKE): S.WAKING,
    (S.FAILED, V.CLAIM_WAKE): S.WAKING,
    (S.RUNNING, V.CLAIM_WAKE): S.WAKING,  # recorded running on this host but its process is gone
    (S.WAKING, V.WOKE): S.RUNNING,
    (S.WAKING, V.FAIL): S.FAILED,
    (S.WAKING, V.RECLAIM): S.WAKING,
    (S.WAKING, V.REPROVISION): S.PROVISIONING,  # the sandbox's disk is gone: fork it again from the template
    (S.RUNNING, V.CLAIM_SLEEP): S.SUSPENDING,
    (S.SUSPENDING, V.SLEPT): S.SLEEPING,
    (S.SUSPENDING, V.FAIL): S.FAILED,
    (S.SUSPENDING, V.RECLAIM): S.WAKING,
    (S.SLEEPING, V.ARCHIVE): S.ARCHIVED,
    (S.SLEEPING, V.DELETE): S.DELETED,
    (S.ARCHIVED, V.DELETE): S.DELETED,
    (S.FAILED, V.DELETE): S.DELETED,
    (S.RUNNING, V.FAIL): S.FAILED,  # host restart: recorded running but its sandbox is gone from disk
    (S.RUNNING, V.ADOPT): S.RUNNING,
    (S.WAKING, V.ADOPT): S.RUNNING,
    (S.SUSPENDING, V.ADOPT): S.RUNNING,
    (S.RUNNING, V.RECOVER): S.SLEEPING,
    (S.WAKING, V.RECOVER): S.SLEEPING,
    (S.SUSPENDING, V.RECOVER): S.SLEEPING,
}


class IllegalTransition(ConflictError):
    """A verb was applied to an instance in a state the machine does not allow it from."""

    code = "illegal-transition"

    def __init__(self, record: SandboxRecord, verb: Verb) -> None:
        allowed = sorted(v.value for (s, v) in TRANSITIONS if s.value == record.state)
        super().__init__(
            f"cannot {verb.value} instance {record.id} of {record.scope}: it is {record.state}",
            current_version=record.version,
            hint=f"from {record.state} the allowed verbs are {', '.join(allowed) or 'none'}; re-read the record",
        )


def target(state: str, verb: Verb) -> InstanceState | None:
    return TRANSITIONS.get((InstanceState(state), verb))


# ---------------------------------------------------------------------------------------------------------------
# Claims: who is moving an instance through a transitional state


@dataclass(frozen=True)
class Owner:
    """One manager incarnation: its host, a unique id, and the OS process that holds its claims."""

    host: str
    id: str
    pid: int
    pid_start: int | None

    @classmethod
    def this_process(cls, host: str) -> "Owner":
        pid = os.getpid()
        return cls(host, uuid.uuid4().hex[:16], pid, proc_starttime(pid))

    def claim(self, now: float | None = None) -> dict[str, Any]:
        return {"owner": self.id, "host": self.host, "pid": self.pid, "pid_start": self.pid_start,
                "at": clock.now() if now is None else now}


def claim_of(record: SandboxRecord) -> dict[str, Any] | None:
    c = record.meta.get("claim")
    return c if isinstance(c, dict) else None


def claim_is_dead(record: SandboxRecord, me: Owner, timeout_s: float, now: float | None = None) -> bool:
    """Whether nobody will finish this record's claim: its process is gone (same host) or it timed out."""
    c = claim_of(record)
    if c is None:
        return True
    now = clock.now() if now is None else now
    if c.get("host") == me.host and isinstance(c.get("pid"), int):
        if c.get("owner") != me.id and proc_starttime(c["pid"]) != c.get("pid_start"):
            return True
    return now - float(c.get("at", 0.0)) > timeout_s


# ---------------------------------------------------------------------------------------------------------------
# Applying a transition


@dataclass(frozen=True)
class TraceContext:
    """Where a transition's span hangs: the request's trace, or a new one for background jobs."""

    trace_id: str
    parent_id: str | None = None

    @classmethod
    def new(cls) -> "TraceContext":
        return cls(uuid.uuid4().hex)


_UNSET: Any = object()


def apply(
    ts: TenantStore,
    record: SandboxRecord,
    verb: Verb,
    *,
    owner: Owner,
    trace: TraceContext | None = None,
    reason: str = "",
    claim: bool | None = None,
    host: Any = _UNSET,
    snapshot_ref: Any = _UNSET,
    disk_ref: Any = _UNSET,
    last_active: float | None = None,
    meta: dict[str, Any] | None = None,
    started_at: float | None = None,
) -> SandboxRecord:
    """Move ``record`` by ``verb`` with compare-and-set on its version, and trace it, in one transaction.

    ``claim``: True stamps ``owner`` as the claimant (default for transitional targets), False clears it.
    Raises ``IllegalTransition`` when the table forbids it and ``ConflictError`` when someone moved it first.
    Blocking (store I/O): call it from a worker thread in async code.
    """
    to = target(record.state, verb)
    if to is None:
        raise IllegalTransition(record, verb)
    now = clock.now()
    new_meta = dict(record.meta if meta is None else meta)
    if claim is None:
        claim = to in CLAIMED_STATES
    if claim:
        new_meta["claim"] = owner.claim(now)
    else:
        new_meta.pop("claim", None)
    new_meta["last_verb"] = verb.value
    changes: dict[str, Any] = {"state": to.value, "meta": new_meta, "last_active": last_active}
    if host is not _UNSET:
        changes["host"] = host
    if snapshot_ref is not _UNSET:
        changes["snapshot_ref"] = snapshot_ref
    if disk_ref is not _UNSET:
        changes["disk_ref"] = disk_ref
    trace = trace or TraceContext.new()
    scope = record.scope
    with ts.transaction():
        awake = _awake_period_ended(ts, record, to, new_meta, owner)
        new = ts.sandboxes.update(record.id, expected_version=record.version, **changes)
        if awake is not None:  # in the same transaction: a takeover that loses the race bills nothing
            ts.usage.add("compute_seconds", awake[1] - awake[0], agent_id=scope.agent, user_id=scope.user,
                         scope=scope, meta={"instance": record.id, "reason": f"{verb.value} after its host stopped",
                                            "awake_until": awake[1]})
        ts.spans.record(Span(
            trace_id=trace.trace_id,
            span_id=uuid.uuid4().hex[:16],
            parent_id=trace.parent_id,
            name=f"lifecycle.{verb.value}",
            start_ts=started_at if started_at is not None else now,
            end_ts=time.time(),
            status="ok",
            attrs={
                "tenant": ts.tenant_id, "agent": scope.agent, "user": scope.user, "scope": scope.key,
                "instance": record.id, "from": record.state, "to": to.value, "verb": verb.value,
                "host": owner.host, "owner": owner.id, "version": new.version, **({"reason": reason} if reason else {}),
            },
            scope=scope,
        ))
    return new


def _awake_period_ended(ts: TenantStore, record: SandboxRecord, to: InstanceState, new_meta: dict[str, Any],
                        owner: Owner) -> tuple[float, float] | None:
    """The awake period a transition ends without a sleep recording it (``awake_since`` to its end), or None.

    A sleep writes its ``compute_seconds`` itself and drops ``awake_since`` (lifecycle/sleeping.py). Any other way
    out of running (recovery after the host restarted, a failure, another host taking the instance over) ended
    the period too: it is billed here, once, and ``awake_since`` leaves the record (it was kept, and the period
    lost, when the next wake stamped a new one). Its end: now, when this process held the instance (it was alive
    until now); otherwise the latest activity the store recorded of the instance's user (their turns' writes and
    model calls), as nothing records when a host died: the idle time between that and the death is not billed."""
    since = record.meta.get("awake_since")
    # Only from an awake state: a record an earlier version left asleep with its ``awake_since`` (its period lost
    # then) is not billed now, at its next wake, up to an activity long after the period ended.
    if (not isinstance(since, (int, float)) or record.state not in (S.RUNNING.value, S.SUSPENDING.value)
            or to in (S.RUNNING, S.SUSPENDING) or new_meta.get("awake_since") != since):
        return None
    new_meta.pop("awake_since")
    now = time.time()
    held = [record.meta.get(k) for k in ("owner", "claim")]
    if any(isinstance(h, dict) and h.get("owner") == owner.id for h in held):
        return since, max(since, now)
    scope = record.scope
    if scope.kind == "user" and scope.user is not None:
        rows = ts.read("SELECT MAX(last_active) FROM scopes WHERE agent_id = ? AND user_id = ?", [scope.agent, scope.user])
        # The model calls its turns made are its activity too: a turn still running when the host died wrote its
        # start only, and its awake time up to its last finished call (billed as tokens) was not billed.
        calls = ts.read("SELECT MAX(ts) FROM usage WHERE ts >= ? AND kind = 'input_tokens' AND agent_id = ? "
                        "AND user_id = ?", [since, scope.agent, scope.user])
    else:
        rows = ts.read("SELECT MAX(last_active) FROM scopes WHERE scope = ?", [scope.key])
        calls = []
    seen = max([float(r[0][0]) for r in (rows, calls) if r and r[0][0] is not None], default=since)
    return since, min(now, max(since, seen))


def _span(ts: TenantStore, record: SandboxRecord, name: str, owner: Owner, trace: TraceContext | None, frm: str | None,
          to: str | None, started_at: float, **attrs: Any) -> Span:
    trace = trace or TraceContext.new()
    scope = record.scope
    return Span(trace.trace_id, uuid.uuid4().hex[:16], trace.parent_id, name, started_at, time.time(), "ok",
                {"tenant": ts.tenant_id, "agent": scope.agent, "user": scope.user, "scope": scope.key,
                 "instance": record.id, "from": frm, "to": to, "host": owner.host, "owner": owner.id, **attrs},
                scope)


def provision(ts: TenantStore, scope: Any, *, owner: Owner, template_ref: str | None, sandbox_id: str,
              trace: TraceContext | None = None, meta: dict[str, Any] | None = None) -> SandboxRecord:
    """Create the instance's row in ``provisioning`` with ``owner``'s claim (``ConflictError`` if one exists)."""
    now = clock.now()
    with ts.transaction():
        rec = ts.sandboxes.create(scope, state=S.PROVISIONING.value, host=owner.host, template_ref=template_ref,
                                  sandbox_id=sandbox_id, meta={**(meta or {}), "claim": owner.claim(now),
                                                               "last_verb": "provision"})
        ts.spans.record(_span(ts, rec, "lifecycle.provision", owner, trace, None, S.PROVISIONING.value, now,
                              verb="provision", template=template_ref))
    return rec


def remove(ts: TenantStore, record: SandboxRecord, *, owner: Owner, trace: TraceContext | None = None) -> None:
    """Drop the row of an instance in ``deleted`` (its disks are already gone), traced. Its disk and snapshot
    levels in the usage ledger go to 0 with it: usage reports each instance's latest level, which would otherwise
    be its last sleep's bytes for as long as the ledger keeps them."""
    if record.state != S.DELETED.value:
        raise IllegalTransition(record, V.DELETE)
    now = time.time()
    with ts.transaction():
        ts.sandboxes.delete(record.id, expected_version=record.version)
        usage_ledger.record(ts, record, dict.fromkeys(usage_ledger.GAUGES, 0))
        ts.spans.record(_span(ts, record, "lifecycle.removed", owner, trace, S.DELETED.value, None, now, verb="removed"))
