"""A micro-VM's network device on the host: a tap in a private network namespace that holds nothing else.

The namespace has only ``lo`` and the tap (no veth, no route out), so the guest reaches the addresses the host binds
inside it (the egress gateway's proxy and DNS responder, see ``runtime/vm_network.py``) and nothing else
(decisions/0013).
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import socket
import struct
import threading
import weakref
from functools import lru_cache
from typing import Any, Callable, Mapping, TypeVar

from moorage.log import get_logger
from moorage.sandbox.base import SandboxError

log = get_logger(__name__)

#: The same addresses in every namespace, so a guest restored from a snapshot finds its gateway where it left it.
GATEWAY_IP = "10.0.2.2"
GUEST_IP = "10.0.2.15"
NETMASK = "255.255.255.0"
PROXY_PORT = 3128
DNS_PORT = 53
#: Fixed hardware addresses: a restored guest's neighbour entry for the gateway stays right across wakes and forks.
GUEST_MAC = "52:54:00:6d:6f:0f"
GATEWAY_MAC = "52:54:00:6d:6f:02"
TAP_NAME = "mtap0"
#: The environment key (set by ``runtime/vm_network.guest_env``) that asks for a network device.
WANT_ENV = "MOORAGE_NIC"

_CLONE_NEWNET = 0x40000000
_TUNSETIFF = 0x400454CA
_IFF_TAP, _IFF_NO_PI, _IFF_VNET_HDR, _IFF_UP = 0x0002, 0x1000, 0x4000, 0x1
_SIOCGIFFLAGS, _SIOCSIFFLAGS, _SIOCSIFADDR, _SIOCSIFNETMASK, _SIOCSIFHWADDR = 0x8913, 0x8914, 0x8916, 0x891C, 0x8924
_ARPHRD_ETHER = 1
_TUNGETDEVNETNS = 0x54E3
_SYS_PIDFD_GETFD = 438

T = TypeVar("T")


class NicUnavailable(SandboxError):
    """This host cannot give a micro-VM a network device (no /dev/net/tun, or no right to make namespaces)."""


@lru_cache(maxsize=1)
def _libc() -> Any:
    return ctypes.CDLL(None, use_errno=True)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _on_own_thread(fn: Callable[[], T]) -> T:
    """Run ``fn`` on a thread that exists only for it: a thread that entered another network namespace ends with
    it, so no other code ever runs there by accident (namespaces are per thread; sockets keep the one they were
    made in)."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append((True, fn()))
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            out.append((False, e))

    t = threading.Thread(target=run, name="vm-netns", daemon=True)
    t.start()
    t.join()
    ok, value = out[0]
    if not ok:
        raise value
    return value  # type: ignore[no-any-return]


def _ifreq(name: str, payload: bytes = b"") -> bytes:
    return struct.pack("16s24s", name.encode(), payload)


def _sockaddr_in(ip: str) -> bytes:
    return struct.pack("HH4s8x", socket.AF_INET, 0, socket.inet_aton(ip))


def _mac(text: str) -> bytes:
    return bytes(int(b, 16) for b in text.split(":"))


def _set_up(ctl: socket.socket, name: str) -> None:
    flags = struct.unpack("16sH22x", fcntl.ioctl(ctl, _SIOCGIFFLAGS, _ifreq(name)))[1]
    fcntl.ioctl(ctl, _SIOCSIFFLAGS, _ifreq(name, struct.pack("H", flags | _IFF_UP)))


def _no_ipv6(name: str) -> None:
    """IPv4 only on the tap (the proxy listens there): no link-local IPv6 address, no neighbour discovery. The
    sysctl is the calling thread's namespace's."""
    try:
        with open(f"/proc/sys/net/ipv6/conf/{name}/disable_ipv6", "w") as f:
            f.write("1")
    except FileNotFoundError:
        pass  # a kernel without IPv6


class VMNetwork:
    """One launch's namespace and tap. QEMU gets the tap's descriptor; the host binds listeners in the namespace.

    The namespace lives while anything holds it: our descriptor of it, QEMU's tap, a socket made in it. ``close``
    drops ours; it disappears when QEMU and the last proxied connection are gone.
    """

    def __init__(self, ns_fd: int, tap_fd: int) -> None:
        self.ns_fd: int | None = ns_fd
        self.tap_fd: int | None = tap_fd
        #: The proxy's address in the namespace, bound from the start: a guest connecting before the host serves
        #: it (a wake, before the first turn) waits in the backlog instead of being refused.
        self.proxy_listener: socket.socket | None = None
        #: The DNS responder's address, bound from the start for the same reason: a query sent before the host
        #: serves it waits in the socket's buffer. UDP, and TCP for answers too long for a datagram.
        self.dns_socket: socket.socket | None = None
        self.dns_listener: socket.socket | None = None

    @classmethod
    def create(cls) -> "VMNetwork":
        def make() -> tuple[int, int]:
            _check(_libc().unshare(_CLONE_NEWNET), "unshare(CLONE_NEWNET)")
            ns_fd = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
            tap_fd = -1
            try:
                tap_fd = os.open("/dev/net/tun", os.O_RDWR | os.O_CLOEXEC)
                fcntl.ioctl(tap_fd, _TUNSETIFF, _ifreq(TAP_NAME, struct.pack("H", _IFF_TAP | _IFF_NO_PI | _IFF_VNET_HDR)))
                _no_ipv6(TAP_NAME)
                with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as ctl:
                    _set_up(ctl, "lo")
                    fcntl.ioctl(ctl, _SIOCSIFHWADDR, _ifreq(TAP_NAME, struct.pack("H6s", _ARPHRD_ETHER, _mac(GATEWAY_MAC))))
                    fcntl.ioctl(ctl, _SIOCSIFADDR, _ifreq(TAP_NAME, _sockaddr_in(GATEWAY_IP)))
                    fcntl.ioctl(ctl, _SIOCSIFNETMASK, _ifreq(TAP_NAME, _sockaddr_in(NETMASK)))
                    _set_up(ctl, TAP_NAME)
            except BaseException:
                os.close(ns_fd)
                if tap_fd >= 0:
                    os.close(tap_fd)
                raise
            return ns_fd, tap_fd

        try:
            net = cls(*_on_own_thread(make))
        except OSError as e:
            raise NicUnavailable(f"could not make the network device of a micro-VM: {e}",
                                 hint="the host needs /dev/net/tun and CAP_SYS_ADMIN + CAP_NET_ADMIN (run as root), "
                                      "or leave the agent on the channel relay (decisions/0013)") from e
        net._bind_gateway()
        return net

    def _bind_gateway(self) -> None:
        """Bind the gateway's addresses in the namespace (the proxy's TCP, DNS's UDP and TCP); closes it all on
        failure."""
        try:
            self.proxy_listener = self.listen(PROXY_PORT)
            self.dns_socket = self.bind_udp(DNS_PORT)
            self.dns_listener = self.listen(DNS_PORT, backlog=16)
        except BaseException:
            self.close()
            raise

    def run_inside(self, fn: Callable[[], T]) -> T:
        """``fn`` on a thread inside this namespace (sockets it makes belong to it)."""
        if self.ns_fd is None:
            raise SandboxError("the micro-VM's network is closed")
        ns_fd = self.ns_fd

        def inside() -> T:
            _check(_libc().setns(ns_fd, _CLONE_NEWNET), "setns")
            return fn()

        return _on_own_thread(inside)

    def listen(self, port: int = PROXY_PORT, backlog: int = 64) -> socket.socket:
        """A listening TCP socket on the gateway's address inside the namespace (non-blocking, for asyncio)."""
        return self._bound(socket.SOCK_STREAM, port, backlog)

    def bind_udp(self, port: int = DNS_PORT) -> socket.socket:
        """A UDP socket bound on the gateway's address inside the namespace (non-blocking, for asyncio)."""
        return self._bound(socket.SOCK_DGRAM, port, None)

    def _bound(self, kind: int, port: int, backlog: int | None) -> socket.socket:
        def make() -> socket.socket:
            s = socket.socket(socket.AF_INET, kind)
            try:
                if backlog is not None:
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind((GATEWAY_IP, port))
                if backlog is not None:
                    s.listen(backlog)
                s.setblocking(False)
            except BaseException:
                s.close()
                raise
            return s

        return self.run_inside(make)

    def interfaces(self) -> list[str]:
        """The namespace's interfaces (what a check of "nothing but the tap" reads)."""
        return sorted(name for _, name in self.run_inside(socket.if_nameindex))

    def release_tap(self) -> None:
        """Drop our copy of the tap once QEMU holds its own."""
        if self.tap_fd is not None:
            os.close(self.tap_fd)
            self.tap_fd = None

    def close(self) -> None:
        self.release_tap()
        if self.proxy_listener is not None:
            self.proxy_listener.close()
            self.proxy_listener = None
        for s in (self.dns_socket, self.dns_listener):
            if s is not None:
                s.close()
        self.dns_socket = self.dns_listener = None
        if self.ns_fd is not None:
            os.close(self.ns_fd)
            self.ns_fd = None


def recover(pid: int) -> VMNetwork:
    """The network of a QEMU still running from before a host restart: its namespace, found through QEMU's own tap
    descriptor (``pidfd_getfd``, then ``TUNGETDEVNETNS``), with the gateway's addresses bound there again."""
    fdinfo = f"/proc/{pid}/fdinfo"
    try:
        fd = next(int(n) for n in os.listdir(fdinfo) if f"iff:\t{TAP_NAME}\n" in _read(f"{fdinfo}/{n}"))
    except (OSError, StopIteration) as e:
        raise NicUnavailable(f"QEMU {pid} holds no tap of ours", hint="sleep and wake the sandbox") from e
    pidfd = os.pidfd_open(pid)
    try:
        tap = _libc().syscall(_SYS_PIDFD_GETFD, pidfd, fd, 0)
        if tap < 0:
            _check(-1, "pidfd_getfd")
    except OSError as e:
        raise NicUnavailable(f"could not reach the tap of QEMU {pid}: {e}", hint="sleep and wake the sandbox") from e
    finally:
        os.close(pidfd)
    try:
        ns_fd = fcntl.ioctl(tap, _TUNGETDEVNETNS)
    except OSError as e:
        raise NicUnavailable(f"could not find the namespace of QEMU {pid}'s tap: {e}", hint="sleep and wake the sandbox") from e
    finally:
        os.close(tap)
    os.set_inheritable(ns_fd, False)
    net = VMNetwork(ns_fd, -1)
    net.tap_fd = None
    net._bind_gateway()
    return net


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def netdev_args(tap_fd: int) -> list[str]:
    """QEMU's side: the tap by descriptor (QEMU, confined and without capabilities, never opens one itself)."""
    # No announcements after a restore (neither QEMU's nor the guest's gratuitous ARPs): each launch's namespace is
    # new and learns the guest's address from its first packet, and announcing only costs the woken guest time.
    return ["-netdev", f"tap,id=net0,fd={tap_fd}",
            "-device", f"virtio-net-device,netdev=net0,mac={GUEST_MAC},guest_announce=off",
            "-global", "migration.announce-rounds=0"]


def wanted(env: Mapping[str, str]) -> bool:
    """Does a sandbox with this environment ask for a network device (and can this host make one)?"""
    return env.get(WANT_ENV) == "1" and available()


@lru_cache(maxsize=1)
def available() -> bool:
    """Can this host make a namespace with a tap? Probed once; a host that cannot says so once in its log, and its
    network agents keep the channel relay (decisions/0009)."""
    try:
        VMNetwork.create().close()
        return True
    except NicUnavailable as e:
        log.warning("micro-VMs get no network device on this host; network agents use the channel relay",
                    error=str(e))
        return False


#: The network of each live channel of a micro-VM (what ``runtime/vm_network`` serves the gateway on).
_BY_CHANNEL: "weakref.WeakKeyDictionary[Any, VMNetwork]" = weakref.WeakKeyDictionary()


def bind_channel(channel: Any, net: VMNetwork | None) -> None:
    if net is not None:
        _BY_CHANNEL[channel] = net


def of_channel(channel: Any) -> VMNetwork | None:
    try:
        return _BY_CHANNEL.get(channel)
    except TypeError:  # not weak-referenceable: not a micro-VM channel
        return None
