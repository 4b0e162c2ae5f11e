"""DTensor sharding rules of the fused ops (tensor and sequence parallel).

A norm works row by row over the last dim, so the fused ops run on each rank's local
rows unchanged when:
- the activations (x, residual, and the grads of the outputs) are sharded on one dim
  that is not the last one (``Shard(0)`` batch, ``Shard(1)`` sequence: torchtitan's
  ``SequenceParallel`` norms), or replicated;
- weight and bias are replicated (``SequenceParallel`` makes them so).
add_norm's modes shard like x: x1 takes x's placement, rowscale (x.shape[:-1]) its rows', weight1
and bias1 are replicated (their gradients partial, like weight's), the dropout seed is a
replicated scalar. (Each rank draws the dropout mask of its local rows from the seed and the
local row index, so ranks holding different rows draw the same pattern.)
The quantization epilogue (add_norm_quant_fwd): q keeps x's placement, a per-row or per-group scale
(x's row dims, then 1 or N // G) its row shard, and a static scale is replicated.
A gate takes x's placement (its gradient too); with norm_group the flat statistics hold (row, group)
pairs, row-major, so a row shard holds its own.
Outputs shaped like x keep x's placement. The per-row statistics (mean, rstd) are flat
``(rows,)`` tensors: each rank holds its own rows' statistics, declared ``Shard(0)``.
They are read only by the backward op, which is offered exactly the forward's sharding
of its input (so DTensor never moves the statistics apart from their rows). Weight and
bias gradients are per-rank partial sums: ``Partial()``.

The last dim must be whole on every rank: an input sharded on it raises
``ShardedNormDimError`` naming the fix (DTensor re-raises it as a RuntimeError with the
same message). (The pass checks this first and leaves such a
site unfused, with the reason: see ``refusal``.) Partial inputs are reduced by DTensor
first (the norm of a pending sum is not a sum of norms).

``register()`` is idempotent and cheap after the first call; the rewriter calls it when
it meets a site on DTensors (``refusal``), and code that calls the ops on DTensors
directly calls it first. Its first call costs ~0.5 s (importing DTensor), so nothing
calls it for models without DTensors.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

__all__ = ["register", "refusal", "ShardedNormDimError"]

_REGISTERED: list[bool] = []


class ShardedNormDimError(ValueError):
    """A fused norm op got an input sharded on the normalized (last) dim."""


def _dtensor_api():
    if not torch.distributed.is_available():
        return None
    try:
        from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
        from torch.distributed.tensor.experimental import register_sharding
    except ImportError:  # pragma: no cover - builds without DTensor
        return None
    return DTensor, Partial, Replicate, Shard, register_sharding


def _row_dims(spec: Any, op: str, arg: str) -> set[int]:
    """The row dims ``spec`` is sharded on; raises when the last dim is sharded."""
    from torch.distributed.tensor import Shard
    ndim = len(spec.shape)
    dims = set()
    for placement in spec.placements:
        if isinstance(placement, Shard):
            dim = placement.dim % ndim
            if dim == ndim - 1:
                raise ShardedNormDimError(
                    f"normfuse.{op}: {arg} is sharded on its last dim ({placement}), the dim the norm normalizes "
                    f"over; every rank needs whole rows. Shard the rows instead (Shard(0), or Shard(1) as "
                    f"SequenceParallel does) or redistribute {arg} to Replicate() before the norm.")
            dims.add(dim)
    return dims


def _strategies(spec: Any, op: str, arg: str, layout) -> list:
    """One strategy per row dim the input is sharded on, plus all-replicated."""
    from torch.distributed.tensor import Replicate, Shard
    rows = sorted(_row_dims(spec, op, arg))
    return [layout(Replicate(), Replicate())] + [layout(Shard(d), Shard(0)) for d in rows]


# add_norm_fwd's arguments after store_sum, with their defaults (a caller may omit them)
_MODE_DEFAULTS = (True, None, None, None, None, 0.0, None, None, "before", "silu", None, None)


def _forward_rule(op: str):
    """Sharding function of add_norm_fwd / norm_add_fwd: (y, s|y, mean, rstd[, y1]) from
    (x, residual, weight, bias, *scalars[, round_sum_first, x1, rowscale, weight1, bias1, dropout_p, seed]);
    of add_norm_quant_fwd: those, then (q_bits, scale) from (store_y, quant_dtype, quant_scale, ...)."""
    quant = op == "add_norm_quant_fwd"

    def rule(x, residual, weight, bias, kind, *rest):
        from torch.distributed.tensor import Replicate
        quant_args = rest[14:] if quant else ()
        rest = rest[:14] if quant else rest
        scalars, modes = rest[:7], rest[7:]  # eps, weight_offset, residual_scale, 3 dtypes, store_*
        (round_sum_first, x1, rowscale, weight1, bias1, dropout_p, seed, gate, *_) = (
            *modes, *_MODE_DEFAULTS[len(modes):])
        if gate is not None:
            _row_dims(gate, op, "gate")
        for name, t in (("residual", residual), ("x1", x1)):
            if t is not None:
                _row_dims(t, op, name)
        has_sum = residual is not None or x1 is not None or rowscale is not None or dropout_p > 0
        store_extra = bool(scalars[6]) and (has_sum or op == "norm_add_fwd")

        def layout(act, stats):
            def rep(t):
                return None if t is None else Replicate()
            outs = [act, act if store_extra else Replicate(),
                    stats if kind == "layer_norm" else Replicate(), stats]
            ins = [act, None if residual is None else act, rep(weight), rep(bias)] + [None] * (1 + len(scalars))
            if op != "norm_add_fwd":
                outs.append(Replicate() if weight1 is None else act)
                # rowscale's dims are x's row dims: a row shard of x is the same shard of it
                # a gate has x's shape and placement; norm_group's statistics stay with their rows
                ins += [None, None if x1 is None else act, None if rowscale is None else act, rep(weight1),
                        rep(bias1), None, rep(seed), None if gate is None else act, None, None, None,
                        None][:len(modes)]
            if quant:
                # q like y; a scale per row or per group has y's row dims (a row shard is the same
                # shard of it); a static scale is replicated (and the scale output then empty)
                static = quant_args[2] is not None
                outs += [act, Replicate() if static else act]
                ins += [None, None, rep(quant_args[2])] + [None] * 7
            return outs, ins
        return _strategies(x, op, "x", layout)
    return rule


def _backward_rule(dy, dextra, inp, mean, rstd, weight, kind, weight_offset, residual_scale, add_after_norm,
                   x_dtype, residual_dtype, bias_dtype, *modes):
    from torch.distributed.tensor import Partial, Replicate
    op = "add_norm_bwd"
    dy1, weight1, bias1_dtype, x1_dtype, rowscale, dropout_p, seed, gate, _, _, _, bias = (
        *modes, *(None, None, None, None, None, 0.0, None, None, "before", "silu", None, None)[len(modes):])

    def layout(act, stats):
        grad = Partial() if act != Replicate() else Replicate()
        has_y1 = dy1 is not None
        outs = [act, act if residual_dtype is not None else Replicate(),
                grad if weight is not None else Replicate(), grad if bias_dtype is not None else Replicate(),
                act if x1_dtype is not None else Replicate(),
                grad if has_y1 and weight1 is not None else Replicate(),
                grad if has_y1 and bias1_dtype is not None else Replicate(),
                act if gate is not None else Replicate()]
        ins = [act, None if dextra is None else act, act, stats if kind == "layer_norm" else Replicate(), stats,
               None if weight is None else Replicate()] + [None] * 7
        ins += [None if dy1 is None else act, None if weight1 is None else Replicate(), None, None,
                None if rowscale is None else act, None, None if seed is None else Replicate(),
                None if gate is None else act, None, None, None,
                None if bias is None else Replicate()][:len(modes)]
        return outs, ins
    # offered only the input's own sharding: the statistics hold exactly its rows
    return _strategies(inp, op, "the saved norm input", layout)


def register() -> bool:
    """Register the DTensor sharding rules of torch.ops.normfuse.*; False when this build has
    no DTensor. Idempotent."""
    if _REGISTERED:
        return _REGISTERED[0]
    api = _dtensor_api()
    if api is None:
        _REGISTERED.append(False)
        return False
    register_sharding = api[-1]
    import normfuse.kernels.add_norm  # noqa: F401 - defines the ops
    ops = torch.ops.normfuse
    register_sharding(ops.add_norm_fwd.default)(_forward_rule("add_norm_fwd"))
    register_sharding(ops.add_norm_quant_fwd.default)(_forward_rule("add_norm_quant_fwd"))
    register_sharding(ops.norm_add_fwd.default)(_forward_rule("norm_add_fwd"))
    register_sharding(ops.add_norm_bwd.default)(_backward_rule)
    _REGISTERED.append(True)
    return True


def is_dtensor(value: Any) -> bool:
    """Whether ``value`` is a DTensor (without importing DTensor when nothing has)."""
    if "torch.distributed.tensor" not in sys.modules:
        return False
    api = _dtensor_api()
    return api is not None and isinstance(value, api[0])


def refusal(values: list[Any]) -> str | None:
    """Why a site whose tensors are ``values`` (example values of its graph nodes) cannot run
    a fused op on DTensors; None when it can (registering the rules then)."""
    if "torch.distributed.tensor" not in sys.modules:  # no DTensor can exist yet: skip the import
        return None
    api = _dtensor_api()
    if api is None:
        return None
    dtensor = api[0]
    dvalues = [v for v in values if isinstance(v, dtensor)]
    if not dvalues:
        return None
    for v in dvalues:
        try:
            _row_dims(v._spec, "add_norm", "an input")
        except ShardedNormDimError:
            return (f"a DTensor input is sharded on the normalized (last) dim ({list(v.placements)}); the fused "
                    f"ops need whole rows on every rank")
    if not register():
        return "DTensor sharding rules are unavailable in this build"
    return None
