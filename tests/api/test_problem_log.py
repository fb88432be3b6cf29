"""A 500 hides its details from the caller and points at a trace id: those details must then be in the log, or the
operator the caller quotes the trace id to has nothing to look up."""

from __future__ import annotations

import json
import logging

import pytest

from moorage.api.problem import from_error
from moorage.errors import InvalidInput, MoorageError


class _QemuBroke(MoorageError):
    code = "sandbox-qmp"
    http_status = 500


def test_a_500_whose_details_are_hidden_logs_them_with_the_trace_id(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="moorage")
    response = from_error(_QemuBroke("could not load module for type 'tcg-accel-ops'", hint="check QEMU"), "t-123")
    body = json.loads(response.body)
    assert response.status_code == 500 and "tcg-accel-ops" not in response.body.decode()
    assert body["trace_id"] == "t-123"
    (record,) = [r for r in caplog.records if getattr(r, "trace_id", None) == "t-123"]
    assert record.levelno == logging.ERROR
    assert "tcg-accel-ops" in getattr(record, "error") and getattr(record, "code") == "sandbox-qmp"


def test_errors_the_caller_is_told_in_full_are_not_logged_as_failures(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="moorage")

    class _Busy(MoorageError):
        code = "busy"
        http_status = 503

    from_error(_Busy("try again"), "t-9")
    from_error(InvalidInput("bad input"), "t-8")
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
