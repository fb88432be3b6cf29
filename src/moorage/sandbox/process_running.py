"""A running process sandbox (a part of ``ProcessSandbox``): watched (its disk quota, a guest that breaks the
channel protocol), its DNS address, stopped (shut down or killed), and re-adopted after a host restart."""

from __future__ import annotations

import asyncio
import os
import subprocess
import time

from moorage.log import get_logger
from moorage.sandbox import process_checkpoints, process_net
from moorage.sandbox import process_limits as limits
from moorage.sandbox.base import ChannelError, SandboxError, SandboxState
from moorage.sandbox.channel import Channel
from moorage.sandbox.process_fs import disk_usage
from moorage.sandbox.process_launch import STOP_TIMEOUT_S, is_guest

log = get_logger("moorage.sandbox.process_sandbox")


class RunningGuest:
    """``ProcessSandbox``'s watch over its running guest and its stop (it holds the state this uses: the process,
    channel, zygote, DNS, watchdog, cgroup, lock and meta)."""

    def _start_watchdog(self) -> None:
        if self._watchdog is None or self._watchdog.done():
            self._watchdog = asyncio.get_running_loop().create_task(self._quota_watchdog(), name=f"quota-{self.id}")
        channel = self._channel
        if channel is not None:
            channel.on_protocol_error = lambda: self._protocol_broken(channel)
            oom_kills = self.cgroup.oom_kills()  # those before this channel are not why it closes
            channel.why_closed = lambda: self._guest_closed(channel, oom_kills)

    def _guest_closed(self, channel: Channel, oom_kills_before: int) -> str | None:
        """The guest closed its channel: its supervisor ended (an exit in the agent's code, the cgroup's OOM killer),
        which ends the sandbox. Taken as stopped now (as ``state`` would once its processes are gone), so the next
        turn starts it instead of finding it "running" with a closed channel while they exit. Returns why, where
        known: the kernel counts an OOM kill before it sends the signal, so the count is there once it closes."""
        why = None
        if self.cgroup.oom_kills() > oom_kills_before:
            why = f"killed for memory (memory_mib = {self.spec.memory_mib})"
        if self._channel is channel and self._state is SandboxState.RUNNING:
            if self._pid is not None and self._alive():
                try:
                    os.killpg(self._pid, 9)  # ending already (its zygote follows its supervisor): not waited for
                except (ProcessLookupError, PermissionError):
                    pass
            self._state = SandboxState.STOPPED
        return why

    def _protocol_broken(self, channel: Channel) -> None:
        """A guest that broke the channel protocol is stopped at once (its disk kept), not trusted with a
        reconnect: killed and marked stopped before any other task sees it running; the next turn starts it
        afresh. Reaping and cgroup removal follow under the lock."""
        if self._channel is not channel or self._state is not SandboxState.RUNNING:
            return
        log.warning("guest broke the channel protocol; stopping it", sandbox=self.id, error=str(channel.protocol_error))
        if self._pid is not None:
            victims = limits.descendants(self._pid)
            try:
                os.killpg(self._pid, 9)
            except (ProcessLookupError, PermissionError):
                pass
            limits.kill_pids(victims)
        self._state = SandboxState.STOPPED
        self._save(pid=None, pid_starttime=None)
        asyncio.get_running_loop().create_task(self._reap_after_protocol_error(channel), name=f"reap-{self.id}")

    async def _reap_after_protocol_error(self, channel: Channel) -> None:
        async with self._lock:
            if self._channel is channel:  # not restarted meanwhile
                await self._kill()

    async def _quota_watchdog(self) -> None:
        """Disk quota check: a layer grown past ``disk_mib`` gets every process but the supervisor killed.

        There is no block-level quota on a plain directory, so this polls; the poll interval adapts to the cost
        of a scan so large layers do not burn CPU. RLIMIT_FSIZE bounds any single file in between.
        """
        quota = self.spec.disk_mib << 20
        loop = asyncio.get_running_loop()
        last = 0
        strikes = orphan_growth = 0
        try:
            while self._state is SandboxState.RUNNING and self._alive():
                t0 = time.monotonic()
                used = await loop.run_in_executor(None, disk_usage, self.layer)
                cost = time.monotonic() - t0
                # Kill only while usage grows past the quota, so removing files (even with rm) stays possible.
                if used > quota and used > last:
                    self.quota_exceeded = True
                    victims = self._guest_workers()
                    strikes += 1
                    orphan_growth = 0 if victims else orphan_growth + 1
                    if orphan_growth > 1 or strikes > 3:
                        # Still growing with no worker left to blame: the writer is the supervisor itself (agent
                        # code runs there). The whole sandbox stops; its disk stays as it is.
                        log.warning("disk quota exceeded by the supervisor; stopping the sandbox", sandbox=self.id,
                                    used=used, quota=quota)
                        loop.create_task(self._stop_over_quota())
                        return
                    limits.kill_pids(victims)
                    log.warning("disk quota exceeded; killed sandbox processes", sandbox=self.id, used=used, quota=quota,
                                killed=len(victims))
                else:
                    strikes = orphan_growth = 0
                last = used
                # Past half the quota the checks come ten times as often: a writer on a fast disk moves hundreds
                # of MiB between two checks 0.2 s apart, and the overshoot is what it writes between them.
                floor = 0.02 if used > quota // 2 else 0.2
                await asyncio.sleep(min(max(cost * 20, floor), 5.0))
        except asyncio.CancelledError:
            pass

    async def _stop_over_quota(self) -> None:
        async with self._lock:
            if self._state is SandboxState.RUNNING:
                # Stopped before the kill: the turn it fails ends when the kill closes the channel, and the next
                # turn must find a stopped sandbox to restart (after this lock), not a running one being killed.
                self._state = SandboxState.STOPPED
                await self._kill()
                self._save(pid=None, pid_starttime=None)

    def _guest_workers(self) -> list[int]:
        """Host pids of everything the supervisor started (its descendants), not bwrap and not the supervisor."""
        if self._pid is None:
            return []
        for pid in limits.descendants(self._pid):
            if is_guest(pid):
                # The first guest process is the zygote; the supervisor is its guest child (none while a
                # rollback restarts it).
                sup = next((c for c in limits.descendants(pid) if is_guest(c)), None)
                return limits.descendants(sup) if sup is not None else []
        return []

    async def _let_go(self) -> None:
        """Stop watching the guest and drop the channel to it (its processes are the caller's to end)."""
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        if self._channel is not None:
            await self._channel.close()
            self._channel = None

    def _serve_dns(self) -> None:
        """A network agent's sandbox: its DNS address bound (once per start) and offered with the new channel
        (``runtime/vm_network`` serves it when it attaches the agent's network)."""
        if not process_net.wanted(self.spec.env) or self._pid is None:
            return
        try:
            if self._dns is None:
                root = self._pid
                inside = next((p for p in limits.descendants(root) if is_guest(p)), None)
                self._dns = None if inside is None else \
                    process_net.bind(inside, still_ours=lambda: inside in limits.descendants(root))
            process_net.bind_channel(self._channel, self._dns)
        except Exception as e:  # noqa: BLE001 - a sandbox without its DNS still starts (its tools use the proxy)
            log.warning("sandbox DNS not bound", sandbox=self.id, error=str(e)[:200])

    def _drop_dns(self) -> None:
        if self._dns is not None:
            self._dns.close()
            self._dns = None

    async def _kill(self) -> None:
        if self._zygote is not None:
            self._zygote.close()
            self._zygote = None
        self._drop_dns()
        await self._let_go()
        if self._pid is not None and self._alive():
            try:
                os.killpg(self._pid, 9)  # the wrapper started a session: its group is the whole sandbox tree
            except (ProcessLookupError, PermissionError):
                pass
        limits.kill_pids(limits.descendants(self._pid) if self._pid else [])
        if self._proc is not None:
            try:
                await asyncio.get_running_loop().run_in_executor(None, self._proc.wait, STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                log.warning("sandbox process did not exit after SIGKILL", sandbox=self.id, pid=self._pid)
        else:
            deadline = time.monotonic() + STOP_TIMEOUT_S
            while self._alive() and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
        self.cgroup.remove()
        self._proc = None

    async def _shutdown(self) -> None:
        """Flush the guest's files, ask the supervisor to exit, then make sure nothing is left running."""
        if self._channel is not None and not self._channel.closed and self._alive():
            self._channel.why_closed = None  # its supervisor ends because it is asked to (``_guest_closed``)
            try:
                await self._channel.call("sys.sync", timeout=30)
                await self._channel.call("sys.shutdown", timeout=5)
            except ChannelError as e:
                log.warning("guest did not shut down cleanly; killing", sandbox=self.id, error=str(e))
        await self._kill()

    async def _adopt(self) -> None:
        """After a host restart: re-attach to a live supervisor, or record that it is gone. Checkpoint copies the
        host's crash left half made go first."""
        await asyncio.to_thread(process_checkpoints.sweep_unfinished, self.dir)
        if self._state is not SandboxState.RUNNING:
            return
        if self._alive():
            try:
                self._channel = await self._connect(10.0)
                self._serve_dns()
                self._start_watchdog()
                log.info("sandbox re-attached", sandbox=self.id, pid=self._pid)
                return
            except SandboxError as e:
                log.warning("live sandbox did not answer; stopping it", sandbox=self.id, error=str(e))
                await self._kill()
        else:
            # It died with its host: nothing of it runs, but its cgroup was never removed (the host that
            # would have removed it is gone). Removed now; the next boot makes a new one.
            self.cgroup.remove()
        self._state = SandboxState.STOPPED
        self._save(pid=None, pid_starttime=None)
