"""The host's code waits with a deadline through ``moorage.aio.within``, never ``asyncio.wait_for``: in Python 3.11
``wait_for`` drops a cancel that arrives as the awaited thing completes, and the cancelled task runs on (a detached
exec cancelled just as it printed ran to its timeout). The guest's code (``moorage/guest``) runs on the guest
image's own Python and is checked by its own tests."""

from __future__ import annotations

from pathlib import Path

import moorage

SRC = Path(moorage.__file__).parent


def test_the_host_never_waits_with_asyncio_wait_for() -> None:
    found = [f"{p.relative_to(SRC)}:{n}" for p in sorted(SRC.rglob("*.py")) if p.parent.name != "guest"
             for n, line in enumerate(p.read_text().splitlines(), 1) if "asyncio.wait_for(" in line]
    assert not found, f"use moorage.aio.within instead of asyncio.wait_for at {found}"
