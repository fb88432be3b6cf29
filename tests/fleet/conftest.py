"""The fleet tests use the object-store harness (local files and a real SeaweedFS S3 server) of tests/objects."""

from tests.objects.conftest import harness, object_store, s3_bucket, seaweedfs  # noqa: F401 - fixtures
