"""moorage waits with a deadline through ``asyncio.timeout`` (the host's code through ``moorage.aio.within``), never
``asyncio.wait_for``: in Python 3.11 ``wait_for`` drops a cancel that arrives as the awaited thing completes, and the
cancelled task runs on (a detached exec cancelled just as it printed ran to its timeout; a guest ``app.read``
cancelled as the app's bytes came handed them to a host that had gone). The guest (``moorage/guest``) runs on the
guest image's Python, Debian 12's 3.11, which has ``asyncio.timeout``."""

from __future__ import annotations

from pathlib import Path

import moorage

SRC = Path(moorage.__file__).parent


def _waits_with_wait_for(root: Path) -> list[str]:
    return [f"{p.relative_to(SRC)}:{n}" for p in sorted(root.rglob("*.py"))
            for n, line in enumerate(p.read_text().splitlines(), 1) if "asyncio.wait_for(" in line]


def test_the_host_never_waits_with_asyncio_wait_for() -> None:
    found = [f for f in _waits_with_wait_for(SRC) if not f.startswith("guest/")]
    assert not found, f"use moorage.aio.within instead of asyncio.wait_for at {found}"


def test_the_guest_never_waits_with_asyncio_wait_for() -> None:
    assert (SRC / "guest" / "rpc.py").exists()
    found = _waits_with_wait_for(SRC / "guest")
    assert not found, f"use 'async with asyncio.timeout(...)' instead of asyncio.wait_for at {found}"
