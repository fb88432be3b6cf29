"""A secret an agent opted into its environment (`[agent.secrets] env`, docs/egress.md) follows what is set: a new
value is there on the next turn, and a deleted one is gone from it (it stayed in the sandbox's environment for every
later turn until the sandbox restarted)."""

from __future__ import annotations

from pathlib import Path

from moorage import Client
from moorage.devservices.fleet import LocalHost

AGENT_PY = '''\
import os


async def on_message(ctx, message):
    return os.environ.get("SEARCH_TOKEN", "-")
'''


def test_a_deleted_env_secret_is_gone_from_the_next_turn(tmp_path: Path) -> None:
    agent = tmp_path / "envy"
    agent.mkdir()
    (agent / "moorage.toml").write_text('[agent]\nname = "envy"\nentry = "agent.py"\n'
                                        '[agent.secrets]\nenv = ["SEARCH_TOKEN"]\n[agent.lifecycle]\nusers = "auto"\n')
    (agent / "agent.py").write_text(AGENT_PY)
    host = LocalHost("up", tmp_path / "data", {"MOORAGE_LOG_LEVEL": "warning"}, start_timeout_s=120)
    try:
        with Client(host.url, host.key, timeout_s=120) as sdk:
            sdk.deploy("envy", agent)
            assert sdk.invoke("envy", "token?", user="ada")["reply"] == "-"
            sdk.set_secret("envy", "SEARCH_TOKEN", "t-1")
            assert sdk.invoke("envy", "token?", user="ada")["reply"] == "t-1"
            sdk.set_secret("envy", "SEARCH_TOKEN", "t-2")
            assert sdk.invoke("envy", "token?", user="ada")["reply"] == "t-2"
            sdk.delete_secret("envy", "SEARCH_TOKEN")
            assert sdk.invoke("envy", "token?", user="ada")["reply"] == "-"  # the same sandbox, awake all along
    finally:
        host.stop()
