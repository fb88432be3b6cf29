"""Fixtures of the outage tests: a PostgreSQL cluster of their own (they stop, restart and cut it, which the
session's shared cluster must not see), and the verbs that take it down and bring it back."""

from __future__ import annotations

import shlex
import subprocess
from typing import Iterator

import pytest

from moorage.devservices.postgres import PostgresCluster, start_cluster
from tests.objects.conftest import s3_bucket, seaweedfs  # noqa: F401 - fixtures


class Outages:
    """Stop, start and restart one cluster as an operator would (``pg_ctl``), and cut its connections."""

    def __init__(self, cluster: PostgresCluster) -> None:
        self.cluster = cluster
        data = cluster.root / "data"
        # The options it was started with (port, socket directory...): a plain `pg_ctl start` would not know them.
        argv = shlex.split((data / "postmaster.opts").read_text())
        self._opts = shlex.join(argv[3:])  # after the binary and its "-D" "<data>"

    def _pg_ctl(self, *args: str) -> None:
        c = self.cluster
        r = subprocess.run([*c._as_postgres, str(c.bindir / "pg_ctl"), "-D", str(c.root / "data"), "-l",
                            str(c.root / "log"), "-w", "-t", "60", *args], capture_output=True, text=True, timeout=90)
        assert r.returncode == 0, f"pg_ctl {' '.join(args)}: {r.stderr.strip()}"

    def restart(self) -> None:
        self._pg_ctl("-m", "fast", "restart")

    def stop(self) -> None:
        self._pg_ctl("-m", "fast", "stop")

    def start(self) -> None:
        self._pg_ctl("-o", self._opts, "start")

    def terminate(self, db: str) -> int:
        """``pg_terminate_backend`` on every connection to ``db``; how many there were."""
        return int(self.cluster.psql(f"SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                                     f"WHERE datname = '{db}' AND pid != pg_backend_pid()").strip())


@pytest.fixture(scope="module")
def outages() -> Iterator[Outages]:
    cluster = start_cluster(max_connections=100)
    o = Outages(cluster)
    yield o
    cluster.stop()
