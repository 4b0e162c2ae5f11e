"""The ``normfuse`` command line: ``normfuse audit TARGET`` and ``normfuse check TARGET``.

    normfuse audit hf:llama --layers 2 --format markdown
    normfuse check hf:gemma2 --layers 2 --dtype bf16     # exit code 0 when equivalent, 1 when not

Each subcommand parses its options, loads the target (``normfuse/targets.py``) and calls the
library (``normfuse.audit``, ``normfuse.check``); exit code 2 when the target cannot be loaded.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from normfuse import __version__
from normfuse.auditing import BANDWIDTHS, DEFAULT_BANDWIDTH, audit, parse_bandwidth
from normfuse.errors import InvalidOptionError, NormfuseError, TargetError, closest

__all__ = ["build_parser", "main"]


# --------------------------------------------------------------------------- audit

def _audit(args: argparse.Namespace) -> int:
    from normfuse.targets import is_config_target, load_target, parse_overrides

    start = time.perf_counter()
    try:
        label, bw = parse_bandwidth(args.bandwidth)
        overrides = parse_overrides(args.set)
        # a transformers config or a diffusers class is audited in bf16 unless told; a factory's model keeps its own dtype
        dtype = args.dtype or ("bf16" if is_config_target(args.target) else None)
        model, margs, mkwargs = load_target(args.target, layers=args.layers, overrides=overrides, dtype=dtype,
                                            device=args.device, batch=args.batch, seq=args.seq)
    except (TargetError, InvalidOptionError) as error:
        print(f"normfuse audit: error: {error}", file=sys.stderr)
        return 2
    try:
        rep = audit(model, *margs, bandwidth=args.bandwidth, name=args.target, **mkwargs)
    except NormfuseError as error:
        print(f"normfuse audit: error: {error}", file=sys.stderr)
        return 1
    rep.batch = args.batch
    rep.seq = rep.tokens // args.batch if args.seq is None and rep.tokens else args.seq
    rep.seconds = time.perf_counter() - start
    from normfuse.render import write
    text = rep.render(args.format)
    if args.out:
        write(args.out, text)
        print(f"wrote {args.out} ({len(rep.sites)} sites, {args.format})", file=sys.stderr)
    else:
        print(text)
    if args.graph:
        write(args.graph, rep.to_svg())
        print(f"wrote {args.graph}", file=sys.stderr)
    return 0


def _add_audit(subparsers) -> None:
    p = subparsers.add_parser(
        "audit", help="report every norm site of a model, what would fuse, and the HBM bytes it saves",
        description="Audit a model without weights, memory or a GPU: per-site table, verdict, and HBM bytes "
                    "moved by the norm sites before and after fusion.")
    p.add_argument("target", help="hf:<model_type> | path/to/config.json | diffusers:<ClassName> | file.py:factory | "
                                  "package.module:factory")
    p.add_argument("--layers", type=int, default=None, help="layer count of a transformers config or diffusers class")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="change a config field (hf/config.json), a diffusers class's __init__ argument, or pass a "
                        "factory keyword; repeatable")
    p.add_argument("--batch", type=int, default=1, help="batch size of the made inputs (default 1)")
    p.add_argument("--seq", type=int, default=None,
                   help="sequence length of the made inputs (default 2048, or the model's maximum if shorter); "
                        "for diffusers:<ClassName>, the image-token count (default 4096)")
    p.add_argument("--dtype", default=None,
                   help="parameter/activation dtype (default: bf16 for a transformers config or a diffusers class, the factory's own)")
    p.add_argument("--device", default="meta", choices=("meta", "cpu"),
                   help="build on the meta device (default: no memory, no compute) or on the CPU")
    p.add_argument("--bandwidth", default=None,
                   help=f"HBM bandwidth that prices the bytes: a GPU name ({', '.join(BANDWIDTHS)}), TB/s, or "
                        f"e.g. 900GB/s (default {DEFAULT_BANDWIDTH})")
    p.add_argument("--format", default="table", choices=("table", "json", "markdown", "html"))
    p.add_argument("--out", default=None, help="write the report to this file instead of stdout")
    p.add_argument("--graph", default=None, metavar="FILE.svg", help="also write a picture of the residual stream")
    p.set_defaults(func=_audit)


# --------------------------------------------------------------------------- check

def _add_check(subparsers) -> None:
    p = subparsers.add_parser(
        "check", help="check that fusing a model keeps its outputs, gradients and every site's math",
        description="Optimize a copy of the model, then compare it with the original and an fp64 reference "
                    "(forward and backward), localize each rewritten site and prove it symbolically. "
                    "Exit code 0 when equivalent, 1 when not, 2 when the target cannot be loaded.")
    p.add_argument("target", help="hf:<model_type> | path/to/config.json | file.py:factory | package.module:factory")
    p.add_argument("--dtype", default="fp32", help="parameter/activation dtype: fp32 (default), bf16, fp16")
    p.add_argument("--layers", type=int, default=None, help="layer count of a transformers config")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="change a config field (hf/config.json) or pass a factory keyword; repeatable")
    p.add_argument("--full", action="store_true",
                   help="hf:<model_type>: the config's own sizes (default: shrunk to 2 layers, hidden 64)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=8)
    p.add_argument("--no-backward", action="store_true", help="compare the forward outputs only")
    p.add_argument("--keep-init", action="store_true",
                   help="check the model as built; by default its 1-D parameters (norm weights, biases) get "
                        "small noise first, since weights of exactly 1 hide rounding-order faults")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=_check)


def _load_for_check(args):
    """(model, args, kwargs) of the target; ``hf:<type>`` is shrunk (zoo.TINY_HF) unless --full."""
    from normfuse import targets, zoo

    overrides = targets.parse_overrides(args.set)
    dtype = targets.parse_dtype(args.dtype)
    if not args.target.startswith("hf:") or args.full:
        return targets.load_target(args.target, layers=args.layers, overrides=overrides, dtype=dtype,
                                   batch=args.batch, seq=args.seq)
    model_type = args.target[3:].strip()
    targets._hf_config_for_type(model_type)  # the loader's message for an unknown type
    config = zoo.hf_config(model_type)
    for key in overrides:
        if not hasattr(config, key):
            raise TargetError(f"{type(config).__name__} has no field {key!r}.{closest(key, config.to_dict())} "
                              "--set only changes fields the config already has.")
    if args.layers is not None:
        overrides.update({f: args.layers for f in targets.LAYER_FIELDS if hasattr(config, f)})
    model = zoo.hf_model(model_type, dtype=dtype or torch.float32, **overrides)
    margs, mkwargs = targets.make_inputs(model, args.batch, args.seq)
    return model, margs, mkwargs


def _check(args) -> int:
    from normfuse.verify.check import check
    from normfuse.verify.numeric import perturb_vectors

    started = time.perf_counter()

    def progress(message: str) -> None:
        print(f"[{time.perf_counter() - started:6.1f}s] {message}", file=sys.stderr, flush=True)

    progress(f"loading {args.target}")
    try:
        model, margs, mkwargs = _load_for_check(args)
    except (TargetError, NormfuseError) as error:
        print(f"normfuse check: {error}", file=sys.stderr)
        return 2
    if not args.keep_init:
        perturb_vectors(model)
    res = check(model, *margs, backward=not args.no_backward, progress=progress, **mkwargs)
    progress("done")
    print(res.to_json(indent=2) if args.json else res)
    return 0 if res.ok else 1


# --------------------------------------------------------------------------- the parser

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="normfuse",
        description="Find and fuse residual-add -> LayerNorm/RMSNorm sites in PyTorch models.",
    )
    parser.add_argument("--version", action="version", version=f"normfuse {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_audit(subparsers)
    _add_check(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    return int(args.func(args) or 0)
