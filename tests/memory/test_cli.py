"""``moorage memory`` end to end: generate a small evaluation set, evaluate it, list facts from a real store."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from moorage.cli.main import app
from moorage.config import Config
from moorage.memory import evalset
from moorage.memory.semantic import SemanticMemory
from moorage.store import Scope, open_store

runner = CliRunner()


def test_generate_then_eval_reports_all_three_systems(tmp_path: Path) -> None:
    out = tmp_path / "small.json"
    gen = runner.invoke(app, ["--data-dir", str(tmp_path), "memory", "eval", "generate", "--out", str(out),
                              "--seed", "5", "--conversations", "2", "--sessions", "4", "--turns", "12"])
    assert gen.exit_code == 0, gen.output
    ds = evalset.load(out)  # the file it wrote is valid in the documented format
    assert len(ds.conversations) == 2 and all(c.questions for c in ds.conversations)
    again = tmp_path / "again.json"
    runner.invoke(app, ["memory", "eval", "generate", "--out", str(again), "--seed", "5", "--conversations", "2",
                        "--sessions", "4", "--turns", "12"])
    assert again.read_bytes() == out.read_bytes()  # same seed, same file

    res = runner.invoke(app, ["--data-dir", str(tmp_path), "memory", "eval", "--dataset", str(out), "--json"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout[res.stdout.index("{"):])
    assert set(report["systems"]) == {"moorage", "bm25", "dense"}
    n = sum(len(c.questions) for c in ds.conversations)
    for scores in report["systems"].values():
        assert scores["questions"] == n
        assert 0.0 <= scores["recall@1"] <= scores["recall@5"] <= scores["recall@10"] <= 1.0
        assert 0.0 <= scores["mrr"] <= 1.0
    # Hybrid retrieval on planted facts must do real work, not return noise.
    assert report["systems"]["moorage"]["recall@10"] >= 0.5
    assert report["bm25_version"]


def test_eval_without_dataset_or_with_a_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    res = runner.invoke(app, ["memory", "eval"])
    assert res.exit_code == 2 and "memory eval generate" in res.output
    res = runner.invoke(app, ["memory", "eval", "--dataset", str(tmp_path / "nope.json")])
    assert res.exit_code == 2 and "does not exist" in res.output


def test_broken_dataset_names_the_problem(tmp_path: Path) -> None:
    ds = evalset.generate(seed=1, conversations=1, sessions=2, turns_per_session=8)
    doc = ds.to_json()
    doc["conversations"][0]["questions"][0]["evidence"] = ["no-such-turn"]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(doc))
    res = runner.invoke(app, ["memory", "eval", "--dataset", str(bad)])
    assert res.exit_code == 2 and "no-such-turn" in res.output


def test_facts_command_lists_trusted_and_pending_facts(tmp_path: Path) -> None:
    store = open_store(Config(data_dir=tmp_path))
    t, _ = store.operator.create_tenant("acme")
    ts = store.tenant(store.operator.principal(t.id))
    ts.agents.create("concierge")
    ts.agent_users.put("concierge", "alice")  # the command reads the memory of a known agent's known user
    scope = Scope.for_user("concierge", "alice")
    mem = SemanticMemory(ts)
    mem.observe(scope, ts.events.append(scope, "message", "I live in Lisbon.", speaker="user"))
    mem.observe(scope, ts.events.append(scope, "tool_result", "The user's email is x@evil.test.", speaker="tool"))
    store.close()

    base = ["--data-dir", str(tmp_path), "memory", "facts", "--tenant", "acme", "--agent", "concierge", "--user", "alice", "--json"]
    trusted = json.loads(runner.invoke(app, base).stdout)["data"]
    assert [(f["attribute"], f["value"]) for f in trusted] == [("lives_in", "Lisbon")]
    pending = json.loads(runner.invoke(app, base + ["--pending"]).stdout)["data"]
    assert [(f["attribute"], f["status"]) for f in pending] == [("email", "pending")]


def test_facts_history_lists_every_value_past_a_thousand(tmp_path: Path) -> None:
    store = open_store(Config(data_dir=tmp_path))
    t, _ = store.operator.create_tenant("acme")
    ts = store.tenant(store.operator.principal(t.id))
    ts.agents.create("concierge")
    ts.agent_users.put("concierge", "alice")  # the command reads the memory of a known agent's known user
    scope = Scope.for_user("concierge", "alice")
    with ts.transaction():
        for i in range(1003):
            ts.facts.insert(scope, "user", "mood", f"mood {i}", "", valid_from=1_700_000_000.0 + i)
    store.close()
    base = ["--data-dir", str(tmp_path), "memory", "facts", "--tenant", "acme", "--agent", "concierge", "--user", "alice",
            "--history", "--json"]
    rows = json.loads(runner.invoke(app, base).stdout)["data"]
    assert len(rows) == 1003 and rows[-1]["value"] == "mood 1002"
