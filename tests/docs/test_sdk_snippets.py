"""docs/sdk.md's examples, run as written against `moorage up`: the page's own Python blocks, with only the server's
address and key, the webhook receiver's URL and the page's placeholders (`other`, `deliver_to_user`) filled in. A
method renamed, an argument or an answer's field the page names that the SDK or the server does not have fails
here, not in a reader's backend."""

from __future__ import annotations

import contextlib
import io
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from moorage.devservices.fleet import LocalHost
from tests.api.test_async_webhooks import Receiver
from tests.cli.test_docs_commands import fenced_blocks

ROOT = Path(__file__).resolve().parents[2]
SDK_MD = ROOT / "docs" / "sdk.md"


def _blocks() -> list[str]:
    blocks = [body for lang, body in fenced_blocks(SDK_MD.read_text()) if lang == "python"]
    assert len(blocks) == 4, "docs/sdk.md's examples changed: say here how each is run"
    return blocks


def _run(code: str, scope: dict[str, Any], name: str) -> str:
    """Execute one block in ``scope`` (the names the blocks before it made); what it printed."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, f"docs/sdk.md {name}", "exec"), scope)  # noqa: S102 - the page's own code
    return out.getvalue()


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalHost]:
    data = tmp_path_factory.mktemp("sdk-snippets") / "data"
    # The webhook receiver below is on 127.0.0.1, which the host's address policy refuses unless the operator allows.
    server = LocalHost("up", data, {"MOORAGE_LOG_LEVEL": "warning", "MOORAGE_EGRESS_ALLOW_CIDRS": "127.0.0.0/8"},
                       start_timeout_s=120)
    try:
        yield server
    finally:
        server.stop()


def test_the_pages_examples_run_as_written(host: LocalHost, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # `sdk.deploy("assistant", "examples/assistant")`: run from the repository, as the page is
    first, webhooks, verify, execs = _blocks()
    scope: dict[str, Any] = {}

    shown = '"http://127.0.0.1:7700", "mrg_..."'
    assert shown in first
    printed = _run(first.replace(shown, f'"{host.url}", "{host.key}"'), scope, "first example")
    sdk = scope["sdk"]
    assert scope["turn"]["reply"] and printed.startswith(scope["turn"]["reply"]), printed
    assert "cust-42 {'sandbox_id': " in printed and "cust-43" not in printed, printed  # only the "pro" user listed
    assert [u["id"] for u in sdk.paginate(sdk.list_users, "assistant")] == ["cust-42"]  # cust-43 forgotten
    assert sdk.get_user("assistant", "cust-42")["metadata"] == {"plan": "pro"}

    receiver = Receiver()
    try:
        shown = '"https://backend.example.com/hooks/moorage"'
        assert shown in webhooks
        _run(webhooks.replace(shown, repr(receiver.url)), scope, "executions and webhooks")
        assert scope["secret"].startswith("whsec_")
        assert scope["ex"]["status"] == "succeeded" and scope["ex"]["reply"], scope["ex"]

        deadline = time.time() + 60
        while not receiver.delivered():
            assert time.time() < deadline, "the execution's webhook never arrived"
            time.sleep(0.1)
        delivered: list[tuple[str, Any]] = []
        scope["deliver_to_user"] = lambda user, reply: delivered.append((user, reply))
        scope["ask_approver"] = lambda run_id, interrupt: delivered.append((run_id, interrupt))
        _run(verify, scope, "the receiver")
        headers, body = receiver.delivered()[0]
        scope["receive"](body, headers)
        assert delivered == [("cust-42", scope["ex"]["reply"])]
        scope["receive"](body, headers)  # a retry of the same delivery (same webhook-id): dropped
        assert len(delivered) == 1
        scope["receive"](body + b" ", headers)  # altered: refused, nothing delivered
        assert len(delivered) == 1
    finally:
        receiver.close()

    # `other`: the page's name for some other detached exec, cancelled at the end of its example.
    sid = sdk.get_user("assistant", "cust-42")["instance"]["sandbox_id"]
    scope["other"] = sdk.exec_detached(sid, ["sleep", "300"], timeout_s=600)
    printed = _run(execs, scope, "commands in a user's sandbox")
    assert scope["r"]["exit_code"] == 0 and scope["r"]["stdout"] == "4\n", scope["r"]
    assert scope["job"]["status"] in ("succeeded", "failed") and "requirements.txt" in printed, printed
    assert sdk.wait(scope["other"]["id"])["status"] == "cancelled"
