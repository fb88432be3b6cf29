"""The capped log a guest's console and supervisor output go through: bounded on disk, cheap for the host however
the guest writes, and handed over between readers without two of them reading one pipe."""

from __future__ import annotations

import os
import subprocess
import threading
import time
from pathlib import Path

import pytest

from moorage.sandbox import capped_log


class CountingOS:
    """``os`` for the module under test, counting its reads."""

    def __init__(self) -> None:
        self.reads = 0

    def read(self, fd: int, n: int) -> bytes:
        self.reads += 1
        return os.read(fd, n)

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        return getattr(os, name)


def feed(fd: int, lines: int, line: bytes, pause_every: int = 0) -> threading.Thread:
    """Write ``lines`` lines one write each (as a serial console delivers them), then close."""
    def run() -> None:
        for i in range(lines):
            os.write(fd, line)
            if pause_every and i % pause_every == 0:
                time.sleep(0.001)
        os.close(fd)
    t = threading.Thread(target=run)
    t.start()
    return t


def test_output_written_line_by_line_is_read_in_batches_and_kept_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    counting = CountingOS()
    monkeypatch.setattr(capped_log, "os", counting)
    r, w = os.pipe()
    line = b'{"event": "rejected host frame", "reason": "response for unknown call"}\n'
    writer = feed(w, 2000, line, pause_every=5)  # 400 bursts over ~0.5 s
    capped_log.drain(r, tmp_path / "console.log", alive=lambda: True)
    writer.join()
    assert (tmp_path / "console.log").read_bytes() == line * 2000
    # Read as it comes, that is a read per burst at least (400); batched, about one per COALESCE_S of writing.
    assert counting.reads < 100, counting.reads


def test_a_flood_is_read_at_full_speed_and_capped(tmp_path: Path) -> None:
    r, w = os.pipe()
    chunk = b"x" * 65536
    writer = feed(w, 64, chunk)  # 4 MiB, every write a full pipe buffer
    started = time.monotonic()
    capped_log.drain(r, tmp_path / "console.log", alive=lambda: True, cap=512 << 10)
    writer.join()
    assert time.monotonic() - started < 0.5 * 64 * capped_log.COALESCE_S  # full reads do not wait
    sizes = [(tmp_path / n).stat().st_size for n in ("console.log", "console.log.1")]
    assert all(s <= 512 << 10 for s in sizes) and sum(sizes) > 512 << 10, sizes


def test_a_stopped_reader_leaves_what_follows_to_the_next(tmp_path: Path) -> None:
    # As at a micro-VM's hand-over between two hosts: both readers have the console FIFO open, the first is stopped
    # and what the guest writes from then on is the second's, even when it arrives while the first still waits.
    fifo = tmp_path / "console.pipe"
    os.mkfifo(fifo, 0o600)
    r1 = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    w = os.open(fifo, os.O_WRONLY)
    r2 = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    stop = threading.Event()
    first = threading.Thread(target=capped_log.drain, args=(r1, tmp_path / "a.log", lambda: True), kwargs={"stop": stop},
                             daemon=True)
    first.start()
    os.write(w, b"before\n")
    for _ in range(200):
        if (tmp_path / "a.log").exists() and (tmp_path / "a.log").read_bytes() == b"before\n":
            break
        time.sleep(0.01)
    time.sleep(capped_log.COALESCE_S * 2)  # the first is back waiting for more
    stop.set()
    os.write(w, b"after\n")  # wakes the first reader's wait: it must leave this alone
    first.join(2)
    assert not first.is_alive()
    os.close(w)
    capped_log.drain(r2, tmp_path / "b.log", alive=lambda: True)
    assert (tmp_path / "a.log").read_bytes() == b"before\n"
    assert (tmp_path / "b.log").read_bytes() == b"after\n"


def test_the_last_words_of_a_writer_that_exited_are_in_the_file_once_settled(tmp_path: Path) -> None:
    # The reader may be waiting out a batch when the writer prints its last line and exits: an error that quotes
    # the log (a sandbox that exited while starting) settles the reader first.
    for attempt in range(5):
        r, w = os.pipe()
        proc = subprocess.Popen(["sh", "-c", "echo starting; sleep 0.005; echo last-words-$0", str(attempt)],
                                stdout=w, stderr=w)
        os.close(w)
        log = tmp_path / f"supervisor-{attempt}.log"
        reader = capped_log.start(r, log, alive=lambda: proc.poll() is None)
        proc.wait()
        capped_log.settled(reader)
        assert log.read_bytes() == f"starting\nlast-words-{attempt}\n".encode()
