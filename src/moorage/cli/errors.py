"""How CLI sub-commands report a moorage error: one red line on stderr and exit status 2, never a traceback."""

from __future__ import annotations

import functools
from typing import Any, Callable, TypeVar

import typer
from rich.markup import escape

from moorage.cli.console import make_console

err_console = make_console(stderr=True)
F = TypeVar("F", bound=Callable[..., Any])


def clear_errors(fn: F) -> F:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from moorage.errors import MoorageError

        try:
            return fn(*args, **kwargs)
        except MoorageError as e:
            err_console.print(f"[red]error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
            raise typer.Exit(2) from None

    return wrapper  # type: ignore[return-value]
