"""The command line's reference page (docs/reference/cli.md) is the parser's own: made again
here and compared, so a flag added, renamed or given another default shows on the page."""

from __future__ import annotations

import argparse

import pytest
from tests.conftest import ROOT

from tessel import cli_reference
from tessel.cli import make_parser

PAGE = ROOT / "docs" / "reference" / "cli.md"


def test_the_page_is_the_parsers() -> None:
    assert PAGE.read_text() == cli_reference.cli_reference(), (
        "docs/reference/cli.md is out of date: python -m tessel.cli_reference docs/reference/cli.md"
    )


def test_every_command_and_flag_has_a_row() -> None:
    page = cli_reference.cli_reference()
    commands = cli_reference._commands(make_parser())
    assert set(commands) == set(cli_reference.GUIDES)
    for name, (_, parser) in commands.items():
        assert f"\n## tessel {name}\n" in page, name
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction):
                continue  # every command's -h, --help
            for flag in action.option_strings:
                assert f"`{flag}`" in page, (name, flag)


def test_a_command_no_guide_describes_is_refused(monkeypatch) -> None:
    monkeypatch.delitem(cli_reference.GUIDES, "demo")
    with pytest.raises(ValueError, match=r"no guide for the commands \['demo'\]"):
        cli_reference.cli_reference()
