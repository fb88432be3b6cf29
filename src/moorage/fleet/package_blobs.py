"""Deploy packages in the object store (``packages/<sha256>.tar.gz``: written by the deploying host, fetched by any
host that lacks its own copy), collected once no deployment of any tenant names one (each that did was deleted).

A deploy may name a package again at any time (the same bytes deployed anew, by any tenant), so a package goes in
two steps, as templates do (``fleet/gc.py``): a collection writes a marker ``package-markers/<sha256>.json``
(``retired``); one at least ``settle_s`` later turns it to ``deleting``, reads the store again, and only if the
package is still unnamed deletes it, the marker last. A deploy, once its deployment names the package (``keep``),
reads the marker: none or ``retired`` means any collection still to decide reads the store after the deployment
was recorded and keeps the package; ``deleting`` means one may have read it before, so the deploy waits for that
collection to end and then writes the package again if it went. Every step is idempotent; hosts may collect at once.
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from moorage.log import get_logger
from moorage.objects import Blobs, ObjectNotFound

if TYPE_CHECKING:
    from moorage.fleet.gc import TemplateUse

log = get_logger(__name__)

MARKERS = "package-markers"


def marker_key(sha256: str) -> str:
    return f"{MARKERS}/{sha256}.json"


def _marker(blobs: Blobs, sha256: str) -> dict[str, Any] | None:
    try:
        d = json.loads(blobs.store.get_bytes(marker_key(sha256)))
    except ObjectNotFound:
        return None
    except ValueError:  # torn: still a marker; the collection that wrote it goes on deleting
        return {"state": "deleting", "at": 0.0}
    return d if isinstance(d, dict) else {"state": "deleting", "at": 0.0}


def keep(blobs: Blobs, sha256: str, path: Path, *, wait_s: float = 90.0, poll_s: float = 0.5) -> None:
    """After a deployment naming ``sha256`` was recorded: make sure the object store has the package (``path``:
    this host's copy), waiting out a collection that is deleting it (at most ``wait_s``). Blocking."""
    deadline = time.monotonic() + wait_s
    while True:
        m = _marker(blobs, sha256)
        if m is None or m.get("state") == "retired":
            break
        if time.monotonic() > deadline:  # a collection cut short left it; the next one removes the marker
            log.warning("a package's deletion marker outlived the wait; writing the package anyway",
                        package=sha256[:16])
            break
        time.sleep(poll_s)
    blobs.put_blob(path)


@dataclass
class PackageReport:
    retired: int = 0
    deleted: int = 0
    restored: int = 0


class PackageCollector:
    """The object store's packages that no deployment names, in two steps (module docstring)."""

    def __init__(self, blobs: Blobs, *, host: str = "", grace_s: float = 600.0, settle_s: float = 60.0) -> None:
        self.blobs = blobs
        self.host = host
        self.grace_s = grace_s
        self.settle_s = settle_s

    def _put_marker(self, sha256: str, state: str, at: float) -> None:
        self.blobs.store.put_bytes(marker_key(sha256),
                                   json.dumps({"state": state, "at": at, "by": self.host}).encode())

    def _unmark(self, sha256: str) -> None:
        with contextlib.suppress(ObjectNotFound):
            self.blobs.store.delete(marker_key(sha256))

    def _listed(self) -> dict[str, float]:
        """sha256 -> when the package's object was written."""
        prefix, suffix = f"{self.blobs.prefix}/", self.blobs.suffix
        out: dict[str, float] = {}
        for o in self.blobs.store.iter(prefix):
            name = o.key[len(prefix):]
            if name.endswith(suffix) and "/" not in name:
                out[name[:len(name) - len(suffix)]] = o.modified
        return out

    def collect(self, use: "TemplateUse", use_of: Callable[[], "TemplateUse"], now: float) -> PackageReport:
        """One round: ``use`` was read before the bucket is listed here; ``use_of`` reads the store again before
        anything is deleted. Nothing goes while ``use.packages`` is unknown (None). Blocking."""
        rep = PackageReport()
        if use.packages is None:
            return rep
        listed = self._listed()
        markers = {o.key[len(MARKERS) + 1:].removesuffix(".json") for o in self.blobs.store.iter(f"{MARKERS}/")}
        to_delete: list[str] = []
        for sha, written in sorted(listed.items()):
            m = _marker(self.blobs, sha) if sha in markers else None
            if sha in use.packages:
                # Named again after it was retired (or a collection that was deleting it was cut short).
                if m is not None and (m.get("state") == "retired" or now - float(m.get("at") or 0.0) >= self.settle_s):
                    self._unmark(sha)
                    rep.restored += 1
                continue
            if now - written < self.grace_s:
                continue
            if m is None:
                self._put_marker(sha, "retired", now)
                rep.retired += 1
                if self.settle_s > 0:
                    continue
                m = {"state": "retired", "at": now}
            if m.get("state") == "deleting" or now - float(m.get("at") or 0.0) >= self.settle_s:
                to_delete.append(sha)
        for sha in sorted(markers - set(listed)):  # the package went and its marker stayed (a cut-short deletion)
            self._unmark(sha)
        if not to_delete:
            return rep
        for sha in to_delete:
            self._put_marker(sha, "deleting", now)
        again = use_of()  # a deploy that names one from here on waits for this round to end (``keep``)
        for sha in to_delete:
            if again.packages is None or sha in again.packages:
                self._unmark(sha)
                rep.restored += 1
                continue
            with contextlib.suppress(ObjectNotFound):
                self.blobs.store.delete(self.blobs.key(sha))
            self._unmark(sha)
            rep.deleted += 1
            log.info("a package no deployment names deleted from the object store", package=sha[:16])
        return rep
