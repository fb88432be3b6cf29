"""`pip install` run in a user's sandbox works as it does in a micro-VM (whose image's pip.conf allows it) on the
process driver too: Debian's Python is "externally managed" (PEP 668), which refused every plain install there.
What docs/sdk.md shows (`sdk.exec(sid, ["sh", "-c", "pip install ..."])`) and the README's "pip works unchanged"."""

from __future__ import annotations

import shutil
from pathlib import Path

from moorage.store.model import EntityKey
from tests.runtime.conftest import Env, write_agent

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

PIP = """
import os, sys

async def on_message(ctx, message):
    src = os.path.join(ctx.agent.path, "vendor", "slugkit")
    r = await ctx.exec([sys.executable, "-m", "pip", "install", "--no-index", "--no-build-isolation", "--quiet", src],
                       timeout=300)
    if r["exit_code"] != 0:
        return "install failed: " + r["stderr"][-600:]
    r = await ctx.exec([sys.executable, "-c", "import slugkit; print(slugkit.slugify('Plain Pip'))"])
    return r["stdout"].strip() or r["stderr"][-300:]
"""


async def test_a_plain_pip_install_in_a_process_sandbox_works(env: Env, tmp_path: Path) -> None:
    src = write_agent(tmp_path / "pipper", "pipper", PIP)
    shutil.copytree(EXAMPLES / "coder" / "vendor", src / "vendor")
    await env.runtime.deploy(env.principal, src)
    r = await env.runtime.invoke(env.principal, EntityKey("pipper", "ada", "s1"), "go")
    assert r.reply == "plain-pip", r.reply
