"""The admin socket of a running `moorage up` (`<data_dir>/admin.sock`, runtime/admin_socket.py) takes requests
only from the user the host runs as, or root: the socket file is mode 0600 (another user cannot connect), and a
peer of another uid that reaches it anyway is refused before its request is read (no backup starts)."""

from __future__ import annotations

import ctypes
import json
import os
import socket
import stat
from pathlib import Path
from typing import Callable

from moorage.devservices.fleet import LocalHost

NOBODY = 65534


def as_other_user(become: Callable[[], None], ask: Callable[[], str]) -> str:
    """``ask()``'s answer from a child process that ran ``become()`` first (to take on another uid), or the
    exception it raised, as ``ExceptionName: text``."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: only system calls and the socket module until _exit
        code = 0
        try:
            os.close(r)
            become()
            answer = ask()
        except BaseException as e:  # noqa: BLE001 - what the parent reads
            answer, code = f"{type(e).__name__}: {e}", 1
        os.write(w, answer.encode())
        os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        answer = f.read().decode()
    os.waitpid(pid, 0)
    return answer


def request(path: str | Path, dest: Path) -> Callable[[], str]:
    def ask() -> str:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(30)
            s.connect(str(path))
            try:
                s.sendall(json.dumps({"op": "backup", "dest": str(dest)}).encode() + b"\n")
            except BrokenPipeError:
                pass  # a refused peer: the host answered and closed before reading anything; its answer is here
            return s.makefile("rb").readline().decode()
    return ask


def nobody_reaching_files_as_root() -> None:
    """uid ``NOBODY`` to the socket's peer check (its effective uid), root's to file permissions (its filesystem
    uid): it connects whatever the socket file's mode, so the peer check alone must refuse it."""
    os.setresuid(0, NOBODY, 0)
    ctypes.CDLL(None, use_errno=True).setfsuid(0)


def nobody() -> None:
    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)


def test_the_admin_socket_refuses_another_uid_and_is_its_owners_only(tmp_path: Path) -> None:
    assert os.getuid() == 0, "the tests run as root: the child takes on another uid"
    data, dest = tmp_path / "data", tmp_path / "backup"
    host = LocalHost("box", data, {"MOORAGE_LOG_LEVEL": "warning"}, start_timeout_s=300)
    try:
        sock = data / "admin.sock"
        st = os.lstat(sock)
        assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.getuid()

        # Another uid that reaches the socket is refused by the peer check, before its request is read.
        answer = as_other_user(nobody_reaching_files_as_root, request(sock, dest))
        event = json.loads(answer)
        assert event["event"] == "error" and event["code"] == "tenant-scope", event
        assert event["message"] == f"uid {NOBODY} may not use this host's admin socket", event
        assert not dest.exists()

        # Another uid with its own file permissions cannot connect at all: the socket's mode (its directory
        # opened to it here, and reached from inside, so only the socket file's own mode stands in the way).
        mode = stat.S_IMODE(os.stat(data).st_mode)
        os.chmod(data, 0o711)
        try:
            def from_inside() -> None:
                os.chdir(data)
                nobody()

            answer = as_other_user(from_inside, request("admin.sock", dest))
        finally:
            os.chmod(data, mode)
        assert answer.startswith("PermissionError"), answer
        assert not dest.exists()

        # The host's own user still may.
        assert json.loads(as_other_user(lambda: None, request(sock, tmp_path / "no-such" / "b")))["message"] \
            == f"{tmp_path / 'no-such'} is not a directory"
    finally:
        host.stop()
