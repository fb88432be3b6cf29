"""Opening the configured object store: the embedded default, ``MOORAGE_OBJECT_STORE_*`` settings, clear failures."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from moorage.config import Config, load
from moorage.devservices.postgres import free_port
from moorage.devservices.seaweedfs import SeaweedFS
from moorage.objects import (
    LocalObjectStore,
    ObjectStoreConfigError,
    ObjectStoreUnavailable,
    object_store_url,
    open_object_store,
)
from moorage.objects.s3 import S3ObjectStore


def test_default_is_local_files_in_the_data_dir(tmp_path: Path) -> None:
    config = Config(data_dir=tmp_path / "data")
    assert object_store_url(config) == (tmp_path / "data" / "objects").as_uri()
    with open_object_store(config) as store:
        assert isinstance(store, LocalObjectStore)
        store.put_bytes("instances/t1/i1/meta", b"m")
    root = tmp_path / "data" / "objects"
    for d in (root, root / "instances", root / "instances" / "t1", root / "instances" / "t1" / "i1"):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700, d
    assert stat.S_IMODE((root / "instances/t1/i1/meta").stat().st_mode) == 0o600


def test_settings_come_from_the_environment(tmp_path: Path, seaweedfs: SeaweedFS, s3_bucket: str) -> None:
    env = {"MOORAGE_DATA_DIR": str(tmp_path / "data"),
           **{f"MOORAGE_{k.upper()}": v for k, v in seaweedfs.settings(s3_bucket, "from-env").items()}}
    config = load(env=env)
    assert config.object_store_url == f"s3://{s3_bucket}/from-env"
    assert seaweedfs.secret_key not in repr(config)  # credentials stay out of logs
    with open_object_store(config) as store:
        assert isinstance(store, S3ObjectStore)
        store.put_bytes("k", b"v")
    assert seaweedfs.client().head_object(Bucket=s3_bucket, Key="from-env/k")["ContentLength"] == 1


def test_file_url_names_the_directory(tmp_path: Path) -> None:
    config = Config(data_dir=tmp_path / "data", object_store_url=(tmp_path / "elsewhere").as_uri())
    with open_object_store(config) as store:
        store.put_bytes("a", b"1")
    assert (tmp_path / "elsewhere" / "a").read_bytes() == b"1"


@pytest.mark.parametrize("url", ["ftp://host/x", "file://otherhost/x", "s3://Bad_Bucket/x", "s3://ok-bucket/../x", "/plain/path"])
def test_unusable_urls_are_config_errors(tmp_path: Path, url: str) -> None:
    with pytest.raises(ObjectStoreConfigError) as e:
        open_object_store(Config(data_dir=tmp_path, object_store_url=url, object_store_access_key="a",
                                 object_store_secret_key="b", object_store_endpoint="http://127.0.0.1:9"))
    assert e.value.hint


def test_s3_needs_credentials(tmp_path: Path) -> None:
    with pytest.raises(ObjectStoreConfigError, match="access key") as e:
        open_object_store(Config(data_dir=tmp_path, object_store_url="s3://bucket/p",
                                 object_store_endpoint="http://127.0.0.1:9"))
    assert "MOORAGE_OBJECT_STORE_ACCESS_KEY" in str(e.value)


def test_wrong_credentials_fail_at_open(tmp_path: Path, seaweedfs: SeaweedFS, s3_bucket: str) -> None:
    settings = {**seaweedfs.settings(s3_bucket), "object_store_secret_key": "not-the-secret"}
    with pytest.raises(ObjectStoreConfigError, match="refused") as e:
        open_object_store(Config(data_dir=tmp_path, **settings))  # type: ignore[arg-type]
    assert "SECRET_KEY" in str(e.value)


def test_missing_bucket_fails_at_open(tmp_path: Path, seaweedfs: SeaweedFS) -> None:
    with pytest.raises(ObjectStoreConfigError, match="does not exist"):
        open_object_store(Config(data_dir=tmp_path, **seaweedfs.settings("no-such-bucket")))  # type: ignore[arg-type]


def test_unreachable_endpoint_is_unavailable(tmp_path: Path) -> None:
    port = free_port()  # nothing listens there
    with pytest.raises(ObjectStoreUnavailable, match=f"127.0.0.1:{port}") as e:
        open_object_store(Config(data_dir=tmp_path, object_store_url="s3://bucket/p",
                                 object_store_endpoint=f"http://127.0.0.1:{port}", object_store_access_key="a",
                                 object_store_secret_key="b"))
    assert e.value.http_status == 503 and "ENDPOINT" in str(e.value)


def test_local_store_refuses_a_key_that_is_also_a_folder(tmp_path: Path) -> None:
    from moorage.errors import InvalidInput

    store = LocalObjectStore(tmp_path / "o")
    store.put_bytes("a/b", b"1")
    with pytest.raises(InvalidInput, match="collides"):
        store.put_bytes("a/b/c", b"2")
    store.put_bytes("x/y/z", b"3")
    with pytest.raises(InvalidInput, match="collides"):
        store.put_bytes("x/y", b"4")
    assert store.get_bytes("a/b") == b"1" and os.listdir(tmp_path / "o" / ".tmp") == []
