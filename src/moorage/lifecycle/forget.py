"""Forgetting a user in a fleet: each of the user's instances is taken out of every other host's reach before its
bytes go (docs/fleet.md, Retention).

The forgetting host holds the user's lines in its own router only; another host could still wake a sleeping
instance of theirs (a turn sent there) while the forget deletes its snapshots and rows, leaving that host running
the user's sandbox, and shipping it again, after the forget returned. So each instance's record is first moved,
by compare-and-set, to ``deleted`` on the forgetting host: a request on any other host then finds it held here and
is forwarded here, where it waits in line behind the forget (and is refused once the user is gone). An instance
another live host holds awake is not taken: the forget is forwarded to that host (``Misplaced``), which cancels
its turns and destroys its sandbox itself. An instance of a dead host (lease lapsed) is taken like a sleeping one.

A forget that cannot be forwarded (it was forwarded here already: one hop), and finds one of the user's instances
awake on yet another live host (a session-scoped agent's sessions on two other hosts), asks that host to let go of
it (``release``: its turns cancelled, its sandbox put to sleep there) and then takes it like a sleeping one; a turn
that woke it again in between makes the compare-and-set fail, and it is asked again.
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable

from moorage.errors import ConflictError, NotFound, UnavailableError
from moorage.lifecycle import fleet as fleet_rules
from moorage.lifecycle import machine
from moorage.lifecycle.errors import Misplaced
from moorage.lifecycle.machine import InstanceState as S
from moorage.lifecycle.machine import Verb as V
from moorage.store import SandboxRecord, TenantStore

#: The step that brings a record in each state one step nearer to ``deleted`` (the machine has no shorter path).
_TOWARDS_DELETED = {
    S.SLEEPING: V.DELETE, S.ARCHIVED: V.DELETE, S.FAILED: V.DELETE,
    S.RUNNING: V.RECOVER, S.WAKING: V.RECOVER, S.SUSPENDING: V.RECOVER,  # its host is dead, or is this one
    S.PROVISIONING: V.FAIL,
}


#: Asks the live host that holds an instance awake to let go of it (cancel its turns, put it to sleep there).
Release = Callable[[SandboxRecord], Awaitable[None]]


async def take_to_forget(manager: Any, ts: TenantStore, rec: SandboxRecord,
                         release: Release | None = None) -> SandboxRecord | None:
    """Mark ``rec``'s instance ``deleted`` on this host (``manager``'s) for a forget that holds its lines here. When
    another live host holds it: with ``release``, that host is asked to let go of it, and it is then taken here;
    without, ``Misplaced`` is raised (the forget goes there). None when its record is gone already. A no-op
    outside a fleet, where the lines alone keep every request out."""
    if manager.fleet is None:
        return rec
    # The object store answers (its snapshots are deleted next): while it is down the forget fails here, with
    # nothing changed (no instance put to sleep elsewhere), rather than leave the instance deleted on this host (its
    # turns waiting for a claim nobody finishes) and its user's rows kept.
    await manager.io(manager.fleet.objects.list, manager.fleet.prefix(ts.tenant_id, rec) + "/", limit=1)
    for _ in range(100):
        try:
            rec = await manager.io(ts.sandboxes.get, rec.id)
        except NotFound:
            return None
        if rec.host not in (None, manager.host) and \
                await manager.io(fleet_rules.placement, manager.fleet, rec) == "forward":
            if release is None:
                raise Misplaced(rec)
            if rec.state in fleet_rules.HELD and rec.state != S.DELETED.value:  # awake there: stopped there first
                await release(rec)
                await asyncio.sleep(0.05)
                continue
            # Asleep there (its newest copy on that host's disk only: nothing runs), or being forgotten there too:
            # taken below like any other.
        state = S(rec.state)
        if state is S.DELETED:  # this host's (a forget retried), or a claim nobody will finish
            return rec
        verb = _TOWARDS_DELETED[state]
        # Not shipped as it is now: while it is on its way to deleted, no other host wakes it from the bucket.
        meta = {**rec.meta, "shipped_current": False}
        try:
            await manager.io(machine.apply, ts, rec, verb, owner=manager.owner, host=manager.host, meta=meta,
                             reason="its user is being forgotten")
        except ConflictError:
            continue  # another host moved it meanwhile: look again (forwarded there if it woke it)
    raise UnavailableError(f"instance {rec.id} of the user kept changing hands while it was being forgotten",
                           hint="retry the forget")
