"""A micro-VM sandbox's QEMU process (a part of ``MicroVMSandbox``): launching it, the channel to its guest
(connect, reconnect, a guest that broke the protocol), tearing it down, and re-attaching after a host restart."""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import subprocess
import time
import weakref
from typing import TYPE_CHECKING, Any, Callable

from moorage.log import get_logger
from moorage.sandbox import microvm_memfd, microvm_net
from moorage.sandbox.base import ChannelError, RemoteError, SandboxError, SandboxState
from moorage.sandbox.channel import Channel
from moorage.sandbox.microvm_diskfull import killed_by_full_disk
from moorage.sandbox.microvm_qemu import (
    console_pipe,
    console_reattach,
    console_release,
    console_settled,
    ensure_private_dir,
    kill_pid,
    pid_is_ours,
    spawn,
)
from moorage.sandbox.qmp import QMPClient, QMPError

if TYPE_CHECKING:
    from moorage.sandbox.microvm_sandbox import MicroVMSandbox

log = get_logger("moorage.sandbox.microvm_sandbox")

COLD_BOOT_TIMEOUT_S = 90.0
WAKE_TIMEOUT_S = 30.0
#: How long a sleep waits for QEMU to quit (closing its disk cleanly) before it kills it.
QUIT_WAIT_S = 5.0
#: Which sandbox object holds the (single-client) QEMU sockets of a sandbox directory in this process.
_ATTACHED: "weakref.WeakValueDictionary[str, MicroVMSandbox]" = weakref.WeakValueDictionary()


class BootError(SandboxError):
    """The guest did not come up; the message carries the tail of its console and QEMU's log."""

    code = "sandbox-boot"


class QemuProcess:
    """``MicroVMSandbox``'s QEMU process and guest channel (it holds the state they use: the process, QMP client,
    channel, network, lock, directory and meta)."""

    async def _launch(self, incoming: bool, paused: bool = False) -> None:
        ensure_private_dir(self.run_dir)
        for s in ("qmp.sock", "chan.sock"):
            (self.run_dir / s).unlink(missing_ok=True)
        paths = self._paths()
        if self.ram_mode == "delta" and os.geteuid() == 0 and not microvm_memfd.ready(self._ram_path()):
            # A fork's QEMU maps its template's RAM from a sealed memfd: the first launch in this process copies
            # the file into it, off the event loop (later ones find it made, without a thread hop per wake).
            await asyncio.to_thread(microvm_memfd.sealed_ram, self._ram_path())
        if self._net is not None:
            self._net.close()
            self._net = None
        if self._vm_config().nic:
            self._net = await asyncio.to_thread(microvm_net.VMNetwork.create)
        try:
            self._proc = spawn(self._argv(incoming, paused), self.dir / "qemu.log",
                               pass_fds=(self._net.tap_fd,) if self._net is not None and self._net.tap_fd is not None else ())
        finally:
            if self._net is not None:
                self._net.release_tap()  # QEMU holds its own; the tap goes when QEMU does
        (self.dir / "qemu.pid").write_text(str(self._proc.pid))
        self._meta["pid"] = self._proc.pid
        deadline = time.monotonic() + 10
        while not paths.qmp_sock.exists():
            if self._proc.poll() is not None:
                raise killed_by_full_disk(self._proc.returncode, self.dir) or \
                    BootError(f"QEMU exited at start (code {self._proc.returncode}): {self._log_tail()}", hint="check qemu.log in the sandbox directory")
            if time.monotonic() > deadline:
                raise BootError("QEMU did not create its monitor socket within 10 s", hint="the host may be overloaded")
            await asyncio.sleep(0.002)
        self._qmp = await QMPClient.connect(str(paths.qmp_sock))
        self._watch_qmp(self._qmp)
        _ATTACHED[str(self.dir)] = self

    def _log_tail(self) -> str:
        if self._proc is not None and self._proc.poll() is not None:
            console_settled(console_pipe(self.dir / "console.log"))  # its last lines, read in the reader's batch
        out = []
        for name in ("qemu.log", "console.log"):
            try:
                text = (self.dir / name).read_text(errors="replace").strip()
            except OSError:
                continue
            if text:
                out.append(f"{name}: ...{text[-600:]}")
        return " | ".join(out) or "no output"

    async def _connect_channel(self, timeout: float, first: Callable[[], tuple[str, dict[str, Any]]] | None = None) -> Any:
        """Connect to the guest's port and wait for its first answer: to ``ping``, or to the call ``first()`` makes.

        A wake makes its first call the after-wake fix-up itself, so the first reply also means the guest's clock
        (and a fork's random generator) are right: one round trip to a cold guest instead of two. ``first`` is
        called again for each attempt (the clock it sends must be current). An error answer is not retried.
        """
        deadline = time.monotonic() + timeout
        path = str(self._paths().chan_sock)
        last: Exception | None = None
        attempt = 0  # short first timeouts: a call sent before the guest reads is retried soon, not after 2 s
        while time.monotonic() < deadline:
            if self._proc is not None and self._proc.poll() is not None:
                raise killed_by_full_disk(self._proc.returncode, self.dir) or \
                    BootError(f"QEMU exited (code {self._proc.returncode}) before the guest answered: {self._log_tail()}")
            try:
                if self._channel is None or self._channel.closed:
                    # The guest's end of the port may still remember request ids of a connection from before a
                    # sleep (it cannot see a disconnect while frozen); start this session's ids where none can clash.
                    self._channel = await Channel.open_unix(path, name=f"microvm:{self.id}",
                                                            first_id=secrets.randbelow(1 << 40) + (1 << 20),
                                                            max_guest_inflight=self._driver.config.guest_calls_per_channel)
                    channel = self._channel
                    channel.on_protocol_error = lambda: self._protocol_broken(channel)
                    channel.why_closed = lambda: self._qemu_exited(channel)
                    microvm_net.bind_channel(channel, self._net)
                wait = min(0.25 * (2 ** attempt), 2.0, max(deadline - time.monotonic(), 0.1))
                method, params = first() if first is not None else ("ping", {})
                return await self._channel.call(method, params, timeout=wait)
            except RemoteError:
                raise
            except ChannelError as e:
                last = e
                attempt += 1
                await asyncio.sleep(0.01)
        raise BootError(f"guest of sandbox {self.id} did not answer within {timeout:.0f} s ({last}): {self._log_tail()}", hint="destroy the sandbox or check the image (`moorage image build`)")

    async def _reconnect(self, accept: Callable[[dict[str, Any]], bool], timeout: float = COLD_BOOT_TIMEOUT_S) -> None:
        """A new channel to the guest, kept once its answer to ``ping`` is one ``accept`` takes (a new supervisor's,
        after ``sys.restart``; until then the old one may still answer)."""
        deadline = time.monotonic() + timeout
        while True:
            if self._channel is not None:
                await self._channel.close("connecting to the guest again")
                self._channel = None
            if accept(await self._connect_channel(max(deadline - time.monotonic(), 0.1))):
                return
            if time.monotonic() > deadline:
                raise BootError(f"the guest of sandbox {self.id} did not restart within {timeout:.0f} s: "
                                f"{self._log_tail()}")
            await asyncio.sleep(0.02)

    def _qemu_exited(self, channel: Channel) -> str | None:
        """The channel's socket closed under a running guest with no verb of the host's in progress: its QEMU died by
        itself (killed from outside, crashed). Marked stopped at once, as a process sandbox whose processes ended
        is, so the next turn boots it from its disk (before, every turn failed until it slept). QEMU closes the
        socket as it exits, a moment before its process can be reaped (on a loaded host that moment outlasted a
        0.1 s wait): it is not waited for here, on the event loop; it is killed and reaped under the lock
        (``_stop_now``). Only QEMU closes that socket (its guest closing its port does not), so nothing else is
        taken for a death."""
        if self._channel is not channel or self.state is not SandboxState.RUNNING:
            return None
        if self._lock.locked():  # a verb in progress (a checkpoint after a turn): looked at again once it is done
            asyncio.get_running_loop().create_task(self._stopped_after_verb(channel), name=f"qemu-exited-{self.id}")
            return None
        return self._mark_qemu_exited(channel)

    def _mark_qemu_exited(self, channel: Channel) -> str:
        code = self._proc.poll() if self._proc is not None else None
        log.warning("the micro-VM's QEMU exited by itself; its next wake boots it from its disk", sandbox=self.id,
                    code=code)
        self._stop_now(channel)
        return "the micro-VM's QEMU exited" + (f" (code {code})" if code is not None else "")

    async def _stopped_after_verb(self, channel: Channel) -> None:
        async with self._lock:
            if self._channel is channel and self.state is SandboxState.RUNNING:
                self._mark_qemu_exited(channel)

    def _protocol_broken(self, channel: Channel) -> None:
        """A guest that broke the channel protocol is stopped at once (disk kept, memory dropped), not trusted with
        a reconnect; the next wake cold-boots it."""
        if self._channel is not channel or self.state is not SandboxState.RUNNING:
            return
        log.warning("guest broke the channel protocol; stopping it", sandbox=self.id, error=str(channel.protocol_error))
        self._stop_now(channel)

    def _stop_now(self, channel: Channel) -> None:
        """Mark the sandbox stopped before any other task sees it running, and kill its QEMU without waiting on the
        event loop (ours unless reaped already, whose pid may be another process's; a re-adopted one while its pid
        is still this sandbox's QEMU). What is left is torn down under the lock (a wake meanwhile does it itself)."""
        pid = self.pid
        with contextlib.suppress(ProcessLookupError):
            if self._proc is not None:
                self._proc.kill()  # signals nothing once reaped
            elif pid and pid_is_ours(pid, str(self.run_dir)):
                os.kill(pid, 9)
        self._set_state(SandboxState.STOPPED, snapshot=None)
        asyncio.get_running_loop().create_task(self._reap_stopped(channel), name=f"reap-stopped-{self.id}")

    async def _reap_stopped(self, channel: Channel) -> None:
        async with self._lock:
            if self._channel is channel:  # not woken meanwhile (a cold boot tears down what is left itself)
                await self._teardown()
                self._save_meta()

    async def _teardown(self, *, quit: bool = False) -> None:
        """Kill QEMU, wait until it is gone, and drop connections (no snapshot). ``quit``: ask QEMU to exit instead
        and wait for it (``QUIT_WAIT_S``), so it closes its disk cleanly; killed if it does not."""
        self._prepared = False
        self._disk_full = False  # a paused guest goes with its QEMU
        if self._channel is not None:
            await self._channel.close("sandbox stopped")
            self._channel = None
        if quit and self._qmp is not None and self._proc is not None and self._proc.poll() is None:
            proc = self._proc
            with contextlib.suppress(QMPError):
                await self._qmp.execute("quit", timeout=QUIT_WAIT_S)
            try:
                await asyncio.to_thread(proc.wait, QUIT_WAIT_S)
            except subprocess.TimeoutExpired:
                log.warning("QEMU did not quit; killing it (its disk is repaired when next opened)", sandbox=self.id)
        if self._qmp is not None:
            await self._qmp.close()
            self._qmp = None
        pid = self._meta.get("pid")
        if self._proc is not None and self._proc.poll() is not None:
            pass  # exited (and reaped): its pid may already be another process's
        elif pid and (self._proc is not None or pid_is_ours(pid, str(self.run_dir))):
            kill_pid(pid, self._proc)
        self._proc = None
        console_release(console_pipe(self.dir / "console.log"), stop=False)  # its reader ends with QEMU's output
        if self._net is not None:
            self._net.close()
            self._net = None
        self._meta["pid"] = None
        (self.dir / "qemu.pid").unlink(missing_ok=True)
        for s in ("qmp.sock", "chan.sock"):
            (self.run_dir / s).unlink(missing_ok=True)

    async def _reattach(self) -> bool:
        """After a host restart: connect to a still-running QEMU of this sandbox."""
        pid = self._meta.get("pid")
        if not pid or not pid_is_ours(pid, str(self.run_dir)):
            return False
        # QEMU's monitor and channel sockets take one client each. A previous driver instance in this process
        # (the host before a restart, in tests and in-process reloads) gives its connections up, as a dead
        # process's would be.
        previous = _ATTACHED.get(str(self.dir))
        if previous is not None and previous is not self:
            await previous._detach()
        try:
            self._qmp = await QMPClient.connect(str(self._paths().qmp_sock))
            self._watch_qmp(self._qmp)
            _ATTACHED[str(self.dir)] = self
            if not console_reattach(console_pipe(self.dir / "console.log"), pid, str(self.run_dir)):
                log.warning("re-attached without its console log", sandbox=self.id)
            if self._vm_config().nic and self._net is None:
                try:  # its namespace outlived the host process through QEMU's tap: serve the gateway there again
                    self._net = await asyncio.to_thread(microvm_net.recover, pid)
                except microvm_net.NicUnavailable as e:
                    log.warning("re-attached without its network until its next wake", sandbox=self.id, error=str(e))
            status = await self._qmp.execute("query-status")
            if not status.get("running"):
                await self._qmp.execute("cont")
            await self._connect_channel(WAKE_TIMEOUT_S)
            return True
        except (QMPError, BootError) as e:
            log.warning("re-attach failed, killing QEMU", sandbox=self.id, error=str(e))
            await self._teardown()
            return False

    async def _detach(self) -> None:
        if _ATTACHED.get(str(self.dir)) is self:
            del _ATTACHED[str(self.dir)]
        if self._channel is not None:
            await self._channel.close("driver closed")
            self._channel = None
        if self._qmp is not None:
            await self._qmp.close()
            self._qmp = None
        # QEMU runs on: whoever re-attaches reads its console (until then what the guest prints there is dropped).
        console_release(console_pipe(self.dir / "console.log"))
        if self._net is not None:  # QEMU keeps its tap; whoever re-attaches finds the namespace through it
            self._net.close()
            self._net = None
