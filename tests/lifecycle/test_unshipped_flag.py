"""The ship loop's "look for unshipped sleeps" flag (``FleetDuties``): a pass that listed this host's records
before a sleep that could not be shipped was recorded must not clear the flag that sleep set, or the sleep stays
unshipped (and only this host's disk holds its newest copy) until the host restarts."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any, Callable

from moorage.lifecycle.fleet import FleetDuties
from moorage.log import FailingRounds, get_logger


class _Host(FleetDuties):
    """Just what a pass reads: a fleet member, no tenants (the listing is where a sleep lands in between)."""

    def __init__(self, during_listing: Callable[[], None] | None = None) -> None:
        self.fleet = SimpleNamespace()
        self.store = SimpleNamespace(operator=SimpleNamespace(list_tenants=lambda: []))
        self._by_record = {}
        self._unshipped_rounds = FailingRounds(get_logger("test"), "shipping sleeping instances")
        self._during_listing = during_listing

    async def io(self, fn: Callable[..., Any], *args: Any) -> Any:  # type: ignore[override]
        out = fn(*args)
        if self._during_listing is not None:
            self._during_listing()  # a sleep recorded right after the pass read the records
        return out


def test_a_pass_that_found_nothing_left_clears_the_flag() -> None:
    host = _Host()
    host.note_unshipped()
    assert asyncio.run(host.ship_unshipped()) == (0, 0)
    assert host._unshipped_check is False


def test_a_sleep_recorded_while_a_pass_ran_keeps_the_flag_for_the_next_pass() -> None:
    host: _Host
    host = _Host(during_listing=lambda: host.note_unshipped())
    assert asyncio.run(host.ship_unshipped()) == (0, 0)
    assert host._unshipped_check is True, "the sleep recorded after the listing would never be shipped"
