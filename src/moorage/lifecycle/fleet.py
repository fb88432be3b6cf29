"""The instance manager's decisions in a fleet: serve here, forward to the owner, or take the instance over.

Kept apart from the manager so the one-host path reads without them; the manager calls these only when the
host is a fleet member (``manager.fleet`` set).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from moorage.lifecycle.machine import InstanceState as S
from moorage.store import SandboxRecord
from moorage.store.repos.sandboxes import LeaseLost  # noqa: F401 - raised by turn commits; named here for callers

if TYPE_CHECKING:
    from moorage.fleet.member import FleetMember

#: States in which the record's host holds the instance (awake, or moving it); others may take it only if that
#: host's lease lapsed.
HELD = frozenset({S.RUNNING.value, S.WAKING.value, S.SUSPENDING.value, S.PROVISIONING.value, S.DELETED.value})


def shipped_current(rec: SandboxRecord) -> bool:
    """Whether the record's last sleep was shipped, so any host can wake it exactly where it stopped."""
    return bool(rec.meta.get("shipped_current")) and isinstance(rec.meta.get("shipped"), dict)


def placement(fleet: "FleetMember", rec: SandboxRecord) -> str:
    """For a record placed on another host: ``forward`` (its owner serves it) or ``claim`` (we take it). Blocking."""
    owner = fleet.host(rec.host) if rec.host else None
    alive = owner is not None and owner.alive(fleet.lease_ttl_s)
    if rec.state in HELD:
        return "forward" if alive else "claim"
    # Asleep (or failed): anyone may wake it from the object store when its last sleep was shipped; otherwise its
    # newest copy is on its host's disk, so that host serves it while it lives.
    if shipped_current(rec) or not alive:
        return "claim"
    return "forward"
