"""The supervisor restarted in place (``sys.restart``): every other process of the guest killed, then the supervisor
executes itself afresh with a new environment. The kernel, its page cache and the disk stay: on a micro-VM this is a
new interpreter (about a second under TCG) where a restart of the VM is a cold boot (about ten).

Stdlib only. A redeploy uses it when an instance's packages or environment changed (``runtime/instance_update.py``):
no module of the old packages stays imported, no process keeps the old environment, as after a reboot.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import sys
import time
from typing import Dict, Iterable, List, Mapping

from .rpc import log

#: The environment the supervisor was last restarted with, for the guest's init should it start the supervisor again
#: (base64url JSON, as the kernel command line's ``moorage.env=``; /run is a tmpfs: a boot reads the command line).
ENV_FILE = "/run/moorage/boot-env"
_PF_KTHREAD = 0x00200000
#: How long the killed processes get to be gone before the supervisor executes itself anyway.
REAP_S = 5.0


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
    log("restarting in place", killed=killed)
    sys.stderr.flush()
    argv = list(getattr(sys, "orig_argv", None) or [sys.executable] + sys.argv)
    os.execve(sys.executable, [sys.executable] + argv[1:], environment(base, env or {}, unset))
