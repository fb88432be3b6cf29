"""The consoles the CLI prints with. Piped output (a script, a file, a pager) is not cut at rich's 80-column
default: tables hold ids that are copied into the next command."""

from __future__ import annotations

import time

from rich.console import Console
from rich.table import Column, Table

#: Width of piped output (a terminal's own width is used as it is).
PIPED_WIDTH = 160


def make_console(*, stderr: bool = False) -> Console:
    console = Console(stderr=stderr)
    return console if console.is_terminal else Console(stderr=stderr, width=PIPED_WIDTH)


class IdColumn(Column):
    """A table column of ids (see ``id_column``)."""


def id_column(header: str) -> Column:
    """A table column of ids: never cut or wrapped (the other columns give way; ``print_table`` sizes it to its
    longest id), so an id can be copied whole into the next command."""
    return IdColumn(header, no_wrap=True)


def print_table(console: Console, table: Table) -> None:
    for column in table.columns:
        if isinstance(column, IdColumn):
            column.min_width = max([len(str(cell)) for cell in column.cells] + [len(str(column.header))])
    console.print(table)


def utc(ts: float | None) -> str:
    """An epoch time as a person reads it, in UTC (``--json`` keeps the number); ``None`` as nothing."""
    return "" if ts is None else time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(float(ts)))
