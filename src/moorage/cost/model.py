"""The cost model: a price table and one agent's resource profile, and what they make an awake or sleeping second cost.

Read from TOML (``[prices]`` and ``[instance]`` tables); defaults are documented in docs/cost.md.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from moorage.errors import InvalidInput
from moorage.lifecycle.policies import SleepEconomics

_HOURS_PER_MONTH = 730.0


@dataclass(frozen=True)
class PriceTable:
    """What the operator pays (or charges itself) for resources, in ``currency``."""

    #: One vCPU reserved for one hour.
    vcpu_hour: float = 0.04
    #: One GB of guest RAM reserved for one hour.
    ram_gb_hour: float = 0.005
    #: One GB of snapshot kept for a month (local NVMe / block storage ≈ 0.08, object storage ≈ 0.023).
    snapshot_gb_month: float = 0.08
    #: What one second of a user waiting for a wake or a provisioning is worth. It is what stops a policy
    #: from sleeping between every two turns; 0 means latency is free.
    latency_per_s: float = 0.001
    currency: str = "USD"


@dataclass(frozen=True)
class InstanceProfile:
    """Resources and lifecycle timings of one agent's sandbox (defaults: measured micro-VM, ARCHITECTURE.md)."""

    vcpus: float = 0.25
    ram_gb: float = 0.25
    #: Memory state written at sleep (≈ 130 MB touched of a 256 MiB guest). The persistent disk is stored
    #: whatever the policy, so it is not counted here.
    snapshot_gb: float = 0.13
    #: Request arrival → turn can start, for a sleeping instance (restore + first channel round trip).
    wake_s: float = 0.1
    #: Compute time to snapshot an instance (device state + RAM file fsync).
    sleep_s: float = 0.075
    #: Provisioning a new agent by copy-on-write fork of the template snapshot.
    fork_s: float = 0.1
    #: Provisioning a new agent by booting it (no template snapshot).
    cold_boot_s: float = 3.7
    #: Handing a new agent a pre-forked, already running sandbox from the warm pool.
    pool_claim_s: float = 0.002


@dataclass(frozen=True)
class CostModel:
    prices: PriceTable = field(default_factory=PriceTable)
    instance: InstanceProfile = field(default_factory=InstanceProfile)

    @property
    def awake_per_s(self) -> float:
        p, i = self.prices, self.instance
        return (p.vcpu_hour * i.vcpus + p.ram_gb_hour * i.ram_gb) / 3600.0

    @property
    def asleep_per_s(self) -> float:
        return self.prices.snapshot_gb_month * self.instance.snapshot_gb / (_HOURS_PER_MONTH * 3600.0)

    @property
    def storage_gb_hour(self) -> float:
        return self.prices.snapshot_gb_month / _HOURS_PER_MONTH

    def economics(self) -> SleepEconomics:
        """The three numbers a sleep policy weighs (see ``SleepEconomics``)."""
        i = self.instance
        transition = self.awake_per_s * (i.sleep_s + i.wake_s) + self.prices.latency_per_s * i.wake_s
        return SleepEconomics(awake_per_s=self.awake_per_s, asleep_per_s=self.asleep_per_s, transition=transition)

    def to_toml(self) -> str:
        lines = ["[prices]"]
        for f in fields(PriceTable):
            lines.append(f"{f.name} = {_toml_value(getattr(self.prices, f.name))}")
        lines += ["", "[instance]"]
        for f in fields(InstanceProfile):
            lines.append(f"{f.name} = {_toml_value(getattr(self.instance, f.name))}")
        return "\n".join(lines) + "\n"


def _toml_value(v: Any) -> str:
    return f'"{v}"' if isinstance(v, str) else repr(v)


def _build(cls: type, table: Any, where: str) -> Any:
    if not isinstance(table, dict):
        raise InvalidInput(f"{where} must be a table", hint=f"write [{where.split(' ')[0]}] followed by key = value lines")
    known = {f.name: f for f in fields(cls)}
    values: dict[str, Any] = {}
    for k, v in table.items():
        if k not in known:
            raise InvalidInput(f"unknown key {k!r} in {where}", hint=f"known keys: {', '.join(known)}")
        if known[k].type in ("str", str):
            values[k] = str(v)
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v) or v < 0:
            raise InvalidInput(f"{where}: {k} = {v!r} must be a number ≥ 0")
        values[k] = float(v)
    return dataclasses.replace(cls(), **values)


def cost_model_from_dict(doc: dict[str, Any], source: str = "price table") -> CostModel:
    extra = set(doc) - {"prices", "instance"}
    if extra:
        raise InvalidInput(f"unknown table(s) {sorted(extra)} in {source}", hint="a price file has [prices] and [instance] tables")
    return CostModel(
        prices=_build(PriceTable, doc.get("prices", {}), f"prices in {source}"),
        instance=_build(InstanceProfile, doc.get("instance", {}), f"instance in {source}"),
    )


def load_cost_model(path: Path | None) -> CostModel:
    """Defaults, overridden by the ``[prices]``/``[instance]`` tables of ``path`` if given."""
    if path is None:
        return CostModel()
    try:
        doc = tomllib.loads(Path(path).read_text())
    except FileNotFoundError:
        raise InvalidInput(f"price file {path} does not exist", hint="`moorage cost prices > prices.toml` writes the defaults") from None
    except tomllib.TOMLDecodeError as e:
        raise InvalidInput(f"price file {path} is not valid TOML: {e}") from None
    return cost_model_from_dict(doc, str(path))
