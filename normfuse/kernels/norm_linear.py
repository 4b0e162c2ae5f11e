"""The linears that read a fused norm's output, with that output recomputed in backward.

A fused site ``y = norm(s)`` followed by linears that read ``y`` (q/k/v, gate/up, a
classifier head) keeps ``y`` alive for the linears' weight gradients, beside the sum
``s`` the norm's own backward keeps. ``norm_linears`` runs those linears on ``y`` and
saves only ``s`` (the tensor the norm already saves: no new memory) and the weights; in
backward it recomputes ``y`` from ``s`` with the site's own fused op, bit for bit what
the forward produced, and returns::

    out_i = linear(y, W_i, b_i)                       # forward, exactly as the graph did
    dW_i  = dout_i^T @ y,  db_i = sum_rows(dout_i)    # y recomputed: norm(s)
    dy    = sum_i dout_i @ W_i                        # flows into the site's own backward

The norm's statistics are recomputed with ``y`` (one row reduction), so nothing but
``s`` is kept. The site's fused op is not changed: its forward and backward, its Triton
kernels and the checker's proof of it stay as they are.

    norm_linears(y, inp, norm_weight, norm_bias, weights, biases, *, kind, eps,
                 weight_offset=0.0, sum_dtype, norm_round_dtype=None, out_dtype)  -> [out_i]

``inp`` is the site's norm input (the sum ``s``; ``x`` for a norm with no add);
``y = norm(inp)`` with the site's modes (see ``normfuse.kernels.reference``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from normfuse.errors import InvalidOptionError, ShapeMismatchError, UnsupportedDtypeError
from normfuse.kernels.add_norm import _one_call_when_fx_traced
from normfuse.kernels import reference
from normfuse.kernels.library import implement, implement_autograd, implement_fake, on_call
from normfuse.kernels.ops import _eager_cpu, _grad_needed, check_shapes, validate
from normfuse.kernels.reference import SUPPORTED_DTYPES
from normfuse.kernels.specs import NormLinearsCall

__all__ = ["norm_linears"]


# --------------------------------------------------------------------------------------
# The math of the backward (shared by the custom op and the eager path)
# --------------------------------------------------------------------------------------

def _recompute_y(inp, norm_weight, norm_bias, modes: dict, y_shape, eager_cpu: bool) -> Tensor:
    """y = norm(inp), by the site's own forward (the reference on eager CPU tensors)."""
    forward = _REFERENCE_ADD_NORM if eager_cpu else torch.ops.normfuse.add_norm_fwd
    y = forward(inp, None, norm_weight, norm_bias, modes["kind"], modes["eps"], modes["weight_offset"], 1.0,
                modes["sum_dtype"], modes["norm_round_dtype"], modes["out_dtype"], False)[0]
    return y.reshape(y_shape)


_REFERENCE_ADD_NORM = on_call("add_norm_fwd", reference.add_norm_fwd)  # with the op's flat arguments


def _linears_backward(grads, y, weights, has_bias):
    """(dy, [dW_i], [db_i]) of out_i = linear(y, W_i, b_i); None grads (unused outputs) skipped."""
    rows = y.reshape(-1, y.shape[-1])  # (R, N)
    dy, dws, dbs = None, [], []
    # eager's autograd adds the linears' input grads in the order backward reaches them: last first
    for g, w in reversed(list(zip(grads, weights))):
        if g is None:
            continue
        part = g @ w  # (..., N)
        dy = part if dy is None else dy + part
    for g, w, bias in zip(grads, weights, has_bias):
        if g is None:
            dws.append(None)
            dbs.append(None)
            continue
        g2 = g.reshape(-1, g.shape[-1])  # (R, out_i)
        dws.append((g2.t() @ rows).to(w.dtype))
        dbs.append(g2.sum(0) if bias else None)
    if dy is None:
        dy = torch.zeros_like(y)
    return dy, dws, dbs


def _setup(ctx, y, inp, norm_weight, norm_bias, weights, biases, modes):
    ctx.save_for_backward(inp, norm_weight, norm_bias, *weights)
    ctx.modes = modes
    ctx.y_shape = tuple(y.shape)
    ctx.has_bias = [b is not None for b in biases]
    ctx.eager_cpu = False


def _backward(ctx, grads):
    inp, norm_weight, norm_bias, *weights = ctx.saved_tensors  # read once (non-reentrant checkpointing)
    y = _recompute_y(inp, norm_weight, norm_bias, ctx.modes, ctx.y_shape, ctx.eager_cpu)
    return _linears_backward(grads, y, weights, ctx.has_bias)


# --------------------------------------------------------------------------------------
# The custom op (traced calls, CUDA, the Triton interpreter)
# --------------------------------------------------------------------------------------

def _linear_out_shape(y: Tensor, w: Tensor) -> tuple:
    return (*y.shape[:-1], w.shape[0])


@implement("norm_linears")
def norm_linears_op(call: NormLinearsCall) -> list[Tensor]:
    """out_i = linear(y, W_i, b_i); y is recomputed from inp in backward, not saved. ``biases``
    holds the biases that exist, ``has_bias`` which linears have one (an optional list entry
    would get no gradient)."""
    linears = call.linears
    return [F.linear(call.y, w, b) for w, b in zip(linears.weights, _spread(linears.biases, linears.has_bias))]


def _spread(present, has_bias) -> list:
    """The per-linear biases (None where a linear has none) from the list of those that exist."""
    it = iter(present)
    return [next(it) if exists else None for exists in has_bias]


@implement_fake("norm_linears")
def _norm_linears_fake(call: NormLinearsCall):
    y, linears = call.y, call.linears
    _check_linears(y, call.inp, linears.weights, _spread(linears.biases, linears.has_bias))
    return [y.new_empty(_linear_out_shape(y, w), dtype=torch.result_type(y, w)) for w in linears.weights]


def _op_setup_context(ctx, call: NormLinearsCall, output):
    norm, rounding, linears = call.norm, call.rounding, call.linears
    _setup(ctx, call.y, call.inp, norm.weight, norm.bias, linears.weights, _spread(linears.biases, linears.has_bias),
           dict(kind=norm.kind, eps=norm.eps, weight_offset=norm.weight_offset, sum_dtype=rounding.sum_dtype,
                norm_round_dtype=rounding.norm_round_dtype, out_dtype=rounding.out_dtype))


def _op_backward(ctx, grads):
    dy, dws, dbs = _backward(ctx, grads)
    dbs = [db for db, exists in zip(dbs, ctx.has_bias) if exists]
    return dy, None, None, None, dws, dbs, None, None, None, None, None, None, None


implement_autograd("norm_linears", _op_backward, setup_context=_op_setup_context)


# --------------------------------------------------------------------------------------
# The eager CPU path (no dispatcher cost; autograd.Function takes tensors, not lists)
# --------------------------------------------------------------------------------------

class _EagerNormLinears(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, inp, norm_weight, norm_bias, modes, has_bias, *params):
        # params: the weights, then the biases that exist (has_bias says which)
        weights, biases = list(params[:len(has_bias)]), _spread(params[len(has_bias):], has_bias)
        _setup(ctx, y, inp, norm_weight, norm_bias, weights, biases, modes)
        ctx.eager_cpu = True
        return tuple(F.linear(y, w, b) for w, b in zip(weights, biases))

    @staticmethod
    def backward(ctx, *grads):
        dy, dws, dbs = _backward(ctx, grads)
        return (dy, None, None, None, None, None, *dws, *(db for db, exists in zip(dbs, ctx.has_bias) if exists))


# --------------------------------------------------------------------------------------
# The functional API
# --------------------------------------------------------------------------------------

def _check_linears(y, inp, weights, biases):
    if not isinstance(y, Tensor) or not isinstance(inp, Tensor):
        raise ShapeMismatchError("norm_linears takes the norm output y and the norm input as tensors.")
    if math.prod(y.shape) != math.prod(inp.shape) or y.shape[-1] != inp.shape[-1]:
        raise ShapeMismatchError(f"y has shape {tuple(y.shape)} but the norm input has shape {tuple(inp.shape)}; "
                                 "y must be the norm of that input (same rows, same last dim).")
    if len(weights) == 0 or len(weights) != len(biases):
        raise InvalidOptionError(f"norm_linears needs one bias (or None) per weight and at least one linear; got "
                                 f"{len(weights)} weights and {len(biases)} biases.")
    for i, (w, b) in enumerate(zip(weights, biases)):
        if w.dim() != 2 or w.shape[1] != y.shape[-1]:
            raise ShapeMismatchError(f"weights[{i}] has shape {tuple(w.shape)}; a linear reading y of last dim "
                                     f"{y.shape[-1]} needs a weight of shape (out_features, {y.shape[-1]}).")
        if b is not None and tuple(b.shape) != (w.shape[0],):
            raise ShapeMismatchError(f"biases[{i}] has shape {tuple(b.shape)}; it must have shape "
                                     f"({w.shape[0]},), the out_features of weights[{i}].")


@_one_call_when_fx_traced
def norm_linears(y, inp, norm_weight, norm_bias, weights, biases, *, kind, eps, weight_offset=0.0, sum_dtype,
                 norm_round_dtype=None, out_dtype):
    """[linear(y, W_i, b_i)] with y = norm(inp) recomputed in backward instead of saved."""
    weights, biases = list(weights), list(biases)
    _check_linears(y, inp, weights, biases)
    # the norm's parameters may be in any dtype the site's fused op took (e.g. bf16 beside an
    # fp32 sum when the stream is widened): their shapes and dtypes are checked, not their pairing
    validate(inp, None, None, None, kind, eps,
             {"sum_dtype": sum_dtype, "norm_round_dtype": norm_round_dtype, "out_dtype": out_dtype})
    check_shapes(inp, None, norm_weight, norm_bias)
    for name, p in (("norm_weight", norm_weight), ("norm_bias", norm_bias)):
        if p is not None and p.dtype not in SUPPORTED_DTYPES + (inp.dtype,):
            raise UnsupportedDtypeError(f"{name} has dtype {p.dtype}; the fused ops take {SUPPORTED_DTYPES}.")
    params = (*weights, *(b for b in biases if b is not None))
    if not _grad_needed(y, *params):
        return [F.linear(y, w, b) for w, b in zip(weights, biases)]  # nothing to save, nothing to recompute
    has_bias = [b is not None for b in biases]
    if _eager_cpu(y, inp, norm_weight, norm_bias, *params):
        modes = dict(kind=kind, eps=float(eps), weight_offset=float(weight_offset), sum_dtype=sum_dtype,
                     norm_round_dtype=norm_round_dtype, out_dtype=out_dtype)
        return list(_EagerNormLinears.apply(y, inp, norm_weight, norm_bias, modes, tuple(has_bias), *params))
    return list(norm_linears_op(y, inp, norm_weight, norm_bias, weights, [b for b in biases if b is not None],
                                has_bias, kind, float(eps), float(weight_offset), sum_dtype, norm_round_dtype,
                                out_dtype))
