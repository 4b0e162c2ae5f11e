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

from normfuse.kernels.declarations import DECLARATIONS
from normfuse.kernels.specs import OP_OUTPUTS, bind, stores_mean

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


# How each op argument is placed, by name (declarations.py names them): "act" takes the activation's
# placement (a row shard of x is the same rows of it: rowscale is x.shape[:-1]), "rep" is replicated,
# "stats" takes the statistics' (their rows), "stats_ln" only where the norm stores a first statistic
# (specs.stores_mean: empty for rms_norm); any other argument is not a tensor. A modulation's scale and shift and a branch's gate
# (one value per sample, or per token) are replicated, and then only the replicated strategy is offered.
_ARG_PLACEMENTS = {
    "x": "act", "residual": "act", "x1": "act", "rowscale": "act", "gate": "act",
    "dy": "act", "dextra": "act", "inp": "act", "dy1": "act",
    "weight": "rep", "bias": "rep", "weight1": "rep", "bias1": "rep", "seed": "rep", "quant_scale": "rep",
    "mod_scale": "rep", "mod_shift": "rep", "x_gate": "rep", "mod1_scale": "rep", "mod1_shift": "rep",
    "mean": "stats_ln", "rstd": "stats",
}


def _place(kind: str, act, stats, has_mean: bool, value):
    from torch.distributed.tensor import Replicate
    if value is None or kind is None:
        return None
    if kind == "act":
        return act
    if kind == "stats" or (kind == "stats_ln" and has_mean):
        return stats
    return Replicate()


def _inputs(op: str, args: tuple, act, stats, has_mean: bool) -> list:
    """The placement of each argument passed (trailing ones may be omitted)."""
    names = DECLARATIONS[op].arg_names[:len(args)]
    return [_place(_ARG_PLACEMENTS.get(name), act, stats, has_mean, value) for name, value in zip(names, args)]


def _strategies_of(a: dict, op: str, layout) -> list:
    """The strategies of an op call with named arguments ``a``: rows of its activation's shards."""
    modulated = any(a.get(name) is not None for name in ("mod_scale", "mod_shift", "x_gate", "mod1_scale", "mod1_shift"))
    for name in ("residual", "x1", "gate"):  # x's shape: its last dim is the normalized one
        if a.get(name) is not None:
            _row_dims(a[name], op, name)
    first = "inp" if op == "add_norm_bwd" else "x"
    strategies = _strategies(a[first], op, "the saved norm input" if first == "inp" else "x", layout)
    return strategies[:1] if modulated else strategies


def _forward_rule(op: str):
    """Sharding function of add_norm_fwd / add_norm_quant_fwd / norm_add_fwd: each input placed by its
    name (_ARG_PLACEMENTS), each output by what it is."""
    def rule(*args):
        from torch.distributed.tensor import Replicate
        a = bind(op, args)
        has_mean = stores_mean(a["kind"])
        has_sum = (a["residual"] is not None or a.get("x1") is not None or a.get("rowscale") is not None
                   or a.get("dropout_p", 0.0) > 0)
        store_extra = bool(a.get("store_sum", a.get("store_norm"))) and (has_sum or op == "norm_add_fwd")

        def layout(act, stats):
            placed = {"y": act, "s": act if store_extra else Replicate(), "out": act,
                      "mean": stats if has_mean else Replicate(), "rstd": stats,
                      "y1": act if a.get("weight1") is not None or a.get("mod1_scale") is not None
                      or a.get("mod1_shift") is not None else Replicate(), "q": act,
                      # a static scale is replicated (the scale output then empty)
                      "scale": Replicate() if a.get("quant_scale") is not None else act}
            if op == "norm_add_fwd":
                placed["y"] = act if store_extra else Replicate()
            outs = [placed[name] for name in OP_OUTPUTS[op]]
            return outs, _inputs(op, args, act, stats, has_mean)
        return _strategies_of(a, op, layout)
    return rule


def _backward_rule(*args):
    from torch.distributed.tensor import Partial, Replicate
    op = "add_norm_bwd"
    a = bind(op, args)
    has_mean = stores_mean(a["kind"])

    def layout(act, stats):
        grad = Partial() if act != Replicate() else Replicate()
        has_y1 = a["dy1"] is not None

        def when(exists, placement):
            return placement if exists else Replicate()
        placed = {"dx": act, "dresidual": when(a["residual_dtype"] is not None, act),
                  "dweight": when(a["weight"] is not None, grad), "dbias": when(a["bias_dtype"] is not None, grad),
                  "dx1": when(a["x1_dtype"] is not None, act),
                  "dweight1": when(has_y1 and a["weight1"] is not None, grad),
                  "dbias1": when(has_y1 and a["bias1_dtype"] is not None, grad),
                  "dgate": when(a["gate"] is not None, act),
                  "dmod_scale": when(a["mod_scale"] is not None, grad),
                  "dmod_shift": when(a["mod_shift"] is not None, grad),
                  "dx_gate": when(a["x_gate"] is not None, grad),
                  "dmod1_scale": when(a.get("mod1_scale") is not None, grad),
                  "dmod1_shift": when(a.get("mod1_shift") is not None, grad)}
        return [placed[name] for name in OP_OUTPUTS[op]], _inputs(op, args, act, stats, has_mean)
    # offered only the input's own sharding: the statistics hold exactly its rows
    return _strategies_of(a, op, layout)


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
