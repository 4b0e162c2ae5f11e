"""Residual add fused with LayerNorm / RMSNorm, in both orders.

Read top to bottom: the plain-PyTorch reference (the one statement of the
semantics, imported by the tests, the CPU path and the equivalence checker) ->
the Triton kernels -> the launcher -> the ``torch.library`` custom ops with
their fakes and autograd -> the functional API.

Add-then-norm (pre-norm and post-norm blocks), normalizing over the last dim N::

    r' = round(residual.dtype, residual_scale * residual)      # skipped when residual_scale == 1
    s  = round(sum_dtype, float(x) + float(r'))                # no residual: s = round(sum_dtype, x)
    u  = float32(s)                                            # statistics always accumulate in fp32
    n  = (u - mean(u)) * rsqrt(var(u) + eps)                   # layer_norm
       = u * rsqrt(mean(u^2) + eps)                            # rms_norm
    w' = float(weight) + weight_offset                         # 1 when there is no weight
    y  = round(out_dtype, n * w' + float(bias))                          # norm_round_dtype None: "multiply then round"
    y  = round(out_dtype, float(round(norm_round_dtype, n)) * w' + float(bias))   # "round then multiply"

``sum_dtype`` defaults to ``promote_types(x.dtype, residual.dtype)`` (``x.dtype``
without a residual); ``out_dtype`` to ``sum_dtype`` when multiplying then
rounding (``F.layer_norm``, ``F.rms_norm``, Gemma's ``1 + w``), and to
``promote_types(norm_round_dtype, weight.dtype)`` when rounding then multiplying
(HF Llama: ``weight * h.to(input_dtype)``). A plain norm returns ``s=None``.

Norm-then-add (res-post blocks ``x + norm(f)``: Swin v2, OLMo2)::

    y   = the norm of x as above (no pre-sum; the norm input dtype is x.dtype)
    out = round(add_dtype, float(round(residual.dtype, residual_scale * residual)) + float(y))

Backward treats every rounding step as the identity (straight-through) and
computes in fp32; fp64 inputs (CPU only, for gradcheck) compute in fp64.
"""

from __future__ import annotations

import math
import os
import sys
from typing import Optional

import torch
from torch import Tensor

from normfuse.errors import InvalidOptionError, ShapeMismatchError, UnsupportedDtypeError, closest

# The Triton interpreter is chosen when a kernel is decorated, so it has to be on
# before triton is imported. NORMFUSE_TRITON_CPU=1 asks for it.
if os.environ.get("NORMFUSE_TRITON_CPU") == "1" and "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"

try:  # optional: without triton only the reference path exists
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - platforms without triton
    triton = None
    tl = None

__all__ = [
    "add_norm", "add_rms_norm", "add_layer_norm",
    "norm_add", "rms_norm_add", "layer_norm_add",
    "add_norm_ref", "norm_add_ref", "add_norm_bwd_ref",
    "KINDS", "SUPPORTED_DTYPES",
]

KINDS = ("rms_norm", "layer_norm")
# Activation, weight and rounding dtypes the fused ops take. fp64 runs on CPU
# only, through the reference (gradcheck needs it).
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_CPU_ONLY_DTYPES = (torch.float64,)


# --------------------------------------------------------------------------------------
# Reference (plain PyTorch)
# --------------------------------------------------------------------------------------

def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Statistics accumulate in fp32; fp64 inputs (gradcheck, fp64 references) stay fp64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _scale_residual(residual: Tensor, residual_scale: float) -> Tensor:
    # Eager computes alpha * r in r's dtype (in fp32 registers, rounded once).
    return residual if residual_scale == 1.0 else residual * residual_scale


def _pre_sum(x: Tensor, residual: Optional[Tensor], residual_scale: float, sum_dtype: torch.dtype) -> Tensor:
    """s = round(sum_dtype, float(x) + float(r'))."""
    if residual is None:
        return x.to(sum_dtype)
    r = _scale_residual(residual, residual_scale)
    if sum_dtype == torch.promote_types(x.dtype, r.dtype):
        return torch.add(x, r)  # eager adds in fp32 (opmath) and rounds once to sum_dtype
    wide = _acc_dtype(sum_dtype if sum_dtype == torch.float64 else torch.promote_types(x.dtype, r.dtype))
    return torch.add(x.to(wide), r.to(wide)).to(sum_dtype)


def _effective_weight(weight: Optional[Tensor], weight_offset: float, acc: torch.dtype) -> Optional[Tensor]:
    """w' = float(weight) + weight_offset; None stands for 1 (the offset is then ignored)."""
    if weight is None or weight_offset == 0.0:
        return weight
    return weight.to(acc) + weight_offset


def _native_layer_norm_ok(u: Tensor, w: Optional[Tensor], b: Optional[Tensor]) -> bool:
    """torch.native_layer_norm computes "multiply then round" (fp32 math) for these dtypes."""
    params = [t.dtype for t in (w, b) if t is not None]
    if all(d == u.dtype for d in params):
        return True
    # bf16/fp16 input with fp32 parameters: eager's mixed-dtype kernel.
    return u.dtype in (torch.float16, torch.bfloat16) and w is not None and all(d == torch.float32 for d in params)


def _native_stats_dtype(u: Tensor, w: Optional[Tensor]) -> torch.dtype:
    """native_layer_norm keeps bf16/fp16 stats unless the weight is fp32 (mixed dtype)."""
    mixed = w is not None and w.dtype != u.dtype
    return _acc_dtype(u.dtype) if u.dtype in (torch.float32, torch.float64) or mixed else u.dtype


def _fused_rms_norm_ok(u: Tensor, w: Optional[Tensor], b: Optional[Tensor]) -> bool:
    if b is not None:
        return False
    return w is None or w.dtype == u.dtype or (w.dtype == torch.float32 and u.dtype != torch.float64)


def _norm_ref(u: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], kind: str, eps: float,
              weight_offset: float, norm_round_dtype: Optional[torch.dtype], out_dtype: torch.dtype):
    """Normalize ``u`` (the norm input, any float dtype) over its last dim.

    Returns (y, mean, rstd) with mean/rstd flat per row in fp32 (fp64 for fp64
    input); mean is an empty tensor for rms_norm.
    """
    acc = _acc_dtype(u.dtype)
    n_cols = u.shape[-1]
    if u.numel() == 0:  # zero rows (kept differentiable for autograd through the reference)
        return (u.to(acc) * 0).to(out_dtype), u.new_empty(0, dtype=acc), u.new_empty(0, dtype=acc)
    w = _effective_weight(weight, weight_offset, acc)
    if norm_round_dtype is None and out_dtype == u.dtype:
        # Fast paths with identical semantics: eager's own fused CPU kernels (one pass).
        if kind == "layer_norm" and _native_layer_norm_ok(u, w, bias):
            # Eager rounds the stats to bf16/fp16 when every parameter is; so does its backward.
            y, mean, rstd = torch.native_layer_norm(u, (n_cols,), w, bias, eps)
            return y, mean.reshape(-1).to(acc), rstd.reshape(-1).to(acc)
        if kind == "rms_norm" and _fused_rms_norm_ok(u, w, bias):
            y, rstd = torch.ops.aten._fused_rms_norm(u, [n_cols], w, eps)
            return y, u.new_empty(0, dtype=acc), rstd.reshape(-1).to(acc)
    uf = u.to(acc)
    if kind == "layer_norm":
        var, mean = torch.var_mean(uf, dim=-1, correction=0, keepdim=True)
        rstd = torch.rsqrt(var + eps)
        n = (uf - mean) * rstd
        mean = mean.reshape(-1)
    else:
        rstd = torch.rsqrt(uf.square().mean(-1, keepdim=True) + eps)
        n = uf * rstd
        mean = uf.new_empty(0)
    if norm_round_dtype is not None:
        n = n.to(norm_round_dtype).to(acc)
    if w is not None:
        n = n * w.to(acc)
    if bias is not None:
        n = n + bias.to(acc)
    return n.to(out_dtype), mean, rstd.reshape(-1)


def _add_norm_fwd_ref(x, residual, weight, bias, kind, eps, weight_offset, residual_scale,
                      sum_dtype, norm_round_dtype, out_dtype):
    """(y, s, mean, rstd) of add-then-norm; s is the norm input (x itself when nothing changes it)."""
    s = _pre_sum(x, residual, residual_scale, sum_dtype)
    y, mean, rstd = _norm_ref(s, weight, bias, kind, eps, weight_offset, norm_round_dtype, out_dtype)
    return y, s, mean, rstd


def _post_add(y: Tensor, residual: Tensor, residual_scale: float, add_dtype: torch.dtype) -> Tensor:
    """out = round(add_dtype, float(round(residual.dtype, residual_scale * residual)) + float(y))."""
    return _pre_sum(_scale_residual(residual, residual_scale), y, 1.0, add_dtype)


def _norm_add_fwd_ref(x, residual, weight, bias, kind, eps, weight_offset, residual_scale,
                      norm_round_dtype, out_dtype, add_dtype):
    """(out, y, mean, rstd) of norm-then-add."""
    y, mean, rstd = _norm_ref(x, weight, bias, kind, eps, weight_offset, norm_round_dtype, out_dtype)
    return _post_add(y, residual, residual_scale, add_dtype), y, mean, rstd


def _default_sum_dtype(x: Tensor, residual: Optional[Tensor]) -> torch.dtype:
    return x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)


def _default_out_dtype(norm_in_dtype: torch.dtype, weight: Optional[Tensor],
                       norm_round_dtype: Optional[torch.dtype]) -> torch.dtype:
    if norm_round_dtype is None:
        return norm_in_dtype
    return norm_round_dtype if weight is None else torch.promote_types(norm_round_dtype, weight.dtype)


def add_norm_ref(x, residual=None, weight=None, bias=None, *, kind, eps, weight_offset=0.0,
                 residual_scale=1.0, sum_dtype=None, norm_round_dtype=None, out_dtype=None,
                 return_sum=True):
    """Plain-PyTorch add-then-norm with the semantics of the module docstring: returns (y, s).

    Same arguments as :func:`add_norm`. A plain norm (``residual=None``) returns s=None,
    as does ``return_sum=False``. For an fp64 reference, pass fp64 tensors and fp64
    rounding dtypes.
    """
    sum_dtype = sum_dtype or _default_sum_dtype(x, residual)
    out_dtype = out_dtype or _default_out_dtype(sum_dtype, weight, norm_round_dtype)
    y, s, _, _ = _add_norm_fwd_ref(x, residual, weight, bias, kind, eps, weight_offset, residual_scale,
                                   sum_dtype, norm_round_dtype, out_dtype)
    return y, (s if return_sum and residual is not None else None)


def norm_add_ref(x, residual, weight=None, bias=None, *, kind, eps, weight_offset=0.0, residual_scale=1.0,
                 norm_round_dtype=None, out_dtype=None, add_dtype=None, return_norm=False):
    """Plain-PyTorch norm-then-add: returns (out, y); y is None unless return_norm."""
    out_dtype = out_dtype or _default_out_dtype(x.dtype, weight, norm_round_dtype)
    add_dtype = add_dtype or torch.promote_types(residual.dtype, out_dtype)
    out, y, _, _ = _norm_add_fwd_ref(x, residual, weight, bias, kind, eps, weight_offset, residual_scale,
                                     norm_round_dtype, out_dtype, add_dtype)
    return out, (y if return_norm else None)


def add_norm_bwd_ref(dy, dextra, inp, mean, rstd, weight=None, *, kind, weight_offset=0.0,
                     residual_scale=1.0, post_add=False, x_dtype, residual_dtype=None, bias_dtype=None):
    """Backward of both orders; rounding steps are identities, math in fp32 (fp64 for fp64).

    ``inp`` is the norm input (s, or x without a residual / for norm_add), ``mean``
    and ``rstd`` its flat per-row stats (mean empty for rms_norm).
    add_norm (post_add=False): dy = grad of y, dextra = grad of s (or None);
        ds = norm_bwd(dy) + dextra; dx = ds; dresidual = residual_scale * ds.
    norm_add (post_add=True): dy = grad of out, dextra = grad of y (or None);
        dx = norm_bwd(dy + dextra); dresidual = residual_scale * dy.
    Returns (dx, dresidual, dweight, dbias); None for inputs that do not exist.
    """
    acc = _acc_dtype(inp.dtype)
    stat_shape = (*inp.shape[:-1], 1)
    u = inp.to(acc)
    rstd = rstd.to(acc).reshape(stat_shape)
    xhat = (u - mean.to(acc).reshape(stat_shape)) * rstd if kind == "layer_norm" else u * rstd
    dout = dy.to(acc)
    dn = dout + dextra.to(acc) if (post_add and dextra is not None) else dout
    w = _effective_weight(weight, weight_offset, acc)
    g = dn * w.to(acc) if w is not None else dn
    c1 = (g * xhat).mean(-1, keepdim=True)
    if kind == "layer_norm":
        du = (g - g.mean(-1, keepdim=True) - xhat * c1) * rstd
    else:
        du = (g - xhat * c1) * rstd
    if not post_add and dextra is not None:
        du = du + dextra.to(acc)
    dres_src = dout if post_add else du
    dres = None if residual_dtype is None else (dres_src * residual_scale if residual_scale != 1.0
                                                else dres_src).to(residual_dtype)
    rows = tuple(range(inp.dim() - 1))
    dw = None if weight is None else (dn * xhat).sum(rows).to(weight.dtype)
    db = None if bias_dtype is None else dn.sum(rows).to(bias_dtype)
    return du.to(x_dtype), dres, dw, db


def _add_norm_bwd_cpu(dy, dextra, inp, mean, rstd, weight, kind, weight_offset, residual_scale, post_add,
                      x_dtype, residual_dtype, bias_dtype):
    """The reference backward, through eager's fused LayerNorm backward where that is identical."""
    w = _effective_weight(weight, weight_offset, _acc_dtype(inp.dtype))
    bias_like = None if bias_dtype is None else inp.new_empty(0, dtype=bias_dtype)
    dn = dy + dextra if (post_add and dextra is not None) else dy
    if (kind == "layer_norm" and inp.numel() and dn.dtype == inp.dtype
            and mean.dtype == rstd.dtype == _acc_dtype(inp.dtype) and _native_layer_norm_ok(inp, w, bias_like)):
        n_cols = inp.shape[-1]
        stat_shape, stat_dtype = (*inp.shape[:-1], 1), _native_stats_dtype(inp, w)
        du, dw, db = torch.ops.aten.native_layer_norm_backward(
            dn, inp, [n_cols], mean.reshape(stat_shape).to(stat_dtype), rstd.reshape(stat_shape).to(stat_dtype), w,
            None if bias_dtype is None else inp.new_zeros(n_cols, dtype=bias_dtype),
            [True, weight is not None, bias_dtype is not None])
        if not post_add and dextra is not None:
            du = du + dextra
        dres_src = dy if post_add else du
        dres = None
        if residual_dtype is not None:
            dres = (dres_src * residual_scale if residual_scale != 1.0 else dres_src).to(residual_dtype)
        return (du.to(x_dtype), dres, None if weight is None else dw.to(weight.dtype),
                None if bias_dtype is None else db.to(bias_dtype))
    return add_norm_bwd_ref(dy, dextra, inp, mean, rstd, weight, kind=kind, weight_offset=weight_offset,
                            residual_scale=residual_scale, post_add=post_add, x_dtype=x_dtype,
                            residual_dtype=residual_dtype, bias_dtype=bias_dtype)


# --------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------

# (added with the launcher below)


# --------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------

def _use_triton(x: Tensor) -> bool:
    """CUDA/ROCm tensors run Triton; CPU tensors run the reference unless NORMFUSE_TRITON_CPU=1."""
    return False


# --------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------

def _dtype_names(dtypes) -> str:
    return ", ".join(str(d) for d in dtypes)


def _validate(x, residual, weight, bias, kind, eps, rounding: dict):
    """Raise a normfuse error naming the problem and the fix; the ops never assert."""
    if kind not in KINDS:
        raise InvalidOptionError(f"kind={kind!r} is not a norm the fused ops implement; use one of {KINDS}."
                                 + closest(str(kind), KINDS))
    if not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps < 0:
        raise InvalidOptionError(f"eps={eps!r} must be a finite number >= 0 (e.g. 1e-5 or 1e-6).")
    if not isinstance(x, Tensor) or x.dim() == 0:
        raise ShapeMismatchError(f"x must be a tensor with at least one dim (the normalized last dim); "
                                 f"got {type(x).__name__} of shape {tuple(getattr(x, 'shape', ()))}.")
    on_cpu = x.device.type == "cpu"
    ok = SUPPORTED_DTYPES + (_CPU_ONLY_DTYPES if on_cpu else ())
    supported = _dtype_names(SUPPORTED_DTYPES) + " (and torch.float64 on CPU)"
    for name, t in (("x", x), ("residual", residual)):
        if t is not None and t.dtype not in ok:
            raise UnsupportedDtypeError(f"{name} has dtype {t.dtype} on {t.device}; the fused add+norm ops take "
                                        f"{supported}. Cast it first, e.g. {name}.to(torch.bfloat16).")
    n_cols = x.shape[-1]
    if n_cols == 0:
        raise ShapeMismatchError(f"x has shape {tuple(x.shape)}: its last dim, the one normalized, is empty; "
                                 f"pass at least one element per row.")
    if residual is not None and residual.shape != x.shape:
        raise ShapeMismatchError(f"residual has shape {tuple(residual.shape)} but x has shape {tuple(x.shape)}; "
                                 f"the fused add does not broadcast, so expand or reshape the residual to "
                                 f"{tuple(x.shape)} first.")
    for name, p in (("weight", weight), ("bias", bias)):
        if p is None:
            continue
        if p.shape != (n_cols,):
            raise ShapeMismatchError(f"{name} has shape {tuple(p.shape)} but x has shape {tuple(x.shape)}; the "
                                     f"norm is over the last dim, so {name} must have shape ({n_cols},).")
        allowed = {x.dtype, torch.float32} | ({residual.dtype} if residual is not None else set())
        if p.dtype not in allowed or p.dtype not in ok:
            raise UnsupportedDtypeError(f"{name} has dtype {p.dtype} but x has dtype {x.dtype}; {name} must have "
                                        f"x's dtype or torch.float32. Cast it with {name}.to(torch.float32).")
    for name, t in (("residual", residual), ("weight", weight), ("bias", bias)):
        if t is not None and t.device != x.device:
            raise InvalidOptionError(f"{name} is on {t.device} but x is on {x.device}; move them to one device.")
    for name, dtype in rounding.items():
        if dtype is not None and dtype not in ok:
            raise UnsupportedDtypeError(f"{name}={dtype} is not a dtype the fused ops round to; use one of "
                                        f"{supported}.")


# --------------------------------------------------------------------------------------
# Custom ops: forward, backward, fakes, autograd
# --------------------------------------------------------------------------------------

def _empty(like: Tensor, dtype: torch.dtype) -> Tensor:
    """Stands in for an output that does not exist (s not stored, mean of rms_norm, ...)."""
    return like.new_empty(0, dtype=dtype)


def _fresh(outputs, inputs) -> tuple:
    """Custom ops may not return an input or one tensor twice (e.g. dx is also dresidual
    when residual_scale == 1 and the dtypes agree): clone such outputs, make all contiguous."""
    seen = {t.data_ptr() for t in inputs if isinstance(t, Tensor) and t.numel()}
    fresh = []
    for t in outputs:
        if t.numel() == 0 or t.data_ptr() in seen:  # empty tensors can share a storage unseen
            t = t.clone(memory_format=torch.contiguous_format)
        seen.add(t.data_ptr())
        fresh.append(t.contiguous())
    return tuple(fresh)


def _n_rows(x: Tensor):
    return math.prod(x.shape[:-1])


def _stats_fake(x: Tensor, kind: str, norm_in_dtype: torch.dtype):
    acc = _acc_dtype(norm_in_dtype)
    rows = _n_rows(x)
    return x.new_empty((rows,) if kind == "layer_norm" else (0,), dtype=acc), x.new_empty((rows,), dtype=acc)


@torch.library.custom_op("normfuse::add_norm_fwd", mutates_args=())
def add_norm_fwd(x: Tensor, residual: Optional[Tensor], weight: Optional[Tensor], bias: Optional[Tensor],
                 kind: str, eps: float, weight_offset: float, residual_scale: float, sum_dtype: torch.dtype,
                 norm_round_dtype: Optional[torch.dtype], out_dtype: torch.dtype, store_sum: bool,
                 ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Add-then-norm. Returns (y, s, mean, rstd): s is empty unless store_sum and there is a residual;
    mean (empty for rms_norm) and rstd are flat per-row fp32 (fp64 for fp64 input)."""
    _validate(x, residual, weight, bias, kind, eps,
              {"sum_dtype": sum_dtype, "norm_round_dtype": norm_round_dtype, "out_dtype": out_dtype})
    store_sum = store_sum and residual is not None
    if _use_triton(x):
        return _add_norm_fwd_triton(x, residual, weight, bias, kind, eps, weight_offset, residual_scale,
                                    sum_dtype, norm_round_dtype, out_dtype, store_sum)
    y, s, mean, rstd = _add_norm_fwd_ref(x, residual, weight, bias, kind, eps, weight_offset, residual_scale,
                                         sum_dtype, norm_round_dtype, out_dtype)
    return _fresh((y, s if store_sum else _empty(x, sum_dtype), mean, rstd), (x, residual, weight, bias))


@add_norm_fwd.register_fake
def _add_norm_fwd_fake(x, residual, weight, bias, kind, eps, weight_offset, residual_scale, sum_dtype,
                       norm_round_dtype, out_dtype, store_sum):
    _validate(x, residual, weight, bias, kind, eps, {})
    store_sum = store_sum and residual is not None
    s = x.new_empty(x.shape, dtype=sum_dtype) if store_sum else _empty(x, sum_dtype)
    return (x.new_empty(x.shape, dtype=out_dtype), s, *_stats_fake(x, kind, sum_dtype))


@torch.library.custom_op("normfuse::norm_add_fwd", mutates_args=())
def norm_add_fwd(x: Tensor, residual: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], kind: str,
                 eps: float, weight_offset: float, residual_scale: float, norm_round_dtype: Optional[torch.dtype],
                 out_dtype: torch.dtype, add_dtype: torch.dtype, store_norm: bool,
                 ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Norm-then-add. Returns (out, y, mean, rstd): y is empty unless store_norm."""
    _validate(x, residual, weight, bias, kind, eps,
              {"norm_round_dtype": norm_round_dtype, "out_dtype": out_dtype, "add_dtype": add_dtype})
    if _use_triton(x):
        return _norm_add_fwd_triton(x, residual, weight, bias, kind, eps, weight_offset, residual_scale,
                                    norm_round_dtype, out_dtype, add_dtype, store_norm)
    out, y, mean, rstd = _norm_add_fwd_ref(x, residual, weight, bias, kind, eps, weight_offset, residual_scale,
                                           norm_round_dtype, out_dtype, add_dtype)
    return _fresh((out, y if store_norm else _empty(x, out_dtype), mean, rstd), (x, residual, weight, bias))


@norm_add_fwd.register_fake
def _norm_add_fwd_fake(x, residual, weight, bias, kind, eps, weight_offset, residual_scale, norm_round_dtype,
                       out_dtype, add_dtype, store_norm):
    _validate(x, residual, weight, bias, kind, eps, {})
    y = x.new_empty(x.shape, dtype=out_dtype) if store_norm else _empty(x, out_dtype)
    return (x.new_empty(x.shape, dtype=add_dtype), y, *_stats_fake(x, kind, x.dtype))


@torch.library.custom_op("normfuse::add_norm_bwd", mutates_args=())
def add_norm_bwd(dy: Tensor, dextra: Optional[Tensor], inp: Tensor, mean: Tensor, rstd: Tensor,
                 weight: Optional[Tensor], kind: str, weight_offset: float, residual_scale: float, post_add: bool,
                 x_dtype: torch.dtype, residual_dtype: Optional[torch.dtype], bias_dtype: Optional[torch.dtype],
                 ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Backward of add_norm_fwd (post_add=False) and norm_add_fwd (post_add=True); see add_norm_bwd_ref.
    Returns (dx, dresidual, dweight, dbias), each empty when that input does not exist."""
    if _use_triton(inp):
        return _add_norm_bwd_triton(dy, dextra, inp, mean, rstd, weight, kind, weight_offset, residual_scale,
                                    post_add, x_dtype, residual_dtype, bias_dtype)
    grads = _add_norm_bwd_cpu(dy, dextra, inp, mean, rstd, weight, kind, weight_offset, residual_scale, post_add,
                              x_dtype, residual_dtype, bias_dtype)
    dtypes = (x_dtype, residual_dtype, None if weight is None else weight.dtype, bias_dtype)
    grads = (_empty(inp, d or inp.dtype) if g is None else g for g, d in zip(grads, dtypes))
    return _fresh(grads, (dy, dextra, inp, mean, rstd, weight))


@add_norm_bwd.register_fake
def _add_norm_bwd_fake(dy, dextra, inp, mean, rstd, weight, kind, weight_offset, residual_scale, post_add,
                       x_dtype, residual_dtype, bias_dtype):
    n_cols = inp.shape[-1]
    return (inp.new_empty(inp.shape, dtype=x_dtype),
            _empty(inp, inp.dtype) if residual_dtype is None else inp.new_empty(inp.shape, dtype=residual_dtype),
            _empty(inp, inp.dtype) if weight is None else inp.new_empty((n_cols,), dtype=weight.dtype),
            _empty(inp, inp.dtype) if bias_dtype is None else inp.new_empty((n_cols,), dtype=bias_dtype))


def _grad_or_none(g: Optional[Tensor], exists: bool) -> Optional[Tensor]:
    return g if exists and g is not None else None


def _norm_backward(ctx, dy, dextra, inp, residual_dtype, post_add):
    """Shared tail of both autograd formulas: call the backward op, map empties to None."""
    mean, rstd, weight = ctx.saved_tensors[-3:]
    if dy is None:
        dy = inp.new_zeros(inp.shape, dtype=ctx.dy_dtype)
    dx, dres, dw, db = torch.ops.normfuse.add_norm_bwd(
        dy, dextra, inp, mean, rstd, weight, ctx.kind, ctx.weight_offset, ctx.residual_scale, post_add,
        ctx.x_dtype, residual_dtype, ctx.bias_dtype)
    return (dx, _grad_or_none(dres, residual_dtype is not None), _grad_or_none(dw, weight is not None),
            _grad_or_none(db, ctx.bias_dtype is not None))


def _save_common(ctx, x, weight, bias, kind, weight_offset, residual_scale, dy_dtype):
    ctx.kind, ctx.weight_offset, ctx.residual_scale = kind, weight_offset, residual_scale
    ctx.x_dtype, ctx.dy_dtype = x.dtype, dy_dtype
    ctx.bias_dtype = None if bias is None else bias.dtype


def _add_norm_setup_context(ctx, inputs, output):
    (x, residual, weight, bias, kind, eps, weight_offset, residual_scale, sum_dtype, norm_round_dtype,
     out_dtype, store_sum) = inputs
    _, s, mean, rstd = output
    ctx.sum_stored = bool(store_sum and residual is not None)
    # Backward needs the norm input s and the per-row stats. When s was not stored
    # (no residual, or a direct call with store_sum=False) it is rebuilt from x.
    if ctx.sum_stored:
        ctx.save_for_backward(s, None, mean, rstd, weight)
    else:
        ctx.save_for_backward(x, residual, mean, rstd, weight)
    ctx.sum_dtype = sum_dtype
    ctx.residual_dtype = None if residual is None else residual.dtype
    _save_common(ctx, x, weight, bias, kind, weight_offset, residual_scale, out_dtype)


def _add_norm_backward(ctx, dy, ds, dmean, drstd):
    inp, residual = ctx.saved_tensors[:2]
    if not ctx.sum_stored:
        inp = _pre_sum(inp, residual, ctx.residual_scale, ctx.sum_dtype)
    ds = ds if ctx.sum_stored else None
    grads = _norm_backward(ctx, dy, ds, inp, ctx.residual_dtype, post_add=False)
    return (*grads, None, None, None, None, None, None, None, None)


add_norm_fwd.register_autograd(_add_norm_backward, setup_context=_add_norm_setup_context)


def _norm_add_setup_context(ctx, inputs, output):
    (x, residual, weight, bias, kind, eps, weight_offset, residual_scale, norm_round_dtype, out_dtype,
     add_dtype, store_norm) = inputs
    _, _, mean, rstd = output
    ctx.save_for_backward(x, mean, rstd, weight)
    ctx.norm_stored = store_norm
    ctx.residual_dtype = residual.dtype
    _save_common(ctx, x, weight, bias, kind, weight_offset, residual_scale, add_dtype)


def _norm_add_backward(ctx, dout, dy, dmean, drstd):
    x = ctx.saved_tensors[0]
    dy = dy if ctx.norm_stored else None
    grads = _norm_backward(ctx, dout, dy, x, ctx.residual_dtype, post_add=True)
    return (*grads, None, None, None, None, None, None, None, None)


norm_add_fwd.register_autograd(_norm_add_backward, setup_context=_norm_add_setup_context)


# --------------------------------------------------------------------------------------
# Functional API
# --------------------------------------------------------------------------------------

def _grad_needed(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def add_norm(x, residual=None, weight=None, bias=None, *, kind, eps, weight_offset=0.0, residual_scale=1.0,
             sum_dtype=None, norm_round_dtype=None, out_dtype=None, return_sum=True):
    """Fused ``s = x + residual_scale * residual; y = norm(s)``: returns (y, s).

    kind: "rms_norm" or "layer_norm", over the last dim N. x, residual: (..., N) of
    equal shape, fp32/fp16/bf16; weight, bias: (N,), x's dtype or fp32.
    weight_offset: w' = weight + offset in fp32 (Gemma: 1.0). residual_scale: the
    residual is scaled in its own dtype before the add (DeepNorm). sum_dtype: dtype
    the sum is rounded to (default: promoted dtype of x and residual).
    norm_round_dtype: None multiplies by the weight then rounds once (F.layer_norm,
    F.rms_norm, Gemma); a dtype rounds the normalized value to it first (HF Llama).
    out_dtype: dtype of y (see the module docstring for its default).
    s is None for a plain norm (residual=None) or return_sum=False.
    """
    _validate(x, residual, weight, bias, kind, eps,
              {"sum_dtype": sum_dtype, "norm_round_dtype": norm_round_dtype, "out_dtype": out_dtype})
    sum_dtype = sum_dtype or _default_sum_dtype(x, residual)
    out_dtype = out_dtype or _default_out_dtype(sum_dtype, weight, norm_round_dtype)
    has_sum = residual is not None
    store_sum = has_sum and (return_sum or _grad_needed(x, residual, weight, bias))
    y, s, _, _ = torch.ops.normfuse.add_norm_fwd(
        x, residual, weight, bias, kind, float(eps), float(weight_offset), float(residual_scale), sum_dtype,
        norm_round_dtype, out_dtype, store_sum)
    return y, (s if has_sum and return_sum else None)


def norm_add(x, residual, weight=None, bias=None, *, kind, eps, weight_offset=0.0, residual_scale=1.0,
             norm_round_dtype=None, out_dtype=None, add_dtype=None, return_norm=False):
    """Fused ``y = norm(x); out = residual_scale * residual + y`` (res-post blocks): returns (out, y).

    y is None unless return_norm. out_dtype is y's dtype (default as in add_norm with
    x.dtype as the norm input dtype); add_dtype is out's dtype (default: promoted dtype
    of residual and y). Other arguments as in :func:`add_norm`.
    """
    _validate(x, residual, weight, bias, kind, eps,
              {"norm_round_dtype": norm_round_dtype, "out_dtype": out_dtype, "add_dtype": add_dtype})
    if residual is None:
        raise InvalidOptionError("norm_add needs a residual to add the norm to; for a plain norm call "
                                 "add_norm(x, None, weight, bias, kind=..., eps=...).")
    out_dtype = out_dtype or _default_out_dtype(x.dtype, weight, norm_round_dtype)
    add_dtype = add_dtype or torch.promote_types(residual.dtype, out_dtype)
    out, y, _, _ = torch.ops.normfuse.norm_add_fwd(
        x, residual, weight, bias, kind, float(eps), float(weight_offset), float(residual_scale),
        norm_round_dtype, out_dtype, add_dtype, bool(return_norm))
    return out, (y if return_norm else None)


def add_rms_norm(x, residual, weight=None, eps=1e-6, **modes):
    """add_norm(kind="rms_norm"): with default modes equals F.rms_norm(x + residual, (N,), weight, eps)."""
    return add_norm(x, residual, weight, None, kind="rms_norm", eps=eps, **modes)


def add_layer_norm(x, residual, weight=None, bias=None, eps=1e-5, **modes):
    """add_norm(kind="layer_norm"): with default modes equals F.layer_norm(x + residual, (N,), weight, bias, eps)."""
    return add_norm(x, residual, weight, bias, kind="layer_norm", eps=eps, **modes)


def rms_norm_add(x, residual, weight=None, eps=1e-6, **modes):
    """norm_add(kind="rms_norm"): residual + F.rms_norm(x, (N,), weight, eps)."""
    return norm_add(x, residual, weight, None, kind="rms_norm", eps=eps, **modes)


def layer_norm_add(x, residual, weight=None, bias=None, eps=1e-5, **modes):
    """norm_add(kind="layer_norm"): residual + F.layer_norm(x, (N,), weight, bias, eps)."""
    return norm_add(x, residual, weight, bias, kind="layer_norm", eps=eps, **modes)
