"""glibc's allocator in a host that runs for months: large blocks are returned to the kernel when they are freed.

glibc maps a block of 128 KiB or more on its own and unmaps it on free, but the first time such a block is freed
it raises that threshold to the block's size (up to 32 MiB), and from then on blocks that large come from its
arenas, where freed memory stays with the process. A host allocates such blocks all the time in its worker
threads (a micro-VM's dirty pages copied at each sleep, RAM files read in 4 MiB pieces, files and packages moved
through the channel), each thread in one of up to 8 arenas per core: the micro-VM soak's host ended with 177 MiB
freed and kept beside 100 MiB in use (bench/results/latest/soak-microvm-long.md). ``keep_large_blocks_mapped``
fixes the threshold at glibc's own starting value, which turns the raise off.
"""

from __future__ import annotations

import ctypes
import os
import platform

from moorage.log import get_logger

log = get_logger(__name__)

#: ``mallopt``'s parameter for the size from which a block is mapped on its own (glibc's malloc.h).
M_MMAP_THRESHOLD = -3
#: glibc's own starting threshold: what it uses until the first large block is freed.
MMAP_THRESHOLD_BYTES = 128 << 10


def keep_large_blocks_mapped(threshold: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Fix glibc's mmap threshold at ``threshold`` for this process (its ``moorage up``). Returns whether it was
    set: not on another C library, nor when the operator chose a value of their own (``MALLOC_MMAP_THRESHOLD_``,
    or ``glibc.malloc.mmap_threshold`` in ``GLIBC_TUNABLES``), which glibc applied as the process started."""
    if platform.libc_ver()[0] != "glibc":
        return False
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or "mmap_threshold" in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    try:
        done = ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, threshold) == 1
    except (OSError, AttributeError):
        return False
    if not done:
        log.warning("could not fix the allocator's mmap threshold; freed large blocks may stay with the host")
    return done
