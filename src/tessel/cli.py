"""The `tessel` command line: build, inspect, run, demo, ckpt."""

from __future__ import annotations

import argparse
import sys

from tessel.config.errors import ConfigError
from tessel.parallel import ckpt_cli


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tessel",
        description="Build, partition and deploy PyTorch models across many devices.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    ckpt_cli.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = make_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except ConfigError as exc:
        print(f"tessel: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("tessel: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
