"""The price table and instance profile: defaults, TOML overrides, errors, derived per-second prices."""

from __future__ import annotations

from pathlib import Path

import pytest

from moorage.cost import CostModel, cost_model_from_dict, load_cost_model
from moorage.errors import InvalidInput


def test_derived_prices() -> None:
    m = CostModel()
    assert m.awake_per_s == pytest.approx((0.04 * 0.25 + 0.005 * 0.25) / 3600)
    assert m.asleep_per_s == pytest.approx(0.08 * 0.13 / 730 / 3600)
    e = m.economics()
    assert e.transition == pytest.approx(m.awake_per_s * 0.175 + 0.001 * 0.1)
    assert e.break_even_s == pytest.approx(e.transition / (m.awake_per_s - m.asleep_per_s))


def test_toml_overrides_and_round_trip(tmp_path: Path) -> None:
    f = tmp_path / "prices.toml"
    f.write_text('[prices]\nvcpu_hour = 0.1\ncurrency = "EUR"\nlatency_per_s = 0\n[instance]\nwake_s = 0.5\n')
    m = load_cost_model(f)
    assert m.prices.vcpu_hour == 0.1 and m.prices.currency == "EUR" and m.instance.wake_s == 0.5
    assert m.prices.ram_gb_hour == 0.005  # untouched default
    f.write_text(m.to_toml())
    assert load_cost_model(f) == m
    assert load_cost_model(None) == CostModel()


@pytest.mark.parametrize(
    ("doc", "match"),
    [
        ({"prices": {"vcpu_hr": 1}}, "unknown key 'vcpu_hr'"),
        ({"prices": {"vcpu_hour": -1}}, "must be a number"),
        ({"prices": {"vcpu_hour": "cheap"}}, "must be a number"),
        ({"instance": {"wake_s": True}}, "must be a number"),
        ({"price": {}}, "unknown table"),
        ({"prices": 3}, "must be a table"),
    ],
)
def test_bad_price_tables_are_clear(doc: dict, match: str) -> None:
    with pytest.raises(InvalidInput, match=match):
        cost_model_from_dict(doc)


def test_bad_files(tmp_path: Path) -> None:
    with pytest.raises(InvalidInput, match="does not exist"):
        load_cost_model(tmp_path / "none.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[prices\n")
    with pytest.raises(InvalidInput, match="not valid TOML"):
        load_cost_model(bad)
