"""Deployments of an agent, as ``Runtime`` does them: validate and package, build the template (a ``deploy`` trace
of the tenant's), go live, roll back to an earlier one, and keep the agents' warm pools of the live template."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from pathlib import Path
from typing import Any

from moorage.egress.gateway import store_recorder
from moorage.fleet import package_blobs
from moorage.errors import ConflictError, InvalidInput, MoorageError, NotFound
from moorage.lifecycle.config import AgentLifecycle
from moorage.log import get_logger
from moorage.observability import current_span_id, current_trace_id, new_span_id, new_trace_id
from moorage.runtime.package import (AgentPackage, AgentPackageError, load_archive, load_dir,
                                     retention_keep_deployments, retention_ttl_s, retention_zero, save_archive)
from moorage.runtime import deploy_apt
from moorage.runtime.sizing import spec_for
from moorage.store import DEPLOYMENT_BUILDING as BUILDING, DEPLOYMENT_DELETED as DELETED
from moorage.store import DEPLOYMENT_FAILED as FAILED, DEPLOYMENT_READY as READY
from moorage.store import Agent, Deployment, Principal, Span, TenantStore
from moorage.store import zero_retention
from moorage.store.repos.agents import refuse_if_deleting
from moorage.usage import tenant_cap

log = get_logger(__name__)


class Deployments:
    """``Runtime``'s deployment verbs (a part of it: it reads the runtime's store, templates and instances)."""

    async def deploy(self, principal: Principal, source: Path | bytes, *, on_progress: Any = None) -> Deployment:
        """Validate and package an agent, record a new deployment, build its template, make it live."""
        principal.require("deploy")
        pkg: AgentPackage = load_dir(source) if isinstance(source, Path) else load_archive(source)
        ts = self.store.tenant(principal)
        try:  # a bad [agent.lifecycle] table fails the deploy, not the first turn
            AgentLifecycle.of(Agent("", pkg.name, {"lifecycle": self._lifecycle_config(pkg.manifest)}, None, 0, 0, 0))
        except InvalidInput as e:
            raise AgentPackageError(f"moorage.toml: {e.message}", hint=e.hint) from e
        # What this host cannot give (a size, Debian packages without the micro-VM driver) is refused before anything
        # is recorded: no agent (for a new name), no failed deployment, no package, as the message says (the build
        # checks again, for a rollback on a smaller host).
        spec_for(pkg.manifest, self.templates.driver.config, self.templates.driver.root)
        driver = self.templates.driver
        if deploy_apt.packages_of(pkg.manifest) and not driver.capabilities.own_kernel:  # apt-get runs as root
            raise deploy_apt.AptInstallFailed(
                f"Debian packages ([agent] apt) need the micro-VM driver: this host's {driver.name} sandboxes do not "
                "run as root inside", hint="deploy on a host whose sandbox_driver is microvm, or vendor what the "
                                           "agent needs; nothing was changed")
        # A package the tenant has not deployed before is more for it to keep: past its storage ceiling the deploy is
        # refused (507) before anything is recorded or saved.
        if not await asyncio.to_thread(ts.deployments.has_package, pkg.sha256):
            await tenant_cap.admit(self.config, ts, len(pkg.archive), "a deploy of a new package")
        # Held from before the file is written until a deployment names it: the collection of packages no
        # deployment names (``Templates.collect``) leaves it alone meanwhile.
        with self.templates.package_files.saving(pkg.sha256):
            saved = save_archive(self.packages, pkg)
            try:
                agent = ts.agents.get(pkg.name)
            except NotFound:
                try:
                    agent = ts.agents.create(pkg.name, {"lifecycle": self._lifecycle_config(pkg.manifest)})
                except ConflictError:
                    agent = ts.agents.get(pkg.name)
            refuse_if_deleting(agent)  # 409 before anything is recorded: the name is free once the delete ends
            # The builder's mark: if this process dies mid-build, any host can tell the deploy will never finish.
            dep = ts.deployments.create(agent.id, pkg.manifest, f"packages/{pkg.sha256}.tar.gz", pkg.sha256,
                                        builder=self.instances.claim_mark(), package_bytes=len(pkg.archive))
        # Build the template before going live: an import error fails the deploy, not a user's turn. A deploy that
        # fails here stays listed as ``failed`` (its error is in its ``deploy`` span), never live.
        try:
            if self.templates.package_blobs is not None:  # a fleet: any host fetches the package from the object
                # store. Written once a deployment names it: a collection of the bucket deciding now keeps it.
                await asyncio.to_thread(package_blobs.keep, self.templates.package_blobs, pkg.sha256, saved,
                                        wait_s=self.config.template_gc_settle_s + 30.0)
            await self._build_traced(ts, dep, pkg.name, on_progress)
        except BaseException:
            with contextlib.suppress(Exception):
                await asyncio.shield(asyncio.to_thread(ts.deployments.set_status, dep.id, FAILED))
            raise
        # Ready, live and its [agent.retention] in one transaction (unless a newer deploy went live while this one
        # built): a host killed between them left the deploy listed ready but never live, or live without its
        # retention (a zero-retention agent keeping its turns).
        dep, agent, pruned = await asyncio.to_thread(self._go_live, ts, dep, pkg.manifest)
        if agent.live_deployment != dep.id:  # a newer deploy went live first: its settings stand
            log.info("deployed, not live: a newer deployment went live while this one built", agent=pkg.name,
                     number=dep.number)
            return dep
        if pruned:
            tenant_cap.levels(ts).freed(ts.tenant_id)  # their packages: room from the tenant's next write
            log.info("older deployments deleted ([agent.retention] keep_deployments)", agent=pkg.name,
                     numbers=[d.number for d in pruned])
        await self._refresh_pool(ts, agent)
        self.templates.collect_soon()  # the template this deploy replaced, once nothing needs it
        log.info("deployed", agent=pkg.name, number=dep.number)
        return dep

    def settle_builds(self, ts: TenantStore, deps: list[Deployment], *, at_start: bool = False) -> list[Deployment]:
        """``deps`` with every ``building`` one whose builder died (its host crashed or restarted, in a fleet its
        host's lease lapsed) marked ``failed`` in the store: such a deploy never finishes, and listing it as building
        for ever told nobody to deploy again. A deploy without a builder mark (an older version's) is failed only at
        a single host's start, when nothing else can be building. Blocking."""
        out = []
        for d in deps:
            if d.status == BUILDING and (
                    self.instances.claim_abandoned(d.builder) if d.builder is not None
                    else at_start and self.instances.fleet is None) and ts.deployments.fail_building(d.id):
                log.warning("a deploy was cut short by the host stopping; marked failed (deploy again)",
                            tenant=ts.tenant_id, deployment=d.id, number=d.number, builder=d.builder)
                d = dataclasses.replace(d, status=FAILED)
            out.append(d)
        return out

    def _go_live(self, ts: TenantStore, dep: Deployment,
                 manifest: dict[str, Any]) -> tuple[Deployment, Agent, list[Deployment]]:
        """Mark ``dep`` ready and make it live with its package's retention settings, the agent's deployments past
        its ``keep_deployments`` deleted, in one transaction; not live when a newer deployment of the agent is live
        already. Returns the deployment, its agent, and the deployments deleted. Blocking."""
        with ts.transaction():
            dep = ts.deployments.set_status(dep.id, READY, live_lifecycle=self._lifecycle_config(manifest))
            agent = ts.agents.get(dep.agent_id)
            if agent.live_deployment != dep.id:
                return dep, agent, []
            ttl = retention_ttl_s(manifest)
            if ttl is not None:  # [agent.retention]: without the table, a TTL set through the API is kept
                ts.retention.set_agent(agent.name, ttl)
            zero = retention_zero(manifest)
            if zero is not None:  # the same: without the table, zero retention stays as the API left it
                agent = zero_retention.set_zero(ts, agent.name, zero)
            keep = retention_keep_deployments(manifest)
            if keep is None:
                return dep, agent, []
            pruned = ts.deployments.prune(agent.id, keep)
            return dep, ts.agents.get(agent.id) if pruned else agent, pruned

    async def _build_traced(self, ts: TenantStore, dep: Deployment, agent: str, on_progress: Any) -> None:
        """``templates.ensure`` as a ``deploy`` span in the tenant's traces (a child of the API request's span),
        with a span under it for every request the build's package installs make through the egress gateway."""
        trace_id, parent, span_id = current_trace_id() or new_trace_id(), current_span_id(), new_span_id()
        attrs: dict[str, Any] = {"agent": agent, "deployment": dep.id, "deployment.number": dep.number}
        record = store_recorder(ts, lambda: trace_id, None, parent_id=span_id, agent=agent, deployment=dep.id)
        started, status = time.time(), "ok"
        try:
            await self.templates.ensure(dep, on_progress, record=record)
        except BaseException as e:
            status = "error"
            attrs["error.message"] = (e.message if isinstance(e, MoorageError) else type(e).__name__)[:500]
            raise
        finally:
            span = Span(trace_id, span_id, parent, "deploy", started, time.time(), status, attrs, None)
            try:
                await asyncio.to_thread(ts.spans.record, span)
                if self.tracer.sink is not None:
                    self.tracer.sink.export(ts.tenant_id, span)
            except Exception as e:  # noqa: BLE001 - tracing never fails the deploy it describes
                log.warning("deploy span not recorded", error=str(e))

    async def _refresh_pool(self, ts: TenantStore, agent: Agent) -> None:
        """After a deployment went live: empty the warm pools of the agent's other deployments (the one it replaced,
        or one that went live while this one built; users keep their own instances) and keep the agent's
        ``lifecycle.pool`` forks of the new template ready."""
        pool = self.instances.pool
        if pool is None:
            return
        for d in await asyncio.to_thread(ts.deployments.list, agent.id):
            old = self.templates.cached(d.id) if d.id != agent.live_deployment else None
            if old is not None:
                await pool.drain(old.id)
        await self._template_for(ts, agent)

    async def start_pools(self) -> None:
        """At host start: keep the pools of every live agent that asks for one; drop pools of stale templates."""
        pool = self.instances.pool
        if pool is None:
            return
        await pool.drop_left_by_crash()  # first: the pools wanted below start refilling at once
        live: set[str] = set()
        for ts in await asyncio.to_thread(lambda: list(self.store.operator.tenants())):
            for agent in await asyncio.to_thread(ts.agents.list):
                if agent.live_deployment is None:
                    continue
                ref = self.templates.cached(agent.live_deployment)
                if ref is not None:
                    live.add(ref.id)
                if AgentLifecycle.of(agent).pool:
                    try:
                        live.add((await self._template_for(ts, agent)).id)
                    except Exception as e:  # one agent's broken template must not stop the host
                        log.warning("warm pool not started", agent=agent.name, error=str(e))
        await pool.drain_except(live)

    @staticmethod
    def _lifecycle_config(manifest: dict[str, Any]) -> dict[str, Any]:
        """The agent's [agent.lifecycle] table, with the package's ``scope`` folded in."""
        lc = dict(manifest.get("lifecycle") or {})
        lc.setdefault("scope", manifest.get("scope", "user"))
        return lc

    def _set_live(self, ts: TenantStore, agent: Agent, dep: Deployment) -> Agent:
        """Make ``dep`` the agent's live deployment (a compare-and-set on the agent; a rollback's). The deployment is
        read again before each try: a delete of it raises the agent's version, so one that came after ``agent``
        was read fails the compare-and-set and is seen here on the next."""
        while True:
            if ts.deployments.get(dep.id).status == DELETED:
                raise _was_deleted(agent.name, dep.number)
            try:
                return ts.agents.update(agent.id, expected_version=agent.version, live_deployment=dep.id,
                                        config={**agent.config, "lifecycle": self._lifecycle_config(dep.manifest)})
            except ConflictError:
                agent = ts.agents.get(agent.id)

    async def rollback(self, principal: Principal, agent_name: str, number: int | None = None) -> Deployment:
        """Make an earlier deployment live again (default: the one before the live one)."""
        principal.require("deploy")
        ts = self.store.tenant(principal)
        agent = ts.agents.get(agent_name)
        deps = ts.deployments.list(agent.id)
        live = next((d for d in deps if d.id == agent.live_deployment), None)
        if number is None:
            older = [d for d in deps if (live is None or d.number < live.number) and d.status == READY]
            if not older:
                raise NotFound(f"agent {agent_name!r} has no earlier deployment to roll back to")
            target = older[-1]
        else:
            target = _numbered(ts, agent, number)
            if target.status == DELETED:
                raise _was_deleted(agent_name, number)
            if target.status != READY:
                raise ConflictError(f"deployment {number} of agent {agent_name!r} is {target.status}, it never went live",
                                    hint=f"roll back to a ready one: GET /v1/agents/{agent_name}/deployments lists them with their status")
        await self.templates.ensure(target)
        agent = self._set_live(ts, agent, target)
        await self._refresh_pool(ts, agent)
        return target

    async def delete_deployment(self, principal: Principal, agent_name: str, number: int) -> Deployment:
        """Delete a deployment of an agent that is neither live nor building: it is no longer listed nor a rollback's
        target, and its package no longer counts for the tenant (the host deletes the file at its next collection
        of templates when no deployment names it). Returns it, ``deleted``; deleting one again answers the same."""
        principal.require("deploy")
        ts = self.store.tenant(principal)

        dep = await asyncio.to_thread(
            lambda: ts.deployments.delete(_numbered(ts, ts.agents.get(agent_name), number).id))
        tenant_cap.levels(ts).freed(ts.tenant_id)  # its package: room under the tenant's ceiling at once
        self.templates.collect_soon()
        log.info("deployment deleted", agent=agent_name, number=number)
        return dep


def _numbered(ts: TenantStore, agent: Agent, number: int) -> Deployment:
    """The agent's deployment ``number`` (a deleted one too), or ``NotFound``. Blocking."""
    dep = ts.deployments.by_number(agent.id, number)
    if dep is None:
        raise NotFound(f"agent {agent.name!r} has no deployment number {number}",
                       hint=f"GET /v1/agents/{agent.name}/deployments lists them")
    return dep


def _was_deleted(agent: str, number: int) -> NotFound:
    return NotFound(f"deployment {number} of agent {agent!r} was deleted",
                    hint=f"GET /v1/agents/{agent}/deployments lists those left")
