"""A micro-VM paused by a full host disk (a part of ``MicroVMSandbox``). When a write to its disk file finds no room,
QEMU stops the guest (virtio-blk's default ``werror=enospc``: nothing is written, nothing is lost, the write waits).

Without the host noticing, every call to the guest then waited out its timeout and the guest stayed paused after
room was made, until the host restarted. Now the calls waiting on the guest fail at once with ``DiskFull`` (507),
new ones are refused the same way while it is paused, and the guest is resumed as soon as the disk has room again:
the write it was doing completes and it goes on where it was.
"""

from __future__ import annotations

import asyncio
import os
import signal
from typing import TYPE_CHECKING, Any

from moorage.errors import DiskFull
from moorage.log import get_logger
from moorage.sandbox.qmp import QMPClient, QMPError

if TYPE_CHECKING:
    from moorage.sandbox.microvm_sandbox import MicroVMSandbox

log = get_logger("moorage.sandbox.microvm_sandbox")

#: Free bytes on the sandbox's filesystem before a paused guest is resumed: its pending write (qcow2 clusters and
#: their refcounts) and the host's own next writes must fit, or the guest pauses again at once.
RESUME_FREE_BYTES = 4 << 20
#: How often a paused guest's filesystem is checked for room.
RESUME_POLL_S = 0.2


def nearly_full(path: "os.PathLike[str] | str") -> bool:
    """Whether the filesystem of ``path`` has less than ``RESUME_FREE_BYTES`` free (QEMU's own errors on a full disk
    say "An IO error has occurred", or it dies: this is how the host tells)."""
    try:
        st = os.statvfs(path)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize < RESUME_FREE_BYTES


def killed_by_full_disk(returncode: int | None, sandbox_dir: "os.PathLike[str] | str") -> DiskFull | None:
    """``DiskFull`` when a QEMU that exited was killed by SIGBUS with the disk (nearly) full: its guest touched a page
    of its RAM file (a cold-booted guest's, sparse) that found no room. Such a boot said "report trace id"."""
    if returncode != -signal.SIGBUS or not nearly_full(sandbox_dir):
        return None
    return DiskFull("the host is out of disk space: the sandbox's memory did not fit on the disk, so it could not "
                    "start")


def paused_error(sandbox_id: str) -> DiskFull:
    return DiskFull(f"the host is out of disk space: the agent's sandbox {sandbox_id} is paused until there is room "
                    "(nothing of it is lost)")


class DiskFullPause:
    """``MicroVMSandbox``'s reaction to QEMU pausing the guest on a full disk (it holds ``_qmp``, ``_channel``,
    ``dir``, ``id``, ``_disk_full`` and ``_resumer``; QEMU's events reach it through ``GuestPortWatch``)."""

    def _on_qmp_event(self: "MicroVMSandbox", qmp: QMPClient, ev: dict[str, Any]) -> None:
        data = ev.get("data") or {}
        if ev.get("event") != "BLOCK_IO_ERROR" or not data.get("nospace") or data.get("action") != "stop":
            return
        if not self._disk_full:
            log.error("the disk is full: the micro-VM is paused until there is room", sandbox=self.id,
                      operation=data.get("operation"), reason=data.get("reason"))
        self._disk_full = True
        loop = asyncio.get_running_loop()
        if self._channel is not None and not self._channel.closed:
            loop.create_task(self._channel.fail_calls(paused_error(self.id)), name=f"disk-full-{self.id}")
        if self._resumer is None or self._resumer.done():
            self._resumer = loop.create_task(self._resume_when_room(qmp), name=f"disk-full-resume-{self.id}")

    async def _resume_when_room(self: "MicroVMSandbox", qmp: QMPClient) -> None:
        """Resume the guest once the disk has ``RESUME_FREE_BYTES`` free; a write that still finds no room pauses it
        again (another event), and this goes on waiting. Ends with the QEMU (teardown, sleep, another launch)."""
        while self._disk_full and self._qmp is qmp and not qmp.closed:
            await asyncio.sleep(RESUME_POLL_S)
            try:
                st = await asyncio.to_thread(os.statvfs, self.dir)
            except OSError:
                return  # the sandbox's directory is gone (destroyed)
            if st.f_bavail * st.f_frsize < RESUME_FREE_BYTES or self._qmp is not qmp:
                continue
            self._disk_full = False  # before ``cont``: a write failing again marks it again
            try:
                await qmp.execute("cont")
            except QMPError as e:
                log.warning("could not resume the micro-VM paused on a full disk", sandbox=self.id, error=str(e))
                return
            log.info("room on the disk again: the micro-VM resumed", sandbox=self.id)
            await asyncio.sleep(RESUME_POLL_S)  # paused again meanwhile: the loop goes on
