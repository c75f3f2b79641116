"""`tessel ckpt ...`: distributed checkpoint tools (owned by the checkpoint work)."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `ckpt` command group to the tessel CLI."""
    p = subparsers.add_parser(
        "ckpt", help="convert, unify, shard and inspect distributed checkpoints"
    )
    p.set_defaults(func=lambda args: p.error("a ckpt subcommand is required"))
