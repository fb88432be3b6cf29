"""How many CPUs this process may keep busy: its affinity, narrowed by a cgroup CPU quota.

``os.cpu_count()`` counts the machine's CPUs. A container started with ``--cpus 2`` on a 32-CPU machine, or a
systemd unit with ``CPUQuota=200%``, may use two of them at a time while its affinity still lists all 32: the
quota is only in its cgroup (``sandbox/cgroups.py`` reads it). Threads sized to the machine there run on time the
process does not have.
"""

from __future__ import annotations

import math
import os

from moorage.sandbox import cgroups


def usable_cpus() -> int:
    """CPUs this process may run on at once (at least 1): its affinity, or fewer where a cgroup quota says so."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    quota = cgroups.cpu_quota(*cgroups.mounts())
    if quota is not None:
        n = min(n, math.ceil(quota))
    return max(1, n)
