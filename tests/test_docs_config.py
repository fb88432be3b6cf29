"""Every TOML block the README, docs/ and examples/ show is read by the loader it is meant for: an agent's
moorage.toml by the deploy's validation, a [moorage] table by config.load, a price file by the cost model, an LLM
policy by the policy parser, mcp.toml by the host's MCP config. A key the code does not know fails here."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from moorage import config
from moorage.cost.model import cost_model_from_dict
from moorage.llm.policy import parse_policy
from moorage.runtime.mcp_tools import HostMcpConfig
from moorage.runtime.package import AgentPackageError, validate_files
from tests.cli.test_docs_commands import DOCS, ROOT, fenced_blocks

AGENT_PY = b"async def on_message(ctx, message):\n    return message\n"


def _blocks() -> list[tuple[str, str]]:
    out = []
    for doc in DOCS:
        for lang, body in fenced_blocks(doc.read_text()):
            if lang == "toml":
                out.append((f"{doc.relative_to(ROOT)}: {body.splitlines()[0].split('#')[0].strip()}", body))
    return out


def load_shown(text: str, tmp_path: Path) -> None:
    """Read one shown TOML block as what its tables say it is (raises what that loader raises)."""
    doc = tomllib.loads(text)
    kinds = set(doc)
    if "agent" in kinds:
        agent = doc["agent"]
        # A block showing one table of an agent gets the [agent] it belongs in.
        manifest = text if "name" in agent else f'[agent]\nname = "shown"\nentry = "agent.py"\n{text}'
        agent = tomllib.loads(manifest)["agent"]
        files = {"moorage.toml": manifest.encode(), str(agent.get("entry", "agent.py")): AGENT_PY}
        files.update({t.split(":", 1)[0]: AGENT_PY for t in agent.get("tools", [])})
        validate_files(files)
    elif "moorage" in kinds:
        (tmp_path / "moorage.toml").write_text(text)
        config.load(tmp_path / "moorage.toml", env={})
    elif kinds <= {"prices", "instance"}:
        cost_model_from_dict(doc, "shown")
    elif kinds == {"llm"}:
        parse_policy(doc)
    elif kinds == {"tenants"}:
        (tmp_path / "mcp.toml").write_text(text)
        host = HostMcpConfig(tmp_path / "mcp.toml")
        assert all(host.servers(tenant) for tenant in doc["tenants"])
    else:
        raise AssertionError(f"a TOML block of tables {sorted(kinds)}: which loader reads it? (add it here)")


@pytest.mark.parametrize(("where", "text"), _blocks(), ids=[w for w, _ in _blocks()])
def test_every_shown_toml_block_loads(where: str, text: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CRM_TOKEN", "t")  # docs/mcp.md's ${CRM_TOKEN}
    load_shown(text, tmp_path)


def test_the_blocks_are_found_and_a_wrong_key_fails(tmp_path: Path) -> None:
    kinds = {tuple(sorted(tomllib.loads(t))) for _, t in _blocks()}
    assert {("agent",), ("instance", "prices"), ("llm",), ("tenants",)} <= kinds, kinds
    with pytest.raises(AgentPackageError, match="memory_mb"):
        load_shown('[agent]\nname = "a"\nentry = "agent.py"\nmemory_mb = 512\n', tmp_path)
    with pytest.raises(AgentPackageError, match="alow"):
        load_shown('[agent.egress]\nalow = ["https://api.github.com"]\n', tmp_path)
    with pytest.raises(config.ConfigError, match="prot"):
        load_shown("[moorage]\nprot = 1\n", tmp_path)
    with pytest.raises(Exception, match="vcpu_hours"):
        load_shown("[prices]\nvcpu_hours = 1\n", tmp_path)


def test_a_misspelt_llm_policy_key_is_refused_not_ignored(tmp_path: Path) -> None:
    with pytest.raises(config.ConfigError, match="unknown_model"):
        load_shown('[llm]\nunknown_model = "price"\n', tmp_path)
    with pytest.raises(config.ConfigError, match="tenant"):
        load_shown('[llm.tenant.acme]\nmodels = ["smollm2*"]\n', tmp_path)


def test_settings_named_in_prose_exist(tmp_path: Path) -> None:
    """`[agent.lifecycle] pool = N`, `[agent] apt` and the like in running text name real settings too."""
    import re

    from moorage.lifecycle.config import _KEYS as LIFECYCLE
    from moorage.runtime.package import _TABLE_SETTINGS, AGENT_SETTINGS, RETENTION_SETTINGS
    from moorage.store.agent_users import USER_LIMITS

    known = {"agent": AGENT_SETTINGS, "lifecycle": LIFECYCLE, "retention": RETENTION_SETTINGS,
             "limits": {*USER_LIMITS, "turn_timeout_s"}, **{k: set(v) for k, v in _TABLE_SETTINGS.items()}}
    seen, wrong = 0, []
    for doc in DOCS:
        for m in re.finditer(r"`\[agent(?:\.([a-z_]+))?\] ([a-z_]+)\b[^`]*`", doc.read_text()):
            table, key = m.group(1) or "agent", m.group(2)
            if table in known:
                seen += 1
                if key not in known[table]:
                    wrong.append(f"{doc.relative_to(ROOT)}: [agent{'.' + table if m.group(1) else ''}] {key}")
    assert seen > 5, seen
    assert not wrong, wrong


def test_lifecycle_md_lists_every_lifecycle_setting() -> None:
    from moorage.lifecycle.config import _KEYS as LIFECYCLE

    text = " ".join((ROOT / "docs" / "lifecycle.md").read_text().split())
    listed = text.split("Agent config, `[agent.lifecycle]` table:", 1)[1].split("Host settings", 1)[0]
    assert not [k for k in LIFECYCLE if f"`{k}`" not in listed], listed
