"""Worker processes for the store's contention and crash tests (run as separate OS processes).

Usage: python workers.py cas STORE_URL N   |   python workers.py transfer STORE_URL
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


if __name__ == "__main__":
    if sys.argv[1] == "cas":
        cas(sys.argv[2], int(sys.argv[3]))
    else:
        transfer(sys.argv[2])
