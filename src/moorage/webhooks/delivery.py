"""The delivery loop: announce finished or interrupted executions into the outbox, then send what is due.

Each round claims due deliveries by compare-and-set, signs and POSTs them, records every attempt, and
schedules a retry with backoff; a host killed at any point leaves every delivery due again after restart (at once
for those it was sending: ``claims``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from moorage import clock
from moorage.errors import ConflictError, MoorageError, NotFound
from moorage.log import FailingRounds, get_logger
from moorage.store import Store, TenantStore
from moorage.store.webhooks import Delivery, Execution
from moorage.webhooks.claims import HeldClaims
from moorage.webhooks.signing import sign

log = get_logger(__name__)

#: Run statuses an execution is announced with, and the webhook event of each.
ANNOUNCED = {"waiting": "interrupt.waiting", "succeeded": "execution.succeeded", "failed": "execution.failed",
             "cancelled": "execution.cancelled"}


@dataclass(frozen=True)
class RetrySchedule:
    """Seconds to wait after each failed attempt; once they are used up the delivery is ``failed``."""

    delays_s: tuple[float, ...] = (5, 30, 120, 600, 1800, 3600, 7200, 14400, 28800)

    def after(self, attempts_done: int) -> float | None:
        if attempts_done > len(self.delays_s):
            return None
        return self.delays_s[attempts_done - 1]

    @property
    def max_attempts(self) -> int:
        return len(self.delays_s) + 1


def execution_data(ex: Execution, run: Any, waiting_for: Any = None) -> dict[str, Any]:
    """What a webhook says about an execution (the same fields as ``GET /v1/executions/{id}``): ``run_id`` is what
    ``POST /v1/workflows/{run_id}/answer`` takes, ``trace_id`` the turn's trace. A synchronous turn's interrupt
    (``api.routes.executions.announce_interrupt``) carries the same fields."""
    result = run.result if isinstance(run.result, dict) else {}
    return {"execution_id": ex.id, "run_id": run.id, "agent": ex.agent, "user": ex.user, "session": ex.session,
            "status": run.status, "reply": result.get("reply"), "error": run.error, "interrupt": waiting_for,
            "trace_id": result.get("trace_id") or (run.input or {}).get("trace_id"),
            "url": f"/v1/executions/{ex.id}"}


def announce(ts: TenantStore) -> int:
    """Queue one webhook event per execution status change not yet announced (interrupt, then the end)."""
    from moorage.durable import DurableEngine

    queued = 0
    # All of them (a tenant's many waiting turns never hide a new one), less those with nothing new to say.
    for ex, run_status in ts.executions.unsettled_to_act_on(tuple(ANNOUNCED)):
        run = None
        if run_status is not None:
            with contextlib.suppress(NotFound):  # its run deleted meanwhile (the user forgotten)
                run = ts.runs.get(ex.id)
        if run is None:
            # Not started yet, or refused before its run existed (the runner recorded why): the latter is final.
            refusal = next((e.get("data") for e in ex.events if e.get("kind") == "error"), None)
            if refusal is not None:
                status = "cancelled" if isinstance(refusal, dict) and refusal.get("type") == "cancelled" else "failed"
                with ts.transaction():
                    if ts.executions.mark_announced(ex.id, status, expected_version=ex.version):
                        ts.deliveries.enqueue(ex.agent, ANNOUNCED[status], {
                            "execution_id": ex.id, "run_id": None, "agent": ex.agent, "user": ex.user,
                            "session": ex.session, "status": status, "reply": None,
                            "error": refusal.get("detail") if isinstance(refusal, dict) else str(refusal),
                            "interrupt": None, "trace_id": None, "url": f"/v1/executions/{ex.id}"})
                        queued += 1
            continue
        if run.status not in ANNOUNCED or run.status == ex.announced:
            continue
        waiting_for = DurableEngine(ts).waiting_for(run.id) if run.status == "waiting" else None
        with ts.transaction():
            # The mark and the deliveries commit together: announced exactly once, even across hosts.
            if not ts.executions.mark_announced(ex.id, run.status, expected_version=ex.version):
                continue
            ts.deliveries.enqueue(ex.agent, ANNOUNCED[run.status], execution_data(ex, run, waiting_for))
        queued += 1
    return queued


class Dispatcher:
    """Drains every tenant's outbox. One per host; several hosts on one store share the work safely."""

    def __init__(self, store: Store, *, schedule: RetrySchedule | None = None, poll_s: float = 0.5,
                 timeout_s: float = 10.0, transport: httpx.AsyncBaseTransport | None = None,
                 egress: Any = None, claims: Path | None = None) -> None:
        self.store = store
        #: Where this host names the claims it holds while sending (``HeldClaims``): with it, a restart sends at once
        #: what the killed process was sending instead of waiting out the lease. Without it (tests) it waits.
        self.claims = HeldClaims(claims) if claims is not None else None
        #: The host's egress service (``moorage.egress.Egress``): with it, a delivery connects only to addresses the
        #: operator's address policy admits (no loopback, private or metadata address unless allowed), judged
        #: before connecting and pinned for the connection. Without it (tests of the outbox) plain HTTP is used.
        self.egress = egress
        self.schedule = schedule or RetrySchedule()
        self.poll_s = poll_s
        self.timeout_s = timeout_s
        #: A claim outlives one attempt; a sender that dies mid-attempt leaves the delivery due after it.
        self.lease_s = timeout_s + 5.0
        self._client = httpx.AsyncClient(timeout=timeout_s, transport=transport, follow_redirects=False)

    async def run(self) -> None:
        if self.claims is not None:
            try:
                await asyncio.to_thread(self.claims.release_left, self.store)
            except Exception as e:  # noqa: BLE001 - the leases still run out: the deliveries are only later
                log.error("webhook claims of the previous process not released", error=str(e))
        failures = FailingRounds(log, "webhook round")
        try:
            while True:
                try:
                    await self.tick()
                    failures.ok()
                except Exception as e:  # noqa: BLE001 - the loop must outlive a bad round
                    failures.failed(e)
                await asyncio.sleep(self.poll_s)
        finally:
            await self._client.aclose()

    async def aclose(self) -> None:
        """Close the HTTP client (``run`` does this itself when it is cancelled)."""
        await self._client.aclose()

    async def tick(self) -> int:
        """One round over every tenant; returns how many attempts were made."""
        sent = 0
        for ts in await asyncio.to_thread(lambda: list(self.store.operator.tenants())):
            await asyncio.to_thread(announce, ts)
            due = await asyncio.to_thread(ts.deliveries.claim_due, clock.now(), self.lease_s)
            if due:
                if self.claims is not None:
                    await asyncio.to_thread(self.claims.hold, ts.tenant_id, due)
                # One delivery that cannot be recorded does not stop the others (its lease makes it due again).
                for d, out in zip(due, await asyncio.gather(*(self.send(ts, d) for d in due), return_exceptions=True)):
                    if isinstance(out, Exception):
                        log.error("webhook attempt not recorded", delivery=d.id, error=f"{type(out).__name__}: {out}")
                if self.claims is not None:
                    await asyncio.to_thread(self.claims.let_go, ts.tenant_id, due)
                sent += len(due)
        return sent

    async def _post(self, url: str, body: bytes, headers: dict[str, str], tenant: str = "") -> int:
        if self.egress is None:
            return (await self._client.post(url, content=body, headers=headers)).status_code
        from moorage.egress.fetch import fetch

        # The webhook's own URL is the only rule: no redirects elsewhere, the answer body is not kept.
        inst = self.egress.instance({"egress": {"allow": [url]}}, owner=tenant)
        result = await fetch(inst, "POST", url, headers=headers, body=body, timeout_s=self.timeout_s,
                             max_body=4096, max_redirects=0)
        return result.status

    async def send(self, ts: TenantStore, d: Delivery) -> Delivery | None:
        """One attempt at ``d`` (already claimed): POST it signed, record the attempt, schedule what follows."""
        try:
            hook = await asyncio.to_thread(ts.webhooks.get, d.webhook_id)
        except NotFound:
            hook = None
        started = clock.now()
        status: int | None = None
        error: str | None = None
        headers: dict[str, str] | None = None
        if hook is None or not hook.enabled:
            error = "the webhook was deleted or disabled"
        else:
            body = json.dumps(d.payload, separators=(",", ":"), default=str)
            try:
                headers = {"content-type": "application/json", "user-agent": "moorage-webhooks/1",
                           **sign(hook.secret, d.id, int(started), body)}
            except Exception as e:  # noqa: BLE001 - a secret that cannot sign fails this attempt, not the round
                error = f"the webhook's secret cannot sign: {type(e).__name__}: {e}"
        if hook is not None and headers is not None:
            try:
                status = await self._post(hook.url, body.encode(), headers, ts.tenant_id)
                if not 200 <= status < 300:
                    error = f"receiver answered {status}"
            except httpx.HTTPError as e:
                error = f"{type(e).__name__}: {e}"
            except MoorageError as e:  # refused by the address policy, or the connection failed
                error = f"{e.code}: {e.message}" + (f" ({e.hint})" if e.hint else "")  # what to do about it too
            except Exception as e:  # noqa: BLE001 - any other failure is this attempt's, recorded and retried
                error = f"{type(e).__name__}: {e}"
        delivered = error is None
        done = d.attempts + 1
        wait = None if delivered or hook is None else self.schedule.after(done)
        try:
            out = await asyncio.to_thread(
                ts.deliveries.record_attempt, d, at=started, status_code=status, error=error,
                duration_ms=round((clock.now() - started) * 1000.0, 1), delivered=delivered,
                retry_at=None if wait is None else clock.now() + wait)
        except ConflictError:
            return None  # its lease ran out and another sender took it; that one records its own attempt
        if not delivered:
            log.info("webhook attempt failed", delivery=d.id, attempt=done, error=error,
                     retry_in_s=wait)
        return out
