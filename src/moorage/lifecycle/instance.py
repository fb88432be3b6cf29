"""What one host process knows about one instance beyond the store (its open sandbox, its turns in flight), and
how its sandbox came up (``WakeKind``); shared by the manager's bring-up and sleep paths."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Union

from moorage.errors import InvalidInput
from moorage.lifecycle.policies import IdleGapHistogram, InstanceActivity, SleepPolicy
from moorage.log import get_logger
from moorage.sandbox import Sandbox, SandboxDriver, SandboxState, TemplateRef
from moorage.store import SandboxRecord, Scope

log = get_logger("moorage.lifecycle.manager")

#: What to provision from: a template, or an async callable that finds one (only called when one is needed).
TemplateSource = Union[TemplateRef, Callable[[], Awaitable[TemplateRef]], None]


async def resolve_template(template: TemplateSource) -> TemplateRef | None:
    if template is None or isinstance(template, TemplateRef):
        return template
    return await template()


@dataclass(eq=False)
class LiveInstance:
    """What this process knows about one instance beyond the store: its open sandbox and its turns in flight."""

    tenant_id: str
    scope: Scope
    activity: InstanceActivity
    policy: SleepPolicy
    ram_mib: int
    record_id: str | None = None
    sandbox: Sandbox | None = None
    #: This manager woke or provisioned it, so this manager (and only it) sleeps or evicts it.
    owned: bool = False
    #: Serialises this process's sleep and wake of the instance.
    op_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    #: Set while an online backup copies the instance (``runtime/backup.py``): new turns wait for it to be done.
    gate: "asyncio.Future[None] | None" = None
    #: The in-process single flight: every concurrent caller awaits this one bring-up.
    pending: "asyncio.Future[Sandbox] | None" = None
    #: A second driver view used to attach to an instance another live process on this host keeps awake.
    peer_driver: SandboxDriver | None = None
    #: The learned idle gaps kept in the record (``meta.activity``, written as it sleeps) were read back.
    restored: bool = False
    #: The lease epoch under which this manager holds it (fleet: checked by every turn commit).
    epoch: int = 0
    #: Fleet: shipping its awake state (after turns, and every ``ship_interval_s``); when it last finished
    #: (monotonic); whether a turn ended since the pending ship started.
    ship_task: "asyncio.Task[None] | None" = None
    last_ship: float = 0.0
    ship_dirty: bool = False

    @property
    def awake(self) -> bool:
        return self.sandbox is not None and self.sandbox.state is SandboxState.RUNNING


@dataclass(frozen=True)
class ManagerStats:
    wakes: int
    provisions: int
    sleeps: int
    evictions: int


class WakeKind:
    """How an instance's sandbox came up, recorded in its record's ``meta.wake_kind`` and its lifecycle span."""

    #: A new instance restored from its template's snapshot (copy-on-write fork, no boot).
    FORK = "fork"
    #: A sleeping instance restored from its own snapshot, processes and memory included.
    SNAPSHOT = "snapshot"
    #: Booted from disk because the driver keeps no memory snapshot (the process driver).
    COLD = "cold"
    #: Booted from disk because the snapshot that should have been restored was damaged or incompatible.
    COLD_FALLBACK = "cold-fallback"


def wake_kind(sandbox: Sandbox, *, fork: bool) -> str:
    mode = getattr(sandbox, "last_wake_mode", None)
    if mode == "snapshot":
        return WakeKind.FORK if fork else WakeKind.SNAPSHOT
    if getattr(sandbox, "last_wake_fallback", None) is not None:
        return WakeKind.COLD_FALLBACK
    return WakeKind.COLD


def restore_activity(li: LiveInstance, rec: SandboxRecord | None, owner_id: str | None = None) -> None:
    """Give a newly seen instance the idle gaps and turn count its record kept from earlier hosts (or from this
    process, ``owner_id``, which released it while it slept)."""
    doc = (rec.meta if rec is not None else {}).get("activity")
    if not isinstance(doc, dict) or li.activity.gaps.count:
        return
    try:
        li.activity.gaps = IdleGapHistogram.from_dict(doc.get("gaps") or {})
        li.activity.turns += int(doc.get("turns") or 0)
    except (InvalidInput, TypeError, ValueError, KeyError) as e:  # an unreadable history only costs the learning
        log.warning("learned idle gaps not restored", instance=rec.id if rec else None, error=str(e))
        return
    since = doc.get("idle_since")
    # Slept by this very process, which then released it: the gap that ends with the turn now starting is learned
    # as if the instance had been held all along (a restarted host, another owner, does not learn it).
    if owner_id is not None and doc.get("slept_by") == owner_id and li.activity.busy \
            and isinstance(since, (int, float)) and li.activity.last_active > since:
        li.activity.gaps.observe(li.activity.last_active - since)
