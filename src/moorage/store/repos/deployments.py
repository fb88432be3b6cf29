"""The numbered deployments of each agent: its manifest and the package it was built from (which one is live is the
agent's field). A deployment is ``building`` until its template is made, then ``ready``, or ``failed`` (never live:
kept as the record of that deploy); ``deleted`` when deleted (``delete``, ``prune``): the row stays, so that a number
is never given twice and a turn that began on it just before can still read its manifest, and nothing lists it,
rolls back to it or counts its package."""

from __future__ import annotations

import dataclasses
from typing import Any

from moorage.errors import ConflictError, NotFound
from moorage.store.model import (DEPLOYMENT_BUILDING, DEPLOYMENT_DELETED, DEPLOYMENT_FAILED, DEPLOYMENT_READY,
                                  Deployment)
from moorage.store.repos.common import _new_id, _now, _Repo
from moorage.store.sql import loads


def _deployment(r: tuple) -> Deployment:
    return Deployment(r[0], r[1], r[2], loads(r[3]), r[4], r[5], r[6], r[7], loads(r[8]) if r[8] else None)


_DEP_COLS = "id, agent_id, number, manifest, package_ref, package_sha256, status, created_at, builder"


class Deployments(_Repo):
    def create(self, agent_id: str, manifest: dict[str, Any], package_ref: str, package_sha256: str, *,
               builder: dict[str, Any] | None = None, package_bytes: int | None = None) -> Deployment:
        """A new ``building`` deployment; ``builder``: the mark of the process building it (``claim_mark``);
        ``package_bytes``: its package's size (the tenant's storage counts it, ``package_bytes()``)."""
        with self._ts._tx() as c:
            if not c.one("SELECT 1 FROM agents WHERE id = ?", (agent_id,)):
                raise NotFound(f"no agent {agent_id!r}")
            row = c.one("SELECT COALESCE(MAX(number), 0) FROM deployments WHERE agent_id = ?", (agent_id,))
            d = Deployment(_new_id(), agent_id, int(row[0]) + 1, manifest, package_ref, package_sha256,
                           DEPLOYMENT_BUILDING, _now(), builder)
            c.x(
                f"INSERT INTO deployments ({_DEP_COLS}, package_bytes) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (d.id, agent_id, d.number, self._json(manifest, "manifest"), package_ref, package_sha256, d.status,
                 d.created_at, self._json(builder, "builder") if builder is not None else None, package_bytes),
            )
        return d

    def package_bytes(self) -> int:
        """The bytes of the tenant's deploy packages, each package once however many deployments name it (rows
        written before store migration 32, or by an older host, have no size: not counted)."""
        with self._ts._tx(write=False) as c:
            r = c.one("SELECT COALESCE(SUM(b), 0) FROM (SELECT MAX(package_bytes) AS b FROM deployments "
                      "WHERE status <> ? GROUP BY package_sha256) x", (DEPLOYMENT_DELETED,))
        return int(r[0] or 0)

    def has_package(self, package_sha256: str) -> bool:
        """Whether a deployment of the tenant's names this package already (a redeploy of it keeps nothing more)."""
        with self._ts._tx(write=False) as c:
            return c.one("SELECT 1 FROM deployments WHERE package_sha256 = ? AND status <> ? LIMIT 1",
                         (package_sha256, DEPLOYMENT_DELETED)) is not None

    def packages(self) -> set[str]:
        """The digests of the packages the tenant's deployments (not deleted) name: a host keeps those files."""
        with self._ts._tx(write=False) as c:
            return {str(r[0]) for r in c.q("SELECT DISTINCT package_sha256 FROM deployments WHERE status <> ?",
                                           (DEPLOYMENT_DELETED,))}

    def delete(self, deployment_id: str) -> Deployment:
        """Delete a deployment that is neither live nor building (``ConflictError``); returns it as deleted. The
        agent's version goes up in the same transaction, so a rollback to it that read the agent before fails its
        compare-and-set, reads the deployment again and finds it deleted; deleting one again returns it as it is."""
        with self._ts._tx() as c:
            return self._delete(c, deployment_id)

    def prune(self, agent_id: str, keep: int) -> list[Deployment]:
        """Delete the agent's oldest deployments beyond the newest ``keep`` (the live one and any building one always
        stay, and count among them); returns those deleted (``[agent.retention] keep_deployments``)."""
        if keep < 1:
            raise ValueError("keep must be 1 or more")
        with self._ts._tx() as c:
            rows = c.q("SELECT id, status FROM deployments WHERE agent_id = ? AND status <> ? ORDER BY number DESC",
                       (agent_id, DEPLOYMENT_DELETED))
            live = c.one("SELECT live_deployment FROM agents WHERE id = ?", (agent_id,))
            return [self._delete(c, str(r[0])) for r in rows[keep:]
                    if r[1] != DEPLOYMENT_BUILDING and (live is None or r[0] != live[0])]

    def _delete(self, c: Any, deployment_id: str) -> Deployment:
        r = c.one(f"SELECT {_DEP_COLS} FROM deployments WHERE id = ?", (deployment_id,))
        if r is None:
            raise NotFound(f"no deployment {deployment_id!r}")
        d = _deployment(r)
        if d.status == DEPLOYMENT_DELETED:
            return d
        # The agent's row first: on PostgreSQL it is locked from here, so a rollback that made this one live and
        # has not committed is waited for, and its choice is seen below.
        c.x("UPDATE agents SET version = version + 1 WHERE id = ?", (d.agent_id,))
        agent = c.one("SELECT live_deployment FROM agents WHERE id = ?", (d.agent_id,))
        if agent is not None and agent[0] == d.id:
            raise ConflictError(f"deployment {d.number} is the agent's live one",
                                hint="roll back to another deployment or deploy a new one first")
        if d.status == DEPLOYMENT_BUILDING:
            raise ConflictError(f"deployment {d.number} is still building",
                                hint="wait for it to be ready or failed (GET .../deployments shows it)")
        c.x("UPDATE deployments SET status = ?, builder = NULL WHERE id = ?", (DEPLOYMENT_DELETED, d.id))
        return dataclasses.replace(d, status=DEPLOYMENT_DELETED, builder=None)

    def fail_building(self, deployment_id: str) -> bool:
        """Mark a deployment ``failed`` if it is still ``building`` (its builder is gone); whether it was."""
        with self._ts._tx() as c:
            return c.x("UPDATE deployments SET status = ? WHERE id = ? AND status = ?",
                       (DEPLOYMENT_FAILED, deployment_id, DEPLOYMENT_BUILDING)) == 1

    def set_status(self, deployment_id: str, status: str, *,
                   live_lifecycle: dict[str, Any] | None = None) -> Deployment:
        """Set a deployment's status. ``live_lifecycle`` (with ``ready``): in the same transaction the deployment
        goes live with that ``[agent.lifecycle]`` table in its agent's config, unless a newer deployment of the
        agent is live already (two deploys at once: the newest wins). Ready and live in two steps left a deploy
        whose host died between them listed ``ready`` but never live."""
        if status not in (DEPLOYMENT_BUILDING, DEPLOYMENT_READY, DEPLOYMENT_FAILED):
            raise ValueError(f"not a deployment status: {status!r}")
        with self._ts._tx() as c:
            c.x("UPDATE deployments SET status = ? WHERE id = ?", (status, deployment_id))
            if live_lifecycle is not None and status == DEPLOYMENT_READY:
                self._go_live(c, deployment_id, live_lifecycle)
        return self.get(deployment_id)

    def _go_live(self, c: Any, deployment_id: str, lifecycle: dict[str, Any]) -> None:
        dep = c.one("SELECT agent_id, number FROM deployments WHERE id = ?", (deployment_id,))
        if dep is None:
            raise NotFound(f"no deployment {deployment_id!r}")
        agent = c.one("SELECT config, live_deployment FROM agents WHERE id = ?", (dep[0],))
        if agent is None:
            raise NotFound(f"no agent {dep[0]!r}")
        if agent[1] not in (None, deployment_id):
            live = c.one("SELECT number FROM deployments WHERE id = ? AND agent_id = ?", (agent[1], dep[0]))
            if live is not None and int(live[0]) > int(dep[1]):
                return
        config = {**loads(agent[0]), "lifecycle": lifecycle}
        if "deleting" in config:  # deleted once its instances are: nothing goes live on it now
            raise ConflictError("the agent is being deleted; this deployment does not go live",
                                hint="deploy the agent anew once DELETE /v1/agents/{agent} has answered")
        c.x("UPDATE agents SET config = ?, live_deployment = ?, updated_at = ?, version = version + 1 WHERE id = ?",
            (self._json(config, "agent config"), deployment_id, _now(), dep[0]))

    def building(self) -> list[Deployment]:
        """Every deployment of the tenant still marked ``building`` (a host start finds those a crash left)."""
        with self._ts._tx(write=False) as c:
            return [_deployment(r) for r in c.q(f"SELECT {_DEP_COLS} FROM deployments WHERE status = ? ORDER BY created_at",
                                                (DEPLOYMENT_BUILDING,))]

    def get(self, deployment_id: str) -> Deployment:
        with self._ts._tx(write=False) as c:
            r = c.one(f"SELECT {_DEP_COLS} FROM deployments WHERE id = ?", (deployment_id,))
        if r is None:
            raise NotFound(f"no deployment {deployment_id!r}")
        return _deployment(r)

    def by_number(self, agent_id: str, number: int) -> Deployment | None:
        """The agent's deployment ``number`` (a deleted one too), or None."""
        with self._ts._tx(write=False) as c:
            r = c.one(f"SELECT {_DEP_COLS} FROM deployments WHERE agent_id = ? AND number = ?", (agent_id, number))
        return _deployment(r) if r is not None else None

    def list(self, agent_id: str, *, deleted: bool = False) -> list[Deployment]:
        """The agent's deployments, oldest first; ``deleted``: the deleted ones too."""
        with self._ts._tx(write=False) as c:
            rows = c.q(f"SELECT {_DEP_COLS} FROM deployments WHERE agent_id = ? AND status <> ? ORDER BY number",
                       (agent_id, "" if deleted else DEPLOYMENT_DELETED))
        return [_deployment(r) for r in rows]
