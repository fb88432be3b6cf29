"""Sandboxes: the driver interface, the host side of the guest channel, and the drivers.

Import the public surface from here; driver modules are imported on demand by ``get_driver``.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from moorage.sandbox.base import (
    Capabilities,
    ChannelClosed,
    ChannelError,
    ChannelTimeout,
    CheckpointInfo,
    ExecResult,
    FileInfo,
    GuestProtocolError,
    RemoteError,
    Sandbox,
    SandboxDriver,
    SandboxError,
    SandboxNotFound,
    SandboxSpec,
    SandboxState,
    SandboxStateError,
    SandboxStats,
    SnapshotCorrupt,
    SnapshotIncompatible,
    SnapshotInfo,
    TemplateRef,
)

if TYPE_CHECKING:
    from moorage.config import Config

__all__ = [
    "Capabilities", "ChannelClosed", "ChannelError", "ChannelTimeout", "CheckpointInfo", "ExecResult", "FileInfo",
    "GuestProtocolError", "RemoteError", "Sandbox", "SandboxDriver", "SandboxError", "SandboxNotFound", "SandboxSpec",
    "SandboxState", "SandboxStateError", "SandboxStats", "SnapshotCorrupt", "SnapshotIncompatible", "SnapshotInfo",
    "TemplateRef", "guest_source_dir",
]


def guest_source_dir() -> Path:
    """The guest package directory that drivers copy (or bind read-only) into each sandbox.

    Located by path, not imported: host code never imports guest code.
    """
    return Path(__file__).resolve().parent.parent / "guest"
