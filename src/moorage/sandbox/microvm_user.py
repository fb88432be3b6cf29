"""The unprivileged host uid each micro-VM's QEMU runs as on a root host, and the descriptors it gets instead of paths.

Every sandbox has a uid of its own (``VM_ID_BASE`` + a slot from a machine-wide registry); QEMU starts already as
that uid (setpriv, no capabilities, ``no_new_privs``) and opens no host path by name: RAM, disks (the whole backing
chain), kernel, initrd, console and sockets are opened or bound here and passed down, a fork's template RAM as a
sealed memfd (``microvm_memfd``; docs/security.md).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import socket
import stat
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moorage.sandbox import microvm_memfd
from moorage.sandbox.base import SandboxError

#: First uid (and gid) of the micro-VM range: above the container ranges systemd hands out (up to 0x6FFFFFFF),
#: below the signed-32-bit edge; a sandbox gets ``VM_ID_BASE + slot``, a template's group likewise.
VM_ID_BASE = 0x70000000
VM_ID_SLOTS = 1 << 20
#: Machine-wide (not per data directory): two hosts of a fleet on one machine must not hand out the same uid.
REGISTRY = Path("/var/lib/moorage-vm/ids")
_PROBES = 4096


class VMUserError(SandboxError):
    code = "sandbox-vm-user"


# --- ids ----------------------------------------------------------------------------------------------------


def _registry() -> Path:
    if not REGISTRY.is_dir():
        REGISTRY.mkdir(parents=True, exist_ok=True)
        os.chmod(REGISTRY, 0o700)
    return REGISTRY


def vm_id(owner: Path) -> int:
    """The uid (or gid) that belongs to ``owner`` (a sandbox or template directory), claimed on first use.

    Slots are found from a hash of the path, so a lookup is usually one readlink. A claim whose directory is gone
    is stale and may be taken over (under the registry's lock): ids are unique among directories that exist. A
    removed directory's claim is given back (``release``), so the probe window may have holes: a key is looked for
    across the whole window, not only up to the first free slot.
    """
    key = str(Path(owner).resolve())
    start = _start(key)
    reg = _registry()
    slot = _find(reg, key, start)
    return VM_ID_BASE + slot if slot is not None else _claim(reg, key, start)


def release(owner: Path) -> None:
    """Give back the slot of ``owner`` (a sandbox or template directory being removed, its QEMU gone), so the
    registry holds the directories that exist rather than every one ever made."""
    if not REGISTRY.is_dir():
        return
    key = str(Path(owner).resolve())
    with open(REGISTRY / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        slot = _find(REGISTRY, key, _start(key))
        if slot is not None:
            (REGISTRY / str(slot)).unlink(missing_ok=True)


def _start(key: str) -> int:
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") % VM_ID_SLOTS


def _find(reg: Path, key: str, start: int) -> int | None:
    """The slot in ``start``'s probe window that ``key`` holds, or None: the first slot (almost always), else
    the window's entries that exist (one directory listing, not thousands of failed readlinks)."""
    with contextlib.suppress(FileNotFoundError):
        if os.readlink(reg / str(start)) == key:
            return start
    names = set(os.listdir(reg))
    for i in range(1, _PROBES):
        slot = (start + i) % VM_ID_SLOTS
        if str(slot) in names:
            with contextlib.suppress(FileNotFoundError):
                if os.readlink(reg / str(slot)) == key:
                    return slot
    return None


def _claim(reg: Path, key: str, start: int) -> int:
    """Take the first free or stale slot of the window, holding the registry lock (claims are rare)."""
    with open(reg / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        found = _find(reg, key, start)  # another host process may have claimed it meanwhile
        if found is not None:
            return VM_ID_BASE + found
        for i in range(_PROBES):
            slot = (start + i) % VM_ID_SLOTS
            entry = reg / str(slot)
            try:
                held: str | None = os.readlink(entry)
            except FileNotFoundError:
                held = None
            if held is None or not os.path.isdir(held):
                tmp = reg / f".{slot}.{os.getpid()}"
                tmp.unlink(missing_ok=True)
                os.symlink(key, tmp)
                os.replace(tmp, entry)
                return VM_ID_BASE + slot
    raise VMUserError(f"no free micro-VM uid near slot {start} in {reg}",
                      hint=f"remove entries of sandboxes that no longer exist from {reg}")


# --- the launch ---------------------------------------------------------------------------------------------


@dataclass
class Launch:
    """A QEMU command line that names descriptors instead of paths, the descriptors, and who it runs as."""

    argv: list[str]
    uid: int
    groups: list[int]
    fds: list[int] = field(default_factory=list)

    def close(self) -> None:
        for fd in self.fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds = []


def _own(path: Path, uid: int, gid: int, mode: int) -> None:
    st = os.lstat(path)
    if not (stat.S_ISREG(st.st_mode) or stat.S_ISFIFO(st.st_mode)):
        raise VMUserError(f"{path} is not a regular file", hint="remove it; the sandbox remakes what it needs")
    if (st.st_uid, st.st_gid) != (uid, gid):
        os.chown(path, uid, gid, follow_symlinks=False)
    if stat.S_IMODE(st.st_mode) != mode:
        os.chmod(path, mode)


def _qcow2_backing(path: Path) -> tuple[Path, str | None] | None:
    """(backing file, its format or None) from a qcow2 header; None when it has none. The format comes from the
    header's backing-format extension (written by ``qemu-img create -F`` and ``rebase -F``)."""
    with open(path, "rb") as f:
        head = f.read(104)
        if len(head) < 72 or head[:4] != b"QFI\xfb":
            return None
        version = int.from_bytes(head[4:8], "big")
        offset, size = int.from_bytes(head[8:16], "big"), int.from_bytes(head[16:20], "big")
        if not offset or not size:
            return None
        if size > 1023:  # qcow2's own limit
            raise VMUserError(f"{path} names a backing file of {size} bytes", hint="the disk's header is damaged")
        f.seek(offset)
        try:
            name = f.read(size).decode()
        except UnicodeDecodeError as e:
            raise VMUserError(f"{path} names a backing file that is not UTF-8", hint="the disk's header is damaged") from e
        fmt = None
        pos = int.from_bytes(head[100:104], "big") if version >= 3 and len(head) >= 104 else 72
        f.seek(pos)
        for _ in range(64):  # header extensions: (type, length, data padded to 8 bytes), type 0 ends them
            ext = f.read(8)
            if len(ext) < 8 or int.from_bytes(ext[:4], "big") == 0:
                break
            n = int.from_bytes(ext[4:8], "big")
            data = f.read((n + 7) & ~7)
            if int.from_bytes(ext[:4], "big") == 0xE2792ACA:
                fmt = data[:n].decode(errors="replace")
    return (Path(name) if name.startswith("/") else path.parent / name), fmt


class _Backing:
    """Which backing files a sandbox's disk chain may name. Its own disk is written by its QEMU, header and all, so
    the first level must be exactly what the host gave it (read from the host's ``meta.json``): its template's
    disk, or a file of its guest image. Deeper levels are root's read-only files: template disks (whose headers
    were checked when the template was made) or guest image files. Nothing else is opened, not even to probe it."""

    def __init__(self, sandbox_dir: Path) -> None:
        meta = json.loads((sandbox_dir / "meta.json").read_text())
        self.templates = (sandbox_dir.parent / ".templates").resolve()
        tdir = meta.get("template_dir") or (self.templates / meta["template_id"] if meta.get("template_id") else None)
        self.first = (Path(tdir) / "disk.qcow2").resolve() if tdir else None
        self.image_dir = Path(meta["image_dir"]).resolve()

    def is_template_disk(self, path: Path) -> bool:
        return path.name == "disk.qcow2" and path.parent.parent == self.templates

    def check(self, disk: Path, backing: Path, level: int) -> Path:
        path = Path(os.path.realpath(backing))
        if level == 0:
            ok = path == self.first if self.first is not None else path.parent == self.image_dir
        else:
            ok = self.is_template_disk(path) or path.parent.parent == self.image_dir.parent
        if not ok or not stat.S_ISREG(os.stat(path).st_mode):
            raise VMUserError(f"the disk {disk} names {backing} as its backing file, not one this sandbox was given",
                              hint="its QEMU may have rewritten the disk's header; keep the sandbox stopped and "
                                   "inspect it (`qemu-img info`) before destroying it")
        return path


def check_backing(disk: Path, sandbox_dir: Path) -> None:
    """Refuse a sandbox disk whose header names a backing file other than the one the host gave it (before the host
    copies it into a template, or starts a QEMU on it)."""
    found = _qcow2_backing(disk)
    if found is not None:
        _Backing(sandbox_dir).check(disk, found[0], 0)


class _Builder:
    def __init__(self, sandbox_dir: Path) -> None:
        self.sandbox_dir = sandbox_dir
        self.uid = vm_id(sandbox_dir)
        self.fds: list[int] = []
        self.groups: set[int] = set()
        self._fdset = 0

    def path_fd(self, path: Path) -> str:
        """``/proc/self/fd/N`` for ``path``: QEMU re-opens the file itself (the inode's owner and mode decide
        what it may do) without walking any directory on the way."""
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        self.fds.append(fd)
        return f"/proc/self/fd/{fd}"

    def fdset(self, fd: int, what: str) -> tuple[int, str]:
        """An ``-add-fd`` for an open descriptor; ``what`` (a path) is its opaque label, for people and ``ps``."""
        self.fds.append(fd)
        self._fdset += 1
        return self._fdset, f"fd={fd},set={self._fdset},opaque={what}"

    def shared_file(self, path: Path) -> None:
        """A file this VM shares read-only with others of its template (a template disk): group access through the
        template's own gid, which this VM gets as a supplementary group; never world access."""
        owner = path.parent
        gid = vm_id(owner)
        _own(path, 0, gid, 0o440)
        self.groups.add(gid)

    def readable(self, path: Path) -> None:
        """A file outside the driver root (the guest image): world-readable already, or refused."""
        if not os.stat(path).st_mode & stat.S_IROTH:
            st = os.stat(path)
            if st.st_gid not in self.groups:
                raise VMUserError(f"{path} is not readable by the micro-VM uid", hint=f"chmod a+r {path} (it is the shared guest image)")


def _opts(arg: str) -> list[tuple[str, str | None]]:
    """QEMU's ``key=value,...`` (a leading bare word, like a backend's type, has the value None)."""
    out: list[tuple[str, str | None]] = []
    for part in arg.split(","):
        k, sep, v = part.partition("=")
        out.append((k, v if sep else None))
    return out


def _join(opts: list[tuple[str, str | None]]) -> str:
    return ",".join(k if v is None else f"{k}={v}" for k, v in opts)


def prepare(argv: list[str], run_dir: Path, console_pipe: Path) -> Launch:
    """Rewrite a QEMU command line (``microvm_qemu.build_argv``) to run as the sandbox's own uid: the files it
    names get that uid (or its template's group) and mode 0600/0440 (a template's RAM root's 0400: forks map a
    sealed memfd copy of it), and are passed as descriptors; its
    sockets are bound here in the root-owned run directory and passed listening. Nothing that can block long, and
    no process is started (a wake stays fast)."""
    sandbox_dir = run_dir.parent
    b = _Builder(sandbox_dir)
    uid = b.uid
    out: list[str] = []
    extra: list[str] = []
    try:
        i = 0
        while i < len(argv):
            a = argv[i]
            nxt = argv[i + 1] if i + 1 < len(argv) else ""
            if a == "-object" and nxt.startswith("memory-backend-file,"):
                opts = _opts(nxt)
                path = Path(str(dict(opts)["mem-path"]))
                if path.parent.resolve() == sandbox_dir.resolve():
                    _own(path, uid, uid, 0o600)
                    mem_path = b.path_fd(path)
                else:
                    # A fork maps its template's RAM privately, but QEMU 7.2 opens it read-write all the same: it
                    # gets a memfd copy sealed against every write instead (copy-on-write still works), and the
                    # file itself stays root's alone.
                    _own(path, 0, 0, 0o400)
                    fd = microvm_memfd.lease(path)
                    b.fds.append(fd)
                    mem_path = f"/proc/self/fd/{fd}"
                opts = [(k, mem_path if k == "mem-path" else v) for k, v in opts]
                out += [a, _join(opts)]
                i += 2
                continue
            if a == "-drive":
                opts = _opts(nxt)
                disk = Path(str(dict(opts)["file"]))
                _own(disk, uid, uid, 0o600)
                opts = [(k, b.path_fd(disk) if k == "file" else v) for k, v in opts]
                rule, prefix, cur = _Backing(sandbox_dir), "backing.", disk
                while (found := _qcow2_backing(cur)) is not None:  # each level named by descriptor, not by header
                    path = rule.check(disk, found[0], prefix.count("backing.") - 1)
                    fmt = found[1] or ("qcow2" if rule.is_template_disk(path) else "raw")
                    if fmt not in ("qcow2", "raw"):
                        raise VMUserError(f"{cur} names a backing file in format {fmt!r}", hint="only qcow2 and raw are used")
                    if rule.is_template_disk(path):
                        b.shared_file(path)
                    else:
                        b.readable(path)
                    opts += [(f"{prefix}driver", fmt), (f"{prefix}file.filename", b.path_fd(path))]
                    prefix, cur = prefix + "backing.", path
                    if prefix.count("backing.") > 32:
                        raise VMUserError(f"backing chain of {disk} is too deep", hint="make templates from forks less often")
                out += [a, _join(opts)]
                i += 2
                continue
            if a in ("-kernel", "-initrd"):
                b.readable(Path(nxt))
                out += [a, b.path_fd(Path(nxt))]
                i += 2
                continue
            if a == "-serial" and nxt.startswith("file:"):
                set_id, spec = b.fdset(_console_writer(console_pipe), f"file:{console_pipe}")
                extra += ["-add-fd", spec]
                out += ["-chardev", f"file,id=console,path=/dev/fdset/{set_id},append=on", "-serial", "chardev:console"]
                i += 2
                continue
            if a == "-pidfile":  # QEMU would create it by name; the host writes qemu.pid itself
                i += 2
                continue
            if a == "-chardev" and nxt.startswith("socket,") and "path=" in nxt:
                opts = _opts(nxt)
                fd = _listen(Path(str(dict(opts)["path"])), run_dir)
                b.fds.append(fd)
                out += [a, _join([(k, v) if k != "path" else ("fd", str(fd)) for k, v in opts])]
                i += 2
                continue
            if a == "-qmp" and nxt.startswith("unix:"):
                path = Path(nxt.removeprefix("unix:").split(",", 1)[0])
                fd = _listen(path, run_dir)
                b.fds.append(fd)
                # The run directory in the command line: how a QEMU of this sandbox is recognised after a restart
                # (microvm_qemu.pid_is_ours). A duplicate of the monitor's socket carries it as its label.
                _, spec = b.fdset(os.dup(fd), str(path))
                extra += ["-add-fd", spec]
                out += ["-chardev", f"socket,id=qmp,fd={fd},server=on,wait=off", "-mon", "chardev=qmp,mode=control"]
                i += 2
                continue
            if a == "-accel" and nxt.split(",", 1)[0] == "kvm" and os.path.exists("/dev/kvm"):
                b.groups.add(os.stat("/dev/kvm").st_gid)
            out.append(a)
            i += 1
    except BaseException:
        for fd in b.fds:
            os.close(fd)
        raise
    for fd in b.fds:
        os.set_inheritable(fd, True)
    exe, rest = out[0], out[1:]
    groups = sorted(b.groups - {0})
    confine = ["setpriv", f"--reuid={uid}", f"--regid={uid}",
               f"--groups={','.join(map(str, groups))}" if groups else "--clear-groups",
               "--no-new-privs", "--inh-caps=-all", "--ambient-caps=-all", "--bounding-set=-all", "--"]
    return Launch([*confine, exe, *extra, *rest], uid, groups, b.fds)


def _console_writer(pipe: Path) -> int:
    """The write end of the console FIFO, for QEMU (the host's drain thread opens the read end)."""
    if pipe.exists() and not stat.S_ISFIFO(os.lstat(pipe).st_mode):
        pipe.unlink()
    if not pipe.exists():
        os.mkfifo(pipe, 0o600)
    reader = os.open(pipe, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a writer cannot open a FIFO without one
    try:
        fd = os.open(pipe, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    finally:
        os.close(reader)
    os.set_blocking(fd, True)  # as QEMU's own open of the FIFO would be
    return fd


def _listen(path: Path, run_dir: Path) -> int:
    """A listening unix socket at ``path`` (in the root-owned 0700 run directory), bound through the directory's
    descriptor when the path is too long for sun_path."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dir_fd = os.open(run_dir, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        path.unlink(missing_ok=True)
        target = str(path) if len(os.fsencode(str(path))) <= 100 else f"/proc/self/fd/{dir_fd}/{path.name}"
        sock.bind(target)
        os.chmod(path, 0o600)
        sock.listen(16)
        return sock.detach()
    except BaseException:
        sock.close()
        raise
    finally:
        os.close(dir_fd)


def popen(launch: Launch | None, argv: list[str], **kw: Any) -> "subprocess.Popen[bytes]":
    """``subprocess.Popen`` that also hands down the launch's descriptors (and leaves the caller's as they are)."""
    if launch is not None:
        kw["pass_fds"] = [*kw.get("pass_fds", ()), *launch.fds]
    return subprocess.Popen(argv, **kw)
