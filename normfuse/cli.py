"""The `normfuse` command line."""

from __future__ import annotations

import argparse
import sys

from normfuse import __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="normfuse",
        description="Find and fuse residual-add -> LayerNorm/RMSNorm sites in PyTorch models.",
    )
    parser.add_argument("--version", action="version", version=f"normfuse {__version__}")
    parser.add_subparsers(dest="command", metavar="COMMAND")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    return 0
