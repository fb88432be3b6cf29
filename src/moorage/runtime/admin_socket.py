"""The running host's local admin socket, ``<data_dir>/admin.sock``: operator requests only a local process of the
data directory's owner can make (an online backup writes a path of this machine's disk, so it is not an HTTP route).

One JSON line in (``{"op": "backup", "dest": "/abs/path"}``), JSON lines out: progress events, then one ``done``
or ``error`` line. A client that goes away stops the request (a backup then stays marked incomplete).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import struct
from pathlib import Path
from typing import Any

from moorage.errors import ConflictError, InvalidInput, MoorageError, TenantScopeError
from moorage.log import get_logger

log = get_logger(__name__)

SOCKET_NAME = "admin.sock"
#: The longest path a unix socket can be bound at (``sun_path``, its NUL included).
MAX_PATH = 107


def socket_path(data_dir: Path) -> Path:
    return Path(data_dir) / SOCKET_NAME


class AdminSocket:
    """Serves the admin socket of one host while ``moorage up`` runs."""

    def __init__(self, host: Any) -> None:
        self.host = host
        self.path = socket_path(host.config.data_dir)
        self._server: asyncio.AbstractServer | None = None
        self._backup: asyncio.Lock = asyncio.Lock()
        #: The request running a backup, cancelled if the host stops first (the backup stays marked incomplete).
        self._running: asyncio.Task[Any] | None = None

    async def start(self) -> bool:
        """Listen; False (and a warning) where the data directory's path is too long for a socket."""
        if len(os.fsencode(self.path)) > MAX_PATH:
            log.warning("the admin socket is not opened: the data directory's path is too long for a unix socket "
                        "(online backups are refused)", path=str(self.path))
            return False
        self.path.unlink(missing_ok=True)  # this process holds the data directory: one left here is a dead host's
        old = os.umask(0o077)
        try:
            self._server = await asyncio.start_unix_server(self._serve, path=str(self.path), limit=1 << 16)
        finally:
            os.umask(old)
        os.chmod(self.path, 0o600)
        return True

    def stop_backup(self) -> None:
        """The host is stopping (SIGTERM, Ctrl-C): a backup still running is stopped now, its copy left incomplete."""
        task = self._running
        if task is not None and not task.done() and not task.cancelling():
            log.warning("the host is stopping: the online backup in progress is stopped, its copy left incomplete")
            task.cancel()

    async def close(self) -> None:
        """Stop listening; a backup still running is stopped (its instances let go before the host sleeps them)."""
        task = self._running
        if task is not None and not task.done():
            self.stop_backup()
            with contextlib.suppress(BaseException):
                await task
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()
            self._server = None
            self.path.unlink(missing_ok=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async def send(event: dict[str, Any]) -> None:
            writer.write(json.dumps(event).encode() + b"\n")
            await writer.drain()

        try:
            self._check_peer(writer)
            try:
                req = json.loads(await reader.readline())
            except ValueError:
                raise InvalidInput("the admin socket takes one JSON object per line") from None
            if not isinstance(req, dict) or req.get("op") != "backup" or not isinstance(req.get("dest"), str):
                raise InvalidInput("unknown admin request", hint='send {"op": "backup", "dest": "/absolute/path"}')
            await send(await self._run_backup(Path(req["dest"]), send))
        except MoorageError as e:
            with contextlib.suppress(Exception):
                await send({"event": "error", "code": e.code, "message": e.message, "hint": e.hint})
        except (ConnectionError, asyncio.IncompleteReadError):
            log.warning("the admin socket's client went away; its request stopped")
        except Exception as e:  # noqa: BLE001 - the host keeps serving whatever one request hit
            log.exception("admin request failed")
            with contextlib.suppress(Exception):
                await send({"event": "error", "code": "internal", "message": f"{type(e).__name__}: {e}",
                            "hint": "see the host's log"})
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _run_backup(self, dest: Path, send: Any) -> dict[str, Any]:
        from moorage.runtime.backup import OnlineBackup

        if self._backup.locked():
            raise ConflictError("an online backup of this host is already running",
                                hint="wait for it to finish, then take another")
        runtime = self.host.runtime
        if runtime.deleting_tenants:  # it removes a tenant's store and instances the backup would copy
            raise ConflictError(f"tenant {sorted(runtime.deleting_tenants)[0]} is being deleted on this host",
                                hint="take the backup once the delete is done")
        async with self._backup:
            self._running = asyncio.current_task()
            runtime.backing_up = True
            try:
                return await OnlineBackup(self.host, dest, send).run()
            finally:
                runtime.backing_up = False
                self._running = None

    @staticmethod
    def _check_peer(writer: asyncio.StreamWriter) -> None:
        """Only the data directory's owner (or root) may ask: the socket's mode says so too."""
        sock = writer.get_extra_info("socket")
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        _, uid, _ = struct.unpack("3i", raw)
        if uid not in (os.getuid(), 0):
            raise TenantScopeError(f"uid {uid} may not use this host's admin socket",
                                   hint="run the command as the user moorage up runs as")
