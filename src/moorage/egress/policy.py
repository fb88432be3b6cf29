"""The egress policy of one agent: its rules from moorage.toml joined with the operator's policy.

Read from ``[agent.egress] allow`` and ``[agent.network] allow``/``packages`` of the deployed manifest,
and from the operator's settings in config.py (address ranges, the package-index rules, limits).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from moorage.egress.addresses import AddressPolicy
from moorage.egress.limits import Limits
from moorage.egress.rules import EgressPolicyError, Rule, Target, parse_rules


@dataclass(frozen=True)
class OperatorPolicy:
    """What the operator decides for every agent on this host."""

    addresses: AddressPolicy = field(default_factory=AddressPolicy)
    #: Rules of the package indexes an agent may reach when it asks for ``[agent.network] packages = true``.
    package_rules: tuple[Rule, ...] = ()
    limits: Limits = field(default_factory=Limits)

    @classmethod
    def from_config(cls, cfg: Any) -> "OperatorPolicy":
        return cls(
            AddressPolicy.of(bool(cfg.egress_allow_private), cfg.egress_allow_cidrs),
            parse_rules(cfg.egress_package_index, "egress_package_index"),
            Limits(max_connections=cfg.egress_max_connections, connects_per_s=float(cfg.egress_connects_per_s),
                   bytes_per_s=cfg.egress_bytes_per_s, max_bytes=cfg.egress_max_bytes),
        )


@dataclass(frozen=True)
class EgressPolicy:
    """Where one agent's traffic may go: a request is allowed when one rule admits it and every address its
    host resolves to is one the operator allows (checked in ``Egress.check``)."""

    rules: tuple[Rule, ...]
    operator: OperatorPolicy = field(default_factory=OperatorPolicy)

    @classmethod
    def from_manifest(cls, manifest: dict[str, Any] | None, operator: OperatorPolicy | None = None) -> "EgressPolicy":
        """The policy of a deployed agent (``manifest`` is its ``[agent]`` table)."""
        operator = operator or OperatorPolicy()
        manifest = manifest or {}
        rules: list[Rule] = []
        egress = manifest.get("egress") or {}
        network = manifest.get("network") or {}
        for table, name in ((egress, "[agent.egress]"), (network, "[agent.network]")):
            if not isinstance(table, dict):
                raise EgressPolicyError(f"{name} must be a table", hint=f'e.g. {name}\nallow = ["https://api.github.com"]')
            rules += parse_rules(table.get("allow"), f"{name} allow")
        if network.get("packages"):
            rules += operator.package_rules
        return cls(tuple(rules), operator)

    @classmethod
    def packages(cls, operator: OperatorPolicy) -> "EgressPolicy":
        """The policy of deploy-time package installs: the operator's package indexes and nothing else."""
        return cls(operator.package_rules, operator)

    def rule_for(self, t: Target) -> Rule | None:
        return next((r for r in self.rules if r.admits(t)), None)

    def rule_for_tunnel(self, host: str, port: int) -> Rule | None:
        return next((r for r in self.rules if r.admits_tunnel(host, port)), None)
