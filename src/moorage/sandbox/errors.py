"""The sandbox interface's typed errors: a sandbox missing or in the wrong state, snapshots that cannot be restored,
the channel failing (closed, timed out, a malformed frame, an error answer) and guest files not found or too large."""

from __future__ import annotations

from typing import Any

from moorage.errors import MoorageError, NotFound


class SandboxError(MoorageError):
    """Something went wrong operating a sandbox (the host is fine; the sandbox may need a restart)."""

    code = "sandbox"
    http_status = 500


class SandboxNotFound(SandboxError, NotFound):
    code = "sandbox-not-found"
    http_status = 404


class SandboxStateError(SandboxError):
    """The verb is not allowed in the sandbox's current state; the hint says which verb to call first."""

    code = "sandbox-state"
    http_status = 409


class SnapshotIncompatible(SandboxError):
    """A snapshot was taken by another driver, binary or device layout and cannot be restored here."""

    code = "snapshot-incompatible"
    http_status = 409


class SnapshotCorrupt(SandboxError):
    """A snapshot is missing files or fails its integrity check."""

    code = "snapshot-corrupt"
    http_status = 500


class ChannelError(SandboxError):
    """The host<->guest channel failed (I/O error, timeout, or an error answer from the peer)."""

    code = "sandbox-channel"
    http_status = 502


class ChannelClosed(ChannelError):
    """The channel is closed: the guest exited, the sandbox slept, or the connection dropped."""

    code = "sandbox-channel-closed"


class ChannelTimeout(ChannelError):
    code = "sandbox-channel-timeout"
    http_status = 504


class GuestProtocolError(ChannelError):
    """The guest sent a malformed frame. It is logged and rejected; the host keeps running."""

    code = "sandbox-guest-protocol"


class RemoteError(ChannelError):
    """The peer answered a call with an error object (``code``, ``message``, optional ``data``)."""

    code = "sandbox-remote"

    def __init__(self, message: str, *, rpc_code: int, data: Any = None, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.rpc_code = rpc_code
        self.data = data


class GuestFileTooLarge(SandboxError):
    """``read_file`` stopped at its byte cap: the file is larger, or the guest never said end-of-file."""

    code = "sandbox-file-too-large"
    http_status = 413


class GuestFileNotFound(SandboxError, NotFound):
    """A path asked for through ``read_file``/``list_files`` does not exist inside the sandbox."""

    code = "sandbox-file-not-found"
    http_status = 404

