"""The guest's restart in place (``guest/restart.py``) run for real, in a PID namespace of its own (bubblewrap) so
that its "kill every other process" reaches only what it started: the holder forks each supervisor, a restart is a
fork unless what an interpreter reads as it starts changed, and a supervisor's own end ends the holder."""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import moorage
from moorage.guest import restart

# Each generation of "supervisor" reports what it sees, then asks for the next restart.
SCRIPT = r'''
import json, os, subprocess, sys, time
from moorage.guest import restart
restart.hold()
gen = int(os.environ.get("GEN", "1"))
try:
    import canary
    found = canary.VALUE
except ImportError:
    found = None
others = []
for n in os.listdir("/proc"):
    if n.isdigit() and int(n) not in (1, os.getpid(), os.getppid()):
        try:
            with open("/proc/%s/comm" % n) as f:
                others.append(f.read().strip())
        except OSError:
            pass
print(json.dumps({"gen": gen, "pid": os.getpid(), "ppid": os.getppid(), "interp": restart.INTERPRETER,
                  "A": os.environ.get("A"), "LANG": os.environ.get("LANG"), "held": restart._control is not None,
                  "canary": found, "others": others}), flush=True)
if gen == 1:
    subprocess.Popen(["sleep", "600"])  # an agent's background process: gone after the restart
    restart.request(dict(os.environ), {"GEN": "2", "A": "1", "PYTHONPATH": sys.argv[1]}, [])
elif gen == 2:
    with open("/run/moorage/boot-env") as f:
        print(f.read(), flush=True)
    restart.request(dict(os.environ), {"GEN": "3", "LANG": "C"}, ["A"])
else:
    sys.exit(7)
time.sleep(60)
'''


def test_a_restart_forks_a_new_supervisor_from_the_holder_unless_the_interpreter_must_start_afresh(
        tmp_path: Path) -> None:
    bwrap = shutil.which("bwrap")
    assert bwrap, "bubblewrap is installed by scripts/test.sh"
    (tmp_path / "pp").mkdir()
    (tmp_path / "pp" / "canary.py").write_text('VALUE = "new packages"\n')
    (tmp_path / "script.py").write_text(SCRIPT)
    src = str(Path(moorage.__file__).parent.parent)
    proc = subprocess.run(
        [bwrap, "--unshare-pid", "--dev-bind", "/", "/", "--proc", "/proc", "--tmpfs", "/run", "--die-with-parent",
         "--setenv", "PYTHONPATH", src, "--setenv", "LANG", "C.UTF-8", "--unsetenv", "A", "--unsetenv", "GEN",
         sys.executable, str(tmp_path / "script.py"), str(tmp_path / "pp")],
        capture_output=True, text=True, timeout=60)
    lines = proc.stdout.splitlines()
    gen1, gen2, gen3 = json.loads(lines[0]), json.loads(lines[1]), json.loads(lines[3])
    assert gen1["held"] and gen1["canary"] is None and gen1["A"] is None, proc.stderr

    # Only the environment changed (PYTHONPATH included): a fork of the same interpreter, with the new environment,
    # the new path's modules importable, and no other process left.
    assert gen2["interp"] == gen1["interp"] and gen2["pid"] != gen1["pid"] and gen2["ppid"] == gen1["ppid"]
    assert gen2["A"] == "1" and gen2["canary"] == "new packages" and gen2["others"] == []
    # What the guest's init would start the next supervisor with, should it have to.
    assert json.loads(base64.urlsafe_b64decode(lines[2])) == {"GEN": "2", "A": "1", "PYTHONPATH": str(tmp_path / "pp")}

    # LANG is read as an interpreter starts: a fresh one (the holder executed itself), dropped keys gone.
    assert gen3["interp"] != gen1["interp"] and gen3["held"] and gen3["ppid"] == gen1["ppid"]
    assert gen3["A"] is None and gen3["LANG"] == "C" and gen3["canary"] == "new packages"

    # A supervisor that ends on its own ends the holder with its status (the guest's init starts another).
    assert proc.returncode == 7, proc.stderr
    events = [json.loads(l)["event"] + ":" + str(json.loads(l).get("how", "")) for l in proc.stderr.splitlines()
              if l.startswith("{")]
    assert events == ["restarting in place:fork", "restarting in place:exec", "supervisor ended:"], proc.stderr


def test_what_a_forked_supervisor_shares_with_its_holder() -> None:
    started = {"LANG": "C.UTF-8", "HOME": "/root", "PYTHONDONTWRITEBYTECODE": "1", "PATH": "/bin"}
    assert restart.forks_alike(started, {**started, "PATH": "/usr/bin", "MOORAGE_NETWORK": "1",
                                         "PYTHONPATH": "/work/.moorage/site", "HTTP_PROXY": "http://10.0.2.2:3128"})
    for key, value in [("LANG", "C"), ("HOME", "/work"), ("TZ", "UTC"), ("PYTHONHASHSEED", "0"),
                       ("LC_ALL", "C"), ("MOORAGE_GUEST_EXTENSIONS", "x"), ("PYTHONDONTWRITEBYTECODE", None)]:
        env = {**started, key: value}
        if value is None:
            del env[key]
        assert not restart.forks_alike(started, env), key


def test_pythonpath_entries_move_where_a_fresh_interpreter_puts_them(monkeypatch) -> None:
    stdlib = os.path.dirname(os.__file__)
    monkeypatch.setattr(sys, "path", ["/opt/moorage", "/opt/moorage/guest", "/old", "/usr/lib/python311.zip",
                                      stdlib, "/usr/lib/python3/dist-packages"])
    restart._swap_pythonpath("/old", "/new:/also")
    assert sys.path == ["/opt/moorage", "/opt/moorage/guest", "/new", "/also", "/usr/lib/python311.zip", stdlib,
                        "/usr/lib/python3/dist-packages"]
    restart._swap_pythonpath("/new:/also", "")
    assert sys.path == ["/opt/moorage", "/opt/moorage/guest", "/usr/lib/python311.zip", stdlib,
                        "/usr/lib/python3/dist-packages"]


ORPHAN = r'''
import os, signal, time
holder = os.fork()
if holder == 0:
    from moorage.guest import restart
    restart.hold()
    os.kill(os.getppid(), signal.SIGKILL)  # the supervisor's holder dies
    time.sleep(30)
    os._exit(0)
os.waitpid(holder, 0)  # this process stands for the guest's init: the holder it started is gone
time.sleep(1.0)
left = []
for n in os.listdir("/proc"):
    if n.isdigit() and int(n) not in (1, os.getpid()):
        with open("/proc/%s/stat" % n) as f:
            if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                left.append(n)
print("left", left, flush=True)
'''


def test_a_supervisor_does_not_outlive_its_holder(tmp_path: Path) -> None:
    """Killed with it (the guest's init then starts a new pair; an orphan would compete for the channel)."""
    (tmp_path / "orphan.py").write_text(ORPHAN)
    src = str(Path(moorage.__file__).parent.parent)
    proc = subprocess.run([shutil.which("bwrap") or "bwrap", "--unshare-pid", "--dev-bind", "/", "/", "--proc", "/proc",
                           "--tmpfs", "/run", "--die-with-parent", "--setenv", "PYTHONPATH", src,
                           sys.executable, str(tmp_path / "orphan.py")], capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip() == "left []", (proc.stdout, proc.stderr)
