"""Waiting with a deadline without losing a cancel.

Python 3.11's ``asyncio.wait_for`` hands back the result of an awaitable that completed in the loop step where
the waiting task was cancelled, and the cancel is gone: a detached exec cancelled just as it printed ran on to
its timeout, a guest handler cancelled as its host call was answered ran on. ``within`` waits the same way with
``asyncio.timeout``, where the cancel always wins (``tests/test_no_wait_for.py`` keeps ``wait_for`` out).
"""

from __future__ import annotations

import asyncio
from typing import Awaitable, TypeVar

T = TypeVar("T")


async def within(aw: Awaitable[T], timeout: float | None) -> T:
    """``await aw``, raising ``TimeoutError`` after ``timeout`` seconds (None: no deadline); ``aw`` is cancelled
    then, as it is when the caller is."""
    async with asyncio.timeout(timeout):
        return await aw
