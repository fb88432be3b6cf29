"""Typed errors of the object store: a missing object, damaged bytes, a lost if-absent race, an unreachable store.

All subclass ``moorage.errors`` types so the API maps them to the right HTTP status.
"""

from __future__ import annotations

from moorage.errors import ConfigError, ConflictError, MoorageError, NotFound, UnavailableError
from moorage.observability import events


class ObjectNotFound(NotFound):
    """No object under this key (never written, or deleted)."""

    code = "object-not-found"

    def __init__(self, key: str, *, where: str = "") -> None:
        super().__init__(f"object {key!r} does not exist{f' in {where}' if where else ''}",
                         hint="check the key; the object may have been deleted by retention or forget")
        self.key = key


class ObjectCorrupt(MoorageError):
    """The bytes read back do not match the sha256 recorded when the object was written.

    Raised instead of handing the bytes over: a destination file is never created from damaged data.
    """

    code = "object-corrupt"
    http_status = 500

    def __init__(self, key: str, detail: str, *, hint: str | None = None) -> None:
        super().__init__(f"object {key!r} is damaged: {detail}",
                         hint=hint or "the stored copy cannot be trusted; restore it from its source or write it again")
        self.key = key


class ObjectExists(ConflictError):
    """An if-absent put found the key already taken (another writer won)."""

    code = "object-exists"

    def __init__(self, key: str) -> None:
        super().__init__(f"object {key!r} already exists", hint="another writer stored it first; read theirs")
        self.key = key


class ObjectChanged(ConflictError):
    """The object was replaced while it was being read in parts."""

    code = "object-changed"

    def __init__(self, key: str) -> None:
        super().__init__(f"object {key!r} was replaced while it was being read", hint="read it again")
        self.key = key


class ObjectStoreUnavailable(UnavailableError):
    """The object store cannot be reached or refused the request for a reason other than the object itself."""

    code = "object-store-unavailable"

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        events.unreachable("object-store")  # /metrics: moorage_unreachable_total


class ObjectStoreConfigError(ConfigError):
    """The object-store URL, endpoint, credentials or bucket are wrong or not usable as configured."""

    code = "object-store-config"


class ObjectStoreUnsupported(ObjectStoreConfigError):
    """The backend cannot give a guarantee the caller asked for (e.g. if-absent writes on an S3 server without them)."""

    code = "object-store-unsupported"
