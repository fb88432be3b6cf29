"""Worker processes for the store's contention and crash tests (run as separate OS processes).

Usage: python workers.py cas STORE_URL N   |   python workers.py transfer STORE_URL   |   python workers.py lgput STORE_URL
The API key comes from $MOORAGE_TEST_KEY.
"""

from __future__ import annotations

import os
import sys

from moorage.config import Config
from moorage.errors import ConflictError
from moorage.store import Scope, open_store

SCOPE = Scope.for_user("bench", "u")


def cas(url: str, n: int) -> None:
    store = open_store(Config(store_url=url))
    ts = store.tenant(store.authenticate(os.environ["MOORAGE_TEST_KEY"]))
    retries = 0
    for _ in range(n):
        while True:
            cur = ts.state.get(SCOPE, "counter")
            try:
                ts.state.put(SCOPE, "counter", cur.value + 1, expected_version=cur.version)
                break
            except ConflictError:
                retries += 1
    print(retries)
    store.close()


def transfer(url: str) -> None:
    """Move one unit from a to b forever, each move one multi-record transaction."""
    store = open_store(Config(store_url=url))
    ts = store.tenant(store.authenticate(os.environ["MOORAGE_TEST_KEY"]))
    print("ready", flush=True)
    while True:
        with ts.transaction():
            a = ts.state.get(SCOPE, "a")
            b = ts.state.get(SCOPE, "b")
            n = ts.state.get(SCOPE, "moves")
            ts.state.put(SCOPE, "a", a.value - 1, expected_version=a.version)
            ts.events.append(SCOPE, "move", f"move {n.value + 1}")
            ts.state.put(SCOPE, "b", b.value + 1, expected_version=b.version)
            ts.state.put(SCOPE, "moves", n.value + 1, expected_version=n.version)


def lg_value(thread: str, step: int, channel: str) -> str:
    """The deterministic 64 KiB channel value the lgput worker writes (large enough for the blob log)."""
    seed = f"{thread}/{step}/{channel}/"
    return (seed * (65536 // len(seed) + 1))[:65536]


def lgput(url: str) -> None:
    """Four threads putting LangGraph checkpoints with large values forever; each acknowledged put is
    printed as ``thread step checkpoint_id`` once ``put`` returned."""
    import threading

    from langgraph.checkpoint.base import empty_checkpoint

    from moorage.store.langgraph import MoorageSaver

    store = open_store(Config(store_url=url))
    saver = MoorageSaver(store.tenant(store.authenticate(os.environ["MOORAGE_TEST_KEY"])))
    out = threading.Lock()
    start = int(sys.argv[3]) if len(sys.argv) > 3 else 0

    def run(thread: str) -> None:
        config = {"configurable": {"thread_id": thread, "checkpoint_ns": ""}}
        step = start
        while True:
            cp = empty_checkpoint()
            cp["channel_values"] = {ch: lg_value(thread, step, ch) for ch in ("a", "b")}
            cp["channel_versions"] = {"a": step + 1, "b": step + 1}
            config = saver.put(config, cp, {"step": step}, {"a": step + 1, "b": step + 1})
            with out:
                print(thread, step, cp["id"], flush=True)
            step += 1

    print("ready", flush=True)
    for i in range(4):
        threading.Thread(target=run, args=(f"t{i}",), daemon=True).start()
    threading.Event().wait()


if __name__ == "__main__":
    if sys.argv[1] == "cas":
        cas(sys.argv[2], int(sys.argv[3]))
    elif sys.argv[1] == "lgput":
        lgput(sys.argv[2])
    else:
        transfer(sys.argv[2])
