"""Packages installed while the supervisor runs: ``packages.refresh`` makes them importable by the agent's code.

Stdlib only. A path on PYTHONPATH that did not exist when the supervisor started is remembered by the import
system as "nothing here"; after the host installed packages into it (deploy time), this forgets that.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any, Dict

from .rpc import Context, Registry


async def refresh(params: Any, ctx: Context) -> Dict[str, Any]:
    importlib.invalidate_caches()  # also drops the import system's "nothing here" entries (Python >= 3.10)
    return {}


def _honour_pythonpath() -> None:
    """A supervisor run isolated (``python3 -I``, the process driver) ignores PYTHONPATH, where a template with
    packages names their directory: its entries are put on the path here, as a plain run would have."""
    if not sys.flags.isolated:
        return
    for entry in reversed([p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]):
        if entry not in sys.path:
            sys.path.insert(1, entry)


def register(registry: Registry) -> None:
    _honour_pythonpath()
    registry.add("packages.refresh", refresh)
