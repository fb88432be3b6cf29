"""The decision itself (resolve → decide), where refusals of non-loopback internal addresses are tested:
these tests never connect anywhere, they show the decision refuses before any connection could be made.
"""

from __future__ import annotations

import ipaddress

import pytest

from moorage.egress import (AddressPolicy, Egress, EgressDenied, EgressPolicy, EgressPolicyError, OperatorPolicy,
                            Rule, StaticResolver, Target, classify)
from moorage.egress.rules import normalize_host, parse_rules
from moorage.secrets.bindings import Bindings

INTERNAL = {
    "private10.test": ("10.1.2.3", "private"),
    "private172.test": ("172.16.5.4", "private"),
    "private192.test": ("192.168.1.1", "private"),
    "cgnat.test": ("100.64.0.1", "private"),
    "ula.test": ("fd12:3456::1", "private"),
    "linklocal.test": ("169.254.1.1", "link-local"),
    "linklocal6.test": ("fe80::1", "link-local"),
    "metadata.test": ("169.254.169.254", "metadata"),
    "metadata6.test": ("fd00:ec2::254", "metadata"),
    "mapped-metadata.test": ("::ffff:169.254.169.254", "metadata"),
    "multicast.test": ("224.0.0.251", "multicast"),
    "multicast6.test": ("ff02::1", "multicast"),
    "unspecified.test": ("0.0.0.0", "unspecified"),
    "unspecified6.test": ("::", "unspecified"),
    "loopback.test": ("127.0.0.1", "loopback"),
    "loopback-other.test": ("127.1.2.3", "loopback"),
    "loopback6.test": ("::1", "loopback"),
    "mapped-loopback.test": ("::ffff:127.0.0.1", "loopback"),
    "compat-loopback.test": ("::127.0.0.1", "loopback"),
    "nat64-loopback.test": ("64:ff9b::7f00:1", "loopback"),
    "sixtofour-private.test": ("2002:0a00:0001::1", "private"),
    "documentation.test": ("192.0.2.10", "reserved"),
    "broadcast.test": ("255.255.255.255", "reserved"),
}
PUBLIC = {"public.test": "93.184.216.34", "public6.test": "2606:4700:4700::1111"}


def _egress(operator: OperatorPolicy | None = None, extra: dict | None = None) -> Egress:
    table = {k: [v[0]] for k, v in INTERNAL.items()} | {k: [v] for k, v in PUBLIC.items()} | (extra or {})
    return Egress(operator or OperatorPolicy(), StaticResolver(table))


def _policy(egress: Egress, *hosts: str) -> EgressPolicy:
    return egress.policy_for({"egress": {"allow": [f"https://{h}" for h in hosts]}})


@pytest.mark.parametrize("name", sorted(INTERNAL))
async def test_internal_addresses_are_refused_by_default(name: str) -> None:
    eg = _egress()
    d = await eg.check(_policy(eg, name), Target.parse(f"https://{name}/"))
    assert not d.allowed and d.reason == INTERNAL[name][1]
    with pytest.raises(EgressDenied, match=INTERNAL[name][1]):
        d.raise_if_denied()


@pytest.mark.parametrize("name", sorted(PUBLIC))
async def test_public_addresses_are_allowed_with_the_address_that_was_judged(name: str) -> None:
    eg = _egress()
    d = await eg.check(_policy(eg, name), Target.parse(f"https://{name}/x"))
    assert d.allowed and d.addresses == (ipaddress.ip_address(PUBLIC[name]),)


@pytest.mark.parametrize("literal", ["[::1]", "[0:0:0:0:0:0:0:1]", "[::ffff:127.0.0.1]", "[::ffff:7f00:1]",
                                     "[::127.0.0.1]", "[64:ff9b::7f00:1]", "127.0.0.1", "127.255.0.1",
                                     "[fe80::1]", "169.254.169.254", "[fd00:ec2::254]", "0.0.0.0", "[::]"])
async def test_ip_literals_of_internal_addresses_are_refused_even_when_a_rule_names_them(literal: str) -> None:
    eg = _egress()
    d = await eg.check(_policy(eg, literal), Target.parse(f"https://{literal}/"))
    assert not d.allowed


async def test_one_internal_address_refuses_the_whole_name() -> None:
    eg = _egress(extra={"mixed.test": ["93.184.216.34", "10.0.0.7"]})
    d = await eg.check(_policy(eg, "mixed.test"), Target.parse("https://mixed.test/"))
    assert not d.allowed and d.reason == "private"


async def test_operator_can_allow_private_ranges_but_never_metadata_or_loopback_that_way() -> None:
    eg = _egress(OperatorPolicy(AddressPolicy.of(allow_private=True)))
    for name, allowed in (("private10.test", True), ("ula.test", True), ("cgnat.test", True),
                          ("metadata.test", False), ("loopback.test", False), ("linklocal.test", False)):
        d = await eg.check(_policy(eg, name), Target.parse(f"https://{name}/"))
        assert d.allowed is allowed, name


async def test_operator_ranges_admit_exactly_what_they_name() -> None:
    eg = _egress(OperatorPolicy(AddressPolicy.of(False, "10.1.0.0/16")))
    assert (await eg.check(_policy(eg, "private10.test"), Target.parse("https://private10.test/"))).allowed
    assert not (await eg.check(_policy(eg, "private172.test"), Target.parse("https://private172.test/"))).allowed


async def test_no_rule_means_nothing_is_resolved() -> None:
    class Counting(StaticResolver):
        calls = 0

        async def resolve(self, host: str, owner: str = ""):  # type: ignore[no-untyped-def]
            Counting.calls += 1
            return await super().resolve(host, owner)

    eg = Egress(OperatorPolicy(), Counting({k: [v] for k, v in PUBLIC.items()}))
    d = await eg.check(_policy(eg, "other.test"), Target.parse("https://public.test/"))
    assert not d.allowed and d.reason == "no-rule" and Counting.calls == 0


def test_classify_covers_ipv6_spellings_of_ipv4() -> None:
    assert classify(ipaddress.ip_address("::ffff:10.0.0.1")) == "private"
    assert classify(ipaddress.ip_address("::ffff:169.254.169.254")) == "metadata"
    assert classify(ipaddress.ip_address("2001:0:4136:e378:8000:63bf:80ff:fffe")) == "loopback"  # Teredo, client 127.0.0.1


def test_rules_parse_the_documented_forms() -> None:
    assert Rule.parse("https://api.github.com") == Rule("https", "api.github.com", 443, "", "https://api.github.com")
    assert Rule.parse("api.github.com").scheme == "https"
    r = Rule.parse("https://*.Example.com:8443/v1/")
    assert (r.host, r.port, r.path) == ("*.example.com", 8443, "/v1/")
    assert Rule.parse("http://127.0.0.1:").port is None  # the old prefix form: any port
    assert Rule.parse("http://h:*").port is None


@pytest.mark.parametrize("bad", ["http://", "https://", "ftp://x", "https://u@x", "https://x/?q=1", "https://x:99999",
                                 "https://x/../y", "https://*.10.0.0.1", "https:// x", ""])
def test_rules_refuse_what_would_be_ambiguous(bad: str) -> None:
    with pytest.raises(EgressPolicyError):
        parse_rules([bad], "[agent.egress] allow")


@pytest.mark.parametrize("raw", ["api\n.example.com", "api.example\n.com", "api.example.com\n.", "a\nb.example.com"])
def test_host_names_with_a_newline_in_a_label_are_refused(raw: str) -> None:
    # A ``$``-anchored label pattern matched with ``match`` let a label end in a newline.
    with pytest.raises(ValueError):
        normalize_host(raw)


def test_secret_bindings_refuse_a_host_with_a_newline() -> None:
    with pytest.raises(EgressPolicyError):
        Bindings.from_manifest({"secrets": {"TOKEN": {"header": "Authorization", "hosts": ["api\n.github.com"]}}})


def test_path_rules_match_by_segment() -> None:
    r = Rule.parse("https://api.github.com/repos")
    ok = [Target.parse(u) for u in ("https://api.github.com/repos", "https://api.github.com/repos/a/b?x=1")]
    no = [Target.parse(u) for u in ("https://api.github.com/reposx", "https://api.github.com/", "http://api.github.com/repos")]
    assert all(r.admits(t) for t in ok) and not any(r.admits(t) for t in no)


def test_tunnels_only_match_https_rules_without_a_path() -> None:
    assert Rule.parse("https://pypi.org").admits_tunnel("pypi.org", 443)
    assert not Rule.parse("https://pypi.org/simple").admits_tunnel("pypi.org", 443)
    assert not Rule.parse("http://pypi.org").admits_tunnel("pypi.org", 80)
    assert not Rule.parse("https://pypi.org").admits_tunnel("pypi.org", 22)


def test_network_table_and_package_indexes_join_the_policy() -> None:
    op = OperatorPolicy(package_rules=parse_rules("https://pypi.org,https://files.pythonhosted.org", "x"))
    p = EgressPolicy.from_manifest({"egress": {"allow": ["https://a.test"]},
                                    "network": {"allow": ["https://b.test"], "packages": True}}, op)
    assert [r.host for r in p.rules] == ["a.test", "b.test", "pypi.org", "files.pythonhosted.org"]
    assert [r.host for r in EgressPolicy.packages(op).rules] == ["pypi.org", "files.pythonhosted.org"]
    assert EgressPolicy.from_manifest({}, op).rules == ()
