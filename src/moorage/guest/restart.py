"""The supervisor restarted in place (``sys.restart``): every other process of the guest killed, then a fresh
supervisor with the new environment. The kernel, its page cache and the disk stay.

On a micro-VM the process init starts is a *holder* (``hold``): the guest's Python with the supervisor's modules
imported and no event loop, no agent code, which forks the supervisor and stays its parent. A restart kills every
other process and forks a new supervisor from the holder, with the new environment: a fork where a new interpreter
spent about a second under TCG importing the same modules again (``asyncio`` alone ~0.6 s). A change of what an
interpreter reads as it starts (``STARTUP_PREFIXES``, ``STARTUP_KEYS``) executes the holder afresh instead, as does
a supervisor with no holder (a guest image from before it).

Stdlib only. A redeploy uses it when an instance's packages or environment changed (``runtime/instance_update.py``):
no module of the old packages stays imported (the holder never imported agent code), no process keeps the old
environment, as after a reboot.
"""

from __future__ import annotations

import base64
import importlib
import json
import os
import select
import signal
import socket
import sys
import time
from typing import Any, Dict, Iterable, List, Mapping, Optional

from .rpc import log

#: The environment the supervisor was last restarted with, for the guest's init should it start the supervisor again
#: (base64url JSON, as the kernel command line's ``moorage.env=``; /run is a tmpfs: a boot reads the command line).
ENV_FILE = "/run/moorage/boot-env"
_PF_KTHREAD = 0x00200000
#: How long the killed processes get to be gone before the restart goes on anyway.
REAP_S = 5.0
#: What a Python interpreter reads from the environment as it starts (its flags, locale, user site directory, time
#: zone) and the guest's list of extensions: a restart that changes one of them executes a fresh interpreter. Not
#: PYTHONPATH: the holder moves its entries on ``sys.path`` itself (``_swap_pythonpath``).
STARTUP_PREFIXES = ("PYTHON", "LC_", "MOORAGE_GUEST_")
STARTUP_KEYS = frozenset({"LANG", "LANGUAGE", "HOME", "TZ"})
#: The most a supervisor's restart request to its holder may hold (its environment, JSON).
MAX_REQUEST = 1 << 20
#: Changes when the supervisor's interpreter is started afresh, not when a holder forks a supervisor (``ping``).
INTERPRETER = os.urandom(8).hex()

#: In a supervisor forked by a holder: its end of the socket over which it asks for its restart.
_control: Optional[socket.socket] = None


def _others() -> List[int]:
    """Every process of the guest but PID 1 (init), this one and the kernel's threads."""
    me, pids = os.getpid(), []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) in (1, me):
            continue
        try:
            with open("/proc/%s/stat" % name) as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        if len(fields) > 6 and not int(fields[6]) & _PF_KTHREAD and fields[0] != "Z":
            pids.append(int(name))
    return pids


def kill_others(wait_s: float = REAP_S) -> int:
    """SIGKILL every other process (until none is left: a fork racing the first pass is caught by the next) and reap
    this process's children among them. Returns how many were killed."""
    killed: set = set()
    deadline = time.monotonic() + wait_s
    while True:
        left = _others()
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
            except OSError:
                pass
        try:
            while os.waitpid(-1, os.WNOHANG)[0] > 0:
                pass
        except ChildProcessError:
            pass
        if not left or time.monotonic() > deadline:
            if left:
                log("processes still there after the restart's kill", pids=left[:20])
            return len(killed)
        time.sleep(0.01)


def environment(base: Mapping[str, str], env: Mapping[str, str], unset: Iterable[str]) -> Dict[str, str]:
    """The new supervisor's environment: the one this supervisor started with (before it configured anything),
    without the keys the old spec set that the new one does not, with the new spec's."""
    drop = set(unset)
    out = {k: v for k, v in base.items() if k not in drop}
    out.update({str(k): str(v) for k, v in env.items()})
    return out


def save_env(env: Mapping[str, str], path: str = ENV_FILE) -> None:
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(base64.urlsafe_b64encode(json.dumps(dict(env)).encode()).decode())
    os.replace(tmp, path)


def exec_again(base: Mapping[str, str], env: "Mapping[str, str] | None", unset: Iterable[str]) -> None:
    """Kill every other process, then become a fresh supervisor (the same command line) with the new environment
    (``env`` None: the one it has). Does not return."""
    killed = kill_others()
    if env is not None:
        save_env(env)
    log("restarting in place", killed=killed, how="exec")
    _execute(environment(base, env or {}, unset))


def _execute(env: Mapping[str, str]) -> None:
    sys.stderr.flush()
    argv = list(getattr(sys, "orig_argv", None) or [sys.executable] + sys.argv)
    os.execve(sys.executable, [sys.executable] + argv[1:], dict(env))


def request(base: Mapping[str, str], env: "Mapping[str, str] | None", unset: Iterable[str]) -> None:
    """The supervisor's side of ``sys.restart``: ask the holder (which kills this process with the others), or,
    without one, execute itself afresh."""
    if _control is not None:
        try:
            _control.sendall(json.dumps({"env": None if env is None else dict(env), "unset": list(unset)}).encode()
                             + b"\n")
            return
        except OSError as e:
            log("the holder did not take the restart; executing afresh", error=str(e))
    exec_again(base, env, unset)


def forks_alike(started: Mapping[str, str], env: Mapping[str, str]) -> bool:
    """Whether a supervisor forked from an interpreter that started with ``started`` runs as one started afresh
    with ``env`` would: no variable it read as it started differs."""
    keys = {k for k in (*started, *env)
            if k in STARTUP_KEYS or (k.startswith(STARTUP_PREFIXES) and k != "PYTHONPATH")}
    return all(started.get(k) == env.get(k) for k in keys)


def _entries(pythonpath: str) -> List[str]:
    return [p for p in pythonpath.split(os.pathsep) if p]


def _swap_pythonpath(old: str, new: str) -> None:
    """``sys.path`` as an interpreter started with PYTHONPATH ``new`` has it, from one started with ``old``: its
    entries come just before the standard library's."""
    olds, news = _entries(old), _entries(new)
    if olds == news:
        return
    for entry in olds:
        if entry in sys.path:
            sys.path.remove(entry)
    stdlib = os.path.dirname(os.__file__)
    at = next((i for i, p in enumerate(sys.path) if p.endswith(".zip") or p == stdlib), len(sys.path))
    sys.path[at:at] = [p for p in news if p not in sys.path]


def _wait(pid: int, ctl: Optional[socket.socket]) -> Dict[str, Any]:
    """Wait for the supervisor ``pid``: its restart request (returned), or its end (this process ends with its
    status, and the guest's init starts a fresh supervisor, as without a holder)."""
    pidfd, buf = os.pidfd_open(pid), b""
    try:
        while True:
            ready, _, _ = select.select([pidfd] if ctl is None else [ctl, pidfd], [], [])
            if pidfd in ready:
                _, status = os.waitpid(pid, 0)
                code = os.waitstatus_to_exitcode(status)
                log("supervisor ended", pid=pid, code=code)
                os._exit(code if code >= 0 else 128 - code)
            assert ctl is not None
            data = ctl.recv(65536)
            if not data:
                ctl = None  # it closed its end: only its end is left to wait for
                continue
            buf += data
            line, nl, buf = buf.partition(b"\n")
            if not nl:
                buf = line
                if len(buf) > MAX_REQUEST:
                    log("restart request over the limit; dropped", bytes=len(buf))
                    buf = b""
                continue
            try:
                req = json.loads(line)
                env, unset = req["env"], req["unset"]
                if not ((env is None or (isinstance(env, dict) and all(isinstance(v, str) for v in env.values())))
                        and isinstance(unset, list) and all(isinstance(k, str) for k in unset)):
                    raise ValueError("env must be null or an object of strings, unset a list of strings")
            except (ValueError, KeyError, TypeError, RecursionError) as e:
                log("bad restart request; ignored", error=str(e)[:200])
                continue
            return req
    finally:
        os.close(pidfd)


def _libc() -> Any:
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True)
    except (ImportError, OSError) as e:
        log("no libc through ctypes: a supervisor may outlive its holder", error=str(e))
        return None


def _die_with_parent(libc: Any) -> None:
    """A supervisor whose holder is gone is killed (PR_SET_PDEATHSIG): init then starts a new pair, and no orphaned
    supervisor competes with it for the channel."""
    if libc is not None and libc.prctl(1, signal.SIGKILL, 0, 0, 0) != 0:  # PR_SET_PDEATHSIG
        log("no parent-death signal for the supervisor")
    if os.getppid() == 1:  # the holder died before the call above
        os._exit(1)


def hold() -> None:
    """Become the holder (see the module; the caller imported what every supervisor needs): fork the supervisor,
    and on its restart request kill every other process and fork a new one. Returns only in a supervisor child.
    Without ``os.pidfd_open`` it returns at once: the supervisor is this process and restarts by executing itself."""
    global _control
    if not hasattr(os, "pidfd_open"):
        return
    started, libc = dict(os.environ), _libc()  # ctypes loaded here once, not in each supervisor
    while True:
        mine, theirs = socket.socketpair()
        pid = os.fork()
        if pid == 0:
            mine.close()
            _control = theirs
            _die_with_parent(libc)
            return
        theirs.close()
        req = _wait(pid, mine)
        mine.close()
        killed = kill_others()
        env = environment(os.environ, req["env"] or {}, req["unset"])
        if req["env"] is not None:
            save_env(req["env"])
        if not forks_alike(started, env):
            log("restarting in place", killed=killed, how="exec")
            _execute(env)
        _swap_pythonpath(os.environ.get("PYTHONPATH", ""), env.get("PYTHONPATH", ""))
        os.environ.clear()
        os.environ.update(env)
        importlib.invalidate_caches()  # packages installed since: their directories are looked at again
        log("restarting in place", killed=killed, how="fork")
