"""Which IP addresses the host may connect to on an agent's behalf: the operator's address policy.

Every address a name resolves to is classified here before any connection; only public unicast
addresses pass, unless the operator names a range (``egress_allow_cidrs``) or allows private ranges.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from typing import Iterable

from moorage.errors import ConfigError

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

#: Cloud instance-metadata endpoints: never reachable unless a CIDR names them explicitly.
METADATA = (ipaddress.ip_network("169.254.169.254/32"), ipaddress.ip_network("fd00:ec2::254/128"),
            ipaddress.ip_network("100.100.100.200/32"))  # the last one: Alibaba Cloud's
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_NAT64_LOCAL = ipaddress.ip_network("64:ff9b:1::/48")
_V4_COMPAT = ipaddress.ip_network("::/96")
# The ranges "private" means (RFC 1918, RFC 4193 unique-local, shared address space for carrier-grade NAT):
# internal to some operator's network. Other non-global ranges (documentation, benchmarking) are "reserved".
_PRIVATE = tuple(ipaddress.ip_network(n) for n in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10",
                                                    "fc00::/7"))


@dataclass(frozen=True)
class AddressVerdict:
    allowed: bool
    #: Why, in a word: public, loopback, private, link-local, multicast, unspecified, metadata, reserved,
    #: or operator-cidr when an operator range admitted it.
    category: str


def parse_cidrs(raw: str | Iterable[str]) -> tuple[IPNetwork, ...]:
    items = raw.split(",") if isinstance(raw, str) else list(raw)
    out = []
    for item in items:
        item = item.strip()
        if not item:
            continue
        try:
            out.append(ipaddress.ip_network(item, strict=False))
        except ValueError as e:
            raise ConfigError(f"egress_allow_cidrs: {item!r} is not an address range",
                              hint="write ranges like 127.0.0.0/8 or ::1/128, separated by commas") from e
    return tuple(out)


def embedded_ipv4(ip: IPAddress) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 form carries (mapped, compatible, NAT64, 6to4, Teredo client), if any."""
    if not isinstance(ip, ipaddress.IPv6Address):
        return None
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip in _NAT64 or ip in _V4_COMPAT:
        if ip in _V4_COMPAT and int(ip) <= 1:  # :: and ::1 are themselves, not IPv4 forms
            return None
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    if ip.sixtofour is not None:
        return ip.sixtofour
    if ip.teredo is not None:
        return ip.teredo[1]
    return None


def classify(ip: IPAddress) -> str:
    """One word for what kind of address ``ip`` is; ``public`` is the only kind allowed by default."""
    inner = embedded_ipv4(ip)
    if inner is not None:
        # An IPv6 spelling of an IPv4 address is judged as that IPv4 address (::ffff:127.0.0.1 is loopback).
        return classify(inner)
    if isinstance(ip, ipaddress.IPv6Address) and ip.scope_id:
        return "link-local"
    if ip.is_unspecified:
        return "unspecified"
    if ip.is_loopback:
        return "loopback"
    if any(ip in n for n in METADATA if n.version == ip.version):
        return "metadata"
    if ip.is_link_local:
        return "link-local"
    if ip.is_multicast:
        return "multicast"
    if ip in _NAT64_LOCAL or any(ip in n for n in _PRIVATE if n.version == ip.version):
        return "private"
    if ip.is_reserved or not ip.is_global:
        return "reserved"
    return "public"


@dataclass(frozen=True)
class AddressPolicy:
    """The operator's part of every egress decision (config: ``egress_allow_private``, ``egress_allow_cidrs``)."""

    #: Admit private and shared ranges (RFC 1918, RFC 4193, 100.64/10); never loopback, link-local or metadata.
    allow_private: bool = False
    #: Ranges admitted whatever their kind (tests name 127.0.0.0/8 here: their "internet" is loopback).
    allow_cidrs: tuple[IPNetwork, ...] = field(default=())

    @classmethod
    def of(cls, allow_private: bool = False, allow_cidrs: str | Iterable[str] = ()) -> "AddressPolicy":
        return cls(allow_private, parse_cidrs(allow_cidrs))

    def judge(self, ip: IPAddress) -> AddressVerdict:
        category = classify(ip)
        # An IPv4-mapped address is a connection to that IPv4 address; other IPv6 forms (6to4, NAT64, Teredo)
        # go through relays, so a named IPv4 range admits only the mapped form.
        mapped = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None
        for net in self.allow_cidrs:
            if (net.version == ip.version and ip in net) or (mapped is not None and net.version == 4 and mapped in net):
                return AddressVerdict(True, "operator-cidr")
        if category == "public":
            return AddressVerdict(True, category)
        if category == "private" and self.allow_private:
            return AddressVerdict(True, category)
        return AddressVerdict(False, category)


def parse_ip(text: str) -> IPAddress | None:
    """``text`` as an IP address (brackets and an IPv6 zone allowed), or None if it is a name."""
    t = text[1:-1] if text.startswith("[") and text.endswith("]") else text
    try:
        return ipaddress.ip_address(t)
    except ValueError:
        return None
