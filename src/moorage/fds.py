"""The process's limit on open descriptors, raised towards its hard limit as a host starts.

A host holds descriptors for what it serves: each awake sandbox's channel and its files, HTTP connections, and on
SQLite each thread's tenant connections (the database and its WAL: two descriptors each, plus one shared-memory file
per database) and each tenant's blob log segments. systemd and most shells give a process a soft limit of 1024, far
below the usual hard one (often 524288): a host passes it long before the hard one, and fails with "too many open
files". Go's runtime raises it the same way at start.
"""

from __future__ import annotations

#: What the soft limit is raised to at most.
OPEN_FILES = 65536


def raise_open_files_limit() -> None:
    """Raise this process's soft limit on open descriptors towards the hard one (at most ``OPEN_FILES``)."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = OPEN_FILES if hard == resource.RLIM_INFINITY else min(hard, OPEN_FILES)
        if soft != resource.RLIM_INFINITY and soft < want:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    except (ImportError, OSError, ValueError):
        pass  # not permitted or not supported: keep the limit the process was given
