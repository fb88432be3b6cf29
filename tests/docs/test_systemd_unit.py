"""docs/operations.md says `systemctl stop moorage` / `systemctl start moorage`, and gave no unit to run it by.
scripts/moorage.service is that unit: systemd-analyze finds nothing wrong in it, and what its ExecStart names, run
with its Environment and WorkingDirectory, serves; stopped as systemd stops it (KillSignal, to the main process
alone as KillMode=mixed sends it), it puts its awake instance to sleep and exits 0 well within TimeoutStopSec."""

from __future__ import annotations

import os
import pwd
import re
import shlex
import shutil
import signal
import subprocess
import time
from pathlib import Path

from moorage import Client
from moorage.config import Config
from moorage.devservices.fleet import write_counter_agent
from moorage.store import open_store
from tests.upproc import wait_serving

ROOT = Path(__file__).resolve().parents[2]
UNIT = ROOT / "scripts" / "moorage.service"
#: Where the unit says this repository is checked out.
CHECKOUT = "/opt/moorage"


def parse_unit(text: str) -> dict[str, dict[str, list[str]]]:
    """A unit file's sections, each key with its values in order (Environment= may be given several times)."""
    out: dict[str, dict[str, list[str]]] = {}
    section = None
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            section = out.setdefault(line[1:-1], {})
            continue
        assert section is not None and "=" in line, raw
        key, value = line.split("=", 1)
        section.setdefault(key.strip(), []).append(value.strip())
    return out


def descendants(pid: int) -> set[int]:
    """The processes below ``pid`` (what runs in its unit's cgroup besides it)."""
    children: dict[int, list[int]] = {}
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                ppid = int((p / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(p.name))
    out, todo = set(), [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.add(c)
            todo.append(c)
    return out


def alive(pid: int) -> bool:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def seconds(value: str) -> float:
    m = re.fullmatch(r"(\d+)\s*(s|sec|min)?", value)
    assert m, value
    return int(m.group(1)) * (60 if m.group(2) == "min" else 1)


def test_the_documented_unit_runs_moorage_up_and_stops_it_cleanly(tmp_path: Path) -> None:
    text = UNIT.read_text()
    unit = parse_unit(text)
    service = unit["Service"]
    assert set(unit) == {"Unit", "Service", "Install"}
    assert "scripts/moorage.service" in (ROOT / "docs" / "operations.md").read_text()

    # systemd itself reads it without a complaint (with this checkout in the place of /opt/moorage).
    here = tmp_path / "moorage.service"
    here.write_text(text.replace(CHECKOUT, str(ROOT)))
    analyze = shutil.which("systemd-analyze")
    assert analyze, "systemd-analyze is needed (Debian's systemd package)"
    verify = subprocess.run([analyze, "verify", str(here)], capture_output=True, text=True, timeout=120)
    assert verify.returncode == 0 and not (verify.stdout + verify.stderr).strip(), verify.stdout + verify.stderr

    # How systemd stops it: KillSignal to `moorage up` alone (mixed), then at most TimeoutStopSec.
    assert service["KillMode"] == ["mixed"]
    kill = signal.Signals[service.get("KillSignal", ["SIGTERM"])[-1]]
    timeout_stop = seconds(service["TimeoutStopSec"][-1])
    assert service["Restart"] == ["on-failure"]  # a clean stop (exit 0) is not restarted; a crash is
    argv = shlex.split(service["ExecStart"][-1].replace(CHECKOUT, str(ROOT)))
    assert argv[0] == str(ROOT / ".venv" / "bin" / "moorage") and argv[1:] == ["up"], argv
    cwd = service["WorkingDirectory"][-1].replace(CHECKOUT, str(ROOT))
    environment = dict(pair.split("=", 1) for value in service["Environment"] for pair in shlex.split(value))
    # The data directory scripts/up.sh's host uses (it runs as root, with the default one).
    assert environment["MOORAGE_DATA_DIR"] == str(Path(pwd.getpwnam("root").pw_dir) / ".local" / "share" / "moorage")

    # Here: the unit's Environment with a temporary data directory, a port the kernel picks and process sandboxes
    # (what a drop-in would set), nothing else of this process's MOORAGE_* settings.
    data = tmp_path / "data"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOORAGE_")}
    env.update(environment)
    env.update(MOORAGE_DATA_DIR=str(data), MOORAGE_PORT="0", MOORAGE_SANDBOX_DRIVER="process",
               MOORAGE_LOG_LEVEL="info")
    log = tmp_path / "journal.log"
    with open(log, "wb") as journal:
        up = subprocess.Popen(argv, cwd=cwd, env=env, stdout=journal, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        url = wait_serving(up, data, output=lambda: log.read_text(errors="replace"))
        with Client(url, (data / "local-admin.key").read_text().strip()) as sdk:
            sdk.deploy("echo", write_counter_agent(tmp_path))
            sdk.invoke("echo", "hi", user="ada")  # an awake instance the stop must put to sleep
            assert [i["state"] for i in sdk.fleet()["instances"]] == ["running"]
        below = descendants(up.pid)
        assert below, "the instance's sandbox runs below moorage up"

        started = time.monotonic()
        os.kill(up.pid, kill)  # KillMode=mixed: the main process only
        code = up.wait(timeout=timeout_stop)
        took = time.monotonic() - started
    finally:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGKILL)  # what systemd does past TimeoutStopSec
            up.wait(timeout=30)
    said = log.read_text(errors="replace")
    assert code == 0, said[-3000:]
    assert took < timeout_stop / 2, took
    assert "host stopping, awake instances put to sleep" in said, said[-3000:]
    # Nothing of the sandbox outlives the stop (KillMode=mixed would SIGKILL it), and the store has it asleep.
    assert not [p for p in below if alive(p)]
    store = open_store(Config(data_dir=data, sandbox_driver="process"))
    try:
        states = [r.state for ts in store.operator.tenants() for r in ts.sandboxes.list()]
    finally:
        store.close()
    assert states == ["sleeping"], states
