"""A hostile start-up: many threads and processes open the end-user token secret at once, a crash leaves it
empty, and forged tokens leave out the key id. The HMAC key is never empty and every token can be revoked.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from moorage.api.auth import MIN_SECRET_CHARS, USER_TOKEN_PREFIX, Authenticator, load_or_create_secret
from moorage.errors import ConfigError, Unauthenticated
from moorage.store import Store
from tests.attacks.api_support import sqlite_store  # noqa: F401 - fixtures, found by name

THREADS = 12
PROCESSES = 4
ROUNDS = 30


def _open_in_process(path: str, start: float, out: "multiprocessing.Queue[str]") -> None:
    while time.time() < start:  # all processes leave the gate together
        pass
    out.put(load_or_create_secret(Path(path)))


def _race(path: Path) -> list[str]:
    """Every thread and process opens ``path`` at the same moment; returns what each one got."""
    ctx = multiprocessing.get_context("fork")
    queue: multiprocessing.Queue[str] = ctx.Queue()
    start = time.time() + 0.3
    procs = [ctx.Process(target=_open_in_process, args=(str(path), start, queue)) for _ in range(PROCESSES)]
    for p in procs:
        p.start()
    barrier = threading.Barrier(THREADS)
    got: list[str] = []

    def opener() -> None:
        barrier.wait()
        got.append(load_or_create_secret(path))

    threads = [threading.Thread(target=opener) for _ in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    got += [queue.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    return got


def test_racing_openers_all_get_the_same_full_secret(tmp_path: Path) -> None:
    for i in range(ROUNDS):
        path = tmp_path / f"round{i}" / "api" / "token-secret"
        got = _race(path)
        assert len(got) == THREADS + PROCESSES
        assert len(set(got)) == 1, f"round {i}: openers saw different secrets"
        assert len(got[0]) >= MIN_SECRET_CHARS
        assert path.read_text().strip() == got[0]
        assert path.stat().st_mode & 0o777 == 0o600
        assert path.parent.stat().st_mode & 0o777 == 0o700
        assert not [p.name for p in path.parent.iterdir() if p.name.endswith(".tmp")]


def test_an_empty_secret_left_by_a_crash_is_replaced_never_used(tmp_path: Path) -> None:
    path = tmp_path / "api" / "token-secret"
    path.parent.mkdir(parents=True)
    path.write_text("")  # what the old creation left when the host died between create and write
    got = _race(path)
    assert len(set(got)) == 1 and len(got[0]) >= MIN_SECRET_CHARS
    assert path.read_text().strip() == got[0]


def test_a_crash_mid_creation_leaves_no_secret_file(tmp_path: Path) -> None:
    """SIGKILL the creating process after its temp file is written but before it is linked into place."""
    path = tmp_path / "api" / "token-secret"
    code = (
        "import os, signal, sys\n"
        "from pathlib import Path\n"
        "from moorage.api import auth\n"
        "os.link = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)\n"
        f"auth.load_or_create_secret(Path({str(path)!r}))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120)
    assert r.returncode == -signal.SIGKILL, r.stderr.decode()
    assert not path.exists(), "a reader could have seen a secret that was never completely written"
    secret = load_or_create_secret(path)
    assert len(secret) >= MIN_SECRET_CHARS and path.read_text().strip() == secret


def test_a_short_secret_is_refused_loudly(sqlite_store: Store, tmp_path: Path) -> None:
    path = tmp_path / "token-secret"
    path.write_text("abc\n")
    with pytest.raises(ConfigError, match="only 3 characters"):
        load_or_create_secret(path)
    with pytest.raises(ConfigError):
        Authenticator(sqlite_store, "", "operator")  # an empty HMAC key never makes an authenticator


def _forge(auth_key: bytes, payload: dict) -> str:
    body = base64.urlsafe_b64encode(json.dumps(payload, separators=(",", ":")).encode()).rstrip(b"=").decode()
    sig = base64.urlsafe_b64encode(hmac.new(auth_key, body.encode(), hashlib.sha256).digest()).rstrip(b"=").decode()
    return f"{USER_TOKEN_PREFIX}{body}.{sig}"


def test_tokens_without_a_key_id_are_refused_and_revocation_always_applies(sqlite_store: Store, tmp_path: Path) -> None:
    tenant, admin = sqlite_store.operator.create_tenant("acme")
    auth = Authenticator.for_data_dir(sqlite_store, tmp_path / "data")
    principal = sqlite_store.authenticate(admin.secret)
    token = auth.issue_user_token(principal, "agent", "alice")
    assert auth.authenticate(f"Bearer {token.token}").user == "alice"

    # Even a correctly signed token (the secret leaked) is refused when it names no issuing key.
    secret = (tmp_path / "data" / "api" / "token-secret").read_text().strip()
    key = hashlib.sha256(b"moorage-user-token\0" + secret.encode()).digest()
    claims = {"v": 1, "t": tenant.id, "a": "agent", "u": "alice", "exp": int(time.time()) + 600, "n": "x"}
    for bad in ({**claims}, {**claims, "k": None}, {**claims, "k": ""}, {**claims, "k": "no-such-key"}):
        with pytest.raises(Unauthenticated):
            auth.authenticate(f"Bearer {_forge(key, bad)}")
    assert auth.authenticate(f"Bearer {_forge(key, {**claims, 'k': principal.key_id})}").user == "alice"

    sqlite_store.backend.revoke_api_key(tenant.id, principal.key_id)
    with pytest.raises(Unauthenticated, match="revoked"):
        auth.authenticate(f"Bearer {token.token}")


def test_secret_files_of_a_data_dir_are_private(sqlite_store: Store, tmp_path: Path) -> None:
    Authenticator.for_data_dir(sqlite_store, tmp_path / "data")
    api = tmp_path / "data" / "api"
    assert api.stat().st_mode & 0o777 == 0o700
    for name in ("token-secret", "operator-token", "metrics-token"):
        assert (api / name).stat().st_mode & 0o777 == 0o600
        assert len((api / name).read_text().strip()) >= MIN_SECRET_CHARS
    os.chmod(api / "operator-token", 0o644)  # widened by hand: narrowed again on the next start
    Authenticator.for_data_dir(sqlite_store, tmp_path / "data")
    assert (api / "operator-token").stat().st_mode & 0o777 == 0o600
