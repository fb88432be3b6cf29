"""How the `moorage` command fails, run as an operator runs it (the console entry point, in a subprocess): a
non-zero exit and one line "error: what happened (what to do next)" on stderr, nothing on stdout, no traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def moorage(*args: str, data: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "MOORAGE_DATA_DIR": str(data), "MOORAGE_LOG_LEVEL": "warning"}
    return subprocess.run([sys.executable, "-m", "moorage.cli.main", *args], env=env, capture_output=True, text=True,
                          timeout=120, cwd=ROOT)


def test_a_folder_given_for_a_file_is_one_line_naming_it(tmp_path: Path) -> None:
    folder = tmp_path / "a-folder"
    folder.mkdir()
    for args in (["--config", str(folder), "agents"], ["cost", "prices", "--prices", str(folder), "--json"],
                 ["cost", "simulate", "--trace", str(folder), "--json"],
                 ["memory", "eval", "--dataset", str(folder), "--json"]):
        r = moorage(*args, data=tmp_path / "data")
        assert r.returncode == 2 and r.stdout == "", (args, r.stdout, r.stderr)
        assert r.stderr.splitlines() == [f"error: {folder}: Is a directory (check the path and run the command again)"], \
            (args, r.stderr)


def test_image_build_json_keeps_its_progress_off_stdout(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("")
    images = tmp_path / "a-file" / "images"  # cannot be made: a file is where its folder would be
    r = moorage("image", "build", "--images-dir", str(images), "--json", data=tmp_path / "data")
    assert r.returncode == 2 and r.stdout == "", (r.stdout, r.stderr)
    assert r.stderr.strip().splitlines()[-1].startswith("error: ") and "Traceback" not in r.stderr, r.stderr


def test_rotate_key_where_there_is_no_store_changes_nothing(tmp_path: Path) -> None:
    data = tmp_path / "mistyped"
    r = moorage("secrets", "rotate-key", data=data)
    assert r.returncode == 2 and r.stdout == "", (r.stdout, r.stderr)
    said = " ".join(r.stderr.split())
    assert said.startswith(f"error: no store yet at {data / 'store'}, so no secrets to re-encrypt; nothing was "
                           "changed (check --data-dir"), said
    assert not data.exists() or not any(data.iterdir())  # no store made, no key written


def test_an_unknown_bench_area_is_one_line_naming_the_areas(tmp_path: Path) -> None:
    r = moorage("bench", "nope", data=tmp_path / "data")
    assert r.returncode == 2 and r.stdout == "", (r.stdout, r.stderr)
    assert r.stderr.splitlines() == ["error: unknown benchmark area 'nope' (choose one of store, memory, durable, "
                                     "lifecycle, sandbox, api, e2e, fleet, attacks, llm, timetravel, soak)"], r.stderr


def test_bench_without_the_test_packages_is_one_line_saying_how_to_install_them(tmp_path: Path) -> None:
    """scripts/up.sh installs what a host runs on, not the test packages the benchmarks' peers and clients come
    from: `moorage bench` there says so, instead of a traceback from the first import that fails."""
    hide = tmp_path / "hide"
    hide.mkdir()
    # As on a host scripts/up.sh installed: dbos and openai (two of the test extras) are not there.
    (hide / "sitecustomize.py").write_text(
        "import importlib.metadata as md\n"
        "_real = md.version\n"
        "def _version(name):\n"
        "    if name in ('dbos', 'openai'):\n"
        "        raise md.PackageNotFoundError(name)\n"
        "    return _real(name)\n"
        "md.version = _version\n")
    env = {**os.environ, "MOORAGE_DATA_DIR": str(tmp_path / "data"), "PYTHONPATH": str(hide)}
    r = subprocess.run([sys.executable, "-m", "moorage.cli.main", "bench", "e2e"], env=env, capture_output=True,
                       text=True, timeout=120, cwd=ROOT)
    assert r.returncode != 0 and r.stdout == "", (r.stdout, r.stderr)
    assert r.stderr.splitlines() == ["error: `moorage bench` needs the test packages: dbos, openai not installed "
                                     "(run `bash scripts/test.sh` once (it installs them), or "
                                     "`bash scripts/bootstrap.sh --test`)"], r.stderr
    assert not (tmp_path / "data").exists()  # nothing ran


def test_up_on_a_port_in_use_is_one_line_saying_how_to_choose_another(tmp_path: Path) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = moorage("up", "--port", str(port), data=tmp_path / "data")
    assert r.returncode == 2 and r.stdout == "", (r.stdout, r.stderr)
    assert r.stderr.splitlines() == [f"error: cannot listen on 127.0.0.1:{port}: Address already in use (stop what "
                                     "serves there, or choose another port with --port / MOORAGE_PORT)"], r.stderr
