"""Tables the CLI prints keep ids whole: piped output is wider than rich's 80 columns, and id columns never cut."""

from __future__ import annotations

import io

from rich.console import Console
from rich.table import Table

from moorage.cli.console import PIPED_WIDTH, id_column, make_console, print_table

CHECKPOINT = "ck3a973b97bde941b9a1b2c3d4e5f6a7b8c9"


def _render(width: int, id_header: object) -> str:
    out = io.StringIO()
    t = Table("seq", id_header, "kind", "branch", "name", "what happened")  # type: ignore[arg-type]
    # A long row squeezes the table: rich would cut even a column that may not wrap.
    t.add_row("3", CHECKPOINT, "auto", "main (history)", "before-something-long",
              "turn 'hello there, a long message' ran 3 steps and wrote 2 files")
    print_table(Console(file=out, width=width), t)
    return out.getvalue()


def test_an_id_column_is_never_cut_even_when_a_long_row_squeezes_the_table() -> None:
    assert CHECKPOINT not in _render(80, "id")  # rich's default: cut with an ellipsis
    for width in (60, 80, 120):
        assert CHECKPOINT in _render(width, id_column("id")), width


def test_piped_output_is_not_held_to_80_columns(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr("sys.stdout", io.StringIO())  # a pipe, whatever runs the tests
    console = make_console()
    assert not console.is_terminal and console.width == PIPED_WIDTH > 80
