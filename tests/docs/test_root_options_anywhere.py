"""The README and docs/operations.md write the root's options after the command: `moorage up --config F`, "another
`--data-dir` and `--port`", `moorage backup DEST` with `--data-dir`. They were taken only before it (`moorage
--config F up`); after it, `moorage up` refused with "no such option: --config". Now they are read anywhere."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from tests.upproc import wait_serving

ROOT = Path(__file__).resolve().parents[2]
MOORAGE = [sys.executable, "-m", "moorage.cli.main"]


def _moorage(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOORAGE_")}
    return subprocess.run([*MOORAGE, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_up_with_config_and_data_dir_after_the_command(tmp_path: Path) -> None:
    conf = tmp_path / "etc" / "moorage.toml"
    conf.parent.mkdir()
    # README, "Configuration": a relative data_dir in the file is relative to the file's own directory.
    conf.write_text('[moorage]\ndata_dir = "data"\nsandbox_driver = "process"\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOORAGE_")}
    up = subprocess.Popen([*MOORAGE, "up", "--config", str(conf), "--log-level", "warning", "--port", "0"],
                          cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          start_new_session=True)
    try:
        wait_serving(up, conf.parent / "data",
                     output=lambda: up.communicate(timeout=30)[0] if up.poll() is not None else "")
        data = conf.parent / "data"
        assert (data / "local-admin.key").exists()
        # A client command given the same file after its own words finds that host and its key.
        listed = _moorage("agents", "--json", "--config", str(conf), cwd=tmp_path)
        assert listed.returncode == 0 and json.loads(listed.stdout) == {"data": []}, listed.stdout + listed.stderr
    finally:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGTERM)
        out = up.communicate(timeout=120)[0]
    assert up.returncode == 0 and "no such option" not in out, out
    # docs/operations.md: `moorage backup DEST` of the data directory named by --data-dir (here, of a stopped host).
    backup = _moorage("backup", str(tmp_path / "copy"), "--data-dir", str(data), cwd=tmp_path)
    assert backup.returncode == 0, backup.stdout + backup.stderr
    assert (tmp_path / "copy" / "local-admin.key").read_text() == (data / "local-admin.key").read_text()
    tenants = _moorage("store", "tenants", "--json", f"--data-dir={tmp_path / 'copy'}", cwd=tmp_path)
    assert [t["name"] for t in json.loads(tenants.stdout)["data"]] == ["local"], tenants.stdout + tenants.stderr


def test_an_option_after_a_double_dash_is_the_commands_word(tmp_path: Path) -> None:
    said = _moorage("invoke", "coder", "--", "--data-dir", cwd=tmp_path)  # the message "--data-dir", no user given
    assert said.returncode == 2 and "missing option '--user'" in said.stderr, said.stderr
    # After a group's own option and its value too (`hosts --store-url URL drain ID`).
    drain = _moorage("hosts", "--store-url", "sqlite", "drain", "h1", "--data-dir", str(tmp_path), cwd=tmp_path)
    assert drain.returncode == 2 and "none is configured" in drain.stderr, drain.stderr
    wrong = _moorage("up", "--data-dri", str(tmp_path), cwd=tmp_path)
    assert wrong.returncode == 2 and "no such option: --data-dri" in wrong.stderr, wrong.stderr


def test_the_readmes_order_of_settings(tmp_path: Path) -> None:
    """README, "Configuration": defaults, then a moorage.toml (`--config`, `MOORAGE_CONFIG`, else `./moorage.toml`
    when there is one), then `MOORAGE_*` variables, then flags; a relative path in the file is the file's."""
    (tmp_path / "moorage.toml").write_text('[moorage]\ndata_dir = "from-file"\n')
    (tmp_path / "elsewhere").mkdir()

    def store_of(*args: str, env: dict[str, str] | None = None, cwd: Path = tmp_path) -> str:
        base = {k: v for k, v in os.environ.items() if not k.startswith("MOORAGE_")}
        r = subprocess.run([*MOORAGE, "store", "info", *args], cwd=cwd, env={**base, **(env or {})},
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and "no store yet at " in r.stderr, r.stderr  # nothing made: it says where it looked
        return r.stderr.split("no store yet at ", 1)[1].split()[0]

    assert store_of() == f"{tmp_path}/from-file/store"
    assert store_of(env={"MOORAGE_DATA_DIR": str(tmp_path / "from-env")}) == f"{tmp_path}/from-env/store"
    assert store_of("--data-dir", str(tmp_path / "from-flag"), env={"MOORAGE_DATA_DIR": str(tmp_path / "from-env")}) \
        == f"{tmp_path}/from-flag/store"
    conf = tmp_path / "moorage.toml"
    assert store_of(env={"MOORAGE_CONFIG": str(conf)}, cwd=tmp_path / "elsewhere") == f"{tmp_path}/from-file/store"
    assert store_of("--config", str(conf), cwd=tmp_path / "elsewhere") == f"{tmp_path}/from-file/store"
