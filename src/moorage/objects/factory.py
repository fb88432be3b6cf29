"""Opens the object store the configuration names: ``file:///path`` (default: ``<data_dir>/objects``) or ``s3://``.

The store is checked on open (bucket reachable, credentials accepted), so a bad setting fails at start, not mid-sleep.
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote, urlsplit

from moorage.config import Config
from moorage.errors import InvalidInput
from moorage.objects.blobs import Blobs
from moorage.objects.errors import ObjectStoreConfigError
from moorage.objects.keys import check_prefix
from moorage.objects.store import ObjectStore

_BUCKET_RE = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")


def object_store_url(config: Config) -> str:
    """The configured URL, with the embedded default filled in."""
    return config.object_store_url or (config.data_dir / "objects").absolute().as_uri()


def open_object_store(config: Config) -> ObjectStore:
    url = object_store_url(config)
    parts = urlsplit(url)
    if parts.scheme == "file":
        if parts.netloc not in ("", "localhost") or not parts.path.startswith("/"):
            raise ObjectStoreConfigError(f"object store URL {url!r} is not a local absolute path",
                                         hint="write it as file:///absolute/path")
        from moorage.objects.local import LocalObjectStore

        store: ObjectStore = LocalObjectStore(Path(unquote(parts.path)))
    elif parts.scheme == "s3":
        bucket, prefix = parts.netloc, parts.path.strip("/")
        if not _BUCKET_RE.fullmatch(bucket):
            raise ObjectStoreConfigError(f"{bucket!r} in {url!r} is not a valid S3 bucket name",
                                         hint="3-63 lowercase letters, digits, '.' and '-': s3://bucket/prefix")
        if prefix:
            try:
                check_prefix(prefix + "/")
            except InvalidInput as e:
                raise ObjectStoreConfigError(f"the prefix {prefix!r} in {url!r} is not usable: {e.message}",
                                             hint=e.hint) from e
        from moorage.objects.s3 import S3ObjectStore

        store = S3ObjectStore(bucket, prefix, endpoint=config.object_store_endpoint,
                              region=config.object_store_region, access_key=config.object_store_access_key,
                              secret_key=config.object_store_secret_key, spool_dir=config.data_dir / "tmp")
    else:
        raise ObjectStoreConfigError(f"unsupported object store URL {url!r}",
                                     hint="use file:///absolute/path or s3://bucket/prefix (MOORAGE_OBJECT_STORE_URL)")
    try:
        store.check()
    except BaseException:
        store.close()
        raise
    return store


def open_package_blobs(config: Config) -> Blobs | None:
    """Deployment packages in the configured object store (``packages/<sha256>.tar.gz``), or None when no
    ``object_store_url`` is set: on one machine the host's own ``<data_dir>/packages`` is the only copy needed."""
    if not config.object_store_url:
        return None
    return Blobs(open_object_store(config), "packages", suffix=".tar.gz")
