"""Fixtures of the object-store tests: one real S3 server (SeaweedFS) per session, and each backend in a harness.

A harness is a store plus a way to damage one of its objects behind its back, as a failing disk or a bad copy would.
"""

from __future__ import annotations

import itertools
import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import pytest

from moorage.config import Config
from moorage.devservices.seaweedfs import SeaweedFS, start_seaweedfs
from moorage.objects import LocalObjectStore, ObjectStore, open_object_store

BACKENDS = ("local", "s3")
_prefixes = itertools.count()


@pytest.fixture(scope="session")
def seaweedfs() -> Iterator[SeaweedFS]:
    server = start_seaweedfs()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def s3_bucket(seaweedfs: SeaweedFS) -> str:
    """One bucket for the session; each test works under a prefix of its own in it."""
    seaweedfs.create_bucket("moorage-tests")
    return "moorage-tests"


@dataclass
class Harness:
    kind: str
    store: ObjectStore
    #: Another store on the same storage, as a second host would open it.
    open_another: Callable[[], ObjectStore]
    #: Replace an object's bytes with same-sized garbage, keeping the digest it recorded.
    corrupt: Callable[[str], None]
    #: Whether a put of this key has started to land in storage without being finished.
    in_progress: Callable[[str], bool]
    #: Whether anything of an unfinished put is still in storage.
    leftovers: Callable[[], bool]
    #: MOORAGE_* settings with which another process opens the same store.
    env: dict[str, str]


def _local(tmp_path: Path) -> Harness:
    root = tmp_path / "objects"

    def corrupt(key: str) -> None:
        path = root / key
        size = path.stat().st_size
        with open(path, "r+b") as f:  # same inode: the recorded digest (an xattr) stays
            f.seek(size // 2)
            b = f.read(1)
            f.seek(size // 2)
            f.write(bytes([b[0] ^ 0xFF]))

    def in_progress(key: str) -> bool:
        tmp = root / ".tmp"
        return tmp.is_dir() and any(e.stat().st_size >= (1 << 20) for e in os.scandir(tmp))

    return Harness("local", LocalObjectStore(root), lambda: LocalObjectStore(root), corrupt, in_progress,
                   lambda: bool(os.listdir(root / ".tmp")), {"MOORAGE_OBJECT_STORE_URL": root.as_uri()})


def _s3(tmp_path: Path, server: SeaweedFS, bucket: str) -> Harness:
    prefix = f"t{next(_prefixes)}-{uuid.uuid4().hex[:8]}/fleet"
    config = Config(data_dir=tmp_path / "data", **server.settings(bucket, prefix))  # type: ignore[arg-type]
    raw = server.client()

    def corrupt(key: str) -> None:
        full = f"{prefix}/{key}"
        head = raw.head_object(Bucket=bucket, Key=full)
        size = head["ContentLength"]
        # A bad copy with the right size and the original's metadata, written past the store.
        raw.put_object(Bucket=bucket, Key=full, Body=os.urandom(size), Metadata=head["Metadata"])

    def in_progress(key: str) -> bool:
        full = f"{prefix}/{key}"
        uploads = raw.list_multipart_uploads(Bucket=bucket, Prefix=full).get("Uploads", [])
        return any(raw.list_parts(Bucket=bucket, Key=full, UploadId=u["UploadId"]).get("Parts") for u in uploads)

    def leftovers() -> bool:
        return bool(raw.list_multipart_uploads(Bucket=bucket, Prefix=f"{prefix}/").get("Uploads"))

    env = {f"MOORAGE_{k.upper()}": v for k, v in server.settings(bucket, prefix).items()}
    return Harness("s3", open_object_store(config), lambda: open_object_store(config), corrupt, in_progress,
                   leftovers, env)


@pytest.fixture(params=BACKENDS)
def harness(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Harness]:
    if request.param == "local":
        h = _local(tmp_path)
    else:
        h = _s3(tmp_path, request.getfixturevalue("seaweedfs"), request.getfixturevalue("s3_bucket"))
    yield h
    h.store.close()


@pytest.fixture
def object_store(harness: Harness) -> ObjectStore:
    return harness.store
