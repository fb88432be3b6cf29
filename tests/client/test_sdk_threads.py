"""One ``Client`` shared by the threads of a backend (a Flask or Django worker does so): each thread's calls, turns
and streams get their own answers from a real ``moorage up``, every mutating request its own idempotency key, and
the client's record of attempts keeps every one of them."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

import pytest

from moorage import Client
from moorage.devservices.fleet import LocalHost
from tests.api.conftest import agent_archive

USERS = 8
THREADS = 16


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalHost]:
    server = LocalHost("up", tmp_path_factory.mktemp("threads") / "data", {"MOORAGE_LOG_LEVEL": "warning"},
                       start_timeout_s=120)
    try:
        yield server
    finally:
        server.stop()


def test_one_client_shared_by_many_threads(host: LocalHost, tmp_path: Path) -> None:
    sdk = Client(host.url, host.key)
    sdk.deploy("echo", agent_archive(tmp_path))
    sent_keys: list[str] = []
    keys_lock = threading.Lock()
    real_request = sdk._http.request

    def recording_request(method: str, url: str, **kw):  # type: ignore[no-untyped-def]
        key = (kw.get("headers") or {}).get("Idempotency-Key")
        if key:
            with keys_lock:
                sent_keys.append(key)
        return real_request(method, url, **kw)

    sdk._http.request = recording_request  # type: ignore[method-assign]
    start = threading.Barrier(THREADS)

    def backend_request(i: int) -> list[str]:
        user = f"cust-{i % USERS}"
        start.wait()  # every thread at once
        seen = [sdk.put_user("echo", user, metadata={"n": str(i % USERS)})["id"]]
        seen.append(sdk.invoke("echo", f"hello {i}", user=user)["reply"])
        seen.append(sdk.invoke("echo", "whoami", user=user)["reply"])
        events = list(sdk.stream("echo", f"stream {i} {user}", user=user))
        seen.append("".join(e["data"]["data"] for e in events if e["event"] == "token"))
        seen.append(sdk.get_user("echo", user)["metadata"]["n"])
        return seen

    try:
        with ThreadPoolExecutor(THREADS) as pool:
            answers = list(pool.map(backend_request, range(THREADS)))
        for i, seen in enumerate(answers):
            user = f"cust-{i % USERS}"
            assert seen == [user, f"echo: hello {i}", f"user={user}", f"{i} {user} ", str(i % USERS)], (i, seen)
        # put_user and two invokes per thread (a stream is sent by _http.stream): each its own key, never one shared.
        assert len(sent_keys) == 3 * THREADS and len(set(sent_keys)) == len(sent_keys)
        assert len(sdk.attempts) >= 5 * THREADS + 1
        assert sorted({u["id"] for u in sdk.paginate(sdk.list_users, "echo")}) == [f"cust-{n}" for n in range(USERS)]
    finally:
        sdk.close()


def test_a_client_made_before_a_fork_serves_parent_and_worker_apart(host: LocalHost) -> None:
    """A pre-fork server (gunicorn --preload, uWSGI) makes the client at import, then forks its workers: a worker
    must not talk over the parent's pooled connection, or each reads the other's answers."""
    sdk = Client(host.url, host.key)
    sdk.deploy("echo-fork", agent_archive(Path(host.data.parent), "echo-fork"))
    for name in ("parent", "worker"):
        sdk.put_user("echo-fork", name, metadata={"who": name})
    assert sdk.get_user("echo-fork", "parent")["metadata"] == {"who": "parent"}  # a kept-alive connection now
    rounds = 60
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the worker
        os.close(read)
        wrong = 0
        try:
            for _ in range(rounds):
                try:
                    wrong += sdk.get_user("echo-fork", "worker")["metadata"] != {"who": "worker"}
                except Exception:  # noqa: BLE001 - a garbled answer counts as a wrong one
                    wrong += 1
        finally:
            os.write(write, str(wrong).encode())
            os._exit(0)
    os.close(write)
    wrong = 0
    for _ in range(rounds):
        try:
            wrong += sdk.get_user("echo-fork", "parent")["metadata"] != {"who": "parent"}
        except Exception:  # noqa: BLE001
            wrong += 1
    os.waitpid(pid, 0)
    worker_wrong = int(os.read(read, 64) or b"-1")
    os.close(read)
    sdk.close()
    assert (wrong, worker_wrong) == (0, 0)
