"""``moorage up`` with a sampler thread for the soak run: every few seconds it writes the host's asyncio tasks.

Run as ``python bench/soak/host.py <tasks.jsonl> up [args]``; the rest is exactly ``moorage up``. Nothing is added
to the product: the count is taken from inside this process (its event loop), written one JSON line per sample
(``t``, ``tasks``, ``top``: the 12 most common coroutine names, ``threads``; every 30 s ``holdings``: what the
host's own objects hold, see ``_holdings``, and ``malloc``: what glibc's allocator holds, see ``_malloc``).

``run.py`` asks for a ``malloc_trim(0)`` by creating ``<tasks.jsonl>.trim``: the next sample returns the allocator's
free memory to the kernel and writes the RSS before and after (``trim``), telling memory the host still uses from
memory glibc merely kept after it was freed.
"""

from __future__ import annotations

import asyncio
import collections
import ctypes
import ctypes.util
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


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]


_LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")


def _malloc(scratch: Path) -> dict[str, float]:
    """glibc's allocator, summed over its arenas (MiB): ``heap`` (obtained from the kernel for its arenas),
    ``in_use`` (allocated and not freed), ``free`` (freed, kept by the allocator), ``mmapped`` (large blocks, each its
    own mapping, returned on free), and ``arenas`` (how many: the main one plus one per thread that ever contended,
    up to 8 per core)."""
    try:
        fn = _LIBC.mallinfo2
    except AttributeError:  # not glibc 2.33+
        return {}
    fn.restype = _MallInfo2
    mi = fn()
    arenas = 0
    fopen = _LIBC.fopen
    fopen.restype = ctypes.c_void_p
    fp = fopen(str(scratch).encode(), b"w")
    if fp:
        _LIBC.malloc_info(0, ctypes.c_void_p(fp))
        _LIBC.fclose(ctypes.c_void_p(fp))
        arenas = scratch.read_text().count("<heap nr=")
    mib = 1 << 20
    return {"heap": mi.arena / mib, "in_use": mi.uordblks / mib, "free": mi.fordblks / mib,
            "mmapped": mi.hblkhd / mib, "arenas": arenas}


def _rss_mib() -> float:
    for ln in Path("/proc/self/status").read_text().splitlines():
        if ln.startswith("VmRSS:"):
            return int(ln.split()[1]) / 1024
    return 0.0


def _sampler(loop: asyncio.AbstractEventLoop, out: Path, every_s: float) -> None:
    n = 0
    trim = out.with_name(out.name + ".trim")
    scratch = out.with_name(out.name + ".malloc.xml")

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
            row["malloc"] = _malloc(scratch)
        if trim.exists():
            before, info = _rss_mib(), _malloc(scratch)
            _LIBC.malloc_trim(0)
            row["trim"] = {"rss_before_mib": before, "rss_after_mib": _rss_mib(), "malloc_before": info,
                           "malloc_after": _malloc(scratch)}
            trim.unlink()
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
