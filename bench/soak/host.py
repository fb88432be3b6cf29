"""``moorage up`` with a sampler thread for the soak run: every few seconds it writes the host's asyncio tasks.

Run as ``python bench/soak/host.py <tasks.jsonl> up [args]``; the rest is exactly ``moorage up``. Nothing is added
to the product: the count is taken from inside this process (its event loop), written one JSON line per sample
(``t``, ``tasks``, ``top``: the 12 most common coroutine names, ``threads``; every 30 s ``holdings``: what the
host's own objects hold, see ``_holdings``).
"""

from __future__ import annotations

import asyncio
import collections
import gc
import json
import os
import sys
import threading
import time
import tracemalloc
import weakref
from pathlib import Path
from typing import Any


def _coro_name(task: asyncio.Task[Any]) -> str:
    coro = task.get_coro()
    return getattr(coro, "__qualname__", None) or type(coro).__name__


def _holdings() -> dict[str, int]:
    """For every live object of a moorage class: how many there are (``Class``) and the summed length of each
    of its dict, set, list and deque attributes (``Class.attr``): what a long-lived object keeps per user,
    sandbox or request shows here as a number that grows."""
    counts: collections.Counter[str] = collections.Counter()
    gc.collect()  # what only a cycle keeps is not held
    for obj in gc.get_objects():
        cls = type(obj)
        module = cls.__dict__.get("__module__")
        if not isinstance(module, str) or not module.startswith("moorage."):
            continue
        name = cls.__qualname__
        counts[name] += 1
        attrs = getattr(obj, "__dict__", None)
        if attrs is None:
            attrs = {a: getattr(obj, a, None) for a in getattr(cls, "__slots__", ())}
        for attr, value in list(attrs.items()):
            if isinstance(value, (dict, set, list, collections.deque, weakref.WeakSet, weakref.WeakValueDictionary)):
                counts[f"{name}.{attr}"] += len(value)
    return dict(counts)


def _sampler(loop: asyncio.AbstractEventLoop, out: Path, every_s: float) -> None:
    n = 0

    def sample() -> None:
        tasks = asyncio.all_tasks(loop)
        top = collections.Counter(_coro_name(t) for t in tasks).most_common(12)
        names = collections.Counter(t.name.rstrip("0123456789_-") for t in threading.enumerate()).most_common(8)
        row = {"t": time.time(), "tasks": len(tasks), "top": top, "threads": threading.active_count(),
               "thread_names": names}
        if n % 15 == 0:  # every 30 s: a walk of every object takes a while
            row["holdings"] = _holdings()
            if tracemalloc.is_tracing():  # SOAK_TRACEMALLOC=1: where the Python heap is, by line
                stats = tracemalloc.take_snapshot().statistics("lineno")[:25]
                row["heap"] = [[str(st.traceback[0]), st.size, st.count] for st in stats]
        with out.open("a") as f:
            f.write(json.dumps(row) + "\n")

    while not loop.is_closed():
        try:
            loop.call_soon_threadsafe(sample)
            n += 1
        except RuntimeError:  # the loop closed between the check and the call
            return
        time.sleep(every_s)


def main() -> None:
    out = Path(sys.argv[1])
    sys.argv = ["moorage", *sys.argv[2:]]
    import moorage.cli.up as up
    from moorage.cli.main import app

    serve = up.serve

    async def serve_sampled(*args: Any, **kwargs: Any) -> None:
        threading.Thread(target=_sampler, args=(asyncio.get_running_loop(), out, 2.0), daemon=True,
                         name="soak-sampler").start()
        await serve(*args, **kwargs)

    up.serve = serve_sampled  # type: ignore[assignment]  # `moorage up` imports serve when it runs
    if os.environ.get("SOAK_TRACEMALLOC") == "1":
        tracemalloc.start()
    app()


if __name__ == "__main__":
    main()
