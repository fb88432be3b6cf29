"""Whether a load balancer should send this host new requests (``GET /readyz``): not while it stops (its turns in
flight finish, new ones would be refused or cut), nor while an operator drains it out of a fleet, nor while its store
does not answer. ``/healthz`` stays the liveness check: the process serves.

The probe needs no credential, so anyone may call it as often as they like: the store is asked at most once per
``STORE_TTL_S`` whatever the number of callers (they share the one answer), and for at most ``STORE_WAIT_S``.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from moorage.aio import within
from moorage.log import get_logger

log = get_logger(__name__)

#: How long one answer of the store stands for every probe, and how long a probe waits for the store.
STORE_TTL_S = 1.0
STORE_WAIT_S = 3.0
#: When a load balancer that was told "not ready" may ask again.
RETRY_AFTER_S = 5


@dataclass(frozen=True)
class Ready:
    ready: bool
    #: ``ready``, or why not: ``starting``, ``stopping``, ``draining``, ``store-unreachable``.
    status: str
    detail: str = ""

    def body(self) -> dict[str, Any]:
        """``status``, and when not ready the ``detail`` and ``retry_after`` (seconds) every 503 of the API has."""
        return {"status": self.status} if self.ready else {"status": self.status, "detail": self.detail,
                                                           "retry_after": RETRY_AFTER_S}


class Readiness:
    def __init__(self, store: Any, runtime: Any | None) -> None:
        self.store, self.runtime = store, runtime
        self._checked = float("-inf")
        self._store_error: str | None = None
        self._lock = asyncio.Lock()

    async def check(self) -> Ready:
        rt = self.runtime
        if rt is None:
            return Ready(False, "starting", "this server has no runtime")
        if rt.stopping.is_set():
            return Ready(False, "stopping", "the host is stopping: its turns in flight finish, new ones go elsewhere")
        fleet = getattr(rt.instances, "fleet", None)
        if fleet is not None and fleet.draining:
            return Ready(False, "draining", "an operator drains this host out of the fleet")
        error = await self._store()
        if error is not None:
            return Ready(False, "store-unreachable", error)
        return Ready(True, "ready")

    async def _store(self) -> str | None:
        """The store's last answer if it is recent, else a new one (one caller asks; the others wait for it)."""
        async with self._lock:
            if time.monotonic() - self._checked >= STORE_TTL_S:
                try:
                    await within(asyncio.to_thread(self.store.ping), STORE_WAIT_S)
                    self._store_error = None
                except asyncio.TimeoutError:
                    self._store_error = f"the store did not answer within {STORE_WAIT_S:.0f} s"
                except Exception as e:  # noqa: BLE001 - whatever the backend raised, the host is not ready
                    self._store_error = f"the store did not answer: {getattr(e, 'message', None) or e}"
                if self._store_error is not None:
                    log.info("not ready", why=self._store_error)
                self._checked = time.monotonic()
            return self._store_error
