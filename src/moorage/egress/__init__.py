"""Egress: the one path from an agent to the outside — policy, decision, connector, gateway and ``ctx.fetch``.

Decide (rules → resolve → judge every address) before connecting, then connect only to the judged address.
See docs/egress.md.
"""

from moorage.egress.addresses import AddressPolicy, AddressVerdict, classify
from moorage.egress.connector import Egress, EgressFailed, InstanceEgress
from moorage.egress.decision import Decision
from moorage.egress.fetch import FetchResult, fetch
from moorage.egress.gateway import Gateway, GatewayBinding, store_recorder
from moorage.egress.limits import EgressLimited, Limits, Usage
from moorage.egress.policy import EgressPolicy, OperatorPolicy
from moorage.egress.resolve import NameNotFound, Resolver, StaticResolver, SystemResolver
from moorage.egress.rules import EgressDenied, EgressPolicyError, Rule, Target

__all__ = [
    "AddressPolicy", "AddressVerdict", "Decision", "Egress", "EgressDenied", "EgressFailed", "EgressLimited",
    "EgressPolicy", "EgressPolicyError", "FetchResult", "Gateway", "GatewayBinding", "InstanceEgress", "Limits",
    "NameNotFound", "OperatorPolicy", "Resolver", "Rule", "StaticResolver", "SystemResolver", "Target", "Usage",
    "classify", "fetch", "store_recorder",
]
