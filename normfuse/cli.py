"""The `normfuse` command line.

Each subcommand lives beside the code it drives and registers itself here through a
``register_cli(subparsers)`` function that adds its parser and sets ``func(args) -> int``.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from normfuse import __version__

# subcommand -> module whose register_cli(subparsers) adds it
SUBCOMMANDS = {
    "audit": "normfuse.auditing",
    "check": "normfuse.verify.check",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="normfuse",
        description="Find and fuse residual-add -> LayerNorm/RMSNorm sites in PyTorch models.",
    )
    parser.add_argument("--version", action="version", version=f"normfuse {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in SUBCOMMANDS.values():
        try:
            register = importlib.import_module(module).register_cli
        except (ImportError, AttributeError):
            continue
        register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    return int(args.func(args) or 0)
