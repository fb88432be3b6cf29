"""The guest's child watcher (``guest/children.py``): asyncio children are waited for on a pidfd by the loop that
started them, with no thread per child, and their exit statuses are asyncio's; a process left running is reaped
the same way. Run in a fresh interpreter: the
watcher is process-wide, as it is in the guest. (That a command runs in a sandbox's last process slot, on both
drivers: ``test_conformance.py::test_exec_needs_one_process_slot_only``.)"""

from __future__ import annotations

import json
import subprocess
import sys

SCRIPT = r"""
import asyncio, json, os, subprocess, threading
from moorage.guest import children

installed = children.install()


async def run(*argv, **kw):
    p = await asyncio.create_subprocess_exec(*argv, **kw)
    await p.wait()
    return p.returncode


async def main():
    out = {"ok": await run("true"), "three": await run("sh", "-c", "exit 3"),
           "killed": await run("sh", "-c", "kill -9 $$")}
    # While a child runs, nothing but this thread is watching it.
    p = await asyncio.create_subprocess_exec("sleep", "0.3")
    out["threads_while_running"] = threading.active_count()
    await p.wait()
    # Output through pipes, as the guest's exec reads it.
    p = await asyncio.create_subprocess_exec("sh", "-c", "echo out; echo err >&2",
                                             stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    o, e = await p.communicate()
    out["pipes"] = [o.decode(), e.decode(), p.returncode]
    # Ten at once.
    out["many"] = await asyncio.gather(*(run("sh", "-c", "exit %d" % i) for i in range(10)))
    # A process left running (ctx.spawn) is reaped once it ends, by the loop: no zombie, no thread meanwhile.
    left = subprocess.Popen(["sh", "-c", "sleep 0.3; exit 4"])
    children.reap(left)
    out["threads_while_left"] = threading.active_count()
    for _ in range(100):
        await asyncio.sleep(0.05)
        if left.returncode is not None:
            break
    out["left"] = [left.returncode, os.path.exists("/proc/%d" % left.pid)]
    return out


result = asyncio.run(main())
# An agent's own event loop, in a worker thread, starts and waits for its own child.
box = []
t = threading.Thread(target=lambda: box.append(asyncio.run(run("sh", "-c", "exit 5"))))
t.start()
t.join(30)
result["thread_loop"] = box
result["installed"] = installed
print(json.dumps(result))
"""


def test_children_are_waited_for_without_a_thread_each() -> None:
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stderr == ""  # no warning (deprecation, unclosed transports) either
    r = json.loads(out.stdout)
    assert r["installed"] is (sys.version_info < (3, 12))
    assert (r["ok"], r["three"], r["killed"]) == (0, 3, -9)
    assert r["threads_while_running"] == 1
    assert r["pipes"] == ["out\n", "err\n", 0]
    assert r["many"] == list(range(10))
    assert r["thread_loop"] == [5]
    assert r["threads_while_left"] == 1 and r["left"] == [4, False]
