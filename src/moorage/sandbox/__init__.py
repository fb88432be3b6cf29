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
    GuestFileNotFound,
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
    "GuestFileNotFound", "GuestProtocolError", "RemoteError", "Sandbox", "SandboxDriver", "SandboxError", "SandboxNotFound", "SandboxSpec",
    "SandboxState", "SandboxStateError", "SandboxStats", "SnapshotCorrupt", "SnapshotIncompatible", "SnapshotInfo",
    "TemplateRef", "guest_source_dir", "get_driver", "DRIVERS",
]


def guest_source_dir() -> Path:
    """The guest package directory that drivers copy (or bind read-only) into each sandbox.

    Located by path, not imported: host code never imports guest code.
    """
    return Path(__file__).resolve().parent.parent / "guest"


#: Driver name -> (module, class). Modules are imported only when that driver is asked for.
DRIVERS: dict[str, tuple[str, str]] = {
    "process": ("moorage.sandbox.process", "ProcessDriver"),
    "microvm": ("moorage.sandbox.microvm", "MicroVMDriver"),
}


def get_driver(config: "Config", root: Path | None = None) -> SandboxDriver:
    """The configured driver over ``root`` (default ``config.sandboxes_dir``).

    ``auto`` means microvm, and fails when QEMU is missing: the process driver shares the host kernel, so a host
    gets it only when the operator names it (``sandbox_driver = "process"``).
    """
    import importlib
    import importlib.util
    import shutil

    from moorage.errors import ConfigError

    name = config.sandbox_driver
    if name == "auto":
        has_microvm = importlib.util.find_spec(DRIVERS["microvm"][0]) is not None
        if not (shutil.which("qemu-system-x86_64") and has_microvm):
            raise ConfigError(
                "sandbox_driver is auto but QEMU (qemu-system-x86_64) is not installed, so no micro-VM can run",
                hint="install qemu-system-x86 (scripts/bootstrap.sh), or accept the weaker process driver (guests "
                     "share the host kernel) with sandbox_driver = \"process\" in moorage.toml or "
                     "MOORAGE_SANDBOX_DRIVER=process",
            )
        name = "microvm"
    if name not in DRIVERS:
        raise ConfigError(f"unknown sandbox driver {name!r}", hint=f"set sandbox_driver to auto, {', '.join(DRIVERS)}")
    module, cls = DRIVERS[name]
    driver_cls = getattr(importlib.import_module(module), cls)
    return driver_cls(root or config.sandboxes_dir, config)  # type: ignore[no-any-return]
