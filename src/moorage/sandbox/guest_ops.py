"""The guest operations every sandbox has, implemented once over the channel because every driver runs the same
guest: ping, exec with streamed output, and files (read, atomic write, list, remove, stat)."""

from __future__ import annotations

import base64
import inspect
import time
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from moorage.sandbox.errors import ChannelTimeout, GuestFileNotFound, GuestFileTooLarge, GuestProtocolError, RemoteError
from moorage.sandbox.values import (
    _EXEC_GRACE_S,
    EXEC_CAPTURE_BYTES,
    FILE_CHUNK_BYTES,
    READ_FILE_MAX_BYTES,
    ExecResult,
    FileInfo,
    OutputCallback,
)

if TYPE_CHECKING:  # channel.py imports the errors; avoid the import cycle at runtime
    from moorage.sandbox.channel import Channel


class GuestOperations:
    """The guest operations of ``Sandbox`` (a mixin: the sandbox has ``id`` and its connected ``channel``)."""

    id: str
    channel: "Channel"

    async def ping(self, timeout: float = 10.0) -> dict[str, Any]:
        return await self.channel.call("ping", {}, timeout=timeout)

    async def exec(
        self,
        argv: Sequence[str],
        *,
        timeout: float = 60.0,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        stdin: bytes | None = None,
        on_output: OutputCallback | None = None,
    ) -> ExecResult:
        """Run ``argv`` in the guest. A timeout kills the process group and sets ``timed_out``; never raises for it."""
        if not argv or not all(isinstance(a, str) for a in argv):
            from moorage.errors import InvalidInput

            raise InvalidInput("exec needs a non-empty list of string arguments")
        params: dict[str, Any] = {"argv": list(argv), "timeout": timeout}
        if cwd is not None:
            params["cwd"] = cwd
        if env:
            params["env"] = dict(env)
        if stdin is not None:
            params["stdin"] = base64.b64encode(stdin).decode()
        out = {"stdout": bytearray(), "stderr": bytearray()}
        truncated = False
        started = time.monotonic()
        stream = self.channel.stream("exec", params, timeout=timeout + _EXEC_GRACE_S)
        try:
            async for ev in stream:
                if ev.event not in out:
                    continue
                chunk = base64.b64decode(ev.data)
                buf = out[ev.event]
                room = EXEC_CAPTURE_BYTES - len(buf)
                if len(chunk) > room:
                    truncated = True
                buf += chunk[: max(room, 0)]
                if on_output is not None:
                    r = on_output(ev.event, chunk)
                    if inspect.isawaitable(r):
                        await r
        except ChannelTimeout:
            # The guest did not report its own kill in time; the stream already sent $cancel.
            return ExecResult(-1, bytes(out["stdout"]), bytes(out["stderr"]), True, truncated, time.monotonic() - started)
        except RemoteError as e:
            from moorage.errors import InvalidInput
            from moorage.sandbox.channel import INVALID_PARAMS

            if e.rpc_code == INVALID_PARAMS:  # what the caller asked for cannot run (a cwd that is no directory)
                raise InvalidInput(str(e), hint="a relative cwd is taken in the sandbox's working directory") from None
            raise
        res = stream.result or {}
        return ExecResult(
            exit_code=int(res.get("exit_code", -1)),
            stdout=bytes(out["stdout"]),
            stderr=bytes(out["stderr"]),
            timed_out=bool(res.get("timed_out", False)),
            truncated=truncated or bool(res.get("truncated", False)),
            duration_s=time.monotonic() - started,
        )

    async def _fs(self, method: str, params: dict[str, Any]) -> Any:
        try:
            return await self.channel.call(method, params, timeout=60)
        except RemoteError as e:
            if isinstance(e.data, dict) and e.data.get("type") in ("FileNotFoundError", "NotADirectoryError"):
                raise GuestFileNotFound(f"{params.get('path')}: no such file in sandbox {self.id}") from e
            raise

    async def read_file(self, path: str, *, max_bytes: int = READ_FILE_MAX_BYTES) -> bytes:
        """The whole file, up to ``max_bytes``: the guest decides when a file ends, so the host bounds it."""
        data = bytearray()
        while True:
            want = min(FILE_CHUNK_BYTES, max_bytes + 1 - len(data))
            r = await self._fs("fs.read", {"path": path, "offset": len(data), "length": want})
            if not isinstance(r, dict) or not isinstance(r.get("data"), str) or len(r["data"]) > (want + 2) // 3 * 4:
                raise GuestProtocolError(f"sandbox {self.id} answered fs.read of {path} with more than it was asked for",
                                         hint="the guest may be compromised; destroy it or roll it back")
            try:
                chunk = base64.b64decode(r["data"], validate=True)
            except ValueError as e:
                raise GuestProtocolError(f"sandbox {self.id} sent invalid base64 for {path}: {e}") from e
            data += chunk
            if len(data) > max_bytes:
                raise GuestFileTooLarge(
                    f"{path} in sandbox {self.id} is larger than {max_bytes} bytes (or never ends)",
                    hint="read it in parts with exec (e.g. head -c) or raise max_bytes",
                )
            if r.get("eof") or not chunk:
                return bytes(data)

    async def write_file(self, path: str, data: bytes, mode: int = 0o644) -> None:
        """Write atomically: chunks go to a temporary file that is renamed over ``path`` at the end."""
        if len(data) <= FILE_CHUNK_BYTES:
            await self.channel.call(
                "fs.write", {"path": path, "data": base64.b64encode(data).decode(), "mode": mode, "atomic": True}, timeout=60
            )
            return
        part = f"{path}.moorage-part"
        for off in range(0, len(data), FILE_CHUNK_BYTES):
            chunk = data[off : off + FILE_CHUNK_BYTES]
            await self.channel.call(
                "fs.write",
                {"path": part, "data": base64.b64encode(chunk).decode(), "mode": mode, "append": off > 0},
                timeout=60,
            )
        await self.channel.call("fs.rename", {"src": part, "dst": path}, timeout=60)

    async def list_files(self, path: str) -> list[FileInfo]:
        r = await self._fs("fs.list", {"path": path})
        return [FileInfo(**e) for e in r["entries"]]

    async def remove(self, path: str, *, recursive: bool = False) -> None:
        """Delete a file (or a directory tree with ``recursive``), done by the supervisor, not a guest process."""
        await self._fs("fs.remove", {"path": path, "recursive": recursive})

    async def stat(self, path: str) -> FileInfo | None:
        r = await self.channel.call("fs.stat", {"path": path}, timeout=60)
        return FileInfo(**r["info"]) if r.get("info") else None
