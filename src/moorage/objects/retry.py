"""Reading a small object again when its bytes came back damaged or cut short, before calling it damaged.

A read garbled or cut in transit (a connection dropped mid-body, a proxy that truncated it) fails its length and
digest check once and reads fine the next time; an object damaged in storage fails every time. A caller that gives
up on what it read (a wake falling back to an older snapshot, losing the turns the newer one held) reads it a few
times first.
"""

from __future__ import annotations

import hashlib
import time

from moorage.log import get_logger
from moorage.objects.errors import ObjectCorrupt, ObjectStoreUnavailable
from moorage.objects.store import ObjectStore

log = get_logger(__name__)

#: Reads of one object in all, and the waits between them (seconds): a bounded ~0.7 s before giving up.
READS = 3
WAITS_S = (0.2, 0.5)


def get_bytes_again(store: ObjectStore, key: str, *, max_bytes: int, sha256: str | None = None,
                    reads: int = READS, waits_s: tuple[float, ...] = WAITS_S) -> bytes:
    """``store.get_bytes(key)``, read again (``reads`` times in all) while the answer is damaged or cut short
    (``ObjectCorrupt``, or bytes that do not hash to ``sha256`` when it is given) or the transfer failed
    (``ObjectStoreUnavailable``); then the last error is raised. A missing object (``ObjectNotFound``) is not read
    again. Blocking."""
    err: Exception | None = None
    for attempt in range(max(1, reads)):
        if attempt:
            time.sleep(waits_s[min(attempt - 1, len(waits_s) - 1)] if waits_s else 0.0)
        try:
            data = store.get_bytes(key, max_bytes=max_bytes)
        except (ObjectCorrupt, ObjectStoreUnavailable) as e:
            err = e
        else:
            got = hashlib.sha256(data).hexdigest() if sha256 is not None else None
            if got == sha256:
                if attempt:
                    log.info("an object read back damaged read fine again", key=key, reads=attempt + 1)
                return data
            err = ObjectCorrupt(key, f"its {len(data)} bytes hash to {got}, {sha256} was expected")
        if attempt + 1 < reads:
            log.warning("an object read back damaged or cut short; reading it again", key=key, read=attempt + 1,
                        error=str(err))
    assert err is not None
    raise err
