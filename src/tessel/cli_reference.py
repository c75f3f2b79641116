"""The command line's reference page, made from the parser `tessel --help` prints: every command
and flag with its value, default and help, so the page cannot say other than the code does.

`python -m tessel.cli_reference docs/reference/cli.md` writes it; a test makes it again and
compares.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tessel.cli import make_parser

# where the guides describe each command (the page's links, from docs/reference/)
GUIDES = {
    "build": "[Inference builds](../guides/inference.md), [generation gears](../guides/generation.md#on-the-command-line)",
    "inspect": "[Reading the plan](../guides/inference.md#reading-the-plan)",
    "run": "[Inputs and outputs](../guides/inference.md#inputs-and-outputs-of-tessel-run)",
    "generate": "[On the command line](../guides/generation.md#on-the-command-line)",
    "serve": "[Serving](../guides/serving.md), [several nodes](../guides/several-nodes.md)",
    "demo": "[Getting started](../getting-started.md#the-two-commands)",
    "ckpt": "[Checkpoints](../guides/checkpoints.md)",
}

INTRO = """\
# Command line

This page is made from the parser itself (`python -m tessel.cli_reference docs/reference/cli.md`).
`tessel --help` lists the commands, and `tessel COMMAND --help` shows each command's flags.
A flag's default is shown where it has one.
"""


def cli_reference() -> str:
    """The reference page's Markdown: the commands as a table, then a section per command."""
    parser = make_parser()
    commands = _commands(parser)
    missing = sorted(set(commands) - set(GUIDES))
    if missing:
        raise ValueError(f"cli_reference.GUIDES has no guide for the commands {missing}")
    lines = [INTRO, "| command | what it does | described in |", "|---|---|---|"]
    for name, (summary, _) in commands.items():
        lines.append(f"| [`tessel {name}`](#tessel-{name}) | {_cell(summary)} | {GUIDES[name]} |")
    lines += ["", "## Options of every command", "", *_table(parser)]
    for name, (summary, sub) in commands.items():
        lines += _section(f"tessel {name}", summary, sub, level=2)
    return "\n".join(lines).rstrip() + "\n"


def _commands(parser: argparse.ArgumentParser) -> dict[str, tuple[str, argparse.ArgumentParser]]:
    """Each subcommand of `parser`: its one-line help and its parser, in the order added."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            return {name: (helps.get(name, ""), sub) for name, sub in action.choices.items()}
    return {}


def _section(title: str, summary: str, parser: argparse.ArgumentParser, level: int) -> list[str]:
    lines = ["", f"{'#' * level} {title}", "", f"{_sentence(summary)}"]
    if parser.description:
        lines += ["", " ".join(parser.description.split())]
    table = _table(parser)
    if table:
        lines += ["", *table]
    for name, (sub_summary, sub) in _commands(parser).items():
        lines += _section(f"{title} {name}", sub_summary, sub, level + 1)
    return lines


def _table(parser: argparse.ArgumentParser) -> list[str]:
    rows = [
        a
        for a in parser._actions
        if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))
        and a.help != argparse.SUPPRESS
    ]
    if not rows:
        return []
    out = ["| flag | value | default | what it does |", "|---|---|---|---|"]
    for a in rows:
        flag = ", ".join(f"`{s}`" for s in a.option_strings) or f"`{a.metavar or a.dest}`"
        out.append(f"| {flag} | {_value(a)} | {_default(a)} | {_cell(a.help or '')} |")
    return out


def _value(action: argparse.Action) -> str:
    if action.nargs == 0:
        return "(a switch)"
    if action.choices is not None:
        return " \\| ".join(f"`{c}`" for c in action.choices)
    if action.metavar is not None and action.option_strings:
        return f"`{action.metavar}`"
    kind = getattr(action.type, "__name__", None)
    return {"int": "integer", "float": "number"}.get(kind or "", "text")


def _default(action: argparse.Action) -> str:
    value = action.default
    if (
        value is None
        or value is argparse.SUPPRESS
        or action.nargs == 0
        or not action.option_strings
    ):
        return ""
    return f"`{value}`"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _sentence(text: str) -> str:
    text = " ".join(text.split())
    return text[:1].upper() + text[1:] + ("" if text.endswith(".") else ".")


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m tessel.cli_reference OUTPUT.md", file=sys.stderr)
        return 2
    out = Path(argv[0])
    partial = out.with_name(f".{out.name}.partial")
    partial.write_text(cli_reference())
    partial.replace(out)  # published in one step
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
