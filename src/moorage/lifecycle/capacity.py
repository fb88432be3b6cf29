"""Host capacity: how many agents (and how much guest RAM) one host keeps awake, and whom to sleep when full.

Pure decisions on data the caller passes in; the lifecycle machine carries them out (sleeps the victims).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from moorage.errors import InvalidInput, UnavailableError


class CapacityExhausted(UnavailableError):
    """Every awake instance on the host is mid-turn, so nothing can be slept to make room."""

    code = "capacity-exhausted"


@dataclass(frozen=True)
class AwakeInstance:
    """What capacity decisions need to know about one awake instance."""

    instance_id: str
    ram_mib: int
    #: Turns in flight; an instance with any is never chosen as a victim.
    in_flight: int
    #: Last turn start or end on the caller's clock: the least recent is slept first.
    last_active: float


@dataclass(frozen=True)
class HostCapacity:
    """Limits of one host. ``None`` means unlimited on that axis."""

    max_awake: int | None = None
    max_ram_mib: int | None = None

    def __post_init__(self) -> None:
        if self.max_awake is not None and self.max_awake < 1:
            raise InvalidInput(f"max awake instances must be ≥ 1, got {self.max_awake}", hint="leave it unset for no limit")
        if self.max_ram_mib is not None and self.max_ram_mib < 1:
            raise InvalidInput(f"max guest RAM must be ≥ 1 MiB, got {self.max_ram_mib}", hint="leave it unset for no limit")

    def fits(self, awake: Iterable[AwakeInstance], incoming: int = 0, incoming_ram_mib: int = 0) -> bool:
        """Whether ``incoming`` more instances using ``incoming_ram_mib`` fit next to ``awake``."""
        count, ram = 0, 0
        for a in awake:
            count += 1
            ram += a.ram_mib
        return self._fits(count + incoming, ram + incoming_ram_mib)

    def _fits(self, count: int, ram_mib: int) -> bool:
        return (self.max_awake is None or count <= self.max_awake) and (self.max_ram_mib is None or ram_mib <= self.max_ram_mib)

    def victims(self, awake: Sequence[AwakeInstance], incoming: int = 1, incoming_ram_mib: int = 0) -> list[str]:
        """Instances to sleep, least recently active first, so ``incoming`` more fit; ``[]`` if they already do.

        ``awake`` must not contain the incoming instances themselves. Instances mid-turn are never chosen;
        if sleeping every idle one is still not enough, raises ``CapacityExhausted`` and chooses nobody
        (sleeping some would cost wakes without admitting the newcomer).
        """
        if incoming < 0 or incoming_ram_mib < 0:
            raise InvalidInput("incoming instances and RAM cannot be negative")
        ids = [a.instance_id for a in awake]
        if len(set(ids)) != len(ids):
            raise InvalidInput("the awake list names an instance twice", hint="pass each awake instance once")
        count = len(awake) + incoming
        ram = sum(a.ram_mib for a in awake) + incoming_ram_mib
        if self._fits(count, ram):
            return []
        if self.max_ram_mib is not None and incoming_ram_mib > self.max_ram_mib:
            raise CapacityExhausted(
                f"an instance needing {incoming_ram_mib} MiB can never fit a host limited to {self.max_ram_mib} MiB",
                hint="raise max_ram_mib or give the agent less guest memory",
            )
        # Ties on recency break by id so the same inputs always pick the same victims.
        idle = sorted((a for a in awake if a.in_flight == 0), key=lambda a: (a.last_active, a.instance_id))
        chosen: list[str] = []
        for a in idle:
            chosen.append(a.instance_id)
            count -= 1
            ram -= a.ram_mib
            if self._fits(count, ram):
                return chosen
        busy = len(awake) - len(idle)
        raise CapacityExhausted(
            f"host is full: {busy} of {len(awake)} awake instance(s) are mid-turn and sleeping all "
            f"{len(idle)} idle one(s) still leaves no room (limits: max_awake={self.max_awake}, max_ram_mib={self.max_ram_mib})",
            hint="retry when a turn ends, raise the host limits, or add a host",
        )
