"""Host capacity: LRU victims, never a mid-turn instance, clear errors when the host is full."""

from __future__ import annotations

import random

import pytest

from moorage.errors import InvalidInput
from moorage.lifecycle.capacity import AwakeInstance, CapacityExhausted, HostCapacity


def _a(iid: str, last: float, busy: int = 0, ram: int = 256) -> AwakeInstance:
    return AwakeInstance(instance_id=iid, ram_mib=ram, in_flight=busy, last_active=last)


def test_nothing_to_do_under_the_limits() -> None:
    cap = HostCapacity(max_awake=3, max_ram_mib=1024)
    awake = [_a("a", 1.0), _a("b", 2.0)]
    assert cap.fits(awake, incoming=1, incoming_ram_mib=256)
    assert cap.victims(awake, incoming=1, incoming_ram_mib=256) == []
    assert HostCapacity().victims([_a(str(i), i) for i in range(1000)]) == []


def test_least_recently_active_idle_instance_is_slept_first() -> None:
    cap = HostCapacity(max_awake=3)
    awake = [_a("a", 30.0), _a("b", 10.0), _a("c", 20.0)]
    assert cap.victims(awake) == ["b"]
    assert cap.victims(awake, incoming=2) == ["b", "c"]


def test_mid_turn_instance_is_never_a_victim_even_if_least_recent() -> None:
    cap = HostCapacity(max_awake=3)
    awake = [_a("old-busy", 1.0, busy=1), _a("b", 10.0), _a("c", 20.0)]
    assert cap.victims(awake) == ["b"]


def test_full_of_busy_instances_raises_and_chooses_nobody() -> None:
    cap = HostCapacity(max_awake=2)
    awake = [_a("a", 1.0, busy=1), _a("b", 2.0, busy=2)]
    with pytest.raises(CapacityExhausted, match="mid-turn") as e:
        cap.victims(awake)
    assert e.value.hint and "retry" in e.value.hint
    # Partly busy and still not enough room: still nobody (sleeping one would admit no one).
    with pytest.raises(CapacityExhausted):
        HostCapacity(max_awake=3).victims([_a("a", 1.0, busy=1), _a("b", 2.0, busy=1), _a("c", 3.0)], incoming=2)


def test_ram_limit_sleeps_enough_memory() -> None:
    cap = HostCapacity(max_ram_mib=1024)
    awake = [_a("small-old", 1.0, ram=128), _a("big", 2.0, ram=512), _a("mid", 3.0, ram=256)]
    # 896 in use, 512 incoming: LRU order frees 128 (not enough), then 512.
    assert cap.victims(awake, incoming=1, incoming_ram_mib=512) == ["small-old", "big"]
    with pytest.raises(CapacityExhausted, match="can never fit"):
        cap.victims(awake, incoming=1, incoming_ram_mib=2048)


def test_ties_break_by_id_for_determinism() -> None:
    cap = HostCapacity(max_awake=2)
    awake = [_a("z", 5.0), _a("m", 5.0)]
    assert cap.victims(awake) == ["m"]
    assert cap.victims(list(reversed(awake))) == ["m"]


def test_invalid_limits_and_inputs() -> None:
    with pytest.raises(InvalidInput):
        HostCapacity(max_awake=0)
    with pytest.raises(InvalidInput):
        HostCapacity(max_ram_mib=0)
    with pytest.raises(InvalidInput, match="twice"):
        HostCapacity(max_awake=1).victims([_a("a", 1.0), _a("a", 2.0)])
    with pytest.raises(InvalidInput):
        HostCapacity(max_awake=1).victims([], incoming=-1)


def test_random_hosts_victims_are_idle_lru_prefix_and_make_room() -> None:
    rng = random.Random(3)
    for _ in range(300):
        n = rng.randint(1, 30)
        awake = [_a(f"i{k}", rng.uniform(0, 100), busy=int(rng.random() < 0.3), ram=rng.choice([128, 256, 512])) for k in range(n)]
        cap = HostCapacity(max_awake=rng.randint(1, 30), max_ram_mib=rng.choice([None, 2048, 4096]))
        incoming_ram = rng.choice([128, 256])
        try:
            victims = cap.victims(awake, incoming=1, incoming_ram_mib=incoming_ram)
        except CapacityExhausted:
            # Only when even sleeping every idle instance would not make room.
            assert not cap.fits([a for a in awake if a.in_flight], incoming=1, incoming_ram_mib=incoming_ram)
            continue
        by_id = {a.instance_id: a for a in awake}
        assert all(by_id[v].in_flight == 0 for v in victims)
        rest = [a for a in awake if a.instance_id not in set(victims)]
        assert cap.fits(rest, incoming=1, incoming_ram_mib=incoming_ram)
        idle_lru = [a.instance_id for a in sorted((a for a in awake if not a.in_flight), key=lambda a: (a.last_active, a.instance_id))]
        assert victims == idle_lru[: len(victims)]
