"""docs/reference/cli.md: every command of ``kvtier``, read from the argparse parsers
(:func:`kvtier.cli.build_parser`): each command's usage, its help, and each argument and option.

argparse keeps a parser's arguments and sub-commands only in private attributes (``_actions``,
``_choices_actions``); they are read here, in one place, as Sphinx's and MkDocs' argparse plugins read them.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Iterator

from kvtier.cli import build_parser
from kvtier.docs import _markdown as md

_WIDTH = 100  # usage lines wrap here, whatever the terminal's width


@dataclasses.dataclass(frozen=True)
class Command:
    """One parser of the tree: ``kvtier``, a group (``kvtier cache``) or a command (``kvtier cache ls``)."""

    prog: str
    help: str
    parser: argparse.ArgumentParser

    def arguments(self) -> list[argparse.Action]:
        """Its own positionals and options (not ``--help``, not sub-command choices, not hidden ones)."""
        return [a for a in self.parser._actions
                if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))
                and a.help != argparse.SUPPRESS]

    def usage(self) -> str:
        formatter = argparse.HelpFormatter(prog=self.prog, width=_WIDTH)
        formatter.add_usage(self.parser.usage, self.parser._actions, self.parser._mutually_exclusive_groups)
        return formatter.format_help().strip()


def commands(parser: argparse.ArgumentParser | None = None, helptext: str = "") -> Iterator[Command]:
    """Every parser under ``parser`` (``kvtier``'s by default), depth first in ``kvtier --help``'s order."""
    parser = parser or build_parser()
    yield Command(parser.prog, helptext or parser.description or "", parser)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help or "" for choice in action._choices_actions}
            for name, sub in action.choices.items():
                yield from commands(sub, helps.get(name, ""))


def option_name(action: argparse.Action) -> str:
    """How an argument is written: ``--config``, ``-q, --quick``, or a positional's metavar (``FILE``)."""
    if action.option_strings:
        return ", ".join(action.option_strings)
    return _metavar(action) or action.dest


def render() -> str:
    parts = []
    for command in commands():
        rows = [[md.code(option_name(a)), _value(a), _default(a), md.text(_help(a, command.prog))]
                for a in command.arguments()]
        table = md.table(["Argument", "Value", "Default", "Description"], rows) if rows else ""
        level = "#" * min(2 + command.prog.count(" "), 4)
        parts.append(f"{level} `{command.prog}`\n\n{md.text(command.help)}\n\n```text\n{command.usage()}\n```\n\n"
                     + table)
    intro = """
Every command of `kvtier` and each of its arguments, as `kvtier COMMAND --help` prints them. The `cache` commands
open the secondary tiers only (no DRAM pool), so they are safe beside a running engine.
"""
    return md.page("Command line reference", intro, parts)


def _metavar(action: argparse.Action) -> str:
    if isinstance(action.metavar, tuple):
        return " ".join(action.metavar)
    if action.metavar:
        return str(action.metavar)
    if action.choices is not None and not isinstance(action, argparse._SubParsersAction):
        return "{" + ",".join(map(str, action.choices)) + "}"
    return ""


def _value(action: argparse.Action) -> str:
    if action.nargs == 0:
        return "flag"
    if action.choices is not None:
        return ", ".join(md.code(c) for c in action.choices)
    shown = _metavar(action) or (action.dest.upper() if action.option_strings else "")
    if action.nargs in ("*", "+", argparse.REMAINDER):
        shown += " ..."
    return md.code(shown) if shown else ""


def _default(action: argparse.Action) -> str:
    if action.nargs == 0 or action.default in (None, argparse.SUPPRESS) or action.required:
        return "required" if action.required and action.option_strings else ""
    return md.code(action.default)


def _help(action: argparse.Action, prog: str) -> str:
    """The help text with argparse's ``%(default)s``-style fields filled in, as ``--help`` shows it."""
    text = action.help or ""
    if "%" not in text:
        return text
    params = {k: v for k, v in vars(action).items() if v is not argparse.SUPPRESS}
    params["prog"] = prog
    if params.get("choices") is not None:
        params["choices"] = ", ".join(map(str, params["choices"]))
    return text % params
