"""The instance manager's errors: the instance lives on another host, the tenant is at its awake limit, or
bringing the sandbox up failed. The API turns each into problem+json (Misplaced into a forward)."""

from __future__ import annotations

from moorage.errors import MoorageError, UnavailableError
from moorage.store import SandboxRecord


class Misplaced(UnavailableError):
    """The instance lives on another host (its disk and snapshot are there); this host cannot serve it."""

    code = "instance-misplaced"

    def __init__(self, record: SandboxRecord | None, host: str | None = None) -> None:
        where = host if record is None else record.host
        what = "this instance" if record is None else f"instance of {record.scope}"
        super().__init__(f"{what} is placed on host {where!r}", hint=f"route requests for this agent to host {where!r}")
        self.host = where


class TenantAwakeLimit(MoorageError):
    """The tenant already has its maximum of awake instances (on this host, or in a fleet on every host), every one
    of them mid-turn."""

    code = "tenant-awake-limit"
    http_status = 429

    def __init__(self, limit: int, *, fleet: bool = False) -> None:
        where = "across the fleet's hosts" if fleet else "on this host"
        super().__init__(f"this tenant already has {limit} awake instance(s) {where}, all busy",
                         hint="retry when a turn ends, or ask the operator to raise max_awake_per_tenant")
        #: Read by the API's problem+json: a turn usually ends within seconds.
        self.retry_after = 5.0


class WakeFailed(UnavailableError):
    """Provisioning or waking a sandbox failed; the instance is marked failed and the next request retries."""

    code = "wake-failed"
