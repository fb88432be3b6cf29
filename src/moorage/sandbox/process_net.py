"""A network agent's process sandbox gets a DNS address: 127.0.0.1:53 inside its own network namespace, bound by
the host.

The sandbox's namespace has only ``lo`` (bubblewrap's ``--unshare-net``); its ``/etc/resolv.conf`` names
127.0.0.1 when the agent declares ``[agent.network]``. Nothing inside the sandbox can bind port 53 there: its
processes run in a user namespace nested inside the one that owns the network namespace (bubblewrap makes the
second one to map the sandbox uid and to disable further user namespaces), so even a capability added with
``--cap-add`` would not count for that namespace, and ``/proc/sys`` (``ip_unprivileged_port_start``) is read-only.
So the host binds the address itself, as it does for a micro-VM's NIC (decisions/0013): on a thread that enters
the sandbox's network namespace (``setns``) and makes a UDP and a TCP socket there (sockets keep the namespace
they were made in), then serves them with the gateway's own responder (``runtime/vm_network``, ``egress.dns``:
only names the agent's policy admits; NXDOMAIN without an upstream query otherwise). The sandbox gets no
capability and no lowered port threshold, and nothing runs inside it for this.

Entering another process's network namespace needs CAP_SYS_ADMIN on the host: a host that does not run as root
(which also runs sandboxes as its own uid) gives its process sandboxes no DNS, says so once, and they keep
relying on the proxy resolving names.
"""

from __future__ import annotations

import errno
import os
import socket
import weakref
from typing import Any, Callable

from moorage.log import get_logger
from moorage.sandbox.microvm_net import _CLONE_NEWNET, WANT_ENV, _check, _libc, _on_own_thread

log = get_logger(__name__)

DNS_IP = "127.0.0.1"
DNS_PORT = 53
#: The sandbox's /etc/resolv.conf for a network agent: the host's responder on its own loopback. Short timeouts: a
#: lookup the responder drops (its rate bound) fails fast instead of hanging the caller.
RESOLV_CONF = "# moorage: the egress gateway's DNS, served by the host (docs/egress.md)\n" \
              f"nameserver {DNS_IP}\noptions timeout:2 attempts:2\n"

_warned = False


class SandboxDNS:
    """The sockets bound on 127.0.0.1:53 in one sandbox's network namespace (what ``runtime/vm_network`` serves
    for as long as a channel of the sandbox is attached; they live as long as the sandbox runs)."""

    proxy_listener = None  # the proxy stays the channel relay's (guest/egress_relay.py)

    def __init__(self, dns_socket: socket.socket, dns_listener: socket.socket) -> None:
        self.dns_socket: socket.socket | None = dns_socket
        self.dns_listener: socket.socket | None = dns_listener

    def close(self) -> None:
        for s in (self.dns_socket, self.dns_listener):
            if s is not None:
                s.close()
        self.dns_socket = self.dns_listener = None


def wanted(env: Any) -> bool:
    """Does a sandbox with this environment belong to an agent with ``[agent.network]``? ``runtime/vm_network``'s
    ``guest_env`` asks for a NIC for those only; ``MOORAGE_NETWORK`` alone is also the relay of a template that
    installs packages at deploy time, whose network is attached only while it builds (its forks get no DNS: a lookup
    there fails at once, as before, instead of waiting on an address nobody serves)."""
    return env.get("MOORAGE_NETWORK") == "1" and env.get(WANT_ENV) == "1"


def bind(pid: int, still_ours: Callable[[], bool] | None = None) -> SandboxDNS | None:
    """Bind the DNS address in the network namespace of ``pid`` (a process of the sandbox). None, logged, where this
    host cannot (not root) or the address is taken; never in the host's own namespace. ``still_ours``, asked once
    the namespace is open: whether ``pid`` is still the sandbox's (a guest process that exited could have left its
    pid to a process of another sandbox, whose namespace must never get this one's resolver)."""
    global _warned
    try:
        ns_fd = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        log.warning("sandbox DNS not bound: its network namespace is gone", pid=pid, error=str(e))
        return None
    try:
        if still_ours is not None and not still_ours():
            log.warning("sandbox DNS not bound: its process exited while the namespace was opened", pid=pid)
            return None
        ns, own = os.fstat(ns_fd), os.stat("/proc/self/ns/net")
        if (ns.st_dev, ns.st_ino) == (own.st_dev, own.st_ino):
            log.warning("sandbox DNS not bound: the process shares the host's network namespace", pid=pid)
            return None

        def make() -> SandboxDNS:
            _check(_libc().setns(ns_fd, _CLONE_NEWNET), "setns")
            udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                udp.bind((DNS_IP, DNS_PORT))
                tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                tcp.bind((DNS_IP, DNS_PORT))
                tcp.listen(16)
                udp.setblocking(False)
                tcp.setblocking(False)
            except BaseException:
                udp.close()
                tcp.close()
                raise
            return SandboxDNS(udp, tcp)

        try:
            return _on_own_thread(make)
        except OSError as e:
            if e.errno not in (errno.EPERM, errno.EACCES):
                log.warning("sandbox DNS not bound", pid=pid, error=str(e))
            elif not _warned:
                _warned = True
                log.warning("process sandboxes get no DNS on this host: it cannot bind in their network namespace "
                            "(run the host as root); tools there rely on the proxy resolving names", error=str(e))
            return None
    finally:
        os.close(ns_fd)


#: The DNS sockets of each live channel of a process sandbox (what ``runtime/vm_network`` serves).
_BY_CHANNEL: "weakref.WeakKeyDictionary[Any, SandboxDNS]" = weakref.WeakKeyDictionary()


def bind_channel(channel: Any, dns: SandboxDNS | None) -> None:
    if dns is not None:
        _BY_CHANNEL[channel] = dns


def of_channel(channel: Any) -> SandboxDNS | None:
    try:
        return _BY_CHANNEL.get(channel)
    except TypeError:
        return None
