"""The tenant's agents: a name, its config and which deployment is live, changed by compare-and-set
on its version."""

from __future__ import annotations

from typing import Any

from moorage.errors import ConflictError, NotFound
from moorage.store.model import DEPLOYMENT_DELETED, Agent, check_id
from moorage.store.repos.common import _check_version, _new_id, _now, _Repo
from moorage.store.sql import loads


def deleting_since(a: Agent) -> float | None:
    """When the agent's deletion began (``DELETE /v1/agents/{agent}``), or None: an agent being deleted takes no new
    turns, users or deploys; what it kept is being forgotten (runtime/agent_delete.py)."""
    mark = a.config.get("deleting")
    return float(mark["since"]) if isinstance(mark, dict) and isinstance(mark.get("since"), (int, float)) else None


def refuse_if_deleting(a: Agent) -> Agent:
    """``a``, or a 409 if it is being deleted (nothing new for an agent on its way out)."""
    if deleting_since(a) is not None:
        raise ConflictError(f"agent {a.name!r} is being deleted",
                            hint=f"DELETE /v1/agents/{a.name} again finishes it; deploy the agent anew once it is gone")
    return a


def _agent(r: tuple) -> Agent:
    return Agent(r[0], r[1], loads(r[2]), r[3], r[4], r[5], r[6])


_AGENT_COLS = "id, name, config, live_deployment, created_at, updated_at, version"


class Agents(_Repo):
    def create(self, name: str, config: dict[str, Any] | None = None) -> Agent:
        check_id(name, "agent name")
        now = _now()
        a = Agent(_new_id(), name, config or {}, None, now, now, 1)
        with self._ts._tx() as c:
            n = c.x(
                f"INSERT INTO agents ({_AGENT_COLS}) VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
                (a.id, a.name, self._json(a.config, "agent config"), None, now, now, 1),
            )
            if n != 1:
                raise ConflictError(f"an agent named {name!r} already exists", hint="pick another name or deploy to it")
        return a

    def get(self, name_or_id: str) -> Agent:
        with self._ts._tx(write=False) as c:
            r = c.one(f"SELECT {_AGENT_COLS} FROM agents WHERE id = ? OR name = ?", (name_or_id, name_or_id))
        if r is None:
            raise NotFound(f"no agent {name_or_id!r}", hint="GET /v1/agents lists them; `moorage deploy` makes one")
        return _agent(r)

    def list(self) -> list[Agent]:
        with self._ts._tx(write=False) as c:
            return [_agent(r) for r in c.q(f"SELECT {_AGENT_COLS} FROM agents ORDER BY name")]

    def mark_deleting(self, name_or_id: str) -> Agent:
        """Mark the agent as being deleted (once: a mark already there keeps its time). Its version moves, so a
        deploy that read it before cannot make a deployment live afterwards (compare-and-set)."""
        while True:
            a = self.get(name_or_id)
            if deleting_since(a) is not None:
                return a
            try:
                return self.update(a.id, expected_version=a.version,
                                   config={**a.config, "deleting": {"since": _now()}})
            except ConflictError:
                continue

    def update(
        self, agent_id: str, *, expected_version: int, config: dict[str, Any] | None = None,
        live_deployment: str | None = None,
    ) -> Agent:
        _check_version(expected_version)
        with self._ts._tx() as c:
            cur = c.one(f"SELECT {_AGENT_COLS} FROM agents WHERE id = ?", (agent_id,))
            if cur is None:
                raise NotFound(f"no agent {agent_id!r}")
            a = _agent(cur)
            new_cfg = a.config if config is None else config
            new_live = a.live_deployment if live_deployment is None else live_deployment
            if live_deployment is not None:
                refuse_if_deleting(a)
            if live_deployment is not None and not c.one(
                "SELECT 1 FROM deployments WHERE id = ? AND agent_id = ? AND status <> ?",
                (live_deployment, agent_id, DEPLOYMENT_DELETED)
            ):
                raise NotFound(f"no deployment {live_deployment!r} of agent {a.name!r} (or it was deleted)")
            now = _now()
            n = c.x(
                "UPDATE agents SET config = ?, live_deployment = ?, updated_at = ?, version = version + 1 "
                "WHERE id = ? AND version = ?",
                (self._json(new_cfg, "agent config"), new_live, now, agent_id, expected_version),
            )
            if n != 1:
                raise ConflictError(f"agent {a.name!r} changed (now version {a.version})", current_version=a.version)
        return Agent(a.id, a.name, new_cfg, new_live, a.created_at, now, expected_version + 1)
