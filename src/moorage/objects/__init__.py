"""Object storage for everything an agent is that is a file: packages, images, templates, snapshots.

One interface (``ObjectStore``), two backends (local files, S3), one conformance suite (tests/objects/).
"""

from moorage.objects.blobs import Blobs
from moorage.objects.errors import (
    ObjectChanged,
    ObjectCorrupt,
    ObjectExists,
    ObjectNotFound,
    ObjectStoreConfigError,
    ObjectStoreUnavailable,
    ObjectStoreUnsupported,
)
from moorage.objects.factory import object_store_url, open_object_store, open_package_blobs
from moorage.objects.keys import check_key, check_prefix, sha256_file
from moorage.objects.local import LocalObjectStore
from moorage.objects.store import ObjectInfo, ObjectPage, ObjectStore

__all__ = [
    "Blobs",
    "LocalObjectStore",
    "ObjectChanged",
    "ObjectCorrupt",
    "ObjectExists",
    "ObjectInfo",
    "ObjectNotFound",
    "ObjectPage",
    "ObjectStore",
    "ObjectStoreConfigError",
    "ObjectStoreUnavailable",
    "ObjectStoreUnsupported",
    "check_key",
    "check_prefix",
    "object_store_url",
    "open_object_store",
    "open_package_blobs",
    "sha256_file",
]
