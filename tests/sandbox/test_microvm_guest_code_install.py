"""The install that brings a micro-VM's guest code up to date (``sandbox/microvm_guest_code._INSTALL``) is cut short
at every file-system step it takes, as a VM stopped hard there would be: the guest code's directory then holds a
whole package, the old one or the new one, and the next install (the next wake's) leaves the new one alone there.

The script runs here as it runs in the guest (the same Python code, on Debian's interpreter as there; a directory
of this machine's for the guest's ``/opt/moorage/guest``); an audit hook ends its process before the step it stops at. The file-system steps of ext4
reach the disk in the order they were made (its journal commits them in order), so a VM stopped hard finds one of
these states; the package's file contents are flushed before the step that names them."""

from __future__ import annotations

import io
import subprocess
import tarfile
from pathlib import Path

from moorage.sandbox.microvm_guest_code import _INSTALL
from tests.sandbox.conftest import SYSTEM_PYTHON

#: Ends the install's process (no clean-up, no flush) before its ``STOP_AT``-th file-system step, and counts them.
CUT_SHORT = r"""
import os, sys
WATCH = {"os.rename", "os.replace", "os.remove", "os.rmdir", "os.unlink", "shutil.rmtree", "ctypes.call_function"}
stop_at, seen = int(os.environ["STOP_AT"]), [0]
def hook(event, args):
    if event in WATCH:
        seen[0] += 1
        if seen[0] == stop_at:
            os._exit(97)
sys.addaudithook(hook)
exec(compile(os.environ["INSTALL"], "<install>", "exec"))
sys.stderr.write("steps=%d\n" % seen[0])
"""

OLD = {"__init__.py": "", "agent_context.py": "VERSION = 'old'\n", "dropped.py": "X = 1\n"}
NEW = {"__init__.py": "", "agent_context.py": "VERSION = 'new'\n", "spawn.py": "Y = 2\n"}


def _package(files: dict[str, str]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as t:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _install(dst: Path, stop_at: int) -> subprocess.CompletedProcess[str]:
    r = subprocess.run([SYSTEM_PYTHON, "-c", CUT_SHORT, str(dst)], input=_package(NEW), capture_output=True,
                       env={"STOP_AT": str(stop_at), "INSTALL": _INSTALL, "PATH": "/usr/bin:/bin"}, timeout=60)
    return subprocess.CompletedProcess(r.args, r.returncode, r.stdout.decode(errors="replace"),
                                       r.stderr.decode(errors="replace"))


def _sources(dst: Path) -> dict[str, str]:
    """The package's Python sources in ``dst`` (its compiled files left aside)."""
    return {p.name: p.read_text() for p in dst.glob("*.py")}


def test_an_install_cut_short_at_any_step_leaves_a_whole_package_and_the_next_one_finishes(tmp_path: Path) -> None:
    whole = _install(_fresh(tmp_path / "count"), stop_at=0)
    assert whole.returncode == 0, whole.stderr
    steps = int(whole.stderr.rsplit("steps=", 1)[1])
    assert steps >= 3, whole.stderr  # the clean-ups, the swap, the old one's removal
    for n in range(1, steps + 1):
        dst = _fresh(tmp_path / f"cut-{n}")
        cut = _install(dst, stop_at=n)
        assert cut.returncode == 97, cut.stderr
        assert _sources(dst) in (OLD, NEW), f"stopped before step {n}: {sorted(_sources(dst))} in {dst}"
        again = _install(dst, stop_at=0)  # the next wake's install
        assert again.returncode == 0, again.stderr
        assert _sources(dst) == NEW
        assert sorted(p.name for p in dst.parent.iterdir()) == ["guest"], f"left behind after step {n}"


def _fresh(root: Path) -> Path:
    dst = root / "guest"
    dst.mkdir(parents=True)
    for name, text in OLD.items():
        (dst / name).write_text(text)
    return dst
