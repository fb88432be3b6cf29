"""Every `moorage ...` command the README, docs/ and examples/ show names a command that exists, with flags it
takes: a renamed flag or command fails here, not in a reader's terminal."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any, Iterator

import typer

from moorage.cli.main import app

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "examples").glob("*/README.md"))]


def fenced_blocks(text: str) -> Iterator[tuple[str, str]]:
    """(language, body) of each fenced block of a markdown text."""
    lang, body = None, []
    for line in text.splitlines():
        fence = re.match(r"^\s*```(\S*)", line)
        if fence and lang is None:
            lang, body = fence.group(1), []
        elif fence:
            yield lang, "\n".join(body)
            lang = None
        elif lang is not None:
            body.append(line)


def _shown_commands(text: str) -> Iterator[str]:
    """What follows `moorage ` in shell blocks (one command per line, comments and pipes cut) and in code spans."""
    for lang, body in fenced_blocks(text):
        if lang not in ("", "bash", "sh", "console", "shell"):
            continue
        for line in body.replace("\\\n", " ").splitlines():
            for part in re.split(r"&&|;|\||\s#\s", line):
                m = re.search(r"(?:^|\s|/)moorage (\S.*)$", part.strip())
                if m:
                    yield m.group(1)
    for span in re.finditer(r"`(?:\.venv/bin/)?moorage ([^`]+)`", re.sub(r"```.*?```", "", text, flags=re.S)):
        yield " ".join(span.group(1).split())


def _problems(root: Any, shown: str) -> list[str]:
    try:
        words = shlex.split(shown)
    except ValueError:
        words = shown.split()
    words = [w.strip("[]") for w in words]  # `[--json]`: an optional flag
    cmd, path, problems = root, [], []
    while hasattr(cmd, "commands") and words:
        if words[0].startswith("-"):  # a group's own option (`hosts --store-url URL drain`), and its value
            problems += _unknown_flags(cmd, path, shown, words[:1])
            words = words[2:] if any(words[0] in p.opts and not p.is_flag for p in cmd.params) else words[1:]
            continue
        sub = cmd.commands.get(words[0])
        if sub is None and getattr(cmd, "invoke_without_command", False):
            break  # a group that runs itself too (`memory eval --dataset F`), given an argument
        if sub is None:
            if cmd is root:
                return []  # prose ("moorage keeps ..."), not a command
            return [f"`moorage {shown}`: `moorage {' '.join(path)}` has no command {words[0]!r}"]
        path.append(words.pop(0))
        cmd = sub
    if cmd is root:
        return problems
    return problems + _unknown_flags(cmd, path, shown, words)


def _unknown_flags(cmd: Any, path: list[str], shown: str, words: list[str]) -> list[str]:
    # `moorage`'s own options (--config, --data-dir, --log-level) are read after any command too; --help everywhere.
    root = typer.main.get_command(app)
    takes = {o for c in (cmd, root) for p in c.params for o in (*p.opts, *p.secondary_opts)} | {"--help"}
    said = [w.split("=")[0] for w in words]
    return [f"`moorage {shown}`: `moorage {' '.join(path)}` takes no {w}" for w in said
            if w.startswith("-") and w not in ("-", "--") and not re.match(r"^-\d", w) and w not in takes]


def test_every_documented_command_and_flag_exists() -> None:
    root = typer.main.get_command(app)
    seen, problems = 0, []
    for doc in DOCS:
        for shown in _shown_commands(doc.read_text()):
            seen += 1
            problems += [f"{doc.relative_to(ROOT)}: {p}" for p in _problems(root, shown)]
    assert seen > 100, seen  # the extraction found the docs' commands
    assert not problems, "\n".join(problems)


def test_the_check_catches_a_wrong_flag_and_a_wrong_command() -> None:
    root = typer.main.get_command(app)
    assert _problems(root, "invoke coder hi --usr dev") == ["`moorage invoke coder hi --usr dev`: `moorage invoke` takes no --usr"]
    assert _problems(root, "checkpoints restore a b c") == [
        "`moorage checkpoints restore a b c`: `moorage checkpoints` has no command 'restore'"]
    assert _problems(root, "share web ada --ttl 1h --label x") == []
    assert _problems(root, "hosts --store-url postgresql://db drain host-b") == []
    assert _problems(root, "hosts --store drain host-b") == [
        "`moorage hosts --store drain host-b`: `moorage hosts` takes no --store"]
