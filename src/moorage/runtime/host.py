"""One moorage host process: store, sandbox driver, instance manager, LLM gateway and runtime, wired once.

``Host.open(config)`` builds everything from the one config; ``start()`` re-adopts instances, resumes
interrupted turns and starts the background sweepers; ``close()`` detaches without losing anything.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, Mapping

from moorage.config import Config
from moorage.log import FailingRounds, get_logger
from moorage.runtime.exec_jobs import ExecJobs
from moorage.store import Store, open_store

log = get_logger(__name__)

#: How long a clean stop waits for turns in flight before it sleeps their instances anyway left awake.
SHUTDOWN_TURN_WAIT_S = 30.0
#: How often expired scopes (retention TTLs) are swept.
RETENTION_SWEEP_S = 300.0


class StoreUsageSink:
    """Writes each model call's tokens and cost into the tenant's usage ledger."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def record(self, *, tenant_id: str, entity: Mapping[str, str] | None, provider: str, model: str,
               input_tokens: int, output_tokens: int, cached_input_tokens: int, cost_usd: float,
               latency_ms: float, trace_id: str | None) -> None:
        ts = self.store.tenant(self.store.operator.principal(tenant_id))
        agent = (entity or {}).get("agent") or None
        user = (entity or {}).get("user") or None
        meta = {"provider": provider, "model": model, "trace_id": trace_id, "latency_ms": round(latency_ms, 1)}
        with ts.transaction():
            for kind, amount in (("input_tokens", input_tokens), ("output_tokens", output_tokens),
                                 ("cached_input_tokens", cached_input_tokens), ("cost_usd", cost_usd)):
                if amount:
                    ts.usage.add(kind, amount, agent_id=agent, user_id=user, meta=meta)


class Host:
    def __init__(self, config: Config, store: Store, driver: Any, manager: Any, runtime: Any) -> None:
        self.config = config
        self.store = store
        self.driver = driver
        self.manager = manager
        self.runtime = runtime
        #: Where spans are also exported (``otlp_endpoint``); the API's tracer gets it too. None: store only.
        self.span_sink: Any = None
        self._tasks: list[asyncio.Task[None]] = []
        #: Fleet: fetches live deployments' templates ahead of their first wake here (``fleet/prefetch.py``).
        self.prefetch: Any = None

    @classmethod
    def open(cls, config: Config) -> "Host":
        from moorage.cost.model import CostModel
        from moorage.lifecycle.manager import InstanceManager
        from moorage.llm import gateway_from_config
        from moorage.runtime.runtime import Runtime
        from moorage.sandbox import get_driver

        from moorage.runtime.private_files import data_dir

        if config.fleet and not config.host_url and config.port == 0:
            from moorage.errors import ConfigError

            raise ConfigError("a fleet host on port 0 needs host_url: the other hosts reach it there",
                              hint="set MOORAGE_HOST_URL, or give the host a port (--port / MOORAGE_PORT)")
        data_dir(config.data_dir)  # 0700: nothing under the data dir is for other local users
        store = open_store(config)
        driver = get_driver(config)
        manager = InstanceManager(store, driver, host_id=config.host_id or None)
        if config.fleet:
            from moorage.fleet.member import FleetMember
            from moorage.objects import open_object_store

            # One of a fleet: sleeps ship to the object store, any host wakes any agent (docs/fleet.md).
            if not config.host_url and config.host in ("127.0.0.1", "localhost", "::1", "0.0.0.0", "::"):
                log.warning("host_url is not set: other hosts will try to reach this one at "
                            f"http://{config.host}:{config.port}, which only works on this machine",
                            hint="set MOORAGE_HOST_URL to the address the other hosts reach this one at")
            manager.fleet = FleetMember(store.backend, open_object_store(config), driver, host_id=manager.host,
                                        url=config.host_url or f"http://{config.host}:{config.port}",
                                        lease_ttl_s=config.lease_ttl_s, heartbeat_s=config.heartbeat_s)
            manager.fleet.on_lease_gap = manager.verify_leases
            from moorage.fleet.forward import ForwardSigner
            from moorage.secrets import Keyring

            # What one host marks on a request it sends another is signed with the secrets key all hosts share.
            manager.fleet.forwarder.signer = ForwardSigner(Keyring.from_config(config).keys)
            manager.ship_interval_s = config.checkpoint_interval_s
            manager.cache_max_bytes = int(config.fleet_cache_mib * (1 << 20))
            manager.fleet.load = lambda: {"awake": len(manager.awake_instances())}
        from moorage.lifecycle.pool import WarmPool

        manager.pool = WarmPool(driver, config.data_dir / "pool")
        llm = gateway_from_config(config, usage_sink=StoreUsageSink(store),
                                  tenant_name=lambda tenant_id: store.operator.get_tenant(tenant_id).name)
        # Prices let agents with sleep = "adaptive" weigh staying awake against a snapshot (it needs them).
        manager.economics = CostModel().economics()
        from moorage.lifecycle.capacity import HostCapacity

        manager.capacity = HostCapacity(max_awake=config.max_awake_instances or None,
                                        max_ram_mib=config.max_awake_ram_mib or None)
        manager.tenant_max_awake = config.max_awake_per_tenant or None
        from moorage.usage import tenant_cap

        # A tenant past its storage ceiling (the operator's default, or its own) gets no new instances.
        manager.admit_new_instance = lambda ts: tenant_cap.admit(config, ts, 0, "a new instance")
        host = cls(config, store, driver, manager, Runtime(config, store, driver, llm, manager))
        if manager.fleet is not None:
            manager.fleet.on_drain = host._drain
        if config.object_store_url:
            from moorage.fleet.templates import PublishedTemplates
            from moorage.objects import open_object_store

            # Deployment templates (and their guest images) go to the object store: every host forks the same one,
            # and a fetched instance finds the template its memory and disk were made against (docs/fleet.md).
            objects = manager.fleet.objects if manager.fleet is not None else open_object_store(config)
            published = PublishedTemplates(objects, driver)
            host.runtime.templates.published = published
            if hasattr(driver, "template_source"):
                driver.template_source = published.fetch
                import threading

                # The first cross-host wake of a template this host lacks checks the guest image by digest.
                threading.Thread(target=published.warm, name="image-digest", daemon=True).start()
        from moorage.fleet.gc import TemplateGC

        # Templates nobody needs any more go, from this host's disk and (once for the fleet) the object store.
        host.runtime.templates.gc = TemplateGC(store, host.runtime.templates, host.runtime.templates.published,
                                               host=manager.host, grace_s=config.template_gc_grace_s,
                                               settle_s=config.template_gc_settle_s,
                                               interval_s=config.template_gc_interval_s)
        if manager.fleet is not None and host.runtime.templates.published is not None and config.template_prefetch > 0:
            from moorage.fleet.prefetch import TemplatePrefetch

            # Live deployments' templates come to this host before their first wake here (docs/fleet.md).
            host.prefetch = TemplatePrefetch(store, host.runtime.templates, limit=config.template_prefetch,
                                             interval_s=config.template_prefetch_interval_s)
        if config.otlp_endpoint:
            from moorage.observability.otlp import otlp_sink

            host.span_sink = otlp_sink(config.otlp_endpoint)
            host.runtime.tracer.sink = host.span_sink
        return host

    async def start(self) -> None:
        if self.manager.fleet is not None:
            await self.manager.fleet.join()
        await self.manager.start()
        await self.runtime.start_pools()
        resumed = await self.runtime.recover()
        if resumed:
            log.info("resumed interrupted turns", count=resumed)
        self._tasks.append(asyncio.create_task(self._sweep_loop(), name="retention-sweeper"))
        from moorage.observability.disk import DiskWatch

        # The log says so while the data disk is nearly full, before writes are refused (507 disk-full).
        self._tasks.append(asyncio.create_task(DiskWatch(self.config.data_dir).loop(), name="disk-watch"))
        if self.runtime.templates.gc is not None:
            self._tasks.append(asyncio.create_task(self.runtime.templates.gc.loop(), name="template-gc"))
        if self.prefetch is not None:
            self._tasks.append(asyncio.create_task(self.prefetch.loop(), name="template-prefetch"))
        from moorage.webhooks import Dispatcher
        from moorage.webhooks.executions import ExecutionRunner

        # Async turns lost before their run existed start again; then the webhook outbox is drained.
        await ExecutionRunner.of(self.runtime).resubmit_orphans(self.store, min_age_s=0.0)
        from moorage.egress.connector import Egress

        # Deliveries go through the egress address policy: a webhook URL cannot reach the host's own network.
        dispatcher = Dispatcher(self.store, egress=Egress.from_config(self.config),
                                claims=self.config.data_dir / "webhook-claims.json")
        self._tasks.append(asyncio.create_task(dispatcher.run(), name="webhook-deliveries"))
        from moorage.usage.caps import enforce_loop

        self._tasks.append(asyncio.create_task(enforce_loop(self.runtime), name="cap-enforcement"))

    async def _drain(self) -> None:
        """An operator marked this host draining: sleep (and ship) every instance, then stop cleanly. Requests
        keep being served meanwhile: new bring-ups go to other hosts, instances still here answer until slept."""
        import os
        import signal

        for i in range(20):  # an instance woken by a forwarded request meanwhile is slept on the next pass
            slept, left = await self.manager.sleep_all("host draining", wait_busy_s=SHUTDOWN_TURN_WAIT_S)
            log.info("drain pass", slept=slept, still_awake=left)
            if not self.manager.awake_instances():
                break
            if i == 0:  # a detached exec still running after the first pass's wait holds its instance: it ends
                await ExecJobs.of(self.runtime).stop_all("the host was drained before the command ended")
            await asyncio.sleep(0.5)
        # Instances that slept while the object store was down live only on this disk: leaving would lose them
        # (the others would wake their older snapshots). Wait for the store, serving them meanwhile.
        while (await self.manager.ship_unshipped())[1]:
            log.warning("draining: sleeping instances wait for the object store before this host leaves")
            await asyncio.sleep(5)
            await self.manager.sleep_all("host draining", wait_busy_s=SHUTDOWN_TURN_WAIT_S)
        os.kill(os.getpid(), signal.SIGTERM)  # the clean stop: leaves the fleet as gone

    async def _sweep_loop(self) -> None:
        failures = FailingRounds(log, "retention sweep")
        while True:
            try:
                rep = await asyncio.to_thread(self.store.operator.sweep_all)
                if rep.scopes:
                    log.info("retention sweep", scopes=rep.scopes, rows=rep.rows)
                # Zero-retention agents: what async executions kept until their outcome was announced.
                from moorage.store.zero_retention import sweep as zero_sweep

                for ts in await asyncio.to_thread(lambda: list(self.store.operator.tenants())):
                    await asyncio.to_thread(zero_sweep, ts)
                failures.ok()
            except Exception as e:  # the sweeper must outlive a bad round
                failures.failed(e)
            await asyncio.sleep(RETENTION_SWEEP_S)

    def _detaching(self, detach: bool | None) -> bool:
        """Whether a stop leaves the sandboxes running: asked for, and they outlive this process."""
        if detach is None:
            detach = self.config.shutdown == "detach"
        return detach and self.driver.capabilities.survives_host_exit

    async def stopping(self) -> int:
        """The stop signal arrived: what would hold the server's graceful stop for long ends now, before it waits
        for requests in flight. An agent app's answers end (an event stream may last ``app_max_duration_s``),
        and the detached execs (``end_execs``)."""
        self.runtime.stopping.set()
        return await self.end_execs()

    async def end_execs(self, *, detach: bool | None = None) -> int:
        """End every detached exec, as a clean stop does: called as the stop signal arrives too, since a client
        following one (``GET /v1/executions/{id}/events``) kept the server's graceful stop waiting until the
        exec ended (its ``timeout_s``, up to 24 h) before any instance was put to sleep."""
        if self._detaching(detach):
            # Followed by this process: left running in the VM, its output would go nowhere and its record would
            # say it failed while it ran on. It ends now, its record saying why.
            why = "the host stopped for a live upgrade (detach) before the command ended; the sandbox kept running"
        else:
            # It holds its instance awake until it ends: nothing could sleep it after this process, and waiting for
            # it only delays the stop (recorded as cancelled, with its output).
            why = "the host stopped before the command ended"
        return await ExecJobs.of(self.runtime).stop_all(why)

    async def close(self, *, detach: bool | None = None) -> None:
        """Stop serving. By default every awake instance is put to sleep first (a durable snapshot each), so
        nothing keeps running with nobody to sleep it. ``detach=True`` (or ``shutdown = "detach"``) leaves
        micro-VMs running for a live upgrade: the next ``start()`` on this host re-adopts them."""
        for t in self._tasks:
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        if self.runtime.templates.gc is not None:
            await self.runtime.templates.gc.close()
        if detach is None:
            detach = self.config.shutdown == "detach"
        if detach and not self.driver.capabilities.survives_host_exit:
            # These sandboxes die with this process: leaving them would lose their memory, so they sleep anyway.
            log.warning("detach asked, but sandboxes of this driver die with the host: sleeping them",
                        driver=self.driver.name)
            detach = False
        await self.end_execs(detach=detach)
        if detach:
            awake = len(self.manager.awake_instances())
            log.info("host stopping, instances left running (detach); the next start re-adopts them", count=awake)
        else:
            slept, left = await self.manager.sleep_all("host shutting down", wait_busy_s=SHUTDOWN_TURN_WAIT_S)
            log.info("host stopping, awake instances put to sleep", slept=slept, still_awake=left)
        # Automatic checkpoints after replies and background embeddings use the driver, the instances and the
        # store: they end before any of those closes.
        await self.runtime.settle_background()
        if self.manager.fleet is not None:
            await self.manager.fleet.leave("active" if detach else "gone")
        await self.manager.close()
        await self.driver.close()
        await self.runtime.aclose()
        if self.span_sink is not None:
            # Spans still queued are sent before the process goes.
            await asyncio.to_thread(self.span_sink.close)
        self.store.close()
