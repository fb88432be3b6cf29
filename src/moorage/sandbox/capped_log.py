"""Guest-written output on host disk, bounded: a thread copies a pipe into a log file rotated at a cap.

Used for a micro-VM's serial console and a process sandbox's supervisor output: a guest printing forever costs
the host at most two files of ``cap`` bytes (``NAME`` and ``NAME.1``), never its disk.
"""

from __future__ import annotations

import os
import select
import threading
import time
from pathlib import Path
from typing import Callable

#: Default cap of one log file; the previous one is kept as NAME.1.
DEFAULT_CAP_BYTES = 512 << 10
#: Output that trickles in (a serial console's bytes come one write at a time) is read in batches: after a short
#: read the reader waits this long before the next, so a guest printing line after line costs the host one read a
#: batch, not one per line (a full read means more is waiting: read on at once).
COALESCE_S = 0.02
_READ_BYTES = 65536


def start(fd: int, log_path: Path, *, alive: Callable[[], bool], cap: int = DEFAULT_CAP_BYTES, name: str = "",
          stop: threading.Event | None = None) -> threading.Thread:
    """Drain ``fd`` (owned from now on: closed at the end) into ``log_path`` on a daemon thread until every writer
    has closed it, or ``alive()`` turns false while it is quiet, or ``stop`` is set (checked between reads: the
    writer's output left in the pipe is then another reader's). Returns the thread: once the writer has exited,
    joining it (``settled``) puts everything it wrote in the file, the last batch included."""
    thread = threading.Thread(target=drain, args=(fd, log_path, alive, cap, stop), name=name or f"log-{log_path.name}",
                              daemon=True)
    thread.start()
    return thread


def settled(thread: threading.Thread | None, timeout: float = 0.5) -> None:
    """Wait (up to ``timeout``) for a reader whose writer has exited to write what was left in the pipe: an error
    that quotes the log's tail reads it after this."""
    if thread is not None:
        thread.join(timeout)


def drain(fd: int, log_path: Path, alive: Callable[[], bool], cap: int = DEFAULT_CAP_BYTES,
          stop: threading.Event | None = None) -> None:
    poller = select.poll()
    poller.register(fd, select.POLLIN | select.POLLHUP)
    out = None
    try:
        out = _open(log_path, "ab")
        size = out.tell()
        while True:
            ready = poller.poll(200 if stop is not None else 1000)
            if stop is not None and stop.is_set():
                return  # what is left in the pipe is the next reader's
            if not ready:
                if not alive():
                    return
                continue
            try:
                data = os.read(fd, _READ_BYTES)
            except BlockingIOError:
                continue
            if not data:  # every writer closed
                return
            batch = len(data) == _READ_BYTES
            data = data[-cap:]
            if size + len(data) > cap:
                out.close()
                os.replace(log_path, log_path.with_name(log_path.name + ".1"))
                out = _open(log_path, "wb")
                size = 0
            out.write(data)
            out.flush()
            size += len(data)
            if not batch:
                time.sleep(COALESCE_S)
    except OSError:
        return  # the sandbox directory went away (destroyed): nothing left to log to
    finally:
        os.close(fd)
        if out is not None:
            out.close()


def _open(path: Path, mode: str):  # type: ignore[no-untyped-def]
    f = open(path, mode)
    os.fchmod(f.fileno(), 0o600)
    return f
