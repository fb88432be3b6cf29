"""A small async client for QEMU's QMP monitor on a unix socket: commands, events and file-descriptor passing.

One ``QMPClient`` per QEMU process; commands are serialised (QMP answers in order) and events are queued.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
from pathlib import Path
from typing import Any, AsyncIterator, Callable

from moorage.aio import within
from moorage.log import get_logger
from moorage.sandbox.base import SandboxError

log = get_logger(__name__)


class QMPError(SandboxError):
    """QEMU refused a monitor command, or the monitor connection failed."""

    code = "sandbox-qmp"

    def __init__(self, message: str, *, qmp_class: str = "", hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.qmp_class = qmp_class


class QMPClient:
    """Connected QMP session. Use ``await QMPClient.connect(path)``; ``close()`` when done."""

    def __init__(self, sock: socket.socket, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._sock = sock
        self._reader = reader
        self._writer = writer
        self._lock = asyncio.Lock()
        self._events: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._waiter: asyncio.Future[dict[str, Any]] | None = None
        self._reader_task: asyncio.Task[None] | None = None
        self._closed = False
        self.greeting: dict[str, Any] = {}
        #: Called with every event as it arrives (besides queueing it for ``next_event``); must not block.
        self.on_event: Callable[[dict[str, Any]], None] | None = None
        #: fd sets removed while the guest was paused: QEMU 7.2 closes a removed descriptor only while the guest
        #: runs, so they are removed again after the next ``cont`` (else each checkpoint would leave one open).
        self._removed_while_paused: set[int] = set()

    @classmethod
    async def connect(cls, path: str, *, timeout: float = 10.0) -> "QMPClient":
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        loop = asyncio.get_running_loop()
        dir_fd = None
        target = path
        if len(os.fsencode(path)) > 100:
            # sun_path holds ~107 bytes; reach a deeper socket through its directory's descriptor instead.
            dir_fd = os.open(os.path.dirname(path) or ".", os.O_PATH | os.O_DIRECTORY)
            target = f"/proc/self/fd/{dir_fd}/{os.path.basename(path)}"
        try:
            deadline = loop.time() + timeout
            while True:
                try:
                    await within(loop.sock_connect(sock, target), timeout)
                    break
                except ConnectionRefusedError:
                    # QEMU binds the socket a moment before it listens on it.
                    if loop.time() > deadline:
                        raise
                    await asyncio.sleep(0.002)
            reader, writer = await asyncio.open_unix_connection(sock=sock, limit=16 << 20)
        except (OSError, asyncio.TimeoutError) as e:
            sock.close()
            raise QMPError(f"cannot connect to the QEMU monitor at {path}: {e}", hint="is the QEMU process still running?") from e
        finally:
            if dir_fd is not None:
                os.close(dir_fd)
        client = cls(sock, reader, writer)
        try:
            try:
                line = await within(reader.readline(), timeout)
            except (OSError, ConnectionError):
                line = b""
            if not line:
                # A socket the host bound for QEMU accepts connections before QEMU runs; one that dies at start
                # closes it (the host then finds out why from QEMU's log).
                raise QMPError(f"the QEMU monitor at {path} closed before greeting", hint="the QEMU process exited at start; see qemu.log")
            greeting = json.loads(line)
            if "QMP" not in greeting:
                raise QMPError(f"unexpected QMP greeting: {greeting!r}")
            client.greeting = greeting["QMP"]
            client._reader_task = asyncio.create_task(client._read_loop(), name=f"qmp:{path}")
            await client.execute("qmp_capabilities", timeout=timeout)
        except asyncio.TimeoutError as e:
            await client.close()
            raise QMPError(f"the QEMU monitor at {path} did not greet within {timeout:.0f} s", hint="another process may hold the monitor connection") from e
        except BaseException:
            await client.close()
            raise
        return client

    @property
    def qemu_version(self) -> str:
        v = self.greeting.get("version", {}).get("qemu", {})
        return f"{v.get('major')}.{v.get('minor')}.{v.get('micro')}"

    async def execute(self, command: str, arguments: dict[str, Any] | None = None, *, timeout: float = 30.0, fds: list[int] | None = None) -> Any:
        """Run one command and return its ``return`` value; ``fds`` are sent with it (for ``getfd``/``add-fd``)."""
        msg: dict[str, Any] = {"execute": command}
        if arguments:
            msg["arguments"] = arguments
        data = (json.dumps(msg) + "\n").encode()
        async with self._lock:
            if self._closed:
                raise QMPError(f"QMP connection closed; cannot run {command}", hint="the QEMU process has exited")
            loop = asyncio.get_running_loop()
            self._waiter = loop.create_future()
            try:
                if fds:
                    # SCM_RIGHTS must ride on the command's own bytes; the stream buffer is empty between commands.
                    await self._writer.drain()
                    socket.send_fds(self._sock, [data], fds)  # a few bytes: never blocks on an empty socket buffer
                else:
                    self._writer.write(data)
                    await self._writer.drain()
                async with asyncio.timeout(timeout):  # not wait_for: in 3.11 it drops a cancel that comes with the reply
                    reply = await self._waiter
            except TimeoutError as e:
                raise QMPError(f"QEMU did not answer {command} within {timeout:.0f} s", hint="the QEMU process may be hung; destroy and wake the sandbox") from e
            except (OSError, ConnectionError) as e:
                raise QMPError(f"QMP connection failed during {command}: {e}") from e
            finally:
                self._waiter = None
        if "error" in reply:
            err = reply["error"]
            raise QMPError(f"QEMU refused {command}: {err.get('desc')}", qmp_class=err.get("class", ""))
        if command == "cont" and self._removed_while_paused:
            await self._close_removed_fdsets()
        return reply.get("return")

    async def _close_removed_fdsets(self) -> None:
        """Remove again, now that the guest runs, the fd sets removed while it was paused; QEMU then closes them."""
        for fdset in sorted(self._removed_while_paused):
            try:
                await self.execute("remove-fd", {"fdset-id": fdset})
            except QMPError:
                pass  # gone already
        try:
            left = {s["fdset-id"] for s in await self.execute("query-fdsets")}
        except QMPError:
            return
        self._removed_while_paused &= left

    async def add_fd(self, fd: int, opaque: str = "") -> int:
        """Hand QEMU a copy of ``fd`` in a new fd set (``add-fd``); it opens it as ``/dev/fdset/<id>``. Returns the
        set's id; ``remove-fd`` it when done (QEMU keeps it until then)."""
        args: dict[str, Any] = {"opaque": opaque} if opaque else {}
        reply = await self.execute("add-fd", args, fds=[fd])
        return int(reply["fdset-id"])

    @contextlib.asynccontextmanager
    async def passed_file(self, path: Path, flags: int = os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode: int = 0o600) -> AsyncIterator[str]:
        """``path`` opened here (by the host, with its rights) and handed to QEMU for the block: yields the name
        QEMU opens it by (``/dev/fdset/N``). A QEMU running as an unprivileged uid never needs to reach the path."""
        fd = os.open(path, flags | os.O_CLOEXEC, mode)
        try:
            fdset = await self.add_fd(fd, str(path))
        finally:
            os.close(fd)
        try:
            yield f"/dev/fdset/{fdset}"
        finally:
            with contextlib.suppress(QMPError):
                await self.execute("remove-fd", {"fdset-id": fdset})
                self._removed_while_paused.add(fdset)  # closed at once if the guest runs; else after ``cont``

    async def save_device_state(self, path: Path, *, timeout: float = 30.0) -> None:
        """``xen-save-devices-state`` of a paused guest into ``path`` (created 0600 by the host, passed by descriptor)."""
        async with self.passed_file(path) as name:
            await self.execute("xen-save-devices-state", {"filename": name, "live": False}, timeout=timeout)

    async def next_event(self, name: str | None = None, *, timeout: float = 30.0) -> dict[str, Any]:
        """Wait for the next event (named ``name`` if given), dropping others."""
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            left = deadline - asyncio.get_running_loop().time()
            try:
                ev = await within(self._events.get(), max(left, 0.001))
            except asyncio.TimeoutError as e:
                raise QMPError(f"no QMP event {name or ''} within {timeout:.0f} s") from e
            if name is None or ev.get("event") == name:
                return ev

    def drain_events(self) -> list[dict[str, Any]]:
        out = []
        while not self._events.empty():
            out.append(self._events.get_nowait())
        return out

    async def _read_loop(self) -> None:
        try:
            while True:
                line = await self._reader.readline()
                if not line:
                    break
                try:
                    msg = json.loads(line)
                except json.JSONDecodeError:
                    log.warning("qmp: malformed line", line=line[:200])
                    continue
                if "event" in msg:
                    self._events.put_nowait(msg)
                    if self.on_event is not None:
                        try:
                            self.on_event(msg)
                        except Exception:  # noqa: BLE001 - a listener's failure must not end the monitor session
                            log.exception("qmp: event listener failed", qmp_event=msg.get("event"))
                elif self._waiter is not None and not self._waiter.done():
                    self._waiter.set_result(msg)
        except (OSError, ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self._closed = True
            if self._waiter is not None and not self._waiter.done():
                self._waiter.set_exception(QMPError("QEMU closed the monitor connection", hint="the QEMU process exited"))

    @property
    def closed(self) -> bool:
        return self._closed

    async def close(self) -> None:
        self._closed = True
        if self._reader_task is not None:
            self._reader_task.cancel()
            try:
                await self._reader_task
            except (asyncio.CancelledError, Exception):
                pass
        try:
            self._writer.close()
        except Exception:
            pass
