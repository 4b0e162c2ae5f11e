"""The ``torch.ops.normfuse.*`` custom ops: routing, registrations, autograd, and the eager CPU path.

Which path a call runs (decided here, in ``forward_for`` and ``_backend``, nowhere else):

| call                                   | tensors                                    | runs                   |
|----------------------------------------|--------------------------------------------|------------------------|
| functional API, eager (not traced)     | plain CPU tensors, NORMFUSE_TRITON_CPU off | reference, directly    |
| the custom op (traced calls: dynamo,   | CUDA/ROCm; CPU with NORMFUSE_TRITON_CPU=1  | Triton (``triton.py``) |
| AOT, export; subclasses; direct calls) | anything else (CPU, fp64, no triton)       | reference              |
|                                        | norm_group not a power of two (any device) | reference              |

(The Triton kernels take a group of the statistics as a power-of-two reshape of the row block.)

The first row exists for speed: the custom-op dispatcher's Python wrapper costs
~100 us a call (as much as a whole small norm on CPU), and custom ops may not
return aliases of their inputs, which costs copies. It runs the same reference
forward and backward as the op's CPU branch, through autograd.Functions that
share the op's setup_context and backward. Traced calls keep the custom ops, so
graphs still show ``torch.ops.normfuse.*``.

The Triton path is a plain ``torch.library.custom_op`` whose body launches the
kernels, not ``torch.library.triton_op`` + ``wrap_triton``, for two reasons:
* the body must pick the reference or Triton at run time (CPU tensors run the
  reference), and a triton_op's body is traced into the graph in place of the op,
  which would put the reference's ATen ops, not one fused call, in the graphs the
  pass and the checker read;
* under Triton's interpreter (all CPU testing) a triton_op cannot be compiled at
  all: its fake is derived by running the body on FakeTensors, and the interpreted
  kernel then reads their data pointers ("Cannot access data pointer of Tensor").
  Measured with torch 2.13 / triton 3.8 on a 4-block add+RMSNorm model, fullgraph:
  custom_op 1 graph, 0 breaks (aot_eager 9.5 s, inductor 35 s compile + first run);
  triton_op fails at the first call.
What triton_op would buy on a GPU (Inductor seeing the kernel) is unmeasured here.

Validation runs once, in the functional API (``validate``); the fakes check shapes only.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from normfuse.errors import InvalidOptionError, ShapeMismatchError, UnsupportedDtypeError, closest
from normfuse.kernels import reference
from normfuse.kernels.library import implement, implement_autograd, implement_fake, on_call
from normfuse.kernels.specs import GRADIENT_OF, OP_OUTPUTS, SUPPORTED_TEXT as _SUPPORTED_TEXT, call_of, op_gradients
from normfuse.kernels.specs import (AddNormCall, BackwardCall, DropoutMask, KeepMaskCall, Norm, NormAddCall, Rows,
                                    Store)
from normfuse.kernels.specs import check_operand, dtypes_on as _dtypes_on, stores_mean
from normfuse.kernels import triton as triton_backend
from normfuse.kernels.reference import KINDS, acc_dtype, channel_split, quant_scale_shape, sum_like

__all__ = ["add_norm_fwd", "add_norm_quant_fwd", "norm_add_fwd", "add_norm_bwd", "dropout_keep_mask", "validate",
           "validate_modes", "validate_norm_group", "forward_for"]


# --------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------

def residual_period(residual: Tensor, x: Tensor) -> Optional[int]:
    """How many rows of x the residual's rows repeat over when it broadcasts over x's leading dims
    only (learned positions: a (S, C) or (1, S, C) table added to (B, S, C)); x's row count for a
    residual of x's shape; None for any other shape."""
    if residual.shape == x.shape:
        return math.prod(x.shape[:-1])
    if residual.dim() > x.dim() or residual.dim() == 0:
        return None
    r = (1,) * (x.dim() - residual.dim()) + tuple(residual.shape)
    k = next((i for i, d in enumerate(r) if d != 1), len(r) - 1)
    if tuple(r[k:]) != tuple(x.shape[k:]):
        return None
    return math.prod(r[k:-1])


def check_shapes(x, residual, weight, bias, x1=None, rowscale=None, weight1=None, bias1=None):
    """The shape checks (all a fake can check): raise a ShapeMismatchError naming the fix."""
    if not isinstance(x, Tensor) or x.dim() == 0:
        raise ShapeMismatchError(f"x must be a tensor with at least one dim (the normalized last dim); "
                                 f"got {type(x).__name__} of shape {tuple(getattr(x, 'shape', ()))}.")
    n_cols = x.shape[-1]
    if n_cols == 0:
        raise ShapeMismatchError(f"x has shape {tuple(x.shape)}: its last dim, the one normalized, is empty; "
                                 f"pass at least one element per row.")
    if residual is not None and isinstance(residual, Tensor) and residual_period(residual, x) is None:
        raise ShapeMismatchError(f"residual has shape {tuple(residual.shape)} but x has shape {tuple(x.shape)}; the "
                                 f"fused add broadcasts the residual over x's leading dims only (a (S, C) or "
                                 f"(1, S, C) table added to (B, S, C)), so expand or reshape it to "
                                 f"{tuple(x.shape)} first.")
    if x1 is not None and x1.shape != x.shape:
        raise ShapeMismatchError(f"x1 has shape {tuple(x1.shape)} but x has shape {tuple(x.shape)}; the "
                                 f"fused add does not broadcast, so expand or reshape x1 to {tuple(x.shape)} first.")
    if rowscale is not None and rowscale.shape != x.shape[:-1]:
        raise ShapeMismatchError(f"rowscale has shape {tuple(rowscale.shape)} but x has shape {tuple(x.shape)}; it "
                                 f"scales each row of x, so it must have shape {tuple(x.shape[:-1])} (x.shape[:-1]).")
    for name, p in (("weight", weight), ("bias", bias), ("weight1", weight1), ("bias1", bias1)):
        if p is not None and p.shape != (n_cols,):
            raise ShapeMismatchError(f"{name} has shape {tuple(p.shape)} but x has shape {tuple(x.shape)}; the "
                                     f"norm is over the last dim, so {name} must have shape ({n_cols},).")


def check_modulation_shapes(x: Tensor, modulation) -> None:
    """scale and shift broadcast to x's shape without changing it (one value per sample, token or column)."""
    check_broadcast("modulation scale", modulation.scale, x)
    check_broadcast("modulation shift", modulation.shift, x)
    check_broadcast("second modulation's scale", getattr(modulation, "scale1", None), x)
    check_broadcast("second modulation's shift", getattr(modulation, "shift1", None), x)


def check_broadcast(name: str, t: Optional[Tensor], x: Tensor) -> None:
    """t (when given) broadcasts to x's shape without changing it."""
    if t is None:
        return
    try:
        fits = torch.broadcast_shapes(t.shape, x.shape) == x.shape and t.dim() <= x.dim()
    except RuntimeError:
        fits = False
    if not fits:
        raise ShapeMismatchError(f"the {name} has shape {tuple(t.shape)} but x has shape {tuple(x.shape)}; it "
                                 f"must broadcast to x's shape, e.g. ({x.shape[0]}, 1, {x.shape[-1]}) for one "
                                 f"value per sample and column (v[:, None]), or x's shape for one per token.")


def validate(x, residual, weight, bias, kind, eps, rounding: dict):
    """Raise a normfuse error naming the problem and the fix; the ops never assert.
    Runs on every functional call: the cheap checks first, message text only on error."""
    if kind not in KINDS:
        raise InvalidOptionError(f"kind={kind!r} is not a norm the fused ops implement; use one of {KINDS}."
                                 + closest(str(kind), KINDS))
    if not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps < 0:
        raise InvalidOptionError(f"eps={eps!r} must be a finite number >= 0 (e.g. 1e-5 or 1e-6).")
    check_shapes(x, residual, weight, bias)
    ok = _dtypes_on(x.device)
    for name, t in (("x", x), ("residual", residual)):
        if t is not None and t.dtype not in ok:
            raise UnsupportedDtypeError(f"{name} has dtype {t.dtype} on {t.device}; the fused add+norm ops take "
                                        f"{_SUPPORTED_TEXT}. Cast it first, e.g. {name}.to(torch.bfloat16).")
    # Parameters of any dtype the ops take, whatever the activations' (fp16 weight with bf16
    # activations, bf16 with fp32): w' and b are used in fp32.
    for name, p in (("weight", weight), ("bias", bias)):
        if p is not None and p.dtype not in ok:
            raise UnsupportedDtypeError(f"{name} has dtype {p.dtype}; the fused add+norm ops take parameters in "
                                        f"{_SUPPORTED_TEXT}. Cast it with {name}.to(torch.float32).")
    for name, t in (("residual", residual), ("weight", weight), ("bias", bias)):
        if t is not None and t.device != x.device:
            raise InvalidOptionError(f"{name} is on {t.device} but x is on {x.device}; move them to one device.")
    for name, dtype in rounding.items():
        if dtype is not None and dtype not in ok:
            raise UnsupportedDtypeError(f"{name}={dtype} is not a dtype the fused ops round to; use one of "
                                        f"{_SUPPORTED_TEXT}.")


def validate_modes(x, x1, rowscale, weight1, bias1) -> None:
    """The checks of add_norm's tensor modes (x1, rowscale, weight1/bias1); shapes are checked by
    check_shapes. The grouped options check themselves (normfuse.kernels.specs)."""
    if x1 is None and rowscale is None and weight1 is None and bias1 is None:
        return  # no mode: the common call pays nothing more
    for name, t in (("x1", x1), ("rowscale", rowscale), ("weight1", weight1), ("bias1", bias1)):
        if t is not None:
            check_operand(name, t, x)
    if bias1 is not None and weight1 is None:
        raise InvalidOptionError("bias1 needs weight1: the second norm output y1 exists only with its own weight; "
                                 "pass weight1 (torch.ones(N) for none) with bias1.")
    if rowscale is not None and _grad_needed(rowscale):
        raise InvalidOptionError("rowscale requires grad, but the fused ops do not differentiate it (it is a "
                                 "per-row mask/scale, as in stochastic depth); pass rowscale.detach().")
    check_shapes(x, None, None, None, x1, rowscale, weight1, bias1)


def validate_norm_group(x, norm_group) -> None:
    """norm_group: statistics per group of that many columns."""
    if isinstance(norm_group, bool) or not isinstance(norm_group, int) or norm_group <= 0 \
            or x.shape[-1] % norm_group:
        raise ShapeMismatchError(f"norm_group={norm_group!r} must be a positive number of columns that divides "
                                 f"the normalized dim N={x.shape[-1]} (statistics per group of that many "
                                 f"columns), or None for statistics over the whole row.")


# --------------------------------------------------------------------------------------
# Routing (the table in the module docstring)
# --------------------------------------------------------------------------------------

def _backend(x: Tensor, dtypes, norm_group: Optional[int] = None):
    """The backend module (``reference`` or ``triton``) the custom op runs for these tensors."""
    if x.device.type == "cpu" and not triton_backend.cpu_requested():
        backend = reference
    elif norm_group and norm_group & (norm_group - 1):
        backend = reference
    elif x.device.type not in ("cpu", "cuda"):  # ROCm devices are "cuda" in torch too
        backend = reference
    elif triton_backend.triton is None or any(d is not None and d not in triton_backend.TL_DTYPES for d in dtypes):
        backend = reference  # fp64 (CPU only) or a platform without triton
    else:
        if x.device.type == "cpu" and not triton_backend.INTERPRETED:
            raise InvalidOptionError(
                "NORMFUSE_TRITON_CPU=1 runs the Triton kernels on CPU under Triton's interpreter, which has to "
                "be on when the kernels are defined: set NORMFUSE_TRITON_CPU=1 (or TRITON_INTERPRET=1) before "
                "normfuse.kernels and triton are first imported.")
        return triton_backend
    # A direct call of the op skips the functional API's checks: no backend takes other dtypes.
    ok = _dtypes_on(x.device)
    bad = next((d for d in dtypes if d is not None and d not in ok), None)
    if bad is not None:
        raise UnsupportedDtypeError(f"the fused add+norm ops got a {bad} tensor or dtype on {x.device}; they take "
                                    f"{_SUPPORTED_TEXT}.")
    return backend


def _dtypes(*items) -> tuple:
    return tuple(t.dtype if isinstance(t, Tensor) else t for t in items if t is not None)


def _eager_cpu(*tensors) -> bool:
    """The first row of the table: real CPU tensors, outside tracing, on the reference backend."""
    if torch.compiler.is_compiling() or triton_backend.cpu_requested():
        return False
    return all(t is None or (type(t) in (Tensor, torch.nn.Parameter) and t.device.type == "cpu") for t in tensors)


def _grad_needed(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def forward_for(op: str, x, residual, weight, bias, *more):
    """The callable a functional call of ``op`` ("add_norm_fwd", "add_norm_quant_fwd" or
    "norm_add_fwd") runs, with the op's positional arguments and outputs (None, not an empty tensor,
    for an output that does not exist on the eager path). ``more``: the other tensor arguments
    (add_norm's modes, a static quantization scale)."""
    if _eager_cpu(x, residual, weight, bias, *more):
        if _grad_needed(x, residual, weight, bias, *more):
            return _EAGER_FUNCTIONS[op].apply
        return _REFERENCE_ON_FLAT[op]  # no autograd graph to record: the reference alone
    return getattr(torch.ops.normfuse, op)


# --------------------------------------------------------------------------------------
# Custom ops: forward, backward, fakes
# --------------------------------------------------------------------------------------

def _empty(like: Tensor, dtype: torch.dtype) -> Tensor:
    """Stands in for an output that does not exist (s not stored, mean of rms_norm, ...)."""
    return like.new_empty(0, dtype=dtype)


def _op_outputs(outputs, empty_dtypes, like: Tensor, inputs, sum_index: Optional[int] = None,
                sum_layout: Optional[Tensor] = None) -> tuple:
    """What a custom op may return: an empty tensor of the fake's dtype for each None, and no
    output that is an input or another output (e.g. dx is also dresidual when residual_scale
    == 1 and the dtypes agree): such outputs are cloned; all are made contiguous, but the sum
    (output ``sum_index``), which takes ``sum_layout``'s layout when that is channels-first
    (``reference.sum_like``)."""
    seen = {t.data_ptr() for t in inputs if isinstance(t, Tensor) and t.numel()}
    fresh = []
    for i, t in enumerate(outputs):
        dtype = empty_dtypes[i]
        if t is None:
            t = _empty(like, dtype)
        elif i == sum_index and channel_split(sum_layout) is not None:
            if t.stride() != sum_like(sum_layout, t.dtype).stride() or t.data_ptr() in seen:
                t = sum_like(sum_layout, t.dtype).copy_(t)
            seen.add(t.data_ptr())
            fresh.append(t)
            continue
        elif t.numel() == 0 or t.data_ptr() in seen:  # empty tensors can share a storage unseen
            t = t.clone(memory_format=torch.contiguous_format)
        seen.add(t.data_ptr())
        fresh.append(t.contiguous())
    return tuple(fresh)


def _stats_fake(x: Tensor, kind: str, norm_in_dtype: torch.dtype, norm_group: Optional[int] = None):
    acc = acc_dtype(norm_in_dtype)
    rows = math.prod(x.shape[:-1]) * (x.shape[-1] // norm_group if norm_group else 1)
    return x.new_empty((rows,) if stores_mean(kind) else (0,), dtype=acc), x.new_empty((rows,), dtype=acc)


def _call_tensors(call: AddNormCall) -> tuple:
    """The tensors an add_norm call reads (the outputs must not alias them)."""
    rows, norm, second, gate, quant, mod = call.rows, call.norm, call.second, call.gate, call.quant, call.modulation
    return (rows.x, rows.residual, norm.weight, norm.bias, rows.x1, rows.rowscale, rows.x_gate,
            *((second.weight, second.bias) if second else ()), *((gate.z,) if gate else ()),
            *((quant.scale,) if quant else ()), *(mod.operands if mod else ()))


def _add_norm_backend(call: AddNormCall):
    """The backend add_norm_fwd runs (and whose dropout mask its backward regenerates)."""
    rounding, gate, mod = call.rounding, call.gate, call.modulation
    dtypes = _dtypes(*_call_tensors(call), rounding.sum_dtype, rounding.norm_round_dtype, rounding.out_dtype,
                     None if gate is None else gate.out_dtype, *((mod.dtype, mod.out_dtype) if mod else ()))
    return _backend(call.rows.x, dtypes, call.norm.group)


def _check_seed(dropout: Optional[DropoutMask]) -> None:
    """A direct call of the op skips the functional API, which draws the seed."""
    if dropout is not None and dropout.seed is None:
        raise InvalidOptionError(f"add_norm_fwd got dropout_p={dropout.p} without a seed; pass seed as an int64 CPU "
                                 f"tensor of shape () (normfuse.add_norm draws one when it is not given).")


def _with_stored_sum(call: AddNormCall) -> AddNormCall:
    """The call with store.sum False when there is no sum to store (a plain norm)."""
    if call.store.sum and not reference.call_has_sum(call):
        call.store = Store(sum=False, y=call.store.y)
    return call


def _sum_layout(call: AddNormCall) -> Tensor:
    """The tensor whose layout the sum takes: the residual's (the stream's), x's when it broadcasts."""
    residual = call.rows.residual
    return call.rows.x if residual is None or residual.shape != call.rows.x.shape else residual


@implement("add_norm_fwd")
def add_norm_fwd(call: AddNormCall):
    """Add-then-norm. Returns (y, s, mean, rstd, y1): s is empty unless store_sum and there is a sum
    (a residual or a mode); mean (empty for rms_norm) and rstd are flat per-row fp32 (fp64 for fp64
    input); y1 (empty without weight1 or a second modulation) is the second norm output, in out_dtype, or y
    modulated a second time (mod1_scale, mod1_shift).
    round_sum_first=False normalizes the sum before its rounding to sum_dtype. The modes x1,
    rowscale, weight1/bias1, dropout_p/seed are those of reference.py; seed (an int64 CPU tensor
    of shape ()) is read once when dropout_p > 0. gate, gate_position, gate_activation, norm_group
    and gate_out_dtype (y's dtype with a gate "after") too; with norm_group, mean and rstd hold one
    value per row and group. The arguments are declared in declarations.py."""
    _check_seed(call.dropout)
    outputs = _add_norm_backend(call).add_norm_fwd(_with_stored_sum(call))
    return _op_outputs(outputs, (None, call.rounding.sum_dtype, None, None, call.rounding.out_dtype), call.rows.x,
                       _call_tensors(call), sum_index=1, sum_layout=_sum_layout(call))


@implement_fake("add_norm_fwd")
def _add_norm_fwd_fake(call: AddNormCall):
    rows, norm, rounding, second = call.rows, call.norm, call.rounding, call.second
    x = rows.x
    check_shapes(x, rows.residual, norm.weight, norm.bias, rows.x1, rows.rowscale,
                 *((second.weight, second.bias) if second else ()))
    if call.modulation is not None:
        check_modulation_shapes(x, call.modulation)
    check_broadcast("x_gate", rows.x_gate, x)
    _check_seed(call.dropout)
    sum_dtype, out_dtype = rounding.sum_dtype, rounding.out_dtype
    stored = call.store.sum and reference.call_has_sum(call)
    s = sum_like(_sum_layout(call), sum_dtype) if stored else _empty(x, sum_dtype)
    y1 = _empty(x, out_dtype)
    if second is not None:
        y1 = x.new_empty(x.shape, dtype=out_dtype)
    elif call.modulation is not None and call.modulation.twice:
        y1 = x.new_empty(x.shape, dtype=y_dtype_of(call))
    mean, rstd = _stats_fake(x, norm.kind, sum_dtype, norm.group)
    return (x.new_empty(x.shape, dtype=y_dtype_of(call)), s, mean, rstd, y1)


def y_dtype_of(call: AddNormCall) -> torch.dtype:
    """y's dtype: the gate's out_dtype after a gate "after" (out_dtype when not given), else out_dtype;
    then the modulation's out_dtype, when there is one."""
    gate, y_dtype = call.gate, call.rounding.out_dtype
    if gate is not None and gate.position == "after":
        y_dtype = gate.out_dtype or y_dtype
    if call.modulation is not None:
        y_dtype = reference.modulation_dtypes(y_dtype, call.modulation)[1]
    return y_dtype


@implement("add_norm_quant_fwd")
def add_norm_quant_fwd(call: AddNormCall):
    """Add-then-norm with the quantization epilogue: add_norm_fwd's arguments, then store_y and the
    quant_* options of reference.py. Returns (y, s, mean, rstd, y1, q_bits, scale) as add_norm_fwd,
    y empty unless store_y; q_bits: q's bytes as uint8 of x's shape (``q_bits.view(quant_dtype)``
    is q: fp8 outputs of an op cannot pass opcheck, whose checks sum every output, and an integer
    output is not differentiable by construction); scale: fp32, empty for a static scale, not
    differentiable."""
    _check_seed(call.dropout)
    y, s, mean, rstd, y1, q, scale = _add_norm_backend(call).add_norm_quant_fwd(_with_stored_sum(call))
    out_dtype = call.rounding.out_dtype
    return _op_outputs((y, s, mean, rstd, y1, q.view(torch.uint8), scale),
                       (out_dtype, call.rounding.sum_dtype, None, None, out_dtype, None, torch.float32), call.rows.x,
                       _call_tensors(call), sum_index=1, sum_layout=_sum_layout(call))


@implement_fake("add_norm_quant_fwd")
def _add_norm_quant_fwd_fake(call: AddNormCall):
    y, s, mean, rstd, y1 = _add_norm_fwd_fake(call)
    x, quant = call.rows.x, call.quant
    y = y if call.store.y else _empty(x, call.rounding.out_dtype)
    scale = (_empty(x, torch.float32) if quant.scale is not None
             else x.new_empty(quant_scale_shape(x.shape, quant.group), dtype=torch.float32))
    return y, s, mean, rstd, y1, x.new_empty(x.shape, dtype=torch.uint8), scale


@implement("dropout_keep_mask")
def dropout_keep_mask_op(call: KeepMaskCall) -> Tensor:
    """The keep mask (bool, x's shape) the backend running x draws for dropout_p=p and this seed;
    on_reference: the reference backend's (where the forward ran it for its dtypes)."""
    x = call.x
    backend = reference if call.on_reference else _backend(x, (x.dtype,))
    n_cols = x.shape[-1]
    return backend.dropout_keep(call.seed, x.numel() // n_cols, n_cols, call.p, x.device).view(x.shape)


@implement_fake("dropout_keep_mask")
def _dropout_keep_mask_fake(call: KeepMaskCall):
    return call.x.new_empty(call.x.shape, dtype=torch.bool)


def seed_tensor(seed) -> Tensor:
    """A seed as the ops take it: an int64 CPU tensor of shape ()."""
    return seed if isinstance(seed, Tensor) else torch.tensor(int(seed), dtype=torch.int64)


def dropout_keep_mask(x: Tensor, p: float, seed) -> Tensor:
    """The bool keep mask (x's shape; True: kept) add_norm's dropout draws for x with dropout_p=p
    and this seed (an int or an int64 CPU tensor of shape ()), from the backend the op runs for x
    (the streams of the backends differ). Multiply x by it and by 1 / (1 - p) to replay the
    dropout in plain PyTorch."""
    if _eager_cpu(x):
        return reference.dropout_keep(seed, x.numel() // x.shape[-1], x.shape[-1], p, x.device).view(x.shape)
    return torch.ops.normfuse.dropout_keep_mask(x, float(p), seed_tensor(seed))


@implement("norm_add_fwd")
def norm_add_fwd(call: NormAddCall):
    """Norm-then-add. Returns (out, y, mean, rstd): y is empty unless store_norm."""
    rows, norm, rounding = call.rows, call.norm, call.rounding
    x, inputs = rows.x, (rows.x, rows.residual, norm.weight, norm.bias)
    backend = _backend(x, _dtypes(*inputs, rounding.norm_round_dtype, rounding.out_dtype, rounding.sum_dtype))
    return _op_outputs(backend.norm_add_fwd(call), (None, rounding.out_dtype, None, None), x, inputs)


@implement_fake("norm_add_fwd")
def _norm_add_fwd_fake(call: NormAddCall):
    rows, norm, rounding = call.rows, call.norm, call.rounding
    x = rows.x
    check_shapes(x, rows.residual, norm.weight, norm.bias)
    y = x.new_empty(x.shape, dtype=rounding.out_dtype) if call.store.y else _empty(x, rounding.out_dtype)
    return (x.new_empty(x.shape, dtype=rounding.sum_dtype), y, *_stats_fake(x, norm.kind, x.dtype))


def _backward_tensors(call: BackwardCall) -> tuple:
    """The tensors a backward call reads (the gradients must not alias them)."""
    grads, saved, norm = call.grads, call.saved, call.norm
    mod, x_gate = call.modulation, call.x_gate
    return (grads.dy, grads.dextra, saved.inp, saved.mean, saved.rstd, norm.weight, grads.dy1,
            None if call.second is None else call.second.weight, call.rowscale,
            None if call.gate is None else call.gate.z, norm.bias,
            *(mod.operands if mod else ()),
            *((x_gate.gate, x_gate.x) if x_gate else ()))


@implement("add_norm_bwd")
def add_norm_bwd(call: BackwardCall):
    """Backward of add_norm_fwd (add_after_norm=False) and norm_add_fwd (add_after_norm=True); see add_norm_bwd_ref.
    Returns (dx, dresidual, dweight, dbias, dx1, dweight1, dbias1, dgate), each empty when that input
    does not exist (dweight1 and dbias1 also without dy1). With a gate, inp is the norm input before
    the gate and bias the norm's (a gate "after" multiplies n * w' + b)."""
    inp, dtypes = call.saved.inp, call.dtypes
    tensors = _backward_tensors(call)
    backend = _backend(inp, _dtypes(*tensors, dtypes.x, dtypes.residual, dtypes.bias, dtypes.bias1, dtypes.x1),
                       call.norm.group)
    return _op_outputs(backend.add_norm_bwd(call), (None, *(inp.dtype,) * 12), inp, tensors)


@implement_fake("add_norm_bwd")
def _add_norm_bwd_fake(call: BackwardCall):
    inp, dtypes, weight, second, gate = call.saved.inp, call.dtypes, call.norm.weight, call.second, call.gate
    n_cols = inp.shape[-1]

    def like(exists, shape, dtype):
        return inp.new_empty(shape, dtype=dtype) if exists else _empty(inp, inp.dtype)
    has_y1 = call.grads.dy1 is not None
    return (inp.new_empty(inp.shape, dtype=dtypes.x),
            like(dtypes.residual is not None, inp.shape, dtypes.residual),
            like(weight is not None, (n_cols,), weight.dtype if weight is not None else None),
            like(dtypes.bias is not None, (n_cols,), dtypes.bias),
            like(dtypes.x1 is not None, inp.shape, dtypes.x1),
            like(has_y1 and second is not None, (n_cols,), second.weight.dtype if second is not None else None),
            like(has_y1 and dtypes.bias1 is not None, (n_cols,), dtypes.bias1),
            like(gate is not None, inp.shape, gate.z.dtype if gate is not None else None),
            *(like(t is not None, None if t is None else t.shape, None if t is None else t.dtype)
              for t in ((call.modulation.scale, call.modulation.shift) if call.modulation else (None, None))),
            like(call.x_gate is not None, None if call.x_gate is None else call.x_gate.gate.shape,
                 None if call.x_gate is None else call.x_gate.gate.dtype),
            *(like(t is not None, None if t is None else t.shape, None if t is None else t.dtype)
              for t in ((call.modulation.scale1, call.modulation.shift1) if call.modulation else (None, None))))


# --------------------------------------------------------------------------------------
# Autograd (shared by the custom ops and the eager path)
# --------------------------------------------------------------------------------------

def _grad_or_none(g: Optional[Tensor], exists: bool) -> Optional[Tensor]:
    return g if exists and g is not None else None


def _norm_backward(ctx, saved, dy, dextra, inp, residual_dtype, add_after_norm, modes=None):
    """Shared tail of both autograd formulas: call the backward, map empties to None.
    ``saved``: ctx.saved_tensors, read once (non-reentrant checkpointing allows one unpack).
    ``modes``: add_norm's (dy1, weight1, x1_dtype, rowscale, seed, gate, bias, mod_scale, mod_shift, x_gate,
    x, mod1_scale, mod1_shift), or None (the scales' one_plus: ctx.mod_one_plus). Returns (dx, dresidual, dweight, dbias, dx1, dweight1, dbias1, dgate,
    dmod_scale, dmod_shift, dx_gate, dmod1_scale, dmod1_shift)."""
    mean, rstd, weight = saved[-3:]
    (dy1, weight1, x1_dtype, rowscale, seed, gate, bias, mod_scale, mod_shift, x_gate, x, mod1_scale,
     mod1_shift) = modes or (None,) * 13
    dropout_p = ctx.dropout_p if modes else 0.0
    if dy is None:
        dy = inp.new_zeros(inp.shape, dtype=ctx.dy_dtype)
    # With residual_scale 1 and matching dtypes the residual's grad is dx (add_norm) or the
    # incoming grad itself (norm_add): hand that tensor over instead of writing a copy.
    # (Not with rowscale or dropout: dx is then a scaled copy of the residual's grad.)
    shared = (residual_dtype is not None and ctx.residual_scale == 1.0 and rowscale is None and dropout_p == 0
              and x_gate is None and residual_dtype == (dy.dtype if add_after_norm else ctx.x_dtype))
    backward = _REFERENCE_ON_FLAT["add_norm_bwd"] if ctx.eager_cpu else torch.ops.normfuse.add_norm_bwd
    modulated = mod_scale is not None or mod_shift is not None or x_gate is not None
    gated = gate is not None or getattr(ctx, "norm_group", None) or modulated
    # (the backward op's arguments past seed only when a gate, groups, a modulation or a gated branch need them)
    gate_args = (gate, ctx.gate_position, ctx.gate_activation, ctx.norm_group, bias) if gated else ()
    mod_args = (mod_scale, mod_shift, x_gate, x, mod1_scale, mod1_shift, getattr(ctx, "mod_one_plus", False)) \
        if modulated else ()
    dx, dres, dw, db, dx1, dw1, db1, dgate, dscale, dshift, dx_gate, dscale1, dshift1 = backward(
        dy, dextra, inp, mean, rstd, weight, ctx.kind, ctx.weight_offset, ctx.residual_scale, add_after_norm,
        ctx.x_dtype, None if shared else residual_dtype, ctx.bias_dtype, dy1, None if dy1 is None else weight1,
        None if dy1 is None else ctx.bias1_dtype, x1_dtype, rowscale, dropout_p, seed, *gate_args, *mod_args)
    if shared:
        dres = dy if add_after_norm else dx
    return (dx, _grad_or_none(dres, residual_dtype is not None), _grad_or_none(dw, weight is not None),
            _grad_or_none(db, ctx.bias_dtype is not None), _grad_or_none(dx1, x1_dtype is not None),
            _grad_or_none(dw1, dy1 is not None and weight1 is not None),
            _grad_or_none(db1, dy1 is not None and ctx.bias1_dtype is not None),
            _grad_or_none(dgate, gate is not None), _grad_or_none(dscale, mod_scale is not None),
            _grad_or_none(dshift, mod_shift is not None), _grad_or_none(dx_gate, x_gate is not None),
            _grad_or_none(dscale1, mod1_scale is not None), _grad_or_none(dshift1, mod1_shift is not None))


def _save_common(ctx, rows: Rows, norm: Norm, dy_dtype):
    # Unused outputs (s or y nobody read, mean, rstd) get None, not a materialized
    # zero tensor that backward would read and add.
    ctx.set_materialize_grads(False)
    ctx.kind, ctx.weight_offset, ctx.residual_scale = norm.kind, norm.weight_offset, rows.residual_scale
    ctx.x_dtype, ctx.dy_dtype = rows.x.dtype, dy_dtype
    ctx.bias_dtype = None if norm.bias is None else norm.bias.dtype
    ctx.eager_cpu = False  # the eager path's autograd.Function sets it after this


# where add_norm_fwd's outputs are (add_norm_quant_fwd's begin with the same), and q onwards
_S, _MEAN, _RSTD = (OP_OUTPUTS["add_norm_fwd"].index(name) for name in ("s", "mean", "rstd"))
_Q = OP_OUTPUTS["add_norm_quant_fwd"].index("q")


def _save_add_norm(ctx, call: AddNormCall, output):
    """What add_norm_fwd's backward needs (add_norm_quant_fwd's too: it has no gate)."""
    rows, norm, gate, second, dropout = call.rows, call.norm, call.gate, call.second, call.dropout
    x, residual, x1, rowscale = rows.x, rows.residual, rows.x1, rows.rowscale
    ctx.gate_position = "before" if gate is None else gate.position
    ctx.gate_activation = "silu" if gate is None else gate.activation
    ctx.norm_group = norm.group
    s, mean, rstd = output[_S], output[_MEAN], output[_RSTD]
    ctx.round_sum_first = call.rounding.round_sum_first
    ctx.sum_stored = bool(call.store.sum and reference.call_has_sum(call))
    ctx.dropout_p = 0.0 if dropout is None else dropout.p
    # The backend the forward ran: its dropout mask is the one a rebuilt sum must use.
    ctx.mask_on_reference = dropout is not None and _add_norm_backend(call) is reference
    # Backward needs the norm input and the per-row stats (and rowscale and the seed for dx).
    # The norm input is s when s was stored and normalized; otherwise (no sum, store_sum=False,
    # or the unrounded sum normalized) it is rebuilt from the inputs (and the seed's mask).
    seed = None if dropout is None else dropout.seed
    weight1, z = (None if second is None else second.weight), (None if gate is None else gate.z)
    mod = call.modulation
    # a gate "after" and a modulation multiply n * w' + b: their backward needs the bias
    gate_bias = norm.bias if (gate is not None and gate.position == "after") or mod is not None else None
    scale, shift = (mod.scale, mod.shift) if mod is not None else (None, None)
    scale1, shift1 = (mod.scale1, mod.shift1) if mod is not None else (None, None)  # a second modulation
    ctx.mod_one_plus = mod is not None and mod.one_plus
    # a gated branch's backward needs the gate and x (dx_gate = sum of ds * x)
    gated_x = (rows.x_gate, x) if rows.x_gate is not None else (None, None)
    if ctx.sum_stored and ctx.round_sum_first:
        ctx.save_for_backward(s, None, None, rowscale, seed, weight1, z, gate_bias, scale, shift, *gated_x, scale1,
                              shift1, mean, rstd, norm.weight)
    else:
        ctx.save_for_backward(x, residual, x1, rowscale, seed, weight1, z, gate_bias, scale, shift, *gated_x, scale1,
                              shift1, mean, rstd, norm.weight)
    ctx.sum_dtype = call.rounding.sum_dtype
    ctx.residual_dtype = None if residual is None else residual.dtype
    ctx.x1_dtype = None if x1 is None else x1.dtype
    ctx.bias1_dtype = None if second is None or second.bias is None else second.bias.dtype
    _save_common(ctx, rows, norm, y_dtype_of(call))


def _rebuilt_norm_input(ctx, x, residual, x1, rowscale, seed) -> Tensor:
    """The forward's norm input, from its inputs; with dropout, the forward backend's mask."""
    keep = None
    if ctx.dropout_p > 0:
        if ctx.eager_cpu:
            n_cols = x.shape[-1]
            keep = reference.dropout_keep(seed, x.numel() // n_cols, n_cols, ctx.dropout_p, x.device)
        else:
            keep = torch.ops.normfuse.dropout_keep_mask(x, ctx.dropout_p, seed, ctx.mask_on_reference)
    return reference.norm_input(x, residual, ctx.residual_scale, ctx.sum_dtype, ctx.round_sum_first, x1, rowscale,
                                keep, ctx.dropout_p)[1]


def _add_norm_grads(ctx, dy, ds, dy1) -> dict:
    """{add_norm_fwd argument: its gradient} (GRADIENT_OF names them)."""
    saved = ctx.saved_tensors
    (inp, residual, x1, rowscale, seed, weight1, gate, gate_bias, mod_scale, mod_shift, x_gate, x, mod1_scale,
     mod1_shift) = saved[:14]
    if not (ctx.sum_stored and ctx.round_sum_first):
        inp = _rebuilt_norm_input(ctx, reference.gated_branch(inp, x_gate), residual, x1, rowscale, seed)
    ds = ds if ctx.sum_stored else None
    # a traced backward may get a tangent of the empty y1
    dy1 = dy1 if weight1 is not None or mod1_scale is not None or mod1_shift is not None else None
    grads = _norm_backward(ctx, saved, dy, ds, inp, ctx.residual_dtype, add_after_norm=False,
                           modes=(dy1, weight1, ctx.x1_dtype, rowscale, seed, gate, gate_bias, mod_scale,
                                  mod_shift, x_gate, x, mod1_scale, mod1_shift))
    return {GRADIENT_OF[name]: g for name, g in zip(OP_OUTPUTS["add_norm_bwd"], grads)}


def _add_norm_backward(ctx, dy, ds, dmean, drstd, dy1):
    return op_gradients("add_norm_fwd", _add_norm_grads(ctx, dy, ds, dy1))


implement_autograd("add_norm_fwd", _add_norm_backward, setup_context=_save_add_norm)


def _add_norm_quant_setup_context(ctx, call: AddNormCall, output):
    _save_add_norm(ctx, call, output)
    ctx.mark_non_differentiable(*(t for t in output[_Q:] if t is not None))  # q and scale (None: static)
    ctx.y_stored = call.store.y


def _add_norm_quant_backward(ctx, dy, ds, dmean, drstd, dy1, dq, dscale):
    dy = dy if ctx.y_stored else None  # a traced backward may get a tangent of the empty y
    grads = _add_norm_grads(ctx, dy, ds, dy1)
    # no gate or modulation argument in this op (the epilogue does not combine with them)
    for name in ("gate", "mod_scale", "mod_shift", "x_gate", "mod1_scale", "mod1_shift"):
        del grads[name]
    return op_gradients("add_norm_quant_fwd", grads)


implement_autograd("add_norm_quant_fwd", _add_norm_quant_backward,
                   setup_context=_add_norm_quant_setup_context)


def _norm_add_setup_context(ctx, call: NormAddCall, output):
    rows, norm = call.rows, call.norm
    _, _, mean, rstd = output
    ctx.save_for_backward(rows.x, mean, rstd, norm.weight)
    ctx.norm_stored = call.store.y
    ctx.residual_dtype = rows.residual.dtype
    _save_common(ctx, rows, norm, call.rounding.sum_dtype)


def _norm_add_backward(ctx, dout, dy, dmean, drstd):
    saved = ctx.saved_tensors
    dy = dy if ctx.norm_stored else None
    grads = _norm_backward(ctx, saved, dout, dy, saved[0], ctx.residual_dtype, add_after_norm=True)
    # norm_add has no modes: the gradients of x, residual, weight and bias, the others None
    grads = {GRADIENT_OF[name]: g for name, g in zip(OP_OUTPUTS["add_norm_bwd"], grads)}
    return op_gradients("norm_add_fwd", {name: grads[name] for name in ("x", "residual", "weight", "bias")})


implement_autograd("norm_add_fwd", _norm_add_backward, setup_context=_norm_add_setup_context)


# --------------------------------------------------------------------------------------
# The eager CPU path (first row of the table)
# --------------------------------------------------------------------------------------

# the reference backend's functions, called with an op's flat arguments
_REFERENCE_ON_FLAT = {op: on_call(op, getattr(reference, op))
                      for op in ("add_norm_fwd", "add_norm_quant_fwd", "norm_add_fwd", "add_norm_bwd")}


def _eager_function(name: str, op: str, compute, setup_context, backward) -> type:
    """An autograd.Function running ``compute`` on the call of ``op`` with the op's own setup_context
    and backward. forward(ctx, ...) style: the setup_context style binds the signature on every call."""
    def forward(ctx, *inputs):
        call = call_of(op, inputs)
        output = compute(call)
        setup_context(ctx, call, output)
        ctx.eager_cpu = True  # _norm_backward then calls the reference backward directly
        return output

    return type(name, (torch.autograd.Function,), {"forward": staticmethod(forward),
                                                   "backward": staticmethod(backward)})


_EAGER_FUNCTIONS = {
    "add_norm_fwd": _eager_function("_EagerAddNorm", "add_norm_fwd", reference.add_norm_fwd, _save_add_norm,
                                    _add_norm_backward),
    "norm_add_fwd": _eager_function("_EagerNormAdd", "norm_add_fwd", reference.norm_add_fwd, _norm_add_setup_context,
                                    _norm_add_backward),
    "add_norm_quant_fwd": _eager_function("_EagerAddNormQuant", "add_norm_quant_fwd", reference.add_norm_quant_fwd,
                                          _add_norm_quant_setup_context, _add_norm_quant_backward),
}
