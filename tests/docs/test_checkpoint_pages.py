"""docs/api.md: "list routes take `limit` and `cursor`, and answer `next_cursor`"; docs/sdk.md: "`paginate(method,
...)` walks them all". A user's checkpoints were the exception nobody named: `limit` only (default 50) and no
`next_cursor`, so `sdk.paginate(sdk.list_checkpoints, ...)` stopped after the newest 50, as if that were all. The
listing now pages like the others, through `moorage up`."""

from __future__ import annotations

from pathlib import Path

import pytest

from moorage import Client
from moorage.client import BadRequest
from moorage.devservices.fleet import LocalHost


def test_a_users_checkpoints_page_like_every_listing(tmp_path: Path) -> None:
    agent = tmp_path / "diary"
    agent.mkdir()
    (agent / "moorage.toml").write_text('[agent]\nname = "diary"\nentry = "agent.py"\n[agent.lifecycle]\nusers = "auto"\n')
    (agent / "agent.py").write_text("async def on_message(ctx, message):\n    return 'noted ' + message\n")
    host = LocalHost("up", tmp_path / "data", {"MOORAGE_LOG_LEVEL": "warning"}, start_timeout_s=120)
    try:
        with Client(host.url, host.key) as sdk:
            sdk.deploy("diary", agent)
            for n in range(7):
                sdk.invoke("diary", f"day {n}", user="ada")  # a checkpoint after each turn
            sdk.take_checkpoint("diary", "ada", name="a week")
            whole = sdk.list_checkpoints("diary", "ada", limit=500)
            assert len(whole["data"]) >= 8 and whole["next_cursor"] is None
            first = sdk.list_checkpoints("diary", "ada", limit=3)
            assert [c["id"] for c in first["data"]] == [c["id"] for c in whole["data"][:3]]
            assert first["next_cursor"] and first["branches"] == whole["branches"]
            paged = [c["id"] for c in sdk.paginate(sdk.list_checkpoints, "diary", "ada", limit=3)]
            assert paged == [c["id"] for c in whole["data"]]  # every one, newest first, none twice
            with pytest.raises(BadRequest, match="cursor"):
                sdk.list_checkpoints("diary", "ada", cursor="not-a-cursor")
            # Past the last page: an empty page, not an error.
            last = whole["data"][-1]["seq"]
            assert sdk.list_checkpoints("diary", "ada", cursor=str(last))["data"] == []
    finally:
        host.stop()
