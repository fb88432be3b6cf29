"""The host side of a micro-VM's NIC (sandbox/microvm_net.py), without QEMU: what its namespace holds, and that the
guest's fixed addresses match the host's. The VM end-to-end tests are in tests/egress/test_vm_network.py."""

from __future__ import annotations

import socket
from pathlib import Path

from moorage.guest import egress_relay
from moorage.sandbox import microvm_net


def test_the_namespace_holds_only_the_tap_and_the_gateway_listener() -> None:
    net = microvm_net.VMNetwork.create()
    try:
        assert net.interfaces() == ["lo", microvm_net.TAP_NAME]
        assert net.tap_fd is not None and net.proxy_listener is not None
        assert net.proxy_listener.getsockname() == (microvm_net.GATEWAY_IP, microvm_net.PROXY_PORT)

        def routes() -> list[tuple[str, str, str]]:
            lines = Path("/proc/thread-self/net/route").read_text().splitlines()[1:]
            return [(f[0], f[1], f[2]) for f in (line.split() for line in lines)]

        # One on-link route for the tap's /24 and nothing else: no default route, no way out of the namespace.
        assert net.run_inside(routes) == [(microvm_net.TAP_NAME, "0002000A", "00000000")]

        def connect(port: int) -> str:
            try:
                socket.create_connection((microvm_net.GATEWAY_IP, port), timeout=2).close()
                return "connected"
            except OSError as e:
                return type(e).__name__

        # Inside the namespace, the gateway's proxy address accepts (it is bound from launch); nothing else does.
        assert net.run_inside(lambda: connect(microvm_net.PROXY_PORT)) == "connected"
        assert net.run_inside(lambda: connect(8080)) == "ConnectionRefusedError"
        # The host's own namespace never sees the tap.
        assert microvm_net.TAP_NAME not in [name for _, name in socket.if_nameindex()]
    finally:
        net.close()
    assert net.ns_fd is None and net.tap_fd is None and net.proxy_listener is None


def test_each_launch_gets_its_own_namespace_with_the_same_addresses() -> None:
    a, b = microvm_net.VMNetwork.create(), microvm_net.VMNetwork.create()
    try:
        assert a.proxy_listener is not None and b.proxy_listener is not None
        assert a.proxy_listener.getsockname() == b.proxy_listener.getsockname()  # same address, no clash
        assert a.run_inside(lambda: Path("/proc/thread-self/ns/net").resolve().name) != \
            b.run_inside(lambda: Path("/proc/thread-self/ns/net").resolve().name)
    finally:
        a.close()
        b.close()


def test_guest_and_host_agree_on_the_nic_addresses() -> None:
    # The guest (stdlib only) cannot import the host's constants: they are kept equal by this test.
    assert egress_relay.NIC_MAC == microvm_net.GUEST_MAC
    assert egress_relay.GATEWAY_PROXY == f"http://{microvm_net.GATEWAY_IP}:{microvm_net.PROXY_PORT}"
    assert egress_relay.NIC_ADDRESS == microvm_net.GUEST_IP and egress_relay.NIC_NETMASK == microvm_net.NETMASK


def test_a_sandbox_asks_for_a_nic_only_with_the_network_environment() -> None:
    assert microvm_net.available()
    assert microvm_net.wanted({microvm_net.WANT_ENV: "1"})
    assert not microvm_net.wanted({"MOORAGE_NETWORK": "1"})  # a deploy-time relay alone gets no device
    assert not microvm_net.wanted({})
