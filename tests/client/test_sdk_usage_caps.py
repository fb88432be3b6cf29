"""A backend shows a user how much of each cap they used: `usage(agent=, user=)["caps"]` counts as the check before a
turn does (the compute cap includes the running part of an awake instance, which the ledger's totals have only once
it sleeps), so the page never says "0.03 of 1 s used" while moorage refuses the turn as over the cap."""

from __future__ import annotations

import re
import time
from datetime import datetime, timezone
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from moorage import Client
from moorage.cli.main import app
from moorage.client import RateLimited
from moorage.devservices.fleet import LocalHost

ROOT = Path(__file__).resolve().parents[2]


def test_usage_of_one_user_gives_their_caps_as_the_turns_check_counts_them(tmp_path: Path) -> None:
    host = LocalHost("up", tmp_path / "data", {"MOORAGE_LOG_LEVEL": "warning"}, start_timeout_s=120)
    try:
        with Client(host.url, host.key) as sdk:
            sdk.deploy("notes", ROOT / "examples" / "backend" / "agent")
            sdk.put_user("notes", "ada", limits={"compute_seconds_per_day": 1, "tokens_per_month": 500})
            sdk.put_user("notes", "bob")
            deadline = time.time() + 60
            with pytest.raises(RateLimited) as refused:
                while True:
                    sdk.invoke("notes", "hello", user="ada")
                    assert time.time() < deadline, "the compute cap never refused a turn"
                    time.sleep(0.3)
            assert refused.value.code == "cap-exceeded"
            used = sdk.usage(agent="notes", user="ada")
            compute = used["caps"]["compute_seconds_per_day"]
            midnight = datetime.now(timezone.utc).replace(hour=0, minute=0, second=0, microsecond=0).timestamp() + 86400
            assert compute["limit"] == 1 and compute["used"] >= 1 and compute["resets_at"] == midnight, used
            assert used["caps"]["tokens_per_month"] == {"limit": 500, "used": 0, "resets_at": used["caps"][
                "tokens_per_month"]["resets_at"]} and used["caps"]["tokens_per_month"]["resets_at"] > time.time()
            assert sdk.usage(agent="notes", user="bob")["caps"] == {}  # no caps of his own, none from the agent
            # `moorage usage --agent --user` shows them too, each with when it resets.
            shown = CliRunner().invoke(app, ["usage", "--agent", "notes", "--user", "ada"],
                                       env={"MOORAGE_API_URL": host.url, "MOORAGE_API_KEY": host.key})
            reset = datetime.fromtimestamp(midnight, timezone.utc).strftime("%Y-%m-%d 00:00:00 UTC")
            assert shown.exit_code == 0 and f"of 1 (resets {reset})" in shown.stdout, shown.output
            assert re.search(r"cap tokens_per_month[\s│]+0 of 500 \(resets ", shown.stdout), shown.output
            assert "caps" not in sdk.usage(agent="notes") and "caps" not in sdk.usage(user="ada")

        # Another tenant asking for the same agent and user name sees its own (none), not ada's.
        operator = (host.data / "api" / "operator-token").read_text().strip()
        made = httpx.post(f"{host.url}/v1/tenants", json={"name": "globex"}, timeout=30,
                          headers={"Authorization": f"Bearer {operator}"})
        assert made.status_code == 201, made.text
        with Client(host.url, made.json()["api_key"]["secret"]) as other:
            assert other.usage(agent="notes", user="ada")["caps"] == {}
    finally:
        host.stop()
