"""The egress decision: match the agent's rules, resolve the host, judge every address; before any connection.

A ``Decision`` carries the exact addresses that were judged; the connector connects only to those,
so a name that resolves differently a moment later (DNS rebinding) cannot change where bytes go.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from moorage.egress.addresses import IPAddress, parse_ip
from moorage.egress.policy import EgressPolicy
from moorage.egress.resolve import NameNotFound, Resolver
from moorage.egress.rules import EgressDenied, Rule, Target


@dataclass(frozen=True)
class Decision:
    scheme: str
    host: str
    port: int
    allowed: bool
    #: One word for the outcome: allowed, no-rule, unresolved, or the category of the refused address.
    reason: str
    addresses: tuple[IPAddress, ...] = ()
    rule: Rule | None = field(default=None, compare=False)

    def raise_if_denied(self) -> "Decision":
        if self.allowed:
            return self
        where = f"{self.scheme}://{self.host}:{self.port}"
        if self.reason == "no-rule":
            raise EgressDenied(f"egress to {where} is not allowed for this agent",
                               hint="list it under [agent.egress] allow in moorage.toml "
                                    '(e.g. "https://api.github.com" or "https://*.example.com")')
        if self.reason == "unresolved":
            raise EgressDenied(f"egress to {where} refused: the name does not resolve")
        # The category is said (loopback, private, metadata...), the address itself is not.
        raise EgressDenied(f"egress to {where} refused: it resolves to a {self.reason} address",
                           hint="the host only connects to public addresses unless the operator admits the range "
                                "(egress_allow_cidrs, e.g. MOORAGE_EGRESS_ALLOW_CIDRS=127.0.0.0/8, or "
                                "egress_allow_private; docs/egress.md)")


async def decide(policy: EgressPolicy, resolver: Resolver, scheme: str, host: str, port: int,
                 rule: Rule | None, owner: str = "") -> Decision:
    """Resolve ``host`` and judge every address it has; ``rule`` is the rule that admitted the request
    (None: no rule did, and nothing is resolved); ``owner`` (the tenant) is whose share of lookups it uses."""
    if rule is None:
        return Decision(scheme, host, port, False, "no-rule")
    literal = parse_ip(host)
    if literal is not None:
        addresses: list[IPAddress] = [literal]
    else:
        try:
            addresses = await resolver.resolve(host, owner)
        except NameNotFound:
            return Decision(scheme, host, port, False, "unresolved", rule=rule)
    if not addresses:
        return Decision(scheme, host, port, False, "unresolved", rule=rule)
    for ip in addresses:
        verdict = policy.operator.addresses.judge(ip)
        if not verdict.allowed:
            # One refused address refuses the name: a resolver that mixes in an internal address must not win
            # by ordering or by a retry on the next address.
            return Decision(scheme, host, port, False, verdict.category, tuple(addresses), rule)
    return Decision(scheme, host, port, True, "allowed", tuple(addresses), rule)


async def decide_target(policy: EgressPolicy, resolver: Resolver, t: Target, owner: str = "") -> Decision:
    return await decide(policy, resolver, t.scheme, t.host, t.port, policy.rule_for(t), owner)


async def decide_tunnel(policy: EgressPolicy, resolver: Resolver, host: str, port: int, owner: str = "") -> Decision:
    return await decide(policy, resolver, "https", host, port, policy.rule_for_tunnel(host, port), owner)
