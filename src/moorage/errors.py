"""Typed errors shared by every part of moorage.

Each error carries a message meant for the person who hit it, with what to do next.
"""

from __future__ import annotations


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
