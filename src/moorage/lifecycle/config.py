"""What an agent's ``lifecycle`` config table says about its instances: scope, sleep policy, TTLs, users, concurrency.

Read from ``Agent.config["lifecycle"]`` once per use and validated here, so a bad setting is a clear InvalidInput.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from moorage.errors import InvalidInput
from moorage.store import Agent

InstanceScope = Literal["user", "session", "workflow"]
Concurrency = Literal["queue", "reject", "parallel"]

_KEYS = {"scope", "sleep", "archive_after_s", "delete_after_s", "users", "concurrency", "max_queue", "pool"}


@dataclass(frozen=True)
class AgentLifecycle:
    #: What one instance (one sandbox) serves: one end-user (default), one session, or one workflow run.
    scope: InstanceScope = "user"
    #: Sleep policy spec for ``moorage.lifecycle.policies.parse_policy``; None: the host's default policy.
    sleep: str | None = None
    #: Seconds asleep before the instance is archived; None: never.
    archive_after_s: float | None = None
    #: Seconds asleep (since its last activity) before its sandbox, disks and snapshots are deleted; None: never.
    delete_after_s: float | None = None
    #: ``existing``: a request for an unknown end-user is NotFound; ``auto``: the user is created on first request.
    users: Literal["existing", "auto"] = "existing"
    #: Concurrent turns from different sessions on one instance: wait in line, 409 Busy, or run side by side.
    #: Turns of one session are always applied one after another, in arrival order.
    concurrency: Concurrency = "queue"
    #: Turns allowed to wait for the instance (queue policy); beyond it the request is Overloaded (429).
    max_queue: int = 32
    #: Sleeping forks of the live template kept ready on each host, so a new user's first turn skips the fork.
    pool: int = 0

    @classmethod
    def of(cls, agent: Agent) -> "AgentLifecycle":
        raw: Any = (agent.config or {}).get("lifecycle", {})
        if not isinstance(raw, dict):
            raise InvalidInput(f"agent {agent.name!r}: lifecycle config must be a table", hint="e.g. [agent.lifecycle] scope = \"user\"")
        unknown = set(raw) - _KEYS
        if unknown:
            raise InvalidInput(f"agent {agent.name!r}: unknown lifecycle settings {sorted(unknown)}",
                               hint=f"known: {', '.join(sorted(_KEYS))}")
        lc = cls(**raw)
        lc._check(agent.name)
        return lc

    def _check(self, name: str) -> None:
        if self.scope not in ("user", "session", "workflow"):
            raise InvalidInput(f"agent {name!r}: lifecycle.scope {self.scope!r} is not user, session or workflow")
        if self.users not in ("existing", "auto"):
            raise InvalidInput(f"agent {name!r}: lifecycle.users {self.users!r} is not existing or auto")
        if self.concurrency not in ("queue", "reject", "parallel"):
            raise InvalidInput(f"agent {name!r}: lifecycle.concurrency {self.concurrency!r} is not queue, reject or parallel")
        for what in ("archive_after_s", "delete_after_s"):
            v = getattr(self, what)
            if v is not None and (not isinstance(v, (int, float)) or v <= 0):
                raise InvalidInput(f"agent {name!r}: lifecycle.{what} must be a positive number of seconds or unset")
        if not isinstance(self.pool, int) or isinstance(self.pool, bool) or not 0 <= self.pool <= 64:
            raise InvalidInput(f"agent {name!r}: lifecycle.pool must be an integer from 0 to 64",
                               hint="the number of pre-forked sleeping instances kept ready for new users")
        if not isinstance(self.max_queue, int) or self.max_queue < 1:
            raise InvalidInput(f"agent {name!r}: lifecycle.max_queue must be an integer ≥ 1")
        if self.sleep is not None:  # checked here, at deploy, not by the first turn that needs it
            from moorage.lifecycle.policies import parse_policy

            if not isinstance(self.sleep, str):
                raise InvalidInput(f"agent {name!r}: lifecycle.sleep must be a string",
                                   hint="always-on, adaptive, or fixed:<seconds> (e.g. fixed:300)")
            if self.sleep.strip().lower() != "adaptive":  # adaptive takes the host's prices, at run time
                try:
                    parse_policy(self.sleep)
                except InvalidInput as e:
                    raise InvalidInput(f"agent {name!r}: lifecycle.sleep: {e.message}", hint=e.hint) from e
