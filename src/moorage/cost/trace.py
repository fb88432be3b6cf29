"""Arrival traces: the JSONL format the simulator replays, and reading/writing it with line-precise errors.

One turn per line: ``{"instance": "u0001", "arrival_s": 12.5, "service_s": 3.2}``; an optional first line
``{"trace": {"horizon_s": 86400, ...}}`` carries the horizon and free-form metadata (scenario, seed).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, TextIO

from moorage.errors import InvalidInput


class TraceFormatError(InvalidInput):
    """A trace file line is not a valid turn; the message names the file and line."""

    code = "trace-format"


@dataclass(frozen=True)
class Turn:
    #: Which agent instance (one per end-user) the request is for.
    instance: str
    #: Seconds since the start of the trace when the request arrived.
    arrival_s: float
    #: How long the turn runs once the instance is awake (model calls, tools), seconds.
    service_s: float


@dataclass(frozen=True)
class Trace:
    """Turns sorted by arrival (ties by instance id), and the time the replay ends."""

    turns: tuple[Turn, ...]
    horizon_s: float
    meta: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, turns: Iterable[Turn], horizon_s: float | None = None, meta: dict[str, Any] | None = None) -> "Trace":
        ordered = tuple(sorted(turns, key=lambda t: (t.arrival_s, t.instance)))
        last_end = max((t.arrival_s + t.service_s for t in ordered), default=0.0)
        # The replay runs at least until the last turn ends, so every turn's cost is counted.
        horizon = last_end if horizon_s is None else max(float(horizon_s), last_end)
        return cls(ordered, horizon, dict(meta or {}))

    @property
    def instances(self) -> int:
        return len({t.instance for t in self.turns})


def _number(doc: dict[str, Any], key: str, where: str) -> float:
    v = doc.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v) or math.isinf(v) or v < 0:
        raise TraceFormatError(f"{where}: {key!r} must be a finite number ≥ 0, got {v!r}", hint=_FORMAT_HINT)
    return float(v)


_FORMAT_HINT = 'each line must look like {"instance": "u1", "arrival_s": 12.5, "service_s": 3.2}'


def parse_trace(lines: Iterable[str], source: str = "trace") -> Trace:
    turns: list[Turn] = []
    horizon: float | None = None
    meta: dict[str, Any] = {}
    header_seen = False
    for n, line in enumerate(lines, 1):
        line = line.strip()
        if not line:
            continue
        where = f"{source} line {n}"
        try:
            doc = json.loads(line)
        except json.JSONDecodeError as e:
            raise TraceFormatError(f"{where} is not JSON: {e.msg}", hint=_FORMAT_HINT) from None
        if not isinstance(doc, dict):
            raise TraceFormatError(f"{where} is not a JSON object", hint=_FORMAT_HINT)
        if "trace" in doc:
            if turns or header_seen:
                raise TraceFormatError(f"{where}: the trace header must be the first line")
            header = doc["trace"]
            if not isinstance(header, dict):
                raise TraceFormatError(f"{where}: 'trace' must be an object like {{\"horizon_s\": 86400}}")
            header_seen = True
            meta = {k: v for k, v in header.items() if k != "horizon_s"}
            if "horizon_s" in header:
                horizon = _number(header, "horizon_s", where)
            continue
        inst = doc.get("instance")
        if not isinstance(inst, str) or not inst:
            raise TraceFormatError(f"{where}: 'instance' must be a non-empty string, got {inst!r}", hint=_FORMAT_HINT)
        turns.append(Turn(inst, _number(doc, "arrival_s", where), _number(doc, "service_s", where)))
    if not turns:
        raise TraceFormatError(f"{source} holds no turns", hint="generate one with `moorage cost trace generate --scenario steady --out t.jsonl`")
    return Trace.of(turns, horizon, meta)


def read_trace(path: Path) -> Trace:
    try:
        with open(path, encoding="utf-8") as f:
            return parse_trace(f, str(path))
    except FileNotFoundError:
        raise InvalidInput(f"trace file {path} does not exist", hint="generate one with `moorage cost trace generate`") from None


def write_trace(trace: Trace, out: TextIO) -> None:
    out.write(json.dumps({"trace": {"horizon_s": trace.horizon_s, **trace.meta}}) + "\n")
    for t in trace.turns:
        out.write(json.dumps({"instance": t.instance, "arrival_s": round(t.arrival_s, 3), "service_s": round(t.service_s, 3)}) + "\n")


def save_trace(trace: Trace, path: Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        write_trace(trace, f)
