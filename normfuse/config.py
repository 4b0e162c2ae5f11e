"""Options of the pass, validated once: ``FuseConfig`` plus keyword shortcuts."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import torch

from normfuse.errors import InvalidOptionError, closest

__all__ = ["FuseConfig", "make_config"]


@dataclass
class FuseConfig:
    """What ``optimize`` / ``fuse_graph`` / the backends do.

    filter_fn:  ``filter_fn(site) -> bool``; a site for which it returns False is left
                as it was (reason "excluded by filter_fn"). ``site`` is a ``normfuse.Site``
                (``site.fqn``, ``site.placement``, ``site.kind``, ...).
    standalone: also rewrite norms with no add next to them into the single-kernel norm.
    fuse_output_add: fold ``x + norm(f)`` (res-post, sandwich) into the norm-then-add op.
    prenorm:    convert Post-Norm blocks to Pre-Norm first (changes the function by design).
    check:      run the numeric equivalence checker on the first call and warn on failure.
    residual_dtype: None, or ``torch.float32`` to keep every fused sum of a bf16/fp16
                residual stream in fp32 (changes the function by design; see
                normfuse/passes/planning.py, rewrite.py).
    recompute_norm_output: when every reader of a fused norm's output is a linear, do not
                keep that output for the linears' backward: recompute it from the sum
                (normfuse/kernels/norm_linear.py; decided in normfuse/passes/planning.py).
    cross_block: carry the residual pair across the blocks of a Pre-Norm stream, so the add
                that ends a block fuses with the norm that starts the next one even when each
                block is a region of its own (FSDP2, per-block compile, a graph break).
                Exact: the same adds and norms, regrouped. Streams that do not fit stay as
                they were. A checkpointed block would keep the pair (two tensors) instead of
                the sum for its recompute, so pairs go into one only with cross_checkpoints;
                the last block's pair always goes to the final norm.
    cross_checkpoints: with cross_block, hand the pair into checkpointed blocks too: every
                add between blocks fused, for one more activation per block held by the
                checkpoints (normfuse/passes/cross_block/).
    fuse_branch: fold what the branch does just before its residual add into the kernel: a
                second add (``x + attn + mlp``) and a per-sample scale (timm's drop_path).
                Exact (normfuse/passes/parts/branch_fold.py).
    fuse_dropout: with fuse_branch, also draw the branch's training-mode dropout in the
                kernel: the same distribution from another random stream (the checker
                compares such sites given the kernel's mask).
    pair_norms: two norms of the same value with the same modes (parallel blocks) become one
                call that reads the value once and writes both outputs.
    fuse_quant: a norm whose output the graph quantizes to fp8 for the next linear (a scale,
                static or from each row's or group's amax; divide; clamp; cast) computes q and
                its scale in the same call (normfuse/passes/parts/quant.py lists the spellings read).
    fuse_gate:  a gated RMSNorm, ``norm(x * act(z))`` (Mamba2) or ``norm(x) * act(z)`` (Qwen3-Next),
                act silu or sigmoid in fp32, takes the gate into its call (normfuse/passes/parts/gate.py).
    fuse_modulation: a diffusion transformer's adaLN modulation of the norm's output (``y * (1 + scale) +
                shift``, addcmul, scale or shift only, Wan's fp32 steps) and the gate of the residual branch
                before the add (``residual + gate * branch``) go into the call
                (normfuse/passes/parts/modulation.py, gated_residual.py).
    fuse_rope:  a q/k norm whose output goes into HF's rotary embedding (``q * cos + rotate_half(q) *
                sin``, partial rotary included) becomes one ``qk_norm_rope`` call, q and k of one
                attention together (normfuse/passes/fusions/qk_norm_rope.py).
    """

    filter_fn: Callable[[Any], bool] | None = None
    standalone: bool = True
    fuse_output_add: bool = True
    prenorm: bool = False
    check: bool = False
    residual_dtype: Any = None
    recompute_norm_output: bool = False
    cross_block: bool = True
    cross_checkpoints: bool = False
    fuse_branch: bool = True
    fuse_dropout: bool = True
    pair_norms: bool = True
    fuse_quant: bool = True
    fuse_gate: bool = True
    fuse_rope: bool = True
    fuse_modulation: bool = True

    def __post_init__(self):
        if self.filter_fn is not None and not callable(self.filter_fn):
            raise InvalidOptionError(
                f"filter_fn must be a callable taking a normfuse.Site and returning bool, got "
                f"{type(self.filter_fn).__name__}. Pass e.g. filter_fn=lambda site: site.placement != 'post'.")
        if self.residual_dtype not in (None, torch.float32):
            raise InvalidOptionError(
                f"residual_dtype must be None (the stream keeps the model's dtype) or torch.float32, got "
                f"{self.residual_dtype!r}. Pass residual_dtype=torch.float32.")
        for name in ("standalone", "fuse_output_add", "prenorm", "check", "recompute_norm_output", "cross_block",
                     "cross_checkpoints",
                     "fuse_branch", "fuse_dropout", "pair_norms", "fuse_quant", "fuse_gate",
                     "fuse_rope", "fuse_modulation"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise InvalidOptionError(f"{name} must be True or False, got {value!r}.")


OPTION_NAMES = tuple(f.name for f in dataclasses.fields(FuseConfig))


def make_config(config: FuseConfig | None = None, **options: Any) -> FuseConfig:
    """A config from an optional FuseConfig and keyword shortcuts (which override it)."""
    if config is not None and not isinstance(config, FuseConfig):
        raise InvalidOptionError(f"config must be a normfuse.FuseConfig, got {type(config).__name__}.")
    for name in options:
        if name not in OPTION_NAMES:
            raise InvalidOptionError(
                f"unknown option {name!r}.{closest(name, OPTION_NAMES)} Options are: {', '.join(OPTION_NAMES)}.")
    base = dataclasses.asdict(config) if config is not None else {}
    if config is not None:
        base["filter_fn"] = config.filter_fn
    base.update(options)
    return FuseConfig(**base)
