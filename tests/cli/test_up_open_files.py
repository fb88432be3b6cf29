"""`moorage up` raises its soft limit on open descriptors as it starts, whatever its store: it was raised only by
the SQLite store, so a host on PostgreSQL kept systemd's 1024, which its sandboxes' channels and files and its HTTP
connections pass with a few hundred awake instances ("too many open files")."""

from __future__ import annotations

import os
from pathlib import Path

from moorage.fds import OPEN_FILES
from tests.upproc import moorage_up


def _soft_limit(pid: int) -> int:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            return int(line.split()[3])
    raise AssertionError("no open files limit in /proc/PID/limits")


def test_a_host_on_postgresql_raises_its_open_files_limit(tmp_path: Path, pg_url: str) -> None:
    data = tmp_path / "data"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOORAGE_")}
    env.update(MOORAGE_DATA_DIR=str(data), MOORAGE_PORT="0", MOORAGE_STORE_URL=pg_url,
               MOORAGE_SANDBOX_DRIVER="process", MOORAGE_LOG_LEVEL="warning")
    # Started as systemd starts a service: a soft limit far below the hard one.
    with moorage_up(data, env, tmp_path / "up.log", prefix=("prlimit", "--nofile=256:8192")) as (proc, _):
        assert _soft_limit(proc.pid) == min(8192, OPEN_FILES)
        assert "store: postgresql" in " ".join((tmp_path / "up.log").read_text().split()).lower()
