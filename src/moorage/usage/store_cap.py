"""The per-user ``store_mib`` cap: how much the store may keep for one end-user's instance of an agent.

A level, not an amount per window: what the user's memories, facts, working state (a graph's checkpoints too),
workflows and agent checkpoints hold now (``ts.footprint``). The agent's code is what fills it, so it is the
agent's calls that hand the store something to keep that are refused past it (``StoreCapExceeded``, a host error
of kind ``store-cap-exceeded`` in the guest); turns still run, reads go on, and what retention, deleting the user,
a rollback or a graph's deleted thread frees is room again. The host's own records of a turn (its messages) are
not refused.

Measuring reads every row of the user, so each host keeps the last measure of the users whose turns it ran and
adds what their calls handed the store since (the calls' frame bytes and a memory's embedding; what is deleted
meanwhile is seen at the next measure).
It measures again when that sum would cross the cap (in each turn the first time, then at most every
``RECHECK_S``) and when the measure is older than ``MEASURE_EVERY_S``: a refusal rests on a measure taken in
its turn, at most ``RECHECK_S`` old. Another host's writes to the same user (a fleet moves an instance between
hosts) are seen at its next measure.
"""

from __future__ import annotations

import asyncio
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from moorage.errors import MoorageError
from moorage.memory.embeddings import DIMENSION

if TYPE_CHECKING:
    from moorage.store import TenantStore

#: A write that would cross the cap measures again, at most this often per user.
RECHECK_S = 10.0
#: A measure older than this is read again at the user's next write.
MEASURE_EVERY_S = 300.0
#: Users whose last measure a host keeps (the least recently written go first).
KEPT = 10_000
#: What the host adds to a remembered text after its call: the text's embedding (float32), which the embedder
#: writes later. Counted with the call, or a loop of short memories would grow the store ~7x faster than counted.
EMBEDDING_BYTES = DIMENSION * 4


class StoreCapExceeded(MoorageError):
    """The user's instance holds its ``store_mib`` in the store; the call that would keep more was refused."""

    code = "store-cap-exceeded"
    http_status = 507

    def __init__(self, agent: str, user: str, cap_mib: float, used: int, method: str) -> None:
        # The advice is in the message, not a hint: a guest that does not catch the error has it said once.
        super().__init__(f"user {user!r} of agent {agent!r} keeps {used / (1 << 20):.1f} MiB in the store, its "
                         f"store_mib cap is {cap_mib:g}; {method} refused: keep large data in files (ctx.files), "
                         f"or raise the cap (the user's limits, or store_mib in [agent.limits])")
        self.cap_mib = cap_mib
        self.used = used


@dataclass
class _Measure:
    bytes: int
    at: float
    #: Bytes counted since the measure (the calls' frames, memories' embeddings).
    since: int = 0


class Footprints:
    """One host's last measure of each user's store, plus what their calls handed it since."""

    def __init__(self, kept: int = KEPT) -> None:
        self._kept = kept
        self._m: OrderedDict[tuple[str, str, str], _Measure] = OrderedDict()

    async def _measure(self, key: tuple[str, str, str], ts: "TenantStore", agent: str, user: str) -> _Measure:
        parts = await asyncio.to_thread(ts.footprint.user_bytes, agent, user)
        m = self._m[key] = _Measure(sum(parts.values()), time.monotonic())
        self._m.move_to_end(key)
        while len(self._m) > self._kept:
            self._m.popitem(last=False)
        return m

    async def admit(self, ts: "TenantStore", agent: str, user: str, cap_mib: float, nbytes: int, method: str, *,
                    recheck: bool = False) -> bool:
        """Let a call hand ``nbytes`` to the store for ``user``, or raise ``StoreCapExceeded``. ``recheck``: a
        call that would cross the cap measures again however recent the measure is (a turn's first: what was
        freed since, by a forget or a rollback on any host, counts at once). Returns whether it measured."""
        key = (ts.tenant_id, agent, user)
        cap = int(cap_mib * (1 << 20))
        m = self._m.get(key)
        now = time.monotonic()
        measured = False
        if (m is None or now - m.at >= MEASURE_EVERY_S
                or (m.bytes + m.since + nbytes > cap and (recheck or now - m.at >= RECHECK_S))):
            m, measured = await self._measure(key, ts, agent, user), True
        else:
            self._m.move_to_end(key)
        if m.bytes + m.since + nbytes > cap:
            raise StoreCapExceeded(agent, user, cap_mib, m.bytes + m.since, method)
        m.since += nbytes
        return measured


_FOOTPRINTS: "weakref.WeakKeyDictionary[Any, Footprints]" = weakref.WeakKeyDictionary()


def footprints(rt: Any) -> Footprints:
    """The runtime's (one host process's) measures."""
    fp = _FOOTPRINTS.get(rt)
    if fp is None:
        fp = _FOOTPRINTS[rt] = Footprints()
    return fp


def under_ceiling(cap: float | None, ceiling: float) -> float | None:
    """A user's ``store_mib`` under the operator's ``user_max_store_mib`` (0: none); None: no cap at all."""
    if ceiling > 0:
        return ceiling if cap is None else min(cap, ceiling)
    return cap


def cap_of(ts: "TenantStore", manifest: dict[str, Any], agent: str, user: str, ceiling: float) -> float | None:
    """The user's ``store_mib``: their own limit, else their agent's ``[agent.limits]``, under the operator's
    ceiling (None: no cap)."""
    u = ts.agent_users.find(agent, user)
    own = (u.limits if u is not None else {}).get("store_mib")
    if own is None:
        own = (manifest.get("limits") or {}).get("store_mib")
    return under_ceiling(None if own is None else float(own), ceiling)


async def admit(rt: Any, b: Any, nbytes: int, method: str) -> None:
    """Before a turn's call hands the store ``nbytes``: refuse it if its user's instance is at its cap. ``b`` is
    the turn's ``runtime.host_calls.TurnBinding`` (its store, manifest, user and ``store_cap_*`` fields)."""
    if not b.store_cap_read:
        b.store_cap_mib = await asyncio.to_thread(cap_of, b.ts, b.manifest, b.entity.agent, b.entity.user,
                                                  float(getattr(rt.config, "user_max_store_mib", 0) or 0))
        b.store_cap_read = True
    if b.store_cap_mib is not None:
        nbytes += EMBEDDING_BYTES if method == "memory.append" else 0
        if await footprints(rt).admit(b.ts, b.entity.agent, b.entity.user, b.store_cap_mib, nbytes, method,
                                      recheck=not b.store_measured):
            b.store_measured = True

