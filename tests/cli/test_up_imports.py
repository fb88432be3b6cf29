"""A host's start imports nothing it does not need before serving (``moorage.cli.up.LAZY_IMPORTS``): the MCP SDK's
import alone took a third of a restart, downtime for every user of the host. The modules listed there are not in a
serving ``moorage up`` process, and each still imports when a request needs it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from moorage.cli.up import LAZY_IMPORTS
from tests.cli.test_cli_e2e import ROOT
from tests.cli.test_cli_up_address import _env

# Runs `moorage up` in this process; once it answers /healthz where it recorded it serves, writes the top-level
# modules it holds, imports the MCP route's server as the first MCP request does, and stops the host as SIGTERM does.
PROBE = r"""
import json, os, signal, sys, threading, time
import httpx

OUT = sys.argv[1]

def probe():
    record = os.path.join(os.environ["MOORAGE_DATA_DIR"], "moorage-up.json")  # where this process serves (port 0)
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            with open(record) as f:
                served = json.load(f)
            if served["pid"] == os.getpid() and httpx.get(served["url"] + "/healthz", timeout=1).status_code == 200:
                break
        except (OSError, ValueError, KeyError, httpx.HTTPError):
            pass
        time.sleep(0.1)
    found = {"serving": sorted({name.split(".")[0] for name in sys.modules})}
    try:
        from moorage.api import mcp
        mcp._mcp_server()
        found["after_mcp"] = sorted({name.split(".")[0] for name in sys.modules})
    finally:
        with open(OUT, "w") as f:
            json.dump(found, f)
        os.kill(os.getpid(), signal.SIGTERM)

threading.Thread(target=probe, daemon=True).start()
sys.argv = ["moorage", "up"]
from moorage.cli.main import run
run()
"""


def test_a_serving_host_has_not_imported_the_lazy_modules(tmp_path: Path) -> None:
    out = tmp_path / "modules.json"
    env = _env(tmp_path / "data", MOORAGE_PORT="0", PYTHONPATH=str(ROOT / "src"))
    proc = subprocess.run([sys.executable, "-c", PROBE, str(out)], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=180)
    assert out.exists(), f"moorage up never served (exit {proc.returncode}): {proc.stdout[-2000:]}{proc.stderr[-2000:]}"
    modules = json.loads(out.read_text())
    assert "moorage" in modules["serving"] and "uvicorn" in modules["serving"]  # the probe saw a real host
    early = [name for name in LAZY_IMPORTS if name in modules["serving"]]
    assert early == [], f"imported before the host served: {early} (see moorage.cli.up.LAZY_IMPORTS)"
    assert "mcp" in modules.get("after_mcp", ()), proc.stderr[-2000:]  # the first MCP request imports the SDK
    assert proc.returncode == 0, proc.stderr[-2000:]  # the host stopped cleanly on SIGTERM
