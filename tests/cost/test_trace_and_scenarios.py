"""Trace JSONL format (round trip, line-precise errors) and the scenario generator (determinism, shape)."""

from __future__ import annotations

import io
import statistics
from pathlib import Path

import pytest

from moorage.cost import SCENARIOS, Trace, TraceFormatError, Turn, generate, parse_trace, read_trace, save_trace, write_trace
from moorage.errors import InvalidInput


def test_round_trip_through_jsonl(tmp_path: Path) -> None:
    tr = generate("bursty", users=5, hours=4, seed=9)
    path = tmp_path / "t.jsonl"
    save_trace(tr, path)
    back = read_trace(path)
    assert back == tr
    assert back.meta == {"scenario": "bursty", "users": 5, "hours": 4, "seed": 9}


def test_minimal_trace_without_header_is_sorted_and_horizon_covers_last_turn() -> None:
    tr = parse_trace(['{"instance": "b", "arrival_s": 5, "service_s": 1}', "", '{"instance": "a", "arrival_s": 2, "service_s": 10}'])
    assert [t.instance for t in tr.turns] == ["a", "b"]
    assert tr.horizon_s == 12.0 and tr.instances == 2


def test_header_horizon_is_kept_when_longer() -> None:
    tr = parse_trace(['{"trace": {"horizon_s": 100, "note": "x"}}', '{"instance": "a", "arrival_s": 2, "service_s": 1}'])
    assert tr.horizon_s == 100.0 and tr.meta == {"note": "x"}


@pytest.mark.parametrize(
    ("line", "match"),
    [
        ("not json", "line 2 is not JSON"),
        ("[1, 2]", "not a JSON object"),
        ('{"arrival_s": 1, "service_s": 1}', "'instance' must be"),
        ('{"instance": "a", "arrival_s": -1, "service_s": 1}', "'arrival_s' must be"),
        ('{"instance": "a", "arrival_s": 1, "service_s": "2"}', "'service_s' must be"),
        ('{"trace": {"horizon_s": 5}}', "header must be the first line"),
    ],
)
def test_bad_lines_name_the_line(line: str, match: str) -> None:
    good = '{"instance": "a", "arrival_s": 0, "service_s": 1}'
    with pytest.raises(TraceFormatError, match=match) as e:
        parse_trace([good, line], "t.jsonl")
    assert "t.jsonl" in str(e.value)


def test_empty_and_missing_traces_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(TraceFormatError, match="no turns"):
        parse_trace(["", '{"trace": {}}'])
    with pytest.raises(InvalidInput, match="does not exist"):
        read_trace(tmp_path / "nope.jsonl")


def test_write_trace_writes_a_header_and_one_turn_per_line() -> None:
    out = io.StringIO()
    write_trace(Trace.of([Turn("a", 1.5, 2.0)], 10.0, {"scenario": "x"}), out)
    lines = out.getvalue().splitlines()
    assert lines == ['{"trace": {"horizon_s": 10.0, "scenario": "x"}}', '{"instance": "a", "arrival_s": 1.5, "service_s": 2.0}']


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_generator_is_deterministic_per_seed(scenario: str) -> None:
    # Diurnal traffic is sparse at night and many-idle users are rare: give those more users.
    kw = {"users": {"many-idle": 50, "diurnal": 20}.get(scenario, 3), "hours": 6}
    a = generate(scenario, seed=1, **kw)
    assert a == generate(scenario, seed=1, **kw)
    assert a.turns != generate(scenario, seed=2, **kw).turns
    assert a.turns, "a scenario must produce traffic"
    assert all(0 <= t.arrival_s < a.horizon_s and t.service_s > 0 for t in a.turns)
    assert list(a.turns) == sorted(a.turns, key=lambda t: (t.arrival_s, t.instance))


def test_adding_users_keeps_earlier_users_traffic() -> None:
    small = generate("steady", users=3, hours=2, seed=4)
    big = generate("steady", users=6, hours=2, seed=4)
    assert [t for t in big.turns if t.instance in {"u0000", "u0001", "u0002"}] == list(small.turns)


def test_chatty_is_one_user_with_a_turn_every_few_seconds() -> None:
    tr = generate("chatty", hours=2, seed=0)
    assert tr.instances == 1
    arrivals = [t.arrival_s for t in tr.turns]
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    assert 3.0 <= statistics.median(gaps) <= 8.0
    assert arrivals[-1] > 1.9 * 3600


def test_unknown_scenario_and_bad_sizes() -> None:
    with pytest.raises(InvalidInput, match="choose one of"):
        generate("weekly")
    with pytest.raises(InvalidInput):
        generate("steady", users=0)
    with pytest.raises(InvalidInput):
        generate("steady", hours=0)
