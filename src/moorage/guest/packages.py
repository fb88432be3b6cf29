"""An agent's deploy-time packages (``requirements.txt``) in the guest: on the path of the agent's code and of every
process it starts.

Stdlib only. A path on PYTHONPATH that did not exist when the supervisor started is remembered by the import
system as "nothing here"; after the host installed packages into it (deploy time), ``packages.refresh`` forgets
that. A sandbox whose packages came after its template was made (a redeploy that added some) was started without
their directory on PYTHONPATH: the marker the host writes beside them (``configure``) puts it there.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any, Dict

from .rpc import Context, Registry

#: Where the host installs the packages (``runtime/deploy_packages.SITE_DIR``), and the file it writes there
#: last, once they are complete (the digest of the requirements they were installed from).
SITE_DIR = "/work/.moorage/site"
MARKER = ".moorage-requirements"


def configure(environ: Any) -> bool:
    """Called by the supervisor before it starts anything: installed packages are on PYTHONPATH (for every process
    started from here on) and on this process's path. Returns whether there are any."""
    if not os.path.isfile(os.path.join(SITE_DIR, MARKER)):
        return False
    entries = [p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if SITE_DIR not in entries:
        environ["PYTHONPATH"] = os.pathsep.join([SITE_DIR] + entries)
    if SITE_DIR not in sys.path:
        sys.path.insert(1, SITE_DIR)
    return True


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
