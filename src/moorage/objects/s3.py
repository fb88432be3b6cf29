"""The S3 object store (any S3-compatible server, through boto3): objects under ``s3://bucket/prefix``.

Uploads are multipart in bounded parts, each with its own SHA256 checksum the server verifies; the whole object's
sha256 rides as user metadata and every get checks it. Downloads stream (large ones in parallel ranges).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import math
import os
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, BinaryIO

from moorage.errors import InvalidInput
from moorage.objects.errors import (
    ObjectChanged,
    ObjectCorrupt,
    ObjectExists,
    ObjectNotFound,
    ObjectStoreConfigError,
    ObjectStoreUnavailable,
    ObjectStoreUnsupported,
)
from moorage.objects.keys import CHUNK, check_digest, check_key, check_prefix, sha256_file
from moorage.objects.store import ObjectInfo, ObjectPage, ObjectStore, check_delete_prefix, check_limit
from moorage.objects.transfer import FileWindow, hash_stream, wait_all

#: S3's smallest part (all but the last) and its most parts per upload.
MIN_PART = 5 << 20
MAX_PARTS = 10_000
_META = "sha256"


def _b64(hex_digest: str) -> str:
    return base64.b64encode(bytes.fromhex(hex_digest)).decode()


class S3ObjectStore(ObjectStore):
    """Parts of ``part_size`` move ``concurrency`` at a time, each streamed in 1 MiB steps (none is held whole)."""

    def __init__(self, bucket: str, prefix: str = "", *, endpoint: str = "", region: str = "us-east-1",
                 access_key: str, secret_key: str, spool_dir: Path | None = None,
                 part_size: int = 8 << 20, concurrency: int = 4) -> None:
        import boto3
        from botocore.config import Config as BotoConfig

        if not access_key or not secret_key:
            raise ObjectStoreConfigError(
                f"the object store s3://{bucket} needs an access key and a secret key",
                hint="set MOORAGE_OBJECT_STORE_ACCESS_KEY and MOORAGE_OBJECT_STORE_SECRET_KEY")
        if part_size < MIN_PART:
            raise InvalidInput(f"part size {part_size} is under S3's minimum of {MIN_PART} bytes")
        if concurrency < 1:
            raise InvalidInput(f"concurrency {concurrency} must be at least 1")
        prefix = prefix.strip("/")
        if prefix:
            check_prefix(prefix + "/")
        self.bucket = bucket
        self.endpoint = endpoint
        self._prefix = f"{prefix}/" if prefix else ""
        self.url = f"s3://{bucket}/{prefix}"
        self.part_size = part_size
        self.concurrency = concurrency
        self._spool = spool_dir
        session = boto3.session.Session(aws_access_key_id=access_key, aws_secret_access_key=secret_key,
                                        region_name=region or "us-east-1")
        self._client = session.client("s3", endpoint_url=endpoint or None, config=BotoConfig(
            # Self-hosted servers answer on one host name; AWS prefers bucket names in the host.
            s3={"addressing_style": "path" if endpoint else "virtual"},
            retries={"mode": "standard", "max_attempts": 5},
            connect_timeout=10, read_timeout=120,
            max_pool_connections=max(10, 2 * concurrency),
            # Every put carries our own SHA256 checksum; botocore need not add its CRC32 on top.
            request_checksum_calculation="when_required",
            response_checksum_validation="when_supported",
        ))
        self._pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="moorage-s3")
        self._if_absent: bool | None = None
        self._probe_lock = threading.Lock()

    def _k(self, key: str) -> str:
        return self._prefix + check_key(key)

    # -- errors ---------------------------------------------------------------------------------------

    def _translate(self, e: Exception, key: str | None, op: str) -> Exception:
        from botocore.exceptions import BotoCoreError, ClientError, FlexibleChecksumError, IncompleteReadError

        if isinstance(e, ClientError):
            err = e.response.get("Error", {})
            code = str(err.get("Code", ""))
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code == "NoSuchBucket" or (op == "head_bucket" and status == 404):
                return ObjectStoreConfigError(f"bucket {self.bucket!r} does not exist at {self._where()}",
                                              hint="create the bucket, or fix MOORAGE_OBJECT_STORE_URL")
            if code in ("NoSuchKey", "NotFound", "404") and key is not None:
                return ObjectNotFound(key, where=self.url)
            if code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "403") or status == 403:
                return ObjectStoreConfigError(f"{self._where()} refused {op} on {self.url} ({code})",
                                              hint="check MOORAGE_OBJECT_STORE_ACCESS_KEY/SECRET_KEY and the key's rights")
            if code in ("BadDigest", "XAmzContentSHA256Mismatch", "InvalidDigest") and key is not None:
                return ObjectCorrupt(key, "the bytes the server received do not match their checksum",
                                     hint="damaged in transit, or the file changed while it was stored; store it again")
            return ObjectStoreUnavailable(f"{op} {key or ''} on {self.url} failed: {code} {err.get('Message', '')}".strip(),
                                          hint="retry; if it persists, check the S3 server's health")
        if isinstance(e, FlexibleChecksumError) and key is not None:
            return ObjectCorrupt(key, f"the server's checksum does not match the bytes received ({e})")
        if isinstance(e, IncompleteReadError):
            return ObjectStoreUnavailable(f"{op} {key or ''}: the transfer from {self._where()} was cut short",
                                          hint="retry")
        if isinstance(e, BotoCoreError):
            return ObjectStoreUnavailable(f"cannot reach the object store at {self._where()}: {e}",
                                          hint="check MOORAGE_OBJECT_STORE_ENDPOINT and that the S3 server runs")
        return e

    def _where(self) -> str:
        return self.endpoint or "AWS S3"

    def _call(self, op: str, key: str | None, **kw: Any) -> Any:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return getattr(self._client, op)(Bucket=self.bucket, **kw)
        except (ClientError, BotoCoreError) as e:
            raise self._translate(e, key, op) from e

    @staticmethod
    def _code(e: BaseException) -> str:
        cause = e.__cause__
        resp = getattr(cause, "response", None) or {}
        return str(resp.get("Error", {}).get("Code", ""))

    def check(self) -> None:
        self._call("head_bucket", None)

    # -- writing --------------------------------------------------------------------------------------

    @property
    def supports_if_absent(self) -> bool:
        # Some S3-compatible servers ignore If-None-Match silently; ask once by trying it on a scratch key.
        with self._probe_lock:
            if self._if_absent is None:
                probe = f"{self._prefix}.moorage-probe/{uuid.uuid4().hex}"
                self._call("put_object", None, Key=probe, Body=b"")
                try:
                    self._call("put_object", None, Key=probe, Body=b"", IfNoneMatch="*")
                    self._if_absent = False
                except ObjectStoreUnavailable as e:
                    if self._code(e) not in ("PreconditionFailed", "412"):
                        raise
                    self._if_absent = True
                finally:
                    self._call("delete_object", None, Key=probe)
            return self._if_absent

    def put_file(self, key: str, path: Path, *, if_absent: bool = False, sha256: str | None = None) -> ObjectInfo:
        check_key(key)
        if if_absent and not self.supports_if_absent:
            raise ObjectStoreUnsupported(f"{self._where()} does not honour if-absent writes (If-None-Match)",
                                         hint="use an S3 server with conditional writes (AWS, MinIO, SeaweedFS)")
        size = os.stat(path).st_size
        digest = check_digest(sha256) if sha256 is not None else sha256_file(Path(path))
        cond = {"IfNoneMatch": "*"} if if_absent else {}
        for _ in range(5):  # AWS answers 409 while another conditional write of the key is in flight
            try:
                if size <= self.part_size:
                    with open(path, "rb") as f:
                        self._call("put_object", key, Key=self._k(key), Body=f, ContentLength=size,
                                   Metadata={_META: digest}, ChecksumSHA256=_b64(digest), **cond)
                else:
                    self._put_multipart(key, Path(path), size, digest, cond)
                return ObjectInfo(key, size, digest, time.time())
            except ObjectCorrupt:
                if sha256 is None or size > self.part_size:  # a part's checksum is taken from the bytes sent
                    raise
                raise InvalidInput(f"{path} does not hash to the sha256 {sha256} given",
                                   hint="the file changed while it was stored, or the digest is wrong; nothing was stored") from None
            except ObjectStoreUnavailable as e:
                code = self._code(e)
                if if_absent and code in ("PreconditionFailed", "412"):
                    raise ObjectExists(key) from None
                if if_absent and code == "ConditionalRequestConflict":
                    time.sleep(0.2)
                    continue
                raise
        raise ObjectStoreUnavailable(f"could not store {key!r}: concurrent conditional writes kept conflicting",
                                     hint="retry")

    def put_bytes(self, key: str, data: bytes, *, if_absent: bool = False) -> ObjectInfo:
        if len(data) > self.part_size:
            return super().put_bytes(key, data, if_absent=if_absent)
        check_key(key)
        fd, name = tempfile.mkstemp(prefix="moorage-put-", dir=self._spool_dir())
        try:  # one code path for puts: a small value is a small file
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            return self.put_file(key, Path(name), if_absent=if_absent, sha256=hashlib.sha256(data).hexdigest())
        finally:
            os.unlink(name)

    def _put_multipart(self, key: str, path: Path, size: int, digest: str, cond: dict[str, str]) -> None:
        part_size = max(self.part_size, math.ceil(size / MAX_PARTS))
        full = self._k(key)
        upload_id = self._call("create_multipart_upload", key, Key=full, Metadata={_META: digest},
                               ChecksumAlgorithm="SHA256")["UploadId"]
        try:
            parts = self._upload_parts(key, full, upload_id, path, size, part_size)
            self._call("complete_multipart_upload", key, Key=full, UploadId=upload_id,
                       MultipartUpload={"Parts": parts}, **cond)
        except BaseException:
            with contextlib.suppress(Exception):
                self._call("abort_multipart_upload", key, Key=full, UploadId=upload_id)
            raise

    def _upload_parts(self, key: str, full: str, upload_id: str, path: Path, size: int,
                      part_size: int) -> list[dict[str, Any]]:
        # Each part streams from the file on its own (a window of it): nothing holds a part in memory.
        futures = [self._pool.submit(self._upload_part, key, full, upload_id, n + 1, path, start,
                                     min(part_size, size - start))
                   for n, start in enumerate(range(0, size, part_size))]
        wait_all(futures)
        return [f.result() for f in futures]

    def _upload_part(self, key: str, full: str, upload_id: str, number: int, path: Path, start: int,
                     length: int) -> dict[str, Any]:
        with FileWindow(path, start, length) as body:
            h = hashlib.sha256()
            while chunk := body.read(CHUNK):
                h.update(chunk)
            body.seek(0)
            checksum = base64.b64encode(h.digest()).decode()
            r = self._call("upload_part", key, Key=full, UploadId=upload_id, PartNumber=number, Body=body,
                           ContentLength=length, ChecksumSHA256=checksum)
        return {"PartNumber": number, "ETag": r["ETag"], "ChecksumSHA256": r.get("ChecksumSHA256") or checksum}

    # -- reading --------------------------------------------------------------------------------------

    def _recorded(self, key: str, meta: dict[str, str]) -> str:
        recorded = meta.get(_META)
        if not recorded:
            raise ObjectCorrupt(key, "no sha256 was recorded with it (not written by moorage?)")
        return recorded

    def get_file(self, key: str, dest: Path, *, sha256: str | None = None) -> ObjectInfo:
        dest = Path(dest)
        head = self._call("head_object", key, Key=self._k(key))
        recorded = self._recorded(key, head.get("Metadata", {}))
        if sha256 is not None and recorded != sha256:
            raise ObjectCorrupt(key, f"it records sha256 {recorded}, {sha256} was expected")
        size, etag = int(head["ContentLength"]), head["ETag"]
        fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".part", dir=dest.parent)
        try:
            with os.fdopen(fd, "r+b") as out:
                if size <= self.part_size:
                    digest, got = self._stream(key, out, IfMatch=etag)
                else:
                    self._get_ranges(key, out.fileno(), size, etag)
                    out.seek(0)
                    digest, got = hash_stream(out)
                if got != size or digest != recorded:
                    raise ObjectCorrupt(key, f"its {got} bytes hash to {digest}, {recorded} was recorded for {size}")
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, dest)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        return ObjectInfo(key, size, recorded, head["LastModified"].timestamp())

    def _stream(self, key: str, out: BinaryIO, **cond: str) -> tuple[str, int]:
        r = self._get(key, **cond)
        h = hashlib.sha256()
        n = 0
        try:
            for chunk in r["Body"].iter_chunks(CHUNK):
                h.update(chunk)
                out.write(chunk)
                n += len(chunk)
        except Exception as e:
            raise self._translate(e, key, "get_object") from e
        finally:
            r["Body"].close()
        return h.hexdigest(), n

    def _get(self, key: str, **kw: Any) -> Any:
        try:
            return self._call("get_object", key, Key=self._k(key), **kw)
        except ObjectStoreUnavailable as e:
            if self._code(e) in ("PreconditionFailed", "412"):
                raise ObjectChanged(key) from None
            raise

    def _get_ranges(self, key: str, fd: int, size: int, etag: str) -> None:
        # Parallel ranged GETs, each pinned to the ETag seen by HEAD so a replaced object cannot be mixed in.
        def fetch(start: int, end: int) -> None:
            r = self._get(key, Range=f"bytes={start}-{end}", IfMatch=etag)
            off = start
            try:
                for chunk in r["Body"].iter_chunks(CHUNK):
                    os.pwrite(fd, chunk, off)
                    off += len(chunk)
            except Exception as e:
                raise self._translate(e, key, "get_object") from e
            finally:
                r["Body"].close()
            if off != end + 1:
                raise ObjectCorrupt(key, f"range {start}-{end} ended at byte {off}")

        wait_all([self._pool.submit(fetch, s, min(s + self.part_size, size) - 1)
                   for s in range(0, size, self.part_size)])

    def get_stream(self, key: str, out: BinaryIO) -> ObjectInfo:
        r = self._get(key)
        recorded = self._recorded(key, r.get("Metadata", {}))
        size = int(r["ContentLength"])
        h = hashlib.sha256()
        n = 0
        try:
            for chunk in r["Body"].iter_chunks(CHUNK):
                h.update(chunk)
                out.write(chunk)
                n += len(chunk)
        except Exception as e:
            raise self._translate(e, key, "get_object") from e
        finally:
            r["Body"].close()
        if n != size or h.hexdigest() != recorded:
            raise ObjectCorrupt(key, f"its {n} bytes hash to {h.hexdigest()}, {recorded} was recorded for {size}")
        return ObjectInfo(key, size, recorded, r["LastModified"].timestamp())

    def head(self, key: str) -> ObjectInfo:
        r = self._call("head_object", key, Key=self._k(key))
        return ObjectInfo(key, int(r["ContentLength"]), r.get("Metadata", {}).get(_META),
                          r["LastModified"].timestamp())

    # -- listing and deleting -------------------------------------------------------------------------

    def list(self, prefix: str = "", *, after: str | None = None, limit: int = 1000) -> ObjectPage:
        check_prefix(prefix)
        check_limit(limit)
        kw: dict[str, Any] = {"Prefix": self._prefix + prefix, "MaxKeys": limit}
        if after is not None:
            kw["StartAfter"] = self._prefix + after
        r = self._call("list_objects_v2", None, **kw)
        n = len(self._prefix)
        objects = [ObjectInfo(o["Key"][n:], int(o["Size"]), None, o["LastModified"].timestamp())
                   for o in r.get("Contents", []) if not o["Key"][n:].startswith(".")]
        more = bool(r.get("IsTruncated")) and bool(r.get("Contents"))
        return ObjectPage(objects, r["Contents"][-1]["Key"][n:] if more else None)

    def delete(self, key: str) -> None:
        try:
            self._call("delete_object", key, Key=self._k(key))
        except ObjectNotFound:
            pass

    def delete_prefix(self, prefix: str) -> int:
        check_prefix(check_delete_prefix(prefix))
        n = 0
        after: str | None = None
        while True:
            page = self.list(prefix, after=after)
            if page.objects:
                r = self._call("delete_objects", None, Delete={
                    "Objects": [{"Key": self._prefix + o.key} for o in page.objects], "Quiet": True})
                if r.get("Errors"):
                    e = r["Errors"][0]
                    raise ObjectStoreUnavailable(f"deleting {e.get('Key')} on {self.url} failed: {e.get('Code')}",
                                                 hint="retry the delete")
                n += len(page.objects)
            if page.next_token is None:
                return n
            after = page.next_token

    def sweep_incomplete(self, older_than_s: float = 24 * 3600) -> int:
        # Parts of an upload nobody will complete cost storage until aborted (AWS can also do this by a
        # lifecycle rule; other servers may not).
        cutoff = time.time() - older_than_s
        n = 0
        kw: dict[str, Any] = {"Prefix": self._prefix}
        while True:
            r = self._call("list_multipart_uploads", None, **kw)
            for u in r.get("Uploads", []):
                if u["Initiated"].timestamp() <= cutoff:
                    with contextlib.suppress(ObjectNotFound, ObjectStoreUnavailable):  # finished or aborted meanwhile
                        self._call("abort_multipart_upload", u["Key"], Key=u["Key"], UploadId=u["UploadId"])
                        n += 1
            if not r.get("IsTruncated"):
                return n
            kw.update(KeyMarker=r.get("NextKeyMarker", ""), UploadIdMarker=r.get("NextUploadIdMarker", ""))

    # -- lifetime -------------------------------------------------------------------------------------

    def _spool_dir(self) -> str | None:
        if self._spool is None:
            return None
        self._spool.mkdir(parents=True, exist_ok=True, mode=0o700)
        return str(self._spool)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._client.close()
