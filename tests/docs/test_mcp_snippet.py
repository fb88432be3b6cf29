"""docs/mcp.md's client example, run as written against `moorage up`: the official `mcp` client with an end-user
token calls `send_message` on `/mcp/support` and gets the agent's reply and moorage's structured result."""

from __future__ import annotations

import contextlib
import io
import textwrap
from pathlib import Path
from typing import Any

from moorage import Client
from moorage.devservices.fleet import LocalHost
from tests.cli.test_docs_commands import fenced_blocks

ROOT = Path(__file__).resolve().parents[2]


async def test_mcp_md_client_example(tmp_path: Path) -> None:
    code = next(body for lang, body in fenced_blocks((ROOT / "docs" / "mcp.md").read_text())
                if lang == "python" and "streamable_http_client" in body)
    agent = tmp_path / "support"
    agent.mkdir()
    (agent / "moorage.toml").write_text('[agent]\nname = "support"\nentry = "agent.py"\n'
                                        '[agent.lifecycle]\nusers = "auto"\n')
    (agent / "agent.py").write_text("async def on_message(ctx, message):\n"
                                    "    return f'{ctx.user} in {ctx.session} asked: {message}'\n")
    host = LocalHost("up", tmp_path / "data", {"MOORAGE_LOG_LEVEL": "warning"}, start_timeout_s=120)
    try:
        with Client(host.url, host.key) as sdk:
            sdk.deploy("support", agent)
            sdk.put_user("support", "cust-7")
            token = sdk.issue_user_token("support", "cust-7")["token"]
        shown = '"http://127.0.0.1:7700/mcp/support"'
        assert shown in code
        body = code.replace(shown, f'"{host.url}/mcp/support"')
        scope: dict[str, Any] = {"token": token}
        exec(compile("async def example():\n" + textwrap.indent(body, "    ") + "\n    return r\n",  # noqa: S102
                     "docs/mcp.md", "exec"), scope)
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            r = await scope["example"]()
    finally:
        host.stop()
    assert printed.getvalue().startswith("cust-7 in web asked: where is my order? {"), printed.getvalue()
    assert r.structured_content["status"] == "done" and r.structured_content["trace_id"], r.structured_content
    assert set(r.structured_content) >= {"status", "turn_id", "trace_id", "run_id", "interrupt"}
