"""A synchronous exec is not replayed by its Idempotency-Key (docs/api.md): sent again, the command runs again. So the
SDK retries it only when it surely did not run (a 429/503 refusal, no connection made), never after a gateway's 504
or a connection lost once it was sent: through a real `moorage up` behind a gateway that loses the answer, the
command runs once and the error says it may have run."""

from __future__ import annotations

from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from moorage import Client
from moorage.client import ServerError, Unavailable
from moorage.devservices.fleet import LocalHost
from tests.client.loopback import Loopback, read_body, reply

ROOT = Path(__file__).resolve().parents[2]


class Gateway(Loopback):
    """Forwards to the host; an exec's answer is lost on the way back as ``mode`` says (after the host ran it), or,
    with ``refuse_first``, the first exec is refused with a 503 before it reaches the host."""

    def __init__(self, upstream: str, mode: str, refuse_first: bool = False) -> None:
        self.forwarded_execs, self.refuse = 0, refuse_first

        def relay(handler: BaseHTTPRequestHandler) -> None:
            body = read_body(handler)
            is_exec = handler.path.endswith("/exec")
            if is_exec and self.refuse:
                self.refuse = False
                return reply(handler, 503, b"busy", {"Retry-After": "0"})
            headers = {k: v for k, v in handler.headers.items() if k.lower() not in ("host", "content-length")}
            r = httpx.request(handler.command, upstream + handler.path, content=body, headers=headers, timeout=120)
            if is_exec:
                self.forwarded_execs += 1
                if mode == "504":
                    return reply(handler, 504, b"<html>504 Gateway Time-out</html>")
                if mode == "drop":
                    handler.close_connection = True
                    return  # the host ran it; the caller never hears back
            reply(handler, r.status_code, r.content, {"content-type": r.headers.get("content-type", "")})

        super().__init__(relay, http11=True)


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalHost, str]]:
    host = LocalHost("up", tmp_path_factory.mktemp("exec-retry") / "data", {"MOORAGE_LOG_LEVEL": "warning"},
                     start_timeout_s=120)
    try:
        with Client(host.url, host.key) as sdk:
            sdk.deploy("notes", ROOT / "examples" / "backend" / "agent")
            user = sdk.put_user("notes", "ada", provision=True)
        yield host, user["instance"]["sandbox_id"]
    finally:
        host.stop()


def _runs(host: LocalHost, sid: str, name: str) -> int:
    with Client(host.url, host.key) as sdk:
        out = sdk.exec(sid, ["sh", "-c", f"cat {name} 2>/dev/null | wc -l"])
    return int(out["stdout"].strip())


@pytest.mark.parametrize("mode", ["504", "drop"])
def test_an_exec_whose_answer_was_lost_is_not_run_again(sandbox: tuple[LocalHost, str], mode: str) -> None:
    host, sid = sandbox
    gateway = Gateway(host.url, mode)
    try:
        with Client(gateway.url, host.key, sleep=lambda s: None) as sdk:
            with pytest.raises((ServerError, Unavailable)) as lost:
                sdk.exec(sid, ["sh", "-c", f"echo ran >> runs-{mode}.txt"])
    finally:
        gateway.close()
    assert gateway.forwarded_execs == 1 and _runs(host, sid, f"runs-{mode}.txt") == 1
    assert "may have run" in (lost.value.hint or "") and "idempotency_key" in (lost.value.hint or ""), lost.value
    assert "check before sending it again" in str(lost.value)


def test_an_exec_refused_before_it_ran_is_still_retried(sandbox: tuple[LocalHost, str]) -> None:
    host, sid = sandbox
    gateway = Gateway(host.url, "pass", refuse_first=True)
    try:
        with Client(gateway.url, host.key, sleep=lambda s: None) as sdk:
            assert sdk.exec(sid, ["sh", "-c", "echo ran >> runs-refused.txt"])["exit_code"] == 0
            assert [status for _, path, status in sdk.attempts if path.endswith("/exec")] == [503, 200]
    finally:
        gateway.close()
    assert _runs(host, sid, "runs-refused.txt") == 1
