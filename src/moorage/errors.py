"""Typed errors shared by every part of moorage.

Each error carries a message meant for the person who hit it, with what to do next.
"""

from __future__ import annotations

import errno
import sqlite3


class MoorageError(Exception):
    """Base of every error moorage raises on purpose."""

    #: Stable machine-readable code (used by the API's problem+json ``type``).
    code = "moorage-error"
    #: HTTP status the API maps this error to.
    http_status = 500
    #: A 5xx whose message and hint are written for the caller (others are kept in the log: the caller gets a
    #: trace id to quote).
    for_caller = False
    #: False: the same request would fail the same way, a client must not retry it (``x-should-retry: false``).
    retryable: bool | None = None

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return f"{self.message} ({self.hint})" if self.hint else self.message


class InvalidInput(MoorageError):
    """The caller sent something malformed, unknown or too large; nothing was changed."""

    code = "invalid-input"
    http_status = 422


class NotFound(MoorageError):
    code = "not-found"
    http_status = 404


class ConflictError(MoorageError):
    """A compare-and-set lost: someone else changed the record first. Re-read and retry."""

    code = "conflict"
    http_status = 409

    def __init__(self, message: str, *, current_version: int | None = None, hint: str | None = None) -> None:
        super().__init__(message, hint=hint or "re-read the record and retry with its current version")
        self.current_version = current_version


class TenantScopeError(MoorageError):
    """An operation tried to cross a tenant boundary, or had no authenticated tenant."""

    code = "tenant-scope"
    http_status = 403


class Unauthenticated(MoorageError):
    code = "unauthenticated"
    http_status = 401


class ConfigError(MoorageError):
    code = "config"
    http_status = 500


class UnavailableError(MoorageError):
    """A dependency (database, sandbox host, model) cannot be reached right now."""

    code = "unavailable"
    http_status = 503


class StoreUnreachable(UnavailableError):
    """The store's PostgreSQL server cannot be reached right now (restarting, failing over, down). Here rather than
    beside the driver (``store/pg_outage.py``) so that a host on SQLite never imports the PostgreSQL driver."""

    #: Seconds a caller is asked to wait before retrying (a PostgreSQL restart takes a second or two).
    retry_after = 2.0


class DiskFull(MoorageError):
    """The disk under the host's data directory (or its database's) is full: what the request was writing was not
    written. Nothing before it is lost; it works again as soon as there is room, without a restart."""

    code = "disk-full"
    http_status = 507  # Insufficient Storage: the server, not the request, lacks room
    for_caller = True

    def __init__(self, message: str = "the host is out of disk space: this request could not be completed",
                 *, hint: str | None = None) -> None:
        super().__init__(message, hint=hint or "the operator must free space on the disk of moorage's data "
                                               "directory (docs/operations.md, 'When the disk fills up'); "
                                               "then retry, no restart is needed")


#: sqlite3's SQLITE_FULL (its primary result code), PostgreSQL's SQLSTATE disk_full.
_SQLITE_FULL, _PG_DISK_FULL = 13, "53100"


def disk_full(exc: BaseException) -> DiskFull | None:
    """A ``DiskFull`` when ``exc`` (or an exception it was raised from or while handling) is the disk being full:
    ``ENOSPC``/``EDQUOT`` from the OS, SQLite's "database or disk is full", PostgreSQL's disk_full; else None."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen and len(seen) < 16:
        seen.add(id(e))
        if isinstance(e, DiskFull):
            return e
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return DiskFull()
        code = getattr(e, "sqlite_errorcode", None)
        if isinstance(code, int) and code & 0xFF == _SQLITE_FULL or getattr(e, "sqlstate", None) == _PG_DISK_FULL \
                or isinstance(e, sqlite3.Error) and "database or disk is full" in str(e):
            return DiskFull()
        e = e.__cause__ or e.__context__
    return None
