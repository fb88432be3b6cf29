"""The seccomp filter of process sandboxes: kernel surfaces a guest on the shared host kernel never needs.

Compiled to a BPF program by libseccomp (the C library, through ctypes: no Python binding is packaged for the
virtualenv) and handed to bubblewrap on a file descriptor (``--seccomp FD``); ``compile_filter`` is cached.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import os
import tempfile
from functools import lru_cache

from moorage.sandbox.base import SandboxError

# libseccomp's ABI (seccomp.h): actions and comparison operators.
_ACT_ALLOW = 0x7FFF0000
_CMP_EQ = 4
_CMP_MASKED_EQ = 7


def _errno(code: int) -> int:
    return 0x00050000 | (code & 0xFFFF)


#: Denied outright with EPERM: namespaces and mounts (the sandbox's own were set up by bubblewrap), kernel
#: keyrings, eBPF, perf, io_uring, userfaultfd (a classic exploit helper), tracing other processes, modules,
#: kexec, clocks, swap, reboot, the kernel log, handle-based opens that bypass the mount namespace.
DENIED = (
    "setns", "mount", "umount2", "pivot_root", "chroot", "move_mount", "open_tree", "fsopen", "fsconfig", "fsmount",
    "fspick", "mount_setattr", "keyctl", "add_key", "request_key", "bpf", "perf_event_open", "io_uring_setup",
    "io_uring_enter", "io_uring_register", "userfaultfd", "ptrace", "process_vm_readv", "process_vm_writev",
    "kcmp", "pidfd_getfd", "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module",
    "swapon", "swapoff", "reboot", "acct", "settimeofday", "clock_settime", "clock_adjtime", "adjtimex", "syslog",
    "quotactl", "quotactl_fd", "lookup_dcookie", "vhangup", "nfsservctl", "uselib", "name_to_handle_at",
    "open_by_handle_at", "iopl", "ioperm", "fanotify_init",
)

#: clone/unshare flags that create a namespace: CLONE_NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET.
NAMESPACE_FLAGS = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000)
_CLONE_NEWTIME = 0x00000080  # unshare only: for clone() the same bit is part of the exit signal

#: Socket families a guest has no use for (its network namespace has only loopback) and that carry old,
#: rarely used kernel code: packet sockets, key management, crypto API, vsock, XDP, and the exotic protocols.
DENIED_SOCKET_FAMILIES = (3, 4, 5, 6, 8, 9, 11, 12, 15, 17, 21, 23, 24, 26, 29, 30, 31, 34, 35, 36, 37, 38, 39, 40,
                          41, 42, 43, 44, 45)

#: ioctls that push input into a terminal (TIOCSTI) or reach the console driver (TIOCLINUX).
DENIED_IOCTLS = (0x5412, 0x541C)


class _ArgCmp(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("datum_a", ctypes.c_uint64), ("datum_b", ctypes.c_uint64)]


def _lib() -> ctypes.CDLL:
    name = ctypes.util.find_library("seccomp") or "libseccomp.so.2"
    try:
        lib = ctypes.CDLL(name, use_errno=True)
    except OSError as e:
        raise SandboxError("libseccomp is not installed: process sandboxes need it for their syscall filter",
                           hint="apt-get install libseccomp2") from e
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    lib.seccomp_syscall_resolve_name.restype = ctypes.c_int
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add_array.restype = ctypes.c_int
    lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint,
                                           ctypes.POINTER(_ArgCmp)]
    lib.seccomp_export_bpf.restype = ctypes.c_int
    lib.seccomp_export_bpf.argtypes = [ctypes.c_void_p, ctypes.c_int]
    return lib


@lru_cache(maxsize=1)
def compile_filter() -> bytes:
    """The BPF program (struct sock_filter[]) for the host's architecture. Other ABIs (i386, x32) are killed."""
    lib = _lib()
    ctx = lib.seccomp_init(_ACT_ALLOW)
    if not ctx:
        raise SandboxError("libseccomp could not start a filter")

    def rule(action: int, name: str, *cmps: tuple[int, int, int, int]) -> None:
        nr = lib.seccomp_syscall_resolve_name(name.encode())
        if nr < 0:
            return  # not a syscall on this architecture
        arr = (_ArgCmp * max(len(cmps), 1))(*[_ArgCmp(*c) for c in cmps])
        rc = lib.seccomp_rule_add_array(ctx, action, nr, len(cmps), arr)
        if rc < 0:
            raise SandboxError(f"libseccomp refused the rule for {name}: {os.strerror(-rc)}")

    try:
        eperm = _errno(errno.EPERM)
        for name in DENIED:
            rule(eperm, name)
        for flag in NAMESPACE_FLAGS:
            rule(eperm, "clone", (0, _CMP_MASKED_EQ, flag, flag))
            rule(eperm, "unshare", (0, _CMP_MASKED_EQ, flag, flag))
        rule(eperm, "unshare", (0, _CMP_MASKED_EQ, _CLONE_NEWTIME, _CLONE_NEWTIME))
        # clone3 passes its flags in memory a filter cannot read: ENOSYS makes libc fall back to clone().
        rule(_errno(errno.ENOSYS), "clone3")
        for family in DENIED_SOCKET_FAMILIES:
            rule(_errno(errno.EAFNOSUPPORT), "socket", (0, _CMP_EQ, family, 0))
        for req in DENIED_IOCTLS:
            rule(eperm, "ioctl", (1, _CMP_MASKED_EQ, 0xFFFFFFFF, req))
        with tempfile.TemporaryFile() as f:
            rc = lib.seccomp_export_bpf(ctx, f.fileno())
            if rc < 0:
                raise SandboxError(f"libseccomp could not export the filter: {os.strerror(-rc)}")
            f.seek(0)
            return f.read()
    finally:
        lib.seccomp_release(ctx)


def filter_fd(min_fd: int = 3) -> int:
    """A fresh readable descriptor (numbered ``min_fd`` or above) holding the compiled filter; bubblewrap reads
    it to the end. The caller closes it."""
    first = os.memfd_create("moorage-seccomp", os.MFD_CLOEXEC)
    fd = fcntl.fcntl(first, fcntl.F_DUPFD, min_fd)  # the dup is not close-on-exec: the launcher inherits it
    os.close(first)
    data = compile_filter()
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd
