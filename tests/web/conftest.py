"""Dashboard test fixtures: the API suite's live server over the real runtime, plus headless Chromium.

The server, runtime and agent archives are the API suite's own (tests/api/conftest.py), imported so the
dashboard is tested against exactly what the API tests run.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, AsyncIterator

import pytest

from tests.api.conftest import acme, globex, live_rt, runtime  # noqa: F401 - fixtures re-exported for pytest

CHROMIUM = "/usr/bin/chromium"
#: Headless, and nothing that reaches beyond 127.0.0.1: no sync, updates, QUIC or background fetches.
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@pytest.fixture
async def browser_context(tmp_path: Path) -> AsyncIterator[Any]:
    """A fresh Chromium profile (its own user-data dir) driven by Playwright; Debian's chromium, not a download."""
    from playwright.async_api import async_playwright

    assert shutil.which(CHROMIUM), "Debian chromium is required (scripts/bootstrap.sh installs it)"
    profile = tmp_path / "chromium-profile"
    async with async_playwright() as pw:
        context = await pw.chromium.launch_persistent_context(
            str(profile), executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS,
            viewport={"width": 1280, "height": 900},
        )
        try:
            yield context
        finally:
            await context.close()
