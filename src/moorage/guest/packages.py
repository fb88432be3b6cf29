"""Packages installed while the supervisor runs: ``packages.refresh`` makes them importable by the agent's code.

Stdlib only. A path on PYTHONPATH that did not exist when the supervisor started is remembered by the import
system as "nothing here"; after the host installed packages into it (deploy time), this forgets that.
"""

from __future__ import annotations

import importlib
from typing import Any, Dict

from .rpc import Context, Registry


async def refresh(params: Any, ctx: Context) -> Dict[str, Any]:
    importlib.invalidate_caches()  # also drops the import system's "nothing here" entries (Python >= 3.10)
    return {}


def register(registry: Registry) -> None:
    registry.add("packages.refresh", refresh)
