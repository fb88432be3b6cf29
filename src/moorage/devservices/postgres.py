"""A throwaway PostgreSQL cluster from Debian's package, on a free loopback port, for tests and benchmarks.

The cluster runs as the ``postgres`` OS user (PostgreSQL refuses root) with a non-superuser owner role
``moorage_owner`` owning database ``moorage``, so forced row-level security binds the owner as well.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from moorage.errors import UnavailableError


def _bindir() -> Path:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    if not found:
        raise UnavailableError("PostgreSQL server binaries not found", hint="apt-get install postgresql")
    return Path(found[-1]).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class PostgresCluster:
    root: Path
    port: int
    bindir: Path
    _as_postgres: list[str]

    @property
    def superuser_url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    @property
    def owner_url(self) -> str:
        return f"postgresql://moorage_owner@127.0.0.1:{self.port}/moorage"

    def url_for(self, db: str, user: str = "moorage_owner") -> str:
        return f"postgresql://{user}@127.0.0.1:{self.port}/{db}"

    def psql(self, sql: str, db: str = "postgres", user: str = "postgres") -> str:
        out = subprocess.run(
            [str(self.bindir / "psql"), "-h", "127.0.0.1", "-p", str(self.port), "-U", user, "-d", db,
             "-v", "ON_ERROR_STOP=1", "-Atq", "-c", sql],
            capture_output=True, text=True, timeout=60,
        )
        if out.returncode != 0:
            raise RuntimeError(out.stderr.strip())
        return out.stdout

    def create_database(self, name: str, owner: str = "moorage_owner") -> str:
        self.psql(f'CREATE DATABASE "{name}" OWNER {owner}')
        return self.url_for(name)

    def stop(self, *, remove_after: bool = False) -> None:
        """Stop the server and remove its files; ``remove_after``: by a process left to do it (a cluster that held
        hundreds of databases is tens of thousands of files: half a minute to remove), so the caller need not wait."""
        subprocess.run([*self._as_postgres, str(self.bindir / "pg_ctl"), "-D", str(self.root / "data"), "-m", "immediate",
                        "stop"], capture_output=True, timeout=60)
        if remove_after:
            subprocess.Popen(["rm", "-rf", "--", str(self.root)], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)
        else:
            shutil.rmtree(self.root, ignore_errors=True)


def start_cluster(max_connections: int = 200, root: Path | None = None) -> PostgresCluster:
    """initdb + start on a free port; returns when it accepts connections. Caller must ``stop()``. ``root``: an
    empty directory of the caller's for the cluster (a small filesystem of a disk-full test); a new one if None."""
    bindir = _bindir()
    root = root or Path(tempfile.mkdtemp(prefix="moorage-pg-"))
    as_postgres: list[str] = []
    if os.geteuid() == 0:
        try:
            pw = pwd.getpwnam("postgres")
        except KeyError as e:
            raise UnavailableError("no 'postgres' OS user to run the cluster as", hint="apt-get install postgresql") from e
        os.chown(root, pw.pw_uid, pw.pw_gid)
        as_postgres = ["runuser", "-u", "postgres", "--"]
    data = root / "data"
    r = subprocess.run([*as_postgres, str(bindir / "initdb"), "-D", str(data), "-U", "postgres", "--auth=trust",
                        "--no-sync", "-E", "UTF8", "--locale=C.UTF-8"], capture_output=True, text=True, timeout=180)
    if r.returncode != 0:
        raise UnavailableError(f"initdb failed: {r.stderr.strip()}")
    port = free_port()
    opts = (f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c max_connections={max_connections} "
            "-c shared_buffers=64MB -c fsync=on -c synchronous_commit=on")
    r = subprocess.run([*as_postgres, str(bindir / "pg_ctl"), "-D", str(data), "-l", str(root / "log"), "-o", opts, "-w",
                        "-t", "60", "start"], capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        log = (root / "log").read_text() if (root / "log").exists() else ""
        raise UnavailableError(f"PostgreSQL did not start: {r.stderr.strip()} {log[-500:]}")
    cluster = PostgresCluster(root, port, bindir, as_postgres)
    deadline = time.time() + 30
    while True:
        try:
            cluster.psql("SELECT 1")
            break
        except RuntimeError:
            if time.time() > deadline:
                cluster.stop()
                raise
            time.sleep(0.2)
    cluster.psql("CREATE ROLE moorage_owner LOGIN CREATEROLE NOSUPERUSER NOBYPASSRLS")
    cluster.create_database("moorage")
    return cluster
