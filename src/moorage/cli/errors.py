"""How the CLI reports a failure: one red line on stderr, "error: what happened (what to do next)", never a
traceback or a usage box; a moorage error exits 2, and so does a mistyped command, option or argument.

Both are caught in one place, the root command's ``invoke`` (``OneLineErrors``), so every command fails the same
way however it is run: the installed ``moorage``, ``python -m moorage.cli.main`` or Typer's test runner."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import typer
from rich.markup import escape
from typer.core import TyperGroup

from moorage.cli.console import make_console
from moorage.errors import MoorageError, disk_full

try:  # Typer from 0.2x parses with its own copy of Click; before, with Click itself
    from typer._click import Context, exceptions as click_errors
except ImportError:  # pragma: no cover - an older Typer
    from click import Context, exceptions as click_errors  # type: ignore[no-redef]

err_console = make_console(stderr=True)


def print_error(message: str) -> None:
    """The one line a failure is: ``error: {message}`` on stderr."""
    err_console.print(f"[red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)


def usage_line(e: click_errors.ClickException, words: list[str] | None = None) -> str:
    """Click's message for a mistyped command line as one line, with the help to read: "missing option '--tenant'
    (see `moorage memory facts --help`)". Click's own is several lines (usage, a hint, the message in a box).
    ``words`` name the command where the error does not (``_command_words``)."""
    said = " ".join(e.format_message().split()).rstrip(".")
    if said[:1].isupper() and said[1:2].islower():  # "Missing option ..." -> "missing option ...", not "NAME" -> "nAME"
        said = said[0].lower() + said[1:]
    if not isinstance(e, click_errors.UsageError):
        return said
    ctx = getattr(e, "ctx", None)
    if ctx is not None:  # the words the user typed to reach the command (not the program's name: `python -m ...`)
        words = []
        while ctx.parent is not None:
            words.insert(0, ctx.info_name or "")
            ctx = ctx.parent
    return f"{said} (see `{' '.join(['moorage', *(words or [])])} --help`)"


def _command_words(root: Any, argv: list[str]) -> list[str]:
    """The command a command line runs, as its words (``store tenants`` of ``--data-dir D store tenants --json=3``):
    for the errors Click raises without saying which command it was reading the options of."""
    cmd, words, rest = root, [], list(argv)
    while rest and getattr(cmd, "commands", None) is not None:
        word = rest.pop(0)
        if word.startswith("-"):  # a group's own option, and its value if it takes one
            if "=" not in word and any(word in p.opts and not getattr(p, "is_flag", False) for p in cmd.params):
                rest = rest[1:]
            continue
        if word not in cmd.commands:
            break
        cmd, words = cmd.commands[word], [*words, word]
    return words


def _root_options_first(root: Any, argv: list[str]) -> list[str]:
    """``moorage up --data-dir D --config F`` as ``moorage --data-dir D --config F up``: the root's own options
    (``--config``, ``--data-dir``, ``--log-level``) are read wherever they stand on the line, as the docs write them
    after the command, unless after ``--`` or where the command itself takes an option of that name."""
    takes_value = {o: not getattr(p, "is_flag", False) for p in root.params for o in p.opts}
    cmd, own, moved, kept = root, set(), [], []
    rest = list(argv)
    while rest:
        word = rest.pop(0)
        if word == "--":
            kept += [word, *rest]
            break
        name = word.split("=", 1)[0]
        if cmd is not root and name in takes_value and name not in own:
            moved.append(word)
            if takes_value[name] and "=" not in word and rest:
                moved.append(rest.pop(0))
            continue
        kept.append(word)
        if word.startswith("-"):  # a command's own option: its value is no command word
            if "=" not in word and rest and any(name in p.opts and not getattr(p, "is_flag", False) for p in cmd.params):
                kept.append(rest.pop(0))
        elif word in (getattr(cmd, "commands", None) or {}):
            cmd = cmd.commands[word]
            own |= {o for p in cmd.params for o in (*p.opts, *p.secondary_opts)}
    return [*moved, *kept]


def _say_root_options(root: Any, cmd: Any, own: frozenset[str] = frozenset()) -> None:
    """Every command's ``--help`` ends with the root's options it takes (those ``_root_options_first`` reads after
    its words): without it, ``moorage up --help`` did not show ``--config``, ``--data-dir`` or ``--log-level``."""
    for sub in (getattr(cmd, "commands", None) or {}).values():
        mine = own | {o for p in sub.params for o in (*p.opts, *p.secondary_opts)}
        taken = [p for p in root.params if not set(p.opts) & mine]
        if taken and not sub.epilog:
            sub.epilog = "\n".join([
                "moorage's own options, taken here too (before or after the command's words):",
                *(f"  {p.opts[0]} {p.metavar or (p.name or '').upper()}  {p.help or ''}".rstrip() for p in taken)])
        _say_root_options(root, sub, mine)


class OneLineErrors(TyperGroup):
    """The root command: a usage error anywhere below it (an unknown command or option, a missing argument, a bad
    choice) and a moorage error raised by any command (a server's problem, an unknown tenant, a bad path) are one
    line and exit status 2. A group given no arguments (``moorage memory``) still shows its help. Every command's
    help names the root's options it takes too."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _say_root_options(self, self)

    def make_context(self, info_name: str | None, args: list[str], parent: Context | None = None,
                     **extra: Any) -> Context:
        args = _root_options_first(self, list(args))
        with _one_line([]):  # the root's own options
            ctx = super().make_context(info_name, args, parent=parent, **extra)
        ctx.meta[_ARGV] = list(args)
        return ctx

    def invoke(self, ctx: Context) -> Any:
        with _one_line(_command_words(self, ctx.meta.get(_ARGV, []))), _moorage_errors():
            return super().invoke(ctx)


_ARGV = "moorage.argv"


@contextlib.contextmanager
def _one_line(words: list[str]) -> Iterator[None]:
    """A Click error raised inside: one line on stderr, and an exit with its status (2 for a usage error)."""
    try:
        yield
    except click_errors.ClickException as e:
        if isinstance(e, getattr(click_errors, "NoArgsIsHelpError", ())):
            raise  # its help is what a group given no arguments shows
        print_error(usage_line(e, words))
        raise typer.Exit(e.exit_code) from None


@contextlib.contextmanager
def _moorage_errors() -> Iterator[None]:
    """moorage's typed errors raised inside as one line on stderr and exit status 2; so is an ``OSError`` about a
    path the command was given (``--config DIR``, ``--trace DIR``: a folder, unreadable, missing), and a full disk
    whatever wrote to it. Any other error is a bug, and shown as one."""
    try:
        yield
    except Exception as e:
        if disk_full(e) is not None:
            # Whatever the write was (``moorage up`` starting on a full disk writes a sandbox's record), the disk
            # is the cause and freeing space the fix; it was a traceback of the write that failed.
            print_error("the disk is out of space: the command could not write what it had to (free space on that "
                        "disk, the data directory's for `moorage up`: docs/operations.md, 'When the disk fills up'; "
                        "then run the command again)")
            raise typer.Exit(2) from None
        if isinstance(e, MoorageError):
            print_error(str(e))
            raise typer.Exit(2) from None
        if not isinstance(e, OSError) or e.filename is None:  # a bug, or not about a path the command was given
            raise
        print_error(f"{e.filename}: {e.strerror or e} (check the path and run the command again)")
        raise typer.Exit(2) from None
