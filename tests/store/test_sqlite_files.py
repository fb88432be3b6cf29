"""SQLite backend housekeeping: a thread's connections close when the thread ends."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading
from pathlib import Path

from moorage.store import Scope, Store
from moorage.store.sqlite import SQLiteBackend


def _open_fds_to(path: Path) -> int:
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}") == str(path):
                n += 1
        except OSError:
            pass
    return n


def test_connections_of_finished_threads_are_closed(tmp_path: Path) -> None:
    backend = SQLiteBackend(tmp_path / "store")
    store = Store(backend)
    _, key = store.operator.create_tenant("threads")
    ts = store.tenant(store.authenticate(key.secret))
    scope = Scope.for_user("bot", "u")
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            ts.state.put(scope, f"k{i}", i, expected_version=0)
        except BaseException as e:  # surfaced below
            errors.append(e)

    for batch in range(4):
        threads = [threading.Thread(target=work, args=(batch * 10 + i,)) for i in range(10)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors, errors
    gc.collect()
    tenant_file = backend.tenant_path(ts.tenant_id)
    # 40 threads each opened the tenant file; only this thread's connections (if any) remain.
    assert backend._files.open_count() <= 3, backend._files.open_count()
    # SQLite keeps a closed connection's descriptor while other connections of the process have the file
    # open (POSIX locks are per process) and reuses it for the next one: the count stays near the ten
    # threads that ran at once, instead of growing by one per thread that ever ran (41).
    assert _open_fds_to(tenant_file) <= 15
    # Everything the threads wrote is there, and this thread can still use the store.
    assert sorted(ts.state.get(scope, f"k{i}").value for i in range(40)) == list(range(40))
    store.close()


def test_opening_a_store_raises_the_soft_open_files_limit(tmp_path: Path) -> None:
    # A process started with the common soft limit of 1024 (or less) gets room for many tenants' files.
    code = (
        "import resource, sys\n"
        "from pathlib import Path\n"
        "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))\n"
        "from moorage.fds import OPEN_FILES\n"
        "from moorage.store.sqlite import SQLiteBackend\n"
        "SQLiteBackend(Path(sys.argv[1])).close()\n"
        "now = resource.getrlimit(resource.RLIMIT_NOFILE)[0]\n"
        "want = OPEN_FILES if hard == resource.RLIM_INFINITY else min(hard, OPEN_FILES)\n"
        "assert now == max(256, want), (now, hard)\n"
        "print('soft', now)\n"
    )
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "store")], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.split()[-1]) > 256


def test_a_thread_keeps_a_bounded_number_of_connections_never_closing_one_in_a_transaction(tmp_path: Path) -> None:
    backend = SQLiteBackend(tmp_path / "store")
    backend._files._per_thread = 3
    store = Store(backend)
    tenants = []
    for i in range(6):
        _, key = store.operator.create_tenant(f"lru{i}")
        tenants.append(store.tenant(store.authenticate(key.secret)))
    scope = Scope.for_user("bot", "u")
    files = [backend.tenant_path(ts.tenant_id) for ts in tenants]
    # Tenant 0's transaction stays open while this thread works on five other tenants' files.
    with tenants[0].transaction():
        tenants[0].state.put(scope, "held", "open", expected_version=0)
        for ts in tenants[1:]:
            ts.state.put(scope, "k", ts.tenant_id, expected_version=0)
        assert _open_fds_to(files[0]) >= 1  # still open: it is inside a transaction
    gc.collect()
    assert sum(1 for f in files if _open_fds_to(f)) <= 3
    # Everything committed, the held transaction included; evicted tenants reopen on use.
    assert tenants[0].state.get(scope, "held").value == "open"
    for ts in tenants[1:]:
        assert ts.state.get(scope, "k").value == ts.tenant_id
    store.close()


_CLOSE_UNDER_A_TRANSACTION = """
import sqlite3, sys, threading, time
from pathlib import Path
from moorage.errors import TenantScopeError
from moorage.store import Scope, Store
from moorage.store.sqlite import SQLiteBackend

backend = SQLiteBackend(Path(sys.argv[1]))
store = Store(backend)
_, key = store.operator.create_tenant("closing")
ts = store.tenant(store.authenticate(key.secret))
scope = Scope.for_user("bot", "u")
inside, closed, outcome = threading.Event(), threading.Event(), []

def writer():
    with ts.transaction():
        ts.state.put(scope, "k", "v", expected_version=0)
        inside.set()
        time.sleep(0.5)  # the other thread closes meanwhile: it must wait for this commit
    outcome.append("committed")
    closed.wait(30)
    try:
        ts.state.get(scope, "k")
    except (sqlite3.ProgrammingError, TenantScopeError) as e:  # a clean error, not a crash
        outcome.append(type(e).__name__)

t = threading.Thread(target=writer)
t.start()
inside.wait()
t0 = time.monotonic()
if sys.argv[2] == "close":
    backend.close()
else:
    store.operator.delete_tenant(ts.tenant_id)
waited = time.monotonic() - t0
closed.set()
t.join()
print(sys.argv[2], outcome, round(waited, 2))
"""


def _close_under_a_transaction(tmp_path: Path, how: str) -> str:
    out = subprocess.run([sys.executable, "-c", _CLOSE_UNDER_A_TRANSACTION, str(tmp_path / how), how],
                         capture_output=True, text=True, timeout=120)
    # Closing a connection another thread is using freed the database under its statement: a segfault.
    assert out.returncode == 0, (out.returncode, out.stderr[-3000:])
    return out.stdout


def test_closing_the_store_waits_for_another_threads_transaction(tmp_path: Path) -> None:
    for _ in range(3):
        line = _close_under_a_transaction(tmp_path / str(_), "close")
        assert "'committed'" in line and "ProgrammingError" in line, line
        assert float(line.split()[-1]) >= 0.3, line  # close waited for the commit


def test_dropping_a_tenant_waits_for_another_threads_transaction(tmp_path: Path) -> None:
    line = _close_under_a_transaction(tmp_path, "drop")
    assert "'committed'" in line and "TenantScopeError" in line, line
    assert float(line.split()[-1]) >= 0.3, line
