"""The deliveries this host's sender holds claims on, named in a file of its data directory while they are sent, so
the next start hands back at once those a killed process held (their lease would otherwise keep them ~15 s)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from moorage import clock
from moorage.log import get_logger
from moorage.store.webhooks import Delivery

log = get_logger(__name__)


class HeldClaims:
    """``{tenant: {delivery id: version after the claim}}`` of the attempts in flight, mirrored to ``path``.

    The data directory is held by one process at a time (``moorage up`` locks it), so what the file names at start
    was held by a process that is gone. A claim the file names is released only if the delivery is still as that
    process claimed it (same version): one another host took after the lease, or whose attempt was recorded, stays."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._held: dict[str, dict[str, int]] = {}

    def hold(self, tenant: str, due: list[Delivery]) -> None:
        """Name claims just made, before their attempts start (a crash before this only waits out the lease)."""
        self._held.setdefault(tenant, {}).update({d.id: d.version for d in due})
        self._save()

    def let_go(self, tenant: str, due: list[Delivery]) -> None:
        """The attempts ended (recorded, or not: then their lease runs out as before)."""
        held = self._held.get(tenant, {})
        for d in due:
            held.pop(d.id, None)
        if not held:
            self._held.pop(tenant, None)
        self._save()

    def _save(self) -> None:
        # No fsync: a killed process's writes survive it; a machine that lost power waits out the leases.
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self._held))
        os.replace(tmp, self.path)

    def release_left(self, store: Any) -> int:
        """At start: make due now the deliveries a previous, dead process of this host held. Blocking."""
        try:
            left: dict[str, dict[str, int]] = json.loads(self.path.read_text())
        except (FileNotFoundError, ValueError):
            return 0
        released = 0
        for ts in store.operator.tenants():
            claims = left.get(ts.tenant_id)
            if claims:
                released += ts.deliveries.release(claims, clock.now())
        if released:
            log.info("webhook deliveries a killed sender was sending are due again", count=released)
        self.path.unlink(missing_ok=True)
        return released
