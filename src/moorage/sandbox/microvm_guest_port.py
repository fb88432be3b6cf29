"""The guest's end of the channel closed under a running micro-VM (a part of ``MicroVMSandbox``).

The guest supervisor holds the virtio-serial port; when it exits (an agent whose code ends its own process, one the
guest kernel kills for memory), the guest's init starts a new one, which opens the port again. The host's end (QEMU's
socket) stays connected throughout, so nothing told the host: a turn in flight waited out its whole timeout
(600 s) for an answer the dead supervisor would never send, and the user's next turns queued behind it. QEMU does
report the guest closing its port (``VSERPORT_CHANGE``); the calls in flight then fail with ``ChannelClosed``: at
once when the guest's init said on its console how the supervisor ended (``ConsoleTail``: its status and the guest
kernel's kills for memory meanwhile, as the process driver reads its cgroup's count), or, from an older init that
says only the status, after a kill as soon as the new supervisor has said whether the guest's kernel killed a
process for memory meanwhile. The next call reaches the new supervisor.
"""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, Optional

from moorage.log import get_logger
from moorage.sandbox.channel import Channel
from moorage.sandbox.errors import ChannelClosed, ChannelError
from moorage.sandbox.qmp import QMPClient

if TYPE_CHECKING:
    from moorage.sandbox.microvm_sandbox import MicroVMSandbox

log = get_logger("moorage.sandbox.microvm_sandbox")

#: The channel port's device id on QEMU's command line: QEMU names a port in its events only when it has one.
PORT_ID = "moorage-port"
#: How long the calls of an ended supervisor wait for the next one to say why it ended, before they fail saying only
#: that it exited. Under TCG it answers 5-6 s after an exit (the init's pause, then a fresh interpreter), and after an
#: OOM kill it was seen to take longer than 10 s (the guest reads back from disk what the kill's pressure evicted).
REOPEN_WAIT_S = 30.0
#: How long the calls wait for the guest's init to say on its console how the supervisor ended (milliseconds after
#: the port closes, under TCG too), before they wait for the next supervisor instead.
CONSOLE_WAIT_S = 2.0
#: The wait status of a process ended by SIGKILL (128 + 9): the guest kernel's OOM kill, or a kill from inside.
KILLED_STATUS = 137
#: The guest init's line (sandbox/image_guest.py) as each supervisor ends: its wait status and, from an init of
#: guest code since 2026-12, the guest kernel's kills for memory during its life (an older VM's disk says only the
#: status: a kill then waits for the next supervisor's word).
_EXITED = re.compile(rb"moorage-init: supervisor exited \((\d{1,3})(?:; oom_kill \+(\d{1,9}))?\); restarting")
#: The most of console.log read (it is capped at 512 KiB, then rotated).
CONSOLE_READ_MAX = 1 << 20
#: What a supervisor logs (guest/supervisor.py) once it holds the port.
_SERVING = b'"serving virtio port"'


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
        if data.get("id") != PORT_ID or channel is None or channel.closed:
            return
        if data.get("open", True):
            reopened = self.__dict__.get("_port_reopened")
            if reopened is not None:
                reopened.set()  # the new supervisor holds the port
            return
        self.__dict__["_port_reopened"] = reopened = asyncio.Event()
        ids = channel.calls_in_flight()  # the ended supervisor's: calls made to the next one are not failed
        memory_mib = self._vm_config().memory_mib
        console = ConsoleTail(self._paths().console_log)

        async def fail() -> None:
            if ids:
                ended = await console.exit_status()
                if ended is not None and ended.oom_kills:
                    why = f"{killed_for_memory(memory_mib)}, and a new one started"
                elif ended is not None and (ended.status != KILLED_STATUS or ended.oom_kills is not None):
                    how = "was killed" if ended.status == KILLED_STATUS else "exited"
                    why = f"the guest's agent process {how} (status {ended.status}), and a new one started"
                else:
                    why = await _why_it_ended(channel, reopened, memory_mib)
            else:
                why = "the guest's agent process exited, and a new one started"
            failed = await channel.fail_calls(ChannelClosed(f"{channel.name} closed: {why}",
                                                            hint="send the request again"), ids)
            if failed:
                log.warning("the guest's supervisor exited with calls in flight; they failed", sandbox=self.id,
                            calls=failed, why=why)

        asyncio.get_running_loop().create_task(fail(), name=f"guest-port-closed-{self.id}")


class ConsoleTail:
    """The guest's init says on its console how each supervisor ended (``supervisor exited (STATUS; oom_kill +N)``:
    the shell's wait status, and the guest kernel's kills for memory during its life) as it starts the next one,
    often before the host hears the port close. The first such line after the ended supervisor said it serves the
    port (``serving virtio port``: the last one written before the close, or, in a console that does not show it, a
    forked VM's or one rotated away, the console's start) tells at once an exit (``os._exit``, ``sys.exit`` from a
    thread), a kill for memory and another kill. An older init's line has no count: a kill then needs the next
    supervisor's word on the guest's OOM count. No such line: the calls wait for the next supervisor as before.
    Read for the message's words only (the guest writes its console)."""

    def __init__(self, console_log: Path) -> None:
        self.path = console_log
        self.start = _size(console_log)

    async def exit_status(self) -> Optional["Ended"]:
        deadline = time.monotonic() + CONSOLE_WAIT_S
        while True:
            status = self._read()
            if status is not None or time.monotonic() >= deadline:
                return status
            await asyncio.sleep(0.02)

    def _read(self) -> Optional["Ended"]:
        try:
            with open(self.path, "rb") as f:
                text = f.read(CONSOLE_READ_MAX)
        except OSError:
            return None
        rotated = len(text) < self.start  # the console became console.log.1 since the close: it is all new
        served = -1 if rotated else text.rfind(_SERVING, 0, self.start)
        found = _EXITED.search(text, max(served, 0))
        if found is None:
            return None
        return Ended(int(found.group(1)), int(found.group(2)) if found.group(2) is not None else None)


class Ended(NamedTuple):
    """How a supervisor ended, as the guest's init told it: the wait status, and the guest kernel's kills for
    memory during its life (None: an older init that does not say)."""

    status: int
    oom_kills: Optional[int]


def killed_for_memory(memory_mib: int) -> str:
    return f"killed for memory (memory_mib = {memory_mib}): the guest's kernel ended its agent process"


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


async def _why_it_ended(channel: Channel, reopened: asyncio.Event, memory_mib: int) -> str:
    """Why the guest's supervisor ended, said in the failure of its calls: the next one (started by the guest's init
    within a few seconds) is asked whether the guest's kernel killed a process for memory meanwhile, as the process
    driver reads its cgroup's count. What the guest answers chooses only these words."""
    exited = "the guest's agent process exited, and a new one started"
    try:
        async with asyncio.timeout(REOPEN_WAIT_S):
            await reopened.wait()
            answer = await channel.call("ping", {}, timeout=REOPEN_WAIT_S)
    except (TimeoutError, ChannelError):
        return exited
    if isinstance(answer, dict) and answer.get("after_oom_kill") is True:
        return f"{killed_for_memory(memory_mib)}, and a new one started"
    return exited
