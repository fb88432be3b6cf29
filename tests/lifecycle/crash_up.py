"""`moorage up` for the tests that SIGKILL a host (tests/lifecycle/test_crash_operations.py,
tests/runtime/test_mustshow_crash.py, ...), run as its own process.

Like tests/timetravel/crash_host.py, it can SIGKILL itself inside an operation: ``CRASH_AT=module:Attr.path``
replaces that callable with one that kills the process when it is called (``CRASH_WHEN=after``: once the real call
has returned), on its ``CRASH_NTH`` call (default 1); with ``CRASH_IF``, only calls whose arguments (as text)
hold that string count (``CRASH_AT=os:rename CRASH_IF=snapshot.new``: a rename of that directory). Nothing of this
is in moorage itself."""

from __future__ import annotations

import functools
import importlib
import inspect
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[2]


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def arm(spec: str, nth: int, after: bool, match: str = "") -> None:
    mod, _, path = spec.partition(":")
    owner: Any = importlib.import_module(mod)
    *parents, name = path.split(".")
    for p in parents:
        owner = getattr(owner, p)
    real = getattr(owner, name)
    calls = [0]

    def due(*a: Any, **kw: Any) -> bool:
        if match and match not in repr((a, kw)):
            return False
        calls[0] += 1
        return calls[0] == nth

    if inspect.iscoroutinefunction(real):
        @functools.wraps(real)
        async def hooked(*a: Any, **kw: Any) -> Any:
            if not after and due(*a, **kw):
                _die()
            out = await real(*a, **kw)
            if after and due(*a, **kw):
                _die()
            return out
    else:
        @functools.wraps(real)
        def hooked(*a: Any, **kw: Any) -> Any:  # type: ignore[misc]
            if not after and due(*a, **kw):
                _die()
            out = real(*a, **kw)
            if after and due(*a, **kw):
                _die()
            return out
    setattr(owner, name, hooked)


class Up:
    """`moorage up` on one data dir (process driver), started, killed and started again by a test."""

    def __init__(self, data: Path, port: int, driver: str = "process", **env: str) -> None:
        self.data, self.port, self.url, self.driver = data, port, f"http://127.0.0.1:{port}", driver
        if driver == "microvm":  # the guest image the test suite builds once (tests/sandbox/conftest.py)
            data.mkdir(parents=True, exist_ok=True)
            (data / "images").symlink_to(os.environ.get("MOORAGE_TEST_IMAGES_DIR", "/var/tmp/moorage-images"))
        self.env = {**os.environ, "MOORAGE_DATA_DIR": str(data), "MOORAGE_PORT": str(port),
                    "MOORAGE_SANDBOX_DRIVER": driver, "MOORAGE_LOG_LEVEL": "info",
                    "PYTHONPATH": str(ROOT / "src") + os.pathsep + str(ROOT), **env}
        self.log = data.parent / "up.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, crash_at: str = "", nth: int = 1, after: bool = False, wait: bool = True,
              crash_if: str = "") -> "Up":
        """Start the host (``wait``: and return once it answers; else at once, so that a test can kill it again
        while it recovers)."""
        self._args = (crash_at, nth, after, crash_if)
        self._launch()
        return self.wait_healthy() if wait else self

    def _launch(self) -> None:
        crash_at, nth, after, crash_if = self._args
        env = {**self.env, "CRASH_AT": crash_at, "CRASH_NTH": str(nth), "CRASH_WHEN": "after" if after else "",
               "CRASH_IF": crash_if}
        self._log_from = self.log.stat().st_size if self.log.exists() else 0
        with open(self.log, "ab") as logf:
            self.proc = subprocess.Popen([sys.executable, "-m", "tests.lifecycle.crash_up"], env=env, cwd=ROOT,
                                         stdout=logf, stderr=logf)

    def wait_healthy(self, timeout: float = 120) -> "Up":
        """Until this process serves: its record names its pid (another test's host that took the port first
        answers /healthz too), and on another free port if the one chosen was taken before it could listen."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while True:
            try:
                if self._serving() and httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None:
                log = self.log.read_bytes()[self._log_from:].decode(errors="replace")
                assert "address already in use" in log.lower(), log[-3000:]
                from moorage.devservices.postgres import free_port

                self.port = free_port()
                self.url = f"http://127.0.0.1:{self.port}"
                self.env["MOORAGE_PORT"] = str(self.port)
                self._launch()
            assert time.monotonic() < deadline, "moorage up did not come up"
            time.sleep(0.1)

    def _serving(self) -> bool:
        try:
            return json.loads((self.data / "moorage-up.json").read_text()).get("pid") == self.proc.pid  # type: ignore[union-attr]
        except (OSError, ValueError):
            return False

    @property
    def key(self) -> str:
        return (self.data / "local-admin.key").read_text().strip()

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {self.key}"}, timeout=60)

    def died(self, timeout: float = 60) -> bool:
        """Whether the process was SIGKILLed (by its hook) within ``timeout``."""
        assert self.proc is not None
        try:
            return self.proc.wait(timeout=timeout) == -signal.SIGKILL
        except subprocess.TimeoutExpired:
            return False

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.kill()


def stop_sandboxes(data: Path) -> None:
    """The process sandboxes outlive a killed host by design; the test stops them through the driver."""
    import asyncio

    from moorage.config import Config
    from moorage.sandbox.process import ProcessDriver

    async def go() -> None:
        cfg = Config(data_dir=data, sandbox_driver="process")
        driver = ProcessDriver(cfg.sandboxes_dir, cfg)
        for sid in await driver.list():
            try:
                await (await driver.open(sid)).stop()
            except Exception:  # noqa: BLE001 - best effort cleanup of a test's leftovers
                pass
        await driver.close()

    asyncio.run(go())


if __name__ == "__main__":
    if os.environ.get("CRASH_AT"):
        arm(os.environ["CRASH_AT"], int(os.environ.get("CRASH_NTH") or 1), os.environ.get("CRASH_WHEN") == "after",
            os.environ.get("CRASH_IF") or "")
    from moorage.cli.main import run

    sys.argv = ["moorage", "up"]
    run()
