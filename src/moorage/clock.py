"""The fleet's clock: the store's. Hosts compare times one wrote with their own (heartbeats, instance claims,
webhook and exec claims, forwarding signatures), so a host whose own clock is off reads them as the store's
clock would: each heartbeat measures how far this host's clock is from the store's, and ``now()`` corrects it.

With a store on this machine (SQLite) the offset stays 0. The measure is one query's round trip; its error is at
most half of it, far under the lease's seconds.
"""

from __future__ import annotations

import threading
import time

from moorage.log import get_logger

log = get_logger(__name__)

#: An offset past this is logged (a warning, again each time it moves by as much): moorage runs on, on the
#: store's clock, but logs, traces and files the host writes carry its own.
WARN_OFFSET_S = 2.0

_lock = threading.Lock()
_offset = 0.0
_warned_at: float | None = None


def now() -> float:
    """Seconds since the epoch on the store's clock, as far as this host can tell."""
    return time.time() + _offset


def offset() -> float:
    """How far the store's clock is ahead of this host's (negative: behind), in seconds."""
    return _offset


def observe(store_now: float, sent: float, received: float) -> float:
    """Record the store's time ``store_now``, read by a query this host sent at ``sent`` and had answered at
    ``received`` (both ``time.time()``); returns the new offset."""
    global _offset, _warned_at
    measured = store_now - (sent + received) / 2
    with _lock:
        _offset = measured
        warn = abs(measured) > WARN_OFFSET_S and (_warned_at is None or abs(measured - _warned_at) > WARN_OFFSET_S)
        back = _warned_at is not None and abs(measured) <= WARN_OFFSET_S
        if warn:
            _warned_at = measured
        elif back:
            _warned_at = None
    if warn:
        log.warning("this host's clock is off the store's: leases, claims and forwarding use the store's clock",
                    offset_s=round(measured, 3), hint="keep the hosts' clocks in step (NTP: systemd-timesyncd, chrony)")
    elif back:
        log.info("this host's clock is in step with the store's again", offset_s=round(measured, 3))
    return measured


def reset() -> None:
    """Forget the measured offset (a host leaving its store)."""
    global _offset, _warned_at
    with _lock:
        _offset, _warned_at = 0.0, None
