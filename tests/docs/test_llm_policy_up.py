"""docs/llm.md, "The operator's policy per tenant", configured as the page says: `llm_policy` in a moorage.toml's
`[moorage]` table, a path relative to that file, holding the page's own policy block, read by `moorage up`. A tenant
the block lets use the embedded model gets its turn; a tenant limited to other models gets the refusal, with the
model never called; a key the file does not know stops `moorage up` with its name."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx

from moorage import Client
from tests.cli.test_docs_commands import fenced_blocks
from tests.upproc import wait_serving

ROOT = Path(__file__).resolve().parents[2]
AGENT_PY = ('async def on_message(ctx, message):\n'
            '    return (await ctx.llm.complete([{"role": "user", "content": message}], max_tokens=8))["text"]\n')


def _policy_block() -> str:
    return next(body for lang, body in fenced_blocks((ROOT / "docs" / "llm.md").read_text())
                if lang == "toml" and body.startswith("[llm]"))


def _up(conf: Path) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOORAGE_")}
    return subprocess.Popen([sys.executable, "-m", "moorage.cli.main", "--config", str(conf), "--log-level", "warning",
                             "up"], cwd=conf.parent, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def test_the_pages_policy_through_moorage_up(tmp_path: Path) -> None:
    block = _policy_block()
    assert '[llm.default]                         # every tenant not listed below\nmodels = ["smollm2*"]' in block
    etc = tmp_path / "etc"
    etc.mkdir()
    # The page's block as written, and one more tenant, listed by name as the page's acme is, without the embedded model.
    (etc / "llm-policy.toml").write_text(block + '\n[llm.tenants.globex]\nmodels = ["gpt-4o-mini*"]\n')
    (etc / "moorage.toml").write_text('[moorage]\ndata_dir = "data"\nport = 0\nsandbox_driver = "process"\n'
                                      'llm_policy = "llm-policy.toml"\n')
    agent = tmp_path / "talk"
    agent.mkdir()
    (agent / "moorage.toml").write_text('[agent]\nname = "talk"\nentry = "agent.py"\n[agent.lifecycle]\nusers = "auto"\n')
    (agent / "agent.py").write_text(AGENT_PY)
    up = _up(etc / "moorage.toml")
    data = etc / "data"
    try:
        url = wait_serving(up, data, output=lambda: up.communicate(timeout=30)[0] if up.poll() is not None else "")
        operator = (data / "api" / "operator-token").read_text().strip()
        made = httpx.post(f"{url}/v1/tenants", json={"name": "globex"}, timeout=30,
                          headers={"Authorization": f"Bearer {operator}"})
        assert made.status_code == 201, made.text
        keys = {"local": (data / "local-admin.key").read_text().strip(), "globex": made.json()["api_key"]["secret"]}
        said = {}
        for tenant, key in keys.items():
            with Client(url, key, max_retries=0) as sdk:
                sdk.deploy("talk", agent)
                try:
                    said[tenant] = sdk.invoke("talk", "hello", user="ada")["status"]
                except Exception as e:  # noqa: BLE001 - the refusal is what this checks
                    said[tenant] = str(e)
                usage = sdk.usage(agent="talk")["totals"]
            # [llm.default] models = ["smollm2*"] lets the local tenant use the embedded model; globex may not.
            assert ("input_tokens" in usage) == (tenant == "local"), (tenant, usage)
        assert said["local"] == "done", said
        assert "model 'smollm2-135m-instruct' is not allowed for this tenant (allowed: gpt-4o-mini*" in said["globex"], said
    finally:
        if up.poll() is None:
            up.terminate()
        out = up.communicate(timeout=120)[0]
    assert up.returncode == 0, out

    # "A key the file does not know (`unknown_model`, `[llm.tenant.acme]`) stops `moorage up` with its name"
    (etc / "llm-policy.toml").write_text(block.replace("[llm.tenants.acme]", "[llm.tenant.acme]"))
    stopped = _up(etc / "moorage.toml")
    out = stopped.communicate(timeout=120)[0]
    assert stopped.returncode == 2 and "unknown settings ['tenant']" in out and "Traceback" not in out, out
