"""Time travel when a fleet's host dies: the host that takes an instance over finishes the rollback or fork its old
host left half done before any turn of it runs, as that host's own restart would (``TimeTravel.recover``).

The instance wakes from the copy its old host last shipped, so the checkpoint the operation needs may not be in it.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from moorage.log import get_logger
from moorage.store import Scope, TenantStore
from moorage.store.repos.checkpoints import checkpoints_of

if TYPE_CHECKING:
    from moorage.sandbox import Sandbox
    from moorage.timetravel.timeline import TimeTravel

log = get_logger(__name__)


async def finish_after_takeover(tt: "TimeTravel", ts: TenantStore, scope: Scope, sandbox: "Sandbox") -> None:
    """Finish the instance's interrupted operation, or drop it when the copy lacks the checkpoint it needs: that
    copy was shipped before the operation began and the store is rolled back only as its last step, so the instance
    is then entirely at the old point. Kept, such an intent would fail every later rollback, fork and checkpoint of
    the user, or roll the instance back turns later."""
    if scope.kind != "user" or scope.user is None:
        return
    agent, user, repo = scope.agent, scope.user, checkpoints_of(ts)
    head = await asyncio.to_thread(repo.head, agent, user)
    pending = head.pending if head else None
    if not pending:
        return
    if pending.get("op") == "rollback":
        target = await asyncio.to_thread(repo.get, agent, user, pending["to"])
        needed = target.sandbox_checkpoint if target.sandbox_id == sandbox.id else "(another sandbox's)"
    else:
        needed = pending.get("vm")
    if needed and needed not in {c.name for c in await sandbox.checkpoints()}:
        log.warning("dropping an interrupted time-travel operation its old host never shipped", agent=agent,
                    user=user, op=pending.get("op"), checkpoint=needed)
        await asyncio.to_thread(repo.set_pending, agent, user, None)
        return
    await tt._finish_pending(ts, agent, user, sandbox)
