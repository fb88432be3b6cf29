"""Calls that fail because PostgreSQL or the S3 object store cannot be reached are counted on ``/metrics``
(``moorage_unreachable_total``), with real clients against ports where nothing listens."""

from __future__ import annotations

from pathlib import Path

import psycopg
import pytest

from moorage.objects.errors import ObjectStoreUnavailable
from moorage.objects.s3 import S3ObjectStore
from moorage.observability.metrics import Metrics
from moorage.store.pg_outage import StoreUnreachable, unreachable_as_503
from tests.api.conftest import free_port

pytestmark = pytest.mark.timeout(120)


def unreachable(m: Metrics, backend: str) -> float:
    return m.registry.get_sample_value("moorage_unreachable_total", {"backend": backend}) or 0.0


def test_store_and_object_store_outages_are_counted(tmp_path: Path) -> None:
    m = Metrics()
    assert unreachable(m, "store") == 0 and unreachable(m, "object-store") == 0  # both shown from the start
    dead = free_port()
    with pytest.raises(StoreUnreachable), unreachable_as_503():
        psycopg.connect(f"postgresql://nobody@127.0.0.1:{dead}/none", connect_timeout=2)
    s3 = S3ObjectStore("bucket", "", endpoint=f"http://127.0.0.1:{dead}", region="us-east-1", access_key="a",
                       secret_key="b", spool_dir=tmp_path)
    try:
        with pytest.raises(ObjectStoreUnavailable):
            s3.head("some/key")
    finally:
        s3.close()
    assert unreachable(m, "store") == 1
    assert unreachable(m, "object-store") == 1
