"""A request sent with an Idempotency-Key whose host died while it ran (a crash mid-deploy) must not keep its key
"still in progress" forever: the client's retry, once the host is back, runs it. While the holder is alive, a
second request with the key is still a 409 (nothing runs twice). Through `moorage up` and HTTP, the host killed. The deploy the crash cut
short is marked failed at the next start instead of "building" for ever."""

from __future__ import annotations

import io
import tarfile
import threading
import time
from pathlib import Path

import httpx

from moorage.devservices.fleet import LocalHost

#: Loading the agent takes a few seconds (the template's build waits for it): time to kill the host meanwhile.
SLOW_AGENT = '''\
import time
time.sleep(6)


async def on_message(ctx, message):
    return "deployed and answering: " + message
'''


def _archive(root: Path) -> bytes:
    root.mkdir(parents=True, exist_ok=True)
    (root / "moorage.toml").write_text('[agent]\nname = "slow"\nentry = "agent.py"\n[agent.lifecycle]\nusers = "auto"\n')
    (root / "agent.py").write_text(SLOW_AGENT)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for p in sorted(root.iterdir()):
            tar.add(p, arcname=p.name)
    return buf.getvalue()


def test_a_key_whose_host_died_mid_request_runs_again_when_retried(tmp_path: Path) -> None:
    data = tmp_path / "data"
    env = {"MOORAGE_LOG_LEVEL": "info"}
    body = _archive(tmp_path / "agent")
    headers = {"Content-Type": "application/gzip", "Idempotency-Key": "deploy-slow-1"}
    host = LocalHost("box", data, env)
    try:
        api = host.client(host.key)
        first: list[httpx.Response | BaseException] = []

        def deploy() -> None:
            try:
                first.append(api.post("/v1/agents/slow/deployments", content=body, headers=headers))
            except BaseException as e:  # noqa: BLE001 - the host is killed under it
                first.append(e)

        t = threading.Thread(target=deploy, daemon=True)
        t.start()
        watch = host.client(host.key)
        deadline = time.time() + 60
        while True:  # the first request holds the key once its deployment is being built
            r = watch.get("/v1/agents/slow/deployments")
            if r.status_code == 200 and any(d["status"] == "building" for d in r.json()["data"]):
                break
            assert time.time() < deadline and not first, (r.text, first)
            time.sleep(0.1)
        # While its holder lives, a second request with the key is refused: nothing runs twice.
        r = watch.post("/v1/agents/slow/deployments", content=body, headers=headers)
        assert r.status_code == 409 and "still in progress" in r.json()["detail"], r.text
        assert not first  # still building
        host.kill()
        t.join(timeout=30)
    finally:
        host.stop()

    again = LocalHost("box", data, env)
    try:
        r = again.client(again.key).post("/v1/agents/slow/deployments", content=body, headers=headers)
        assert r.status_code == 201, r.text  # was a 409 "still in progress" for ever
        deploys = again.client(again.key).get("/v1/agents/slow/deployments").json()["data"]
        # The deploy the crash cut short is failed (it was "building" for ever); the retry's is live.
        assert [(d["number"], d["status"]) for d in deploys] == [(1, "failed"), (2, "ready")]
        replay = again.client(again.key).post("/v1/agents/slow/deployments", content=body, headers=headers)
        assert replay.status_code == 201 and replay.headers.get("Idempotent-Replayed") == "true"
        turn = again.client(again.key).post("/v1/agents/slow/invoke", json={"message": "hi", "user": "ada"})
        assert turn.json()["reply"] == "deployed and answering: hi", turn.text
    finally:
        again.stop()
    log = again.log.read_text()
    assert "took over an Idempotency-Key whose request died with its host" in log
    assert "a deploy was cut short by the host stopping" in log
