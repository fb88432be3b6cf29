"""Work a revoked API key started detached ends: its async turns, queued or running, and its detached execs are
cancelled by the host that holds them, each naming the key, within ``CHECK_S`` of the revoke on any host of a fleet.

Every execution records the key that started it (for an end-user token, the key that issued the token; store
migration 30). The host that answers the revoke cancels the key's queued turns in the store at once, wherever they
wait; each host checks the keys of the detached work it holds every ``CHECK_S`` while it holds some, so a running
turn or exec stops on the host that runs it. Requests still open are the credential watch's (``api/credential_watch``).
"""

from __future__ import annotations

import asyncio
import time
import weakref
from typing import Any

from moorage import clock
from moorage.errors import ConflictError, NotFound
from moorage.log import FailingRounds, get_logger
from moorage.store import Principal, TenantStore

log = get_logger(__name__)

#: How often a host holding detached work checks whether the keys that started it were revoked (tests shorten it).
CHECK_S = 1.0
#: How long a revoked key's async turn still waiting for its instance is refused as it is admitted.
REFUSED_FOR_S = 900.0
#: How many of a revoked key's queued turns are read from the store at once (tests shorten it).
QUEUED_PAGE = 1000
#: How an end-user token's principal names the key that issued it (``api/auth.py``).
TOKEN_KEY = "user-token:"


def starting_key(principal: Principal) -> str | None:
    """The API key behind ``principal``: its own, or the one that issued its end-user token (None: the operator)."""
    key = principal.key_id
    if key is None:
        return None
    return key[len(TOKEN_KEY):] if key.startswith(TOKEN_KEY) else key


def reason(key_id: str) -> str:
    """What a cancelled run says (its ``error``, and its webhook's)."""
    return f"cancelled: API key {key_id}, which started it (or issued the end-user token that did), was revoked"


class KeyRevoked(ConflictError):
    """An async turn of a revoked key reached its instance: refused there, it never starts (``cancelled``)."""

    code = "cancelled"

    def __init__(self, message: str) -> None:
        super().__init__(message, hint="send the turn again with a valid credential if it is still wanted")


class RevokedWork:
    """The check of one runtime's detached work against revoked keys (``RevokedWork.of(runtime)``)."""

    _instances: "weakref.WeakKeyDictionary[Any, RevokedWork]" = weakref.WeakKeyDictionary()

    def __init__(self, runtime: Any) -> None:
        self.runtime = runtime
        self._task: asyncio.Task[None] | None = None
        #: (tenant, run id) of turns run here -> the key that started them (None: not an async turn, or no key).
        self._keys: dict[tuple[str, str], str | None] = {}
        #: (tenant, execution id) of a revoked key's async turns not started -> (until when refused, why).
        self._refused: dict[tuple[str, str], tuple[float, str]] = {}
        self._failures = FailingRounds(log, "the check of revoked keys' detached work")

    @classmethod
    def of(cls, runtime: Any) -> "RevokedWork":
        watch = cls._instances.get(runtime)
        if watch is None:
            watch = cls._instances[runtime] = cls(runtime)
        return watch

    # -- what the rest of the runtime calls --------------------------------------------------------------------

    def watch(self) -> None:
        """This host took on detached work: the check runs (until it holds none)."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="revoked-keys-work")

    def refusal(self, tenant_id: str, turn_id: str) -> KeyRevoked | None:
        """Why a turn about to start must not (its key was revoked while it waited), else None."""
        held = self._refused.get((tenant_id, turn_id))
        if held is None or held[0] <= time.monotonic():
            return None
        return KeyRevoked(f"{held[1]} before the turn began")

    async def revoked(self, ts: TenantStore, key_id: str) -> int:
        """``key_id`` of ``ts``'s tenant was just revoked: its queued async turns, on any host, are cancelled in the
        store now (they never start), and what this host runs of its work is cancelled. Other hosts cancel theirs
        at their next check. How many queued turns were cancelled."""
        why = reason(key_id)
        n, after = 0, ""
        while True:  # all of them, a page at a time: a key may have queued more than a page
            queued = await asyncio.to_thread(ts.executions.queued_of_key, key_id, after=after, limit=QUEUED_PAGE)
            for ex in queued:
                if any(e.get("kind") == "error" for e in ex.events):
                    continue  # refused or cancelled before it started already
                await asyncio.to_thread(ts.executions.add_events, ex.id, [_cancelled_event(why)])
                n += 1
            if len(queued) < QUEUED_PAGE:
                break
            after = queued[-1].id
        await self.check(only=ts.tenant_id)
        if n:
            log.info("queued async turns of a revoked key cancelled", key=key_id, count=n)
        return n

    # -- the check ---------------------------------------------------------------------------------------------

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(CHECK_S)
            if not self._holds_work():
                self._keys.clear()
                return  # ``watch`` starts it again with the next piece of detached work
            try:
                await self.check()
                self._failures.ok()
            except Exception as e:  # noqa: BLE001 - the store out of reach: checked again next round
                self._failures.failed(e)

    def _holds_work(self) -> bool:
        from moorage.runtime.exec_jobs import ExecJobs
        from moorage.webhooks.executions import ExecutionRunner

        # A turn bound here whose key is not known yet counts (the next check reads it); a synchronous turn does not.
        return bool(ExecutionRunner.of(self.runtime).held
                    or any(j.status == "running" for j in ExecJobs.of(self.runtime).jobs.values())
                    or any(self._keys.get((b.ts.tenant_id, b.run_id), "") is not None
                           for b in list(self.runtime.turns.values())))

    async def check(self, only: str | None = None) -> None:
        """Cancel what this host holds of the work of revoked keys (of tenant ``only``, or all)."""
        from moorage.runtime.exec_jobs import ExecJobs
        from moorage.webhooks.executions import ExecutionRunner

        runner = ExecutionRunner.of(self.runtime)
        now = time.monotonic()
        for k, (until, _) in list(self._refused.items()):
            if until <= now:
                self._refused.pop(k, None)
        execs = [j for j in ExecJobs.of(self.runtime).jobs.values()
                 if j.status == "running" and j.task is not None and not j.task.done() and j.key_id is not None]
        held = dict(runner.held)  # execution id -> (tenant store, execution)
        bindings = list(self.runtime.turns.values())
        tenants = {j.tenant_id for j in execs} | {ts.tenant_id for ts, _ in held.values()} | \
            {b.ts.tenant_id for b in bindings}
        if only is not None:
            tenants &= {only}
        bound = {(b.ts.tenant_id, b.run_id) for b in bindings}
        for key in [k for k in self._keys if k not in bound]:
            self._keys.pop(key, None)
        for tenant_id in tenants:
            theirs = [b for b in bindings if b.ts.tenant_id == tenant_id]
            await self._learn_keys(tenant_id, theirs, held)
            keys = ({j.key_id for j in execs if j.tenant_id == tenant_id}
                    | {ex.key_id for ts, ex in held.values() if ts.tenant_id == tenant_id}
                    | {self._keys.get((tenant_id, b.run_id)) for b in theirs}) - {None}
            if not keys:
                continue
            revoked = await asyncio.to_thread(self._revoked_of, tenant_id, keys)
            for key_id in revoked:
                await self._cancel_here(tenant_id, key_id, execs, held, theirs)

    async def _learn_keys(self, tenant_id: str, bindings: list[Any], held: dict[str, Any]) -> None:
        """The key of each turn bound here not known yet: from its execution (a synchronous turn has none)."""
        unknown = [b for b in bindings if (tenant_id, b.run_id) not in self._keys]
        if not unknown:
            return
        for b in list(unknown):
            if b.run_id in held:
                self._keys[(tenant_id, b.run_id)] = held[b.run_id][1].key_id
                unknown.remove(b)
        if unknown:
            found = await asyncio.to_thread(unknown[0].ts.executions.keys_of, [b.run_id for b in unknown])
            for b in unknown:
                self._keys[(tenant_id, b.run_id)] = found.get(b.run_id)

    def _revoked_of(self, tenant_id: str, keys: set[str]) -> list[str]:
        now = time.time()
        return [k for k, at in self.runtime.store.backend.key_revocations(tenant_id, keys).items()
                if at is not None and at <= now]

    async def _cancel_here(self, tenant_id: str, key_id: str, execs: list[Any], held: dict[str, Any],
                           bindings: list[Any]) -> None:
        from moorage.durable import DurableEngine
        from moorage.webhooks.executions import ExecutionRunner

        why = reason(key_id)
        running = {b.run_id for b in bindings if self._keys.get((tenant_id, b.run_id)) == key_id}
        waiting = [(ts, ex_id) for ex_id, (ts, ex) in held.items()
                   if ts.tenant_id == tenant_id and ex.key_id == key_id and ex_id not in running]
        # Refused before anything here awaits: a turn in line behind a running one it cancels gets its instance
        # the moment that one ends, and must not start then.
        for ts, ex_id in waiting:
            self._refused[(tenant_id, ex_id)] = (time.monotonic() + REFUSED_FOR_S, why)
        for job in execs:
            if job.tenant_id == tenant_id and job.key_id == key_id and job.task is not None and not job.task.done():
                job.stopped_because = why  # recorded as its error; the guest kills its process group
                job.task.cancel()
                log.info("detached exec of a revoked key cancelled", execution=job.id, key=key_id)
        for b in bindings:
            if b.run_id not in running:
                continue
            try:
                run = await asyncio.to_thread(DurableEngine(b.ts).cancel, b.run_id, why)
            except NotFound:
                continue
            if run.status == "cancelled" and b.reader is not None:
                b.reader.cancel()  # the agent stops in the guest now, not at its next journal write
                log.info("async turn of a revoked key cancelled", run=b.run_id, key=key_id)
        runner = ExecutionRunner.of(self.runtime)
        for ts, ex_id in waiting:  # stopped while it waits to be tried again, and recorded cancelled
            await runner.cancel_waiting(ts, ex_id, why)


def _cancelled_event(why: str) -> dict[str, Any]:
    from moorage.webhooks.executions import CANCELLED

    return {"kind": "error", "data": {"type": CANCELLED, "status": 409, "detail": why, "hint": None},
            "at": clock.now()}
