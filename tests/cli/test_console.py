"""Tables the CLI prints keep ids whole: piped output is wider than rich's 80 columns, and id columns never cut."""

from __future__ import annotations

import io

from rich.console import Console
from rich.table import Table

from moorage.cli.console import PIPED_WIDTH, id_column, make_console

SANDBOX = "sb-3f9a2b7c1d4e5f60718293a4b5c6d7e8"


def _render(width: int, first: object) -> str:
    out = io.StringIO()
    t = Table(first, "instance", "state", "since", "RAM", "disk")  # type: ignore[arg-type]
    t.add_row(SANDBOX, "assistant/user:ada-lovelace-the-first", "running", "12s ago", "120.5 MiB", "33.2 MiB")
    Console(file=out, width=width).print(t)
    return out.getvalue()


def test_an_id_column_is_never_cut_even_on_a_narrow_terminal() -> None:
    assert SANDBOX not in _render(60, "sandbox")  # rich's default: cut with an ellipsis
    assert SANDBOX in _render(60, id_column("sandbox"))


def test_piped_output_is_not_held_to_80_columns(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr("sys.stdout", io.StringIO())  # a pipe, whatever runs the tests
    console = make_console()
    assert not console.is_terminal and console.width == PIPED_WIDTH > 80
