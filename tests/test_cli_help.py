"""Every option and argument of every `dynaplane` command says what it is (issue 46): `--help`
is the first thing a new user reads."""
from __future__ import annotations

import argparse

from dynaplane.cli import build_parser


def undocumented(parser: argparse.ArgumentParser, command: str = "dynaplane") -> list[str]:
    missing = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                missing += undocumented(sub, f"{command} {name}")
        elif isinstance(action, argparse._HelpAction):
            continue
        elif not action.help:
            missing.append(f"{command} {'/'.join(action.option_strings) or action.dest}")
    return missing


def test_every_option_of_every_command_has_help() -> None:
    assert undocumented(build_parser()) == []


def test_the_walk_finds_an_option_without_help() -> None:
    parser = argparse.ArgumentParser()
    parser.add_subparsers().add_parser("up").add_argument("--host")
    assert undocumented(parser) == ["dynaplane up --host"]
