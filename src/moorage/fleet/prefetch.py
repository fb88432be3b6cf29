"""Fleet: a host fetches the templates of live deployments before their first wake on it.

Without this, the first wake of a deployment's instance on a host that lacks its template (a host that just
joined, a survivor taking over a dead host's users, one the load balancer never sent that agent before) waits
for the whole template to come from the object store: 1.9 s for a 256 MiB micro-VM guest on a quiet
development host, 2-4 s under load (docs/fleet.md). Here each host looks at the store at start and every
``template_prefetch_interval_s``, takes the live deployments of every tenant, the ones with most instances
first, up to ``template_prefetch``, and fetches those whose published template it does not have, one at a time,
in the background. It never builds one (a deployment nobody published yet is its deploying host's to build).

The fetch is the one a wake would make (``Templates.prefetch``, under the deployment's lock: a wake that comes
meanwhile waits for it rather than fetching twice), and what it fetched is this host's collection's to delete
once the deployment stops being live, like any fetched template. After the fetch (and for a live template the
host already had, e.g. after a restart) the driver makes what the first fork in this process would make
(``warm_template``: a micro-VM template's RAM sealed in memory, if the host keeps half its memory available).
A host whose disk is short of room fetches nothing more (``MIN_FREE_BYTES``, or 5% of the filesystem): a wake
still fetches what it needs.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from moorage.log import FailingRounds, get_logger

if TYPE_CHECKING:
    from moorage.runtime.templates import Templates
    from moorage.store import Store

log = get_logger(__name__)

#: Below this much free disk (or 5% of the filesystem, whichever is more) under the templates, nothing more is
#: fetched ahead.
MIN_FREE_BYTES = 2 << 30


@dataclass(frozen=True)
class Live:
    """A live deployment and how many instances its agent has (in any state)."""

    tenant_id: str
    agent: str
    deployment_id: str
    instances: int


def live_deployments(store: "Store") -> list[Live]:
    """Every tenant's live deployments, the agents with most instances first (newest agent first on a tie).
    Blocking: one query for the agents and one count of instances per agent, per tenant."""
    found: list[tuple[int, float, Live]] = []
    for ts in store.operator.tenants():
        counts = {str(a): int(n) for a, n in ts.read("SELECT agent_id, COUNT(*) FROM sandboxes GROUP BY agent_id")}
        for name, dep, created in ts.read(
                "SELECT name, live_deployment, created_at FROM agents WHERE live_deployment IS NOT NULL"):
            live = Live(ts.tenant_id, str(name), str(dep), counts.get(str(name), 0))
            found.append((-live.instances, -float(created), live))
    return [live for *_, live in sorted(found, key=lambda f: (f[0], f[1]))]


class TemplatePrefetch:
    """Runs the prefetch for one host (started by the host in a fleet whose templates are published)."""

    def __init__(self, store: "Store", templates: "Templates", *, limit: int, interval_s: float) -> None:
        self.store = store
        self.templates = templates
        self.limit = limit
        self.interval_s = interval_s
        self._lock = asyncio.Lock()
        self._short_of_disk = False
        self._failures = FailingRounds(log, "fetching templates ahead", level=logging.WARNING)

    def _room(self) -> bool:
        du = shutil.disk_usage(self.templates.root)
        room = du.free >= max(MIN_FREE_BYTES, du.total // 20)
        if not room and not self._short_of_disk:
            log.warning("templates are not fetched ahead: the disk is short of room", free_mib=du.free >> 20)
        self._short_of_disk = not room
        return room

    def _deployment(self, live: Live) -> Any:
        principal = self.store.operator.principal(live.tenant_id)
        return self.store.tenant(principal).deployments.get(live.deployment_id)

    async def run(self) -> int:
        """One pass (single-flight): returns how many templates it fetched."""
        if self.limit <= 0 or self.templates.published is None:
            return 0
        async with self._lock:
            wanted = (await asyncio.to_thread(live_deployments, self.store))[:self.limit]
            fetched = 0
            for live in wanted:
                ref = self.templates.cached(live.deployment_id)
                if ref is None:
                    if not await asyncio.to_thread(self._room):
                        break
                    started = time.monotonic()
                    deployment = await asyncio.to_thread(self._deployment, live)
                    ref = await self.templates.prefetch(deployment)
                    if ref is None:
                        continue
                    fetched += 1
                    log.info("template fetched ahead of its first wake", agent=live.agent,
                             deployment=live.deployment_id, template=ref.id, instances=live.instances,
                             ms=round((time.monotonic() - started) * 1000, 1))
                # What the first fork in this process would make (micro-VMs: the template RAM's sealed copy),
                # for a template fetched now or one this host had (after a restart, nothing of it is in memory).
                await asyncio.to_thread(self.templates.driver.warm_template, ref)
            return fetched

    async def _quiet_run(self) -> None:
        try:
            await self.run()
            self._failures.ok()
        except Exception as e:  # noqa: BLE001 - the next pass tries again; a wake fetches what it needs
            self._failures.failed(e)

    async def loop(self) -> None:
        """At once (a host that just joined), then every ``interval_s``."""
        while True:
            await self._quiet_run()
            await asyncio.sleep(self.interval_s)
