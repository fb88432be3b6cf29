"""The guest's end of the channel closed under a running micro-VM (a part of ``MicroVMSandbox``).

The guest supervisor holds the virtio-serial port; when it exits (an agent whose code ends its own process, one the
guest kernel kills for memory), the guest's init starts a new one, which opens the port again. The host's end (QEMU's
socket) stays connected throughout, so nothing told the host: a turn in flight waited out its whole timeout
(600 s) for an answer the dead supervisor would never send, and the user's next turns queued behind it. QEMU does
report the guest closing its port (``VSERPORT_CHANGE``); the calls in flight then fail at once with
``ChannelClosed``, and the next call reaches the new supervisor.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from moorage.log import get_logger
from moorage.sandbox.errors import ChannelClosed
from moorage.sandbox.qmp import QMPClient

if TYPE_CHECKING:
    from moorage.sandbox.microvm_sandbox import MicroVMSandbox

log = get_logger("moorage.sandbox.microvm_sandbox")

#: The channel port's device id on QEMU's command line: QEMU names a port in its events only when it has one.
PORT_ID = "moorage-port"


class GuestPortWatch:
    """Listens to one QEMU's events (``MicroVMSandbox`` holds ``_channel`` and ``id``; ``_on_qmp_event`` is the
    full-disk pause's)."""

    def _watch_qmp(self: "MicroVMSandbox", qmp: QMPClient) -> None:
        """Listen to this QEMU's events (called whenever a monitor connection is made)."""
        qmp.on_event = lambda ev: self._on_event(qmp, ev)

    def _on_event(self: "MicroVMSandbox", qmp: QMPClient, ev: dict[str, Any]) -> None:
        if ev.get("event") == "VSERPORT_CHANGE":
            self._on_port_change(ev.get("data") or {})
        else:
            self._on_qmp_event(qmp, ev)

    def _on_port_change(self: "MicroVMSandbox", data: dict[str, Any]) -> None:
        channel = self._channel
        if data.get("id") != PORT_ID or data.get("open", True) or channel is None or channel.closed:
            return
        error = ChannelClosed(f"{channel.name} closed: the guest's agent process exited, and a new one started",
                              hint="send the request again")

        async def fail() -> None:
            failed = await channel.fail_calls(error)
            if failed:
                log.warning("the guest's supervisor exited with calls in flight; they failed at once", sandbox=self.id,
                            calls=failed)

        asyncio.get_running_loop().create_task(fail(), name=f"guest-port-closed-{self.id}")
