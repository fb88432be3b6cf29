"""The "Run it" steps of examples/approval, examples/webapp and examples/langgraph's READMEs, as written: `moorage up`
with the setting they name, their stand-in services (the README's own code, on free ports instead of 8000/8001), and
their `moorage` commands run by a shell, checked against what the READMEs say they print."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

import json

import httpx
import pytest

from moorage.devservices.fleet import LocalHost
from moorage.devservices.postgres import free_port
from tests.cli.test_docs_commands import fenced_blocks
from tests.langgraph.wheelhouse import build_index, serve

ROOT = Path(__file__).resolve().parents[2]
MOORAGE = f"{sys.executable} -m moorage.cli.main"


def _steps(example: str) -> tuple[str, list[str]]:
    """The README's stand-in service (its heredoc) and its `moorage` commands other than `up`."""
    block = next(body for lang, body in fenced_blocks((ROOT / "examples" / example / "README.md").read_text())
                 if lang == "bash")
    service = block.split("<<'EOF'", 1)[1].split("\n", 1)[1].split("\nEOF\n", 1)[0] if "<<'EOF'" in block else ""
    commands = [line.split("  #")[0].strip() for line in block.splitlines()
                if ".venv/bin/moorage" in line and "moorage up" not in line and not line.startswith("#")]
    return service, commands


@pytest.fixture(scope="module")
def index() -> Iterator[str]:
    with tempfile.TemporaryDirectory(prefix="webapp-index-") as root:
        build_index(Path(root), "tabulate", "langgraph")
        for port in serve(Path(root), "127.0.0.2"):  # not 127.0.0.1: a sandbox's pip reaches it through its proxy
            yield f"http://127.0.0.2:{port}"


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory, index: str) -> Iterator[LocalHost]:
    data = tmp_path_factory.mktemp("readme-steps") / "data"
    # What both READMEs start: `MOORAGE_EGRESS_ALLOW_CIDRS=127.0.0.0/8 .venv/bin/moorage up &` (and the package
    # index this offline test serves, in place of PyPI).
    server = LocalHost("up", data, {"MOORAGE_LOG_LEVEL": "warning", "MOORAGE_EGRESS_ALLOW_CIDRS": "127.0.0.0/8",
                                    "MOORAGE_EGRESS_PACKAGE_INDEX": index,
                                    "MOORAGE_PACKAGE_INDEX_URL": index + "/simple/"}, start_timeout_s=120)
    try:
        yield server
    finally:
        server.stop()


def _service(code: str, port_in_readme: int, tmp: Path) -> tuple[subprocess.Popen[str], int]:
    port = free_port()
    assert f'("127.0.0.1", {port_in_readme})' in code
    script = tmp / f"service-{port}.py"
    script.write_text(code.replace(f'("127.0.0.1", {port_in_readme})', f'("127.0.0.1", {port})'))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 30
    while True:
        try:
            httpx.get(f"http://127.0.0.1:{port}/", timeout=1)
            return proc, port
        except httpx.HTTPError:
            assert time.time() < deadline and proc.poll() is None, "the README's stand-in service did not start"
            time.sleep(0.1)


def _run(host: LocalHost, command: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "MOORAGE_DATA_DIR": str(host.data), "MOORAGE_PORT": str(host.port)}
    return subprocess.run(command.replace(".venv/bin/moorage", MOORAGE), shell=True, env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)


def test_approval_readme_steps(host: LocalHost, tmp_path: Path) -> None:
    code, commands = _steps("approval")
    assert [c.split()[1] for c in commands] == ["deploy", "invoke", "answer"], commands
    pay, port = _service(code, 8000, tmp_path)
    try:
        deployed = _run(host, commands[0])
        assert deployed.returncode == 0 and "deployed refunds" in deployed.stdout, deployed.stdout + deployed.stderr
        waiting = _run(host, commands[1].replace("127.0.0.1:8000", f"127.0.0.1:{port}"))
        said = waiting.stdout + waiting.stderr
        m = re.search(r"waiting for approval \(workflow (\w+)\): (\{.*\})", said)
        assert waiting.returncode == 0 and m and '"question": "Refund 12.50 for order A17?"' in m.group(2), said
        answered = _run(host, commands[2].replace("RUN_ID", m.group(1)))
        assert answered.returncode == 0, answered.stdout + answered.stderr
        assert re.match(r"refunded 12\.50 for order A17, receipt r-\S+", answered.stdout), answered.stdout
        again = _run(host, commands[2].replace("RUN_ID", m.group(1)))  # "a second answer ... is refused (409)"
        assert again.returncode != 0 and "409" in again.stderr and "Traceback" not in again.stderr, again.stderr
    finally:
        pay.terminate()
        printed = pay.communicate(timeout=30)[0]
    assert printed.count("pay {'order': 'A17', 'amount': 12.5} idempotency key ") == 1, printed


def test_webapp_readme_steps(host: LocalHost, tmp_path: Path) -> None:
    code, commands = _steps("webapp")
    assert [c.split("moorage ", 1)[1].split()[0] for c in commands] == ["deploy", "secrets", "invoke", "share"], commands
    api, port = _service(code, 8001, tmp_path)
    try:
        for command in commands[:3]:
            r = _run(host, command.replace("127.0.0.1:8001", f"127.0.0.1:{port}"))
            assert r.returncode == 0, (command, r.stdout + r.stderr)
        assert r.stdout.startswith('tracked {"price": 42.5'), r.stdout
        shared = _run(host, commands[3])
        link = shared.stdout.strip()
        assert shared.returncode == 0 and link.startswith(f"{host.url}/v1/shared/"), shared.stdout + shared.stderr
        page = httpx.get(link, timeout=60)  # no key needed
        assert page.status_code == 200 and "Tracked values" in page.text and "42.5" in page.text, page.text[:500]
        assert httpx.get(link + "results.json", timeout=60).json()[0]["value"]["price"] == 42.5
        # `moorage share digest ada --revoke LINK_ID`: the link stops working at once.
        link_id = link.split("/v1/shared/", 1)[1].split(".")[1]
        revoked = _run(host, f".venv/bin/moorage share digest ada --revoke {link_id}")
        assert revoked.returncode == 0, revoked.stdout + revoked.stderr
        assert httpx.get(link, timeout=60).status_code == 404
    finally:
        api.terminate()
        printed = api.communicate(timeout=30)[0]
    # "The stand-in API prints `Authorization: Bearer s3cr3t-token` for each call."
    assert "Authorization: Bearer s3cr3t-token" in printed, printed


@pytest.mark.timeout(1200)
def test_langgraph_readme_steps(host: LocalHost) -> None:
    _, commands = _steps("langgraph")
    said = [c.split("moorage ", 1)[1] for c in commands]
    assert said[:4] == ["deploy examples/langgraph", 'invoke notebook "note buy milk" -u ada',
                        'invoke notebook "note call mum" -u ada', 'invoke notebook "do water the plants" -u ada'], said
    deployed = _run(host, commands[0])
    assert deployed.returncode == 0 and "deployed notebook" in deployed.stdout, deployed.stdout + deployed.stderr
    assert _run(host, commands[1]).stdout.strip() == "notes: buy milk"
    assert _run(host, commands[2]).stdout.strip() == "notes: buy milk, call mum"
    waiting = _run(host, commands[3])
    m = re.search(r"waiting for approval \(workflow (\w+)\): (\{.*\})", waiting.stdout)
    assert m and "Go ahead with 'water the plants: " in m.group(2), waiting.stdout + waiting.stderr
    assert said[4] == "answer RUN_ID yes"
    done = _run(host, commands[4].replace("RUN_ID", m.group(1)))
    assert re.match(r"done: water the plants: .* \(1 done so far\)", done.stdout), done.stdout + done.stderr
    assert said[5] == "checkpoints list notebook ada"
    listed = _run(host, commands[5])
    assert listed.returncode == 0 and "note buy milk" in listed.stdout, listed.stdout + listed.stderr
    checkpoints = json.loads(_run(host, commands[5] + " --json").stdout)["data"]
    milk = next(c["id"] for c in checkpoints if (c["summary"].get("turn") or {}).get("reply") == "notes: buy milk")
    # "back to "notes: buy milk": the graph too"
    assert said[6] == "checkpoints rollback notebook ada CHECKPOINT"
    rolled = _run(host, commands[6].replace("CHECKPOINT", milk))
    assert rolled.returncode == 0 and f"rolled back to {milk}" in rolled.stdout, rolled.stdout + rolled.stderr
    assert _run(host, commands[1].replace("buy milk", "feed the cat")).stdout.strip() == "notes: buy milk, feed the cat"
    assert said[7] == "checkpoints fork notebook ada CHECKPOINT --to ada-what-if"
    forked = _run(host, commands[7].replace("CHECKPOINT", milk))
    assert forked.returncode == 0 and "ada-what-if" in forked.stdout, forked.stdout + forked.stderr
    what_if = _run(host, commands[1].replace("buy milk", "buy bread").replace("-u ada", "-u ada-what-if"))
    assert what_if.stdout.strip() == "notes: buy milk, buy bread", what_if.stdout + what_if.stderr
