"""The process driver's start does not wait for the guest package's byte-compile (a host's start is downtime for its
users): it runs beside serving, and the bytecode it writes is the same."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from moorage.config import Config
from moorage.sandbox import process
from moorage.sandbox.process import ProcessDriver


def test_the_driver_starts_while_the_guest_compiles(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    compiled = threading.Event()
    release = threading.Event()
    real = process._compile_guest

    def slow_compile(guest: Path) -> None:  # the real compile, held until the driver has started
        release.wait(60)
        real(guest)
        compiled.set()

    monkeypatch.setattr(process, "_compile_guest", slow_compile)
    monkeypatch.setattr(process, "_guest_compiled", set())
    started = threading.Event()

    def start() -> None:
        ProcessDriver(tmp_path / "sandboxes", Config(data_dir=tmp_path))
        started.set()

    threading.Thread(target=start, daemon=True).start()
    try:
        assert started.wait(30), "the driver's start waited for the guest's byte-compile"
    finally:
        release.set()
    assert compiled.wait(120)
    guest = Path(process.__file__).resolve().parent.parent / "guest"
    assert list((guest / "__pycache__").glob("*.pyc")), "the compile wrote no bytecode beside the guest package"
