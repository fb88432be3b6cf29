"""An async turn survives its host being killed mid-execution: `moorage up` is SIGKILLed while the turn runs, a new
`moorage up` on the same data dir resumes it (Runtime.recover), and its webhook is delivered once."""

from __future__ import annotations

import io
import signal
import subprocess
import tarfile
import time
from pathlib import Path

from moorage import Client
from moorage.client import verify_webhook
from tests.api.test_async_webhooks import Receiver
from tests.cli.test_cli_e2e import MOORAGE, ROOT, _env
from tests.upproc import wait_serving

AGENT = '''
import asyncio

async def on_message(ctx, message):
    await asyncio.sleep(4)
    return "finished: " + message
'''


def archive() -> bytes:
    files = {"moorage.toml": '[agent]\nname = "slowpoke"\nentry = "agent.py"\n[agent.lifecycle]\nusers = "auto"\n',
             "agent.py": AGENT}
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, text in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(text.encode())
            tar.addfile(info, io.BytesIO(text.encode()))
    return buf.getvalue()


def start(env: dict[str, str]) -> tuple[subprocess.Popen[str], str]:
    server = subprocess.Popen([*MOORAGE, "up"], env=env, cwd=ROOT, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, text=True)
    return server, wait_serving(server, Path(env["MOORAGE_DATA_DIR"]), timeout=180)


def test_host_killed_mid_execution_resumes_it_and_delivers_once(tmp_path: Path) -> None:
    # The receiver is on loopback, which webhook deliveries may reach only when the operator admits it.
    env = {**_env(tmp_path / "data", 0), "MOORAGE_EGRESS_ALLOW_CIDRS": "127.0.0.0/8"}
    receiver = Receiver()
    server, url = start(env)
    second = None
    try:
        key = (tmp_path / "data" / "local-admin.key").read_text().strip()
        sdk = Client(url, key, max_retries=10)
        sdk.deploy("slowpoke", archive())
        hook = sdk.create_webhook("slowpoke", receiver.url, events=["execution.succeeded"])
        ex = sdk.invoke_async("slowpoke", "the report", user="kim")
        sdk.wait_execution(ex["id"], until=("running",), poll_s=0.05, timeout_s=120)
        server.send_signal(signal.SIGKILL)  # mid-turn: the agent is inside its 4 s sleep
        server.wait()
        assert receiver.delivered() == []

        second, url = start(env)  # the same data dir: recovery resumes the run on start
        sdk.close()
        sdk = Client(url, key, max_retries=10)
        done = sdk.wait_execution(ex["id"], poll_s=0.1, timeout_s=180)
        assert done["status"] == "succeeded" and done["reply"] == "finished: the report"
        deadline = time.time() + 60
        while not receiver.delivered():
            assert time.time() < deadline, "the webhook never came"
            time.sleep(0.1)
        time.sleep(1.5)  # more delivery rounds: nothing is sent twice
        assert len(receiver.delivered()) == 1
        headers, body = receiver.delivered()[0]
        event = verify_webhook(hook["secret"], body, headers)
        assert event["type"] == "execution.succeeded" and event["data"]["execution_id"] == ex["id"]
        sdk.close()
    finally:
        for p in (server, second):
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGINT)
                try:
                    p.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    p.kill()
        receiver.close()
