"""A mistyped command line (an unknown command or option, a missing argument, a value of the wrong type) fails
like every other CLI error: one line "error: what happened (see `moorage ... --help`)" on stderr, nothing on
stdout, exit status 2; never Click's usage block and boxed message. Every command of the tree is tried."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from moorage.cli.main import app
from tests.cli.test_cli_json import commands

ROOT = Path(__file__).resolve().parents[2]


def one_line(args: list[str], tmp_path: Path) -> str:
    """The one line ``moorage ARGS`` fails with (asserting it is one, exit status 2, stdout empty)."""
    r = CliRunner().invoke(app, ["--data-dir", str(tmp_path), *args])
    assert r.exit_code == 2 and r.stdout == "", (args, r.exit_code, r.stdout, r.stderr)
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), (args, r.stderr)
    return lines[0]


def test_every_command_says_an_unknown_option_in_one_line(tmp_path: Path) -> None:
    found = commands()
    assert len(found) > 40, sorted(found)
    for words in found:
        said = one_line([*words.split(), "--no-such-option"], tmp_path)
        assert said == f"error: no such option: --no-such-option (see `moorage {words} --help`)", said


def test_every_command_with_a_required_argument_says_it_is_missing_in_one_line(tmp_path: Path) -> None:
    required = {words: cmd for words, cmd in commands().items() if any(p.required for p in cmd.params)}
    assert {"deploy", "invoke", "memory facts", "checkpoints list", "bench", "secrets set"} <= set(required)
    for words, cmd in required.items():
        first = next(p for p in cmd.params if p.required)
        said = one_line(words.split(), tmp_path)
        what = "argument" if first.param_type_name == "argument" else "option"
        assert said.startswith(f"error: missing {what} '") and said.endswith(f" (see `moorage {words} --help`)"), \
            (words, said)


def number_options(cmd: Any) -> list[str]:
    """The options of ``cmd`` that take a number (those whose default is one)."""
    return [p.opts[-1] for p in cmd.params if p.param_type_name == "option" and not getattr(p, "is_flag", False)
            and isinstance(p.default, (int, float)) and not isinstance(p.default, bool)]


def test_a_value_of_the_wrong_type_is_one_line_naming_the_option(tmp_path: Path) -> None:
    typed = {words: number_options(cmd) for words, cmd in commands().items() if number_options(cmd)}
    assert {"logs", "checkpoints list", "llm chat", "memory search"} <= set(typed), typed
    for words, options in typed.items():
        cmd = commands()[words]
        needed = []  # the command's required arguments and options, so that only the number is wrong
        for p in cmd.params:
            if p.required:
                needed += ["x"] if p.param_type_name == "argument" else [p.opts[-1], "x"]
        said = one_line([*words.split(), *needed, options[0], "many"], tmp_path)
        assert said.startswith("error: invalid value for '") and options[0] in said, said
        assert said.endswith(f" (see `moorage {words} --help`)"), said


@pytest.mark.parametrize("args, what, command", [
    (["nosuch"], "no such command 'nosuch'", "moorage"),
    (["memory", "nosuch"], "no such command 'nosuch'", "moorage memory"),
    # Click says these without naming the command: the words of the command line do.
    (["logs", "--limit"], "option '--limit' requires an argument", "moorage logs"),
    (["--log-level", "warning", "store", "tenants", "--json=yes"], "option '--json' does not take a value",
     "moorage store tenants"),
    (["--config"], "option '--config' requires an argument", "moorage"),
    (["ps", "extra"], "got unexpected extra argument", "moorage ps"),
])
def test_mistyped_command_lines(args: list[str], what: str, command: str, tmp_path: Path) -> None:
    said = one_line(args, tmp_path)
    assert said.startswith(f"error: {what}") and said.endswith(f" (see `{command} --help`)"), said


def test_the_installed_command_says_it_as_moorage(tmp_path: Path) -> None:
    """Run as an operator runs it (a subprocess): the hint names `moorage`, not the interpreter running it."""
    env = {**os.environ, "MOORAGE_DATA_DIR": str(tmp_path), "MOORAGE_LOG_LEVEL": "warning"}
    r = subprocess.run([sys.executable, "-m", "moorage.cli.main", "memory", "facts", "--agent", "a"], env=env,
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 2 and r.stdout == "", (r.stdout, r.stderr)
    assert r.stderr.splitlines() == ["error: missing option '--tenant' (see `moorage memory facts --help`)"], r.stderr


def test_a_group_without_arguments_still_shows_its_help(tmp_path: Path) -> None:
    r = CliRunner().invoke(app, ["--data-dir", str(tmp_path), "memory"])
    assert "Usage: " in r.output and "facts" in r.output and "error:" not in r.output, r.output
