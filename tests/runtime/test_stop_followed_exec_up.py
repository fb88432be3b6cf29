"""SIGTERM to ``moorage up`` (``systemctl stop``, Ctrl-C) while a client follows a detached exec: the server's
graceful stop waited for that stream, so for the exec to end (its ``timeout_s``, up to 24 h) before any instance
was put to sleep, and systemd's TimeoutStopSec killed the host with its instances awake. The exec is now ended as
the signal arrives (recorded as cancelled, the follower told so) and the host stops at once."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from moorage import Client
from moorage.devservices.fleet import LocalHost, write_counter_agent

#: What the stop may take here: far under the exec's timeout_s (and the shutdown's 30 s wait for busy instances).
STOP_S = 20.0


def test_sigterm_ends_a_followed_exec_and_stops_at_once(tmp_path: Path) -> None:
    host = LocalHost("up", tmp_path / "data", {"MOORAGE_LOG_LEVEL": "info"}, start_timeout_s=120)
    events: list[dict[str, Any]] = []
    try:
        with Client(host.url, host.key) as sdk:
            sdk.deploy("echo", write_counter_agent(tmp_path))
            sdk.invoke("echo", "hi", user="ada")
            sandbox = sdk.fleet()["instances"][0]["id"]
            ex = sdk.exec_detached(sandbox, ["sh", "-c", "echo ready; exec sleep 900"], timeout_s=900)

        def follow() -> None:
            with Client(host.url, host.key) as c:
                events.extend(c.follow_exec(ex["id"]))

        follower = threading.Thread(target=follow, daemon=True)
        follower.start()
        deadline = time.time() + 30
        while not any(e["event"] == "output" and "ready" in e["data"]["text"] for e in list(events)):
            assert time.time() < deadline and follower.is_alive(), events
            time.sleep(0.1)

        code, took = host.sigterm(STOP_S)
        assert code == 0, (code, took, host.log.read_text(errors="replace")[-3000:])
        follower.join(timeout=10)
        end = events[-1]
        assert end["event"] == "end" and end["data"]["status"] == "cancelled", events
        assert end["data"]["error"] == "the host stopped before the command ended"
        said = host.log.read_text(errors="replace")
        assert "host stopping, awake instances put to sleep slept=1 still_awake=0" in said, said[-3000:]
    finally:
        if host.proc.poll() is None:
            host.kill()  # the host and its sandboxes' processes
