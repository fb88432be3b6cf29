"""Every ``moorage`` command starts by importing the CLI's command groups. Three of them imported what only they
use at the top of their module (the cost simulator and numpy, the guest image builder, the backup and time-travel
runtime): ``moorage version`` took 345 ms, now 233 ms (medians of 15, byte-compiled). They import it when run."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.cli.test_cli_e2e import ROOT

#: Modules only some commands use; the CLI's start must not import them.
ONLY_WHEN_RUN = ("numpy", "moorage.cost", "moorage.sandbox.image", "moorage.runtime.backup", "moorage.timetravel",
                 "moorage.store", "moorage.api")


def test_the_clis_start_imports_no_command_groups_work() -> None:
    probe = "import json, sys; import moorage.cli.main; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True,
                         env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"})
    modules = json.loads(out.stdout)
    assert "moorage.cli.cost" in modules and "moorage.cli.image" in modules  # the groups themselves are attached
    assert [m for m in modules if any(m == name or m.startswith(name + ".") for name in ONLY_WHEN_RUN)] == []


def test_the_commands_still_import_what_they_run(tmp_path) -> None:
    env = {"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin", "MOORAGE_DATA_DIR": str(tmp_path / "data")}
    listed = subprocess.run([sys.executable, "-m", "moorage.cli.main", "cost", "trace", "scenarios", "--json"],
                            cwd=ROOT, capture_output=True, text=True, env=env)
    assert listed.returncode == 0, listed.stderr
    assert "steady" in {s["name"] for s in json.loads(listed.stdout)["data"]}
    made = subprocess.run([sys.executable, "-m", "moorage.cli.main", "cost", "trace", "generate", "--scenario",
                           "steady", "--users", "3", "--hours", "1", "--out", str(tmp_path / "t.jsonl")],
                          cwd=ROOT, capture_output=True, text=True, env=env)
    assert made.returncode == 0 and (tmp_path / "t.jsonl").stat().st_size > 0, made.stderr
    images = subprocess.run([sys.executable, "-m", "moorage.cli.main", "image", "list", "--json", "--images-dir",
                             str(tmp_path / "images")], cwd=ROOT, capture_output=True, text=True, env=env)
    assert images.returncode == 0 and json.loads(images.stdout) == {"data": []}, images.stderr
