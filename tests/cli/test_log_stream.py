"""The ``moorage`` command run in-process (its streams swapped for the run, as a test's runner does) leaves the
moorage logger writing to stderr as it is later, never to the run's closed stream."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from typer.testing import CliRunner

from moorage.cli.main import app
from moorage.log import get_logger


def test_logging_after_an_in_process_command_reaches_the_current_stderr(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    root = logging.getLogger("moorage")
    saved = (root.handlers[:], root.level, root.propagate)
    try:
        r = CliRunner().invoke(app, ["--data-dir", str(tmp_path), "version"])
        assert r.exit_code == 0, r.output
        capsys.readouterr()
        get_logger("moorage.test").warning("a line after the command", step=2)
        err = capsys.readouterr().err
        assert "a line after the command" in err and "step=2" in err
        assert "Logging error" not in err
    finally:
        root.handlers[:], root.level, root.propagate = saved[0], saved[1], saved[2]
