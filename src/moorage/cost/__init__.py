"""Cost model and sleep-policy simulator: what keeping agents awake or asleep costs, replayed on traces.

Public API re-exported here; see docs/cost.md for the trace format, the price table and the scenarios.
"""

from moorage.cost.model import CostModel, InstanceProfile, PriceTable, cost_model_from_dict, load_cost_model
from moorage.cost.report import Comparison, compare, default_policies, render
from moorage.cost.scenarios import SCENARIOS, generate
from moorage.cost.simulator import Hindsight, PolicyContractError, PolicyResult, SimSettings, simulate
from moorage.cost.trace import Trace, TraceFormatError, Turn, parse_trace, read_trace, save_trace, write_trace

__all__ = [
    "SCENARIOS",
    "Comparison",
    "CostModel",
    "Hindsight",
    "InstanceProfile",
    "PolicyContractError",
    "PolicyResult",
    "PriceTable",
    "SimSettings",
    "Trace",
    "TraceFormatError",
    "Turn",
    "compare",
    "cost_model_from_dict",
    "default_policies",
    "generate",
    "load_cost_model",
    "parse_trace",
    "read_trace",
    "render",
    "save_trace",
    "simulate",
    "write_trace",
]
