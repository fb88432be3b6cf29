"""A local fleet for tests and benchmarks: N `moorage up` processes sharing one PostgreSQL store and one S3 bucket.

Each host has its own data directory, port and host id, as separate machines would. ``LocalHost.kill`` ends the
host and every sandbox process it started, as a machine that dies would.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from moorage.devservices.postgres import free_port

ROOT = Path(__file__).resolve().parents[3]
#: An agent whose turns count in a file (so a reply shows whether its disk came along); "slow" takes 4 s.
COUNTER_AGENT_PY = '''\
import asyncio

async def on_message(ctx, message):
    try:
        n = int(ctx.files.read("counter.txt"))
    except Exception:
        n = 0
    if message == "slow":
        await asyncio.sleep(4)
    ctx.files.write("counter.txt", str(n + 1))
    return f"{n + 1}: {message}"
'''


def write_counter_agent(base: Path, name: str = "echo") -> Path:
    """The counter agent's folder (``users = "auto"``, asleep only when told), ready to deploy."""
    d = base / name
    d.mkdir(parents=True, exist_ok=True)
    (d / "moorage.toml").write_text(f'[agent]\nname = "{name}"\nentry = "agent.py"\n'
                                    '[agent.lifecycle]\nusers = "auto"\nsleep = "fixed:3600"\n')
    (d / "agent.py").write_text(COUNTER_AGENT_PY)
    return d


def share_installation_secrets(shared: Path, data: Path) -> None:
    """What an operator does for a fleet (docs/fleet.md): one set of installation secrets, made once in ``shared``
    and copied into each host's data directory before its first start (files already there are kept)."""
    from moorage.api.auth import load_or_create_secret
    from moorage.secrets.keyring import KEY_FILE, Keyring

    for name in INSTALLATION_SECRETS[:-1]:
        load_or_create_secret(shared / name)
    Keyring.from_file(shared / KEY_FILE)
    for name in INSTALLATION_SECRETS:
        dst = data / name
        if not dst.exists():
            dst.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            shutil.copy2(shared / name, dst)  # its 0600 mode too


#: The files under a data directory every host of a fleet must share (the secrets key last).
INSTALLATION_SECRETS = ("api/token-secret", "api/operator-token", "api/metrics-token", "secrets.key")


class LocalHost:
    def __init__(self, name: str, data: Path, env: dict[str, str], *, driver: str = "process",
                 start_timeout_s: float = 900.0, host_url: str | None = None) -> None:
        """``host_url``: the URL the other hosts reach this one at, where it is not its own port (a TLS proxy in
        front of it); its own URL (``url``) is loopback HTTP either way."""
        self.name, self.data = name, data
        data.mkdir(parents=True, exist_ok=True)
        if "MOORAGE_OBJECT_STORE_URL" in env:  # one host of a fleet: the hosts beside it share its secrets
            share_installation_secrets(data.parent / "fleet-secrets", data)
        images = env.get("MOORAGE_TEST_IMAGES_DIR") or os.environ.get("MOORAGE_TEST_IMAGES_DIR")
        if images and not (data / "images").exists():  # built once, shared by every host (tests, benches)
            Path(images).mkdir(parents=True, exist_ok=True)
            (data / "images").symlink_to(images)
        self.log = data.parent / f"{name}.log"
        # Its URL is its host_url, so its port is chosen here: another process may take that port before this host
        # listens (then it stops at once, saying so, and starts again on another one).
        for _ in range(3):
            self.port = free_port()
            self.url = f"http://127.0.0.1:{self.port}"
            full = {**os.environ, **env, "MOORAGE_DATA_DIR": str(data), "MOORAGE_PORT": str(self.port),
                    "MOORAGE_HOST_ID": name, "MOORAGE_HOST_URL": host_url or self.url, "MOORAGE_SANDBOX_DRIVER": driver}
            full.setdefault("MOORAGE_LOG_LEVEL", "info")
            start = self.log.stat().st_size if self.log.exists() else 0
            with open(self.log, "ab") as out:
                self.proc = subprocess.Popen([sys.executable, "-m", "moorage.cli.main", "up"], env=full, cwd=ROOT,
                                             stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
            if self._serving(start, start_timeout_s):
                break
        else:
            raise RuntimeError(f"host {name} found no free port in three tries")
        self.key = (data / "local-admin.key").read_text().strip()

    def _serving(self, log_from: int, timeout_s: float) -> bool:
        """True once this process serves: its own record names its pid (another process that took the port first
        would answer /healthz too) and it answers; False if it stopped because its port was taken."""
        deadline = time.time() + timeout_s
        while True:
            try:
                record = json.loads((self.data / "moorage-up.json").read_text())
                if record.get("pid") == self.proc.pid and httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200:
                    return True
            except (OSError, ValueError, httpx.HTTPError):
                pass
            if self.proc.poll() is not None:
                said = self.log.read_bytes()[log_from:].decode(errors="replace")
                if f"cannot listen on 127.0.0.1:{self.port}" in said or "address already in use" in said.lower():
                    return False  # moorage up's own check, or the server's bind a moment after it
                raise RuntimeError(f"host {self.name} did not come up: {said[-3000:]}")
            if time.time() > deadline:
                raise RuntimeError(f"host {self.name} did not come up in {timeout_s:.0f} s: "
                                   f"{self.log.read_text(errors='replace')[-3000:]}")
            time.sleep(0.2)

    def client(self, key: str) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {key}"}, timeout=600)

    def pids(self) -> list[int]:
        """Processes whose command line names a path under this host's data directory (its sandboxes)."""
        return pids_under(self.data)

    def kill(self) -> None:
        """The machine dies: the host process and every sandbox process it started."""
        os.killpg(self.proc.pid, signal.SIGKILL)
        for pid in self.pids():
            with _gone():
                os.kill(pid, signal.SIGKILL)
        self.proc.wait(timeout=30)

    def sigterm(self, timeout_s: float) -> tuple[int | None, float]:
        """``systemctl stop``: SIGTERM to the host alone, then its exit status (None: still running after
        ``timeout_s``) and how long it took."""
        started = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            code: int | None = self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            code = None
        return code, time.monotonic() - started

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.kill()
        for pid in self.pids():
            with _gone():
                os.kill(pid, signal.SIGKILL)


class _gone:
    def __enter__(self) -> None:
        return None

    def __exit__(self, typ: object, exc: object, tb: object) -> bool:
        return typ is ProcessLookupError


def pids_under(data: Path) -> list[int]:
    out = []
    needle = str(data).encode()
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if needle in (p / "cmdline").read_bytes():
                    out.append(int(p.name))
            except OSError:
                continue
    return out


def fleet_env(store_url: str, s3: dict[str, str], **settings: str) -> dict[str, str]:
    """The MOORAGE_* settings every host of one fleet shares."""
    return {"MOORAGE_STORE_URL": store_url, **{f"MOORAGE_{k.upper()}": v for k, v in s3.items()},
            **{f"MOORAGE_{k.upper()}": v for k, v in settings.items()}}
