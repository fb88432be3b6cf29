"""How full the data directory's disk is, before it is full: a gauge for the operator's monitoring
(``moorage_data_disk_free_bytes``, ``moorage_data_disk_size_bytes``) and a warning in the host's log while little
room is left. A full disk refuses writes with 507 ``disk-full`` (docs/operations.md); this is the notice ahead."""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from moorage.log import FailingRounds, get_logger

log = get_logger(__name__)

#: How often the host looks at its data disk.
DISK_CHECK_S = 30.0
#: Nearly full: less free than this share of the disk, or than ``NEARLY_FULL_BYTES``, whichever is smaller (a
#: large disk is not nearly full with 40 GiB left; a small one is with 3%).
NEARLY_FULL_SHARE = 0.05
NEARLY_FULL_BYTES = 1 << 30


@dataclass(frozen=True)
class DiskSpace:
    size: int
    free: int  # what an unprivileged writer may still use (root's reserve left out)

    @property
    def nearly_full(self) -> bool:
        return self.free < min(NEARLY_FULL_BYTES, NEARLY_FULL_SHARE * self.size)


def disk_space(path: Path) -> DiskSpace:
    st = os.statvfs(path)
    return DiskSpace(st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize)


class DiskWatch:
    """Says in the log when the data disk becomes nearly full (once, until it has room again), and when it has
    room again."""

    def __init__(self, path: Path, every_s: float = DISK_CHECK_S) -> None:
        self.path = path
        self.every_s = every_s
        self.warned = False
        self._unreadable = FailingRounds(log, "data disk check", level=logging.WARNING)

    def check(self) -> DiskSpace | None:
        try:
            space = disk_space(self.path)
        except OSError as e:  # the directory gone or unreadable: the requests that need it say so
            self._unreadable.failed(e, path=str(self.path))
            return None
        self._unreadable.ok()
        if space.nearly_full and not self.warned:
            self.warned = True
            log.warning("data disk nearly full", path=str(self.path), free_mib=space.free >> 20,
                        size_mib=space.size >> 20,
                        hint="free space or grow the disk: once it is full, writes are refused (507 disk-full)")
        elif self.warned and not space.nearly_full:
            self.warned = False
            log.info("data disk has room again", path=str(self.path), free_mib=space.free >> 20)
        return space

    async def loop(self) -> None:
        while True:
            await asyncio.to_thread(self.check)
            await asyncio.sleep(self.every_s)
