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

Custom ops (outputs that do not exist are empty tensors; the functional API
returns None for them)::

    normfuse::add_norm_fwd(x, residual?, weight?, bias?, kind, eps, weight_offset, residual_scale,
                           sum_dtype, norm_round_dtype?, out_dtype, store_sum) -> (y, s, mean, rstd)
    normfuse::norm_add_fwd(x, residual, weight?, bias?, kind, eps, weight_offset, residual_scale,
                           norm_round_dtype?, out_dtype, add_dtype, store_norm) -> (out, y, mean, rstd)
    normfuse::add_norm_bwd(dy, dextra?, inp, mean, rstd, weight?, kind, weight_offset, residual_scale,
                           post_add, x_dtype, residual_dtype?, bias_dtype?) -> (dx, dresidual, dweight, dbias)

CUDA/ROCm tensors run the Triton kernels; CPU tensors run the reference (or the
Triton kernels under Triton's interpreter when NORMFUSE_TRITON_CPU=1).
"""

from __future__ import annotations

import functools
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
            y, mean, rstd = torch.native_layer_norm(u, (n_cols,), w, bias, eps)
            if mean.dtype != acc:
                # With bf16/fp16 input and parameters eager returns the stats rounded to that
                # dtype; the backward needs them in fp32 (x_hat's error times rstd otherwise).
                var, mean = torch.var_mean(u.to(acc), dim=-1, correction=0)
                rstd = torch.rsqrt(var + eps)
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
    rounding dtypes. Where eager's fused CPU LayerNorm/RMSNorm compute this very
    function, they are used, so default modes equal F.layer_norm / F.rms_norm bit for
    bit; it is differentiable with plain autograd.
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
    # Eager's fused LayerNorm backward only where it keeps the stats in fp32: with bf16/fp16
    # input and parameters it rounds mean/rstd to that dtype, and x_hat's error, times rstd,
    # is then far above the reference's (fuzzing found 2e-2 against 5e-7 at N = 2, eps = 0).
    if (kind == "layer_norm" and inp.numel() and dn.dtype == inp.dtype
            and mean.dtype == rstd.dtype == _acc_dtype(inp.dtype) and _native_layer_norm_ok(inp, w, bias_like)
            and _native_stats_dtype(inp, w) == _acc_dtype(inp.dtype)):
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
# One forward kernel (and its looped sibling for rows wider than one block) serves
# both orders. Pointer S holds "the residual sum" of either order: the pre-norm sum
# s of add_norm, or out = r' + y of norm_add (POST_ADD). Flags are constexpr, so
# each combination compiles to straight-line code. Rows are addressed with 64-bit
# offsets (row * row_stride), so tensors past 2^31 elements and strided rows work.

# The interpreter's fp32 -> bf16 cast truncates (triton 3.8 passes it no rounding
# mode), unlike the GPU's round-to-nearest-even; under the interpreter _round does
# the rounding by hand so the CPU tests see the GPU's numbers.
_INTERPRETED = triton is not None and os.environ.get("TRITON_INTERPRET") == "1"

# A forward program takes several rows (and loads w, b once for all of them) only for
# blocks up to this many columns.
_MULTI_ROW_MAX_BLOCK = 4096
# Row blocks of this many bytes of input (the widest single-pass ones: bf16 N = 32768,
# fp32 N = 16384) load w, b after the row's stats: held across the reductions they take
# registers the row itself needs, and those blocks spilled (such programs take one row).
_PARAMS_AFTER_STATS_BYTES = 65536

if triton is not None:
    _RNE_BY_HAND = tl.constexpr(_INTERPRETED)
    _PARAMS_AFTER_STATS_BYTES_C = tl.constexpr(_PARAMS_AFTER_STATS_BYTES)

    @triton.jit
    def _round(v, DTYPE: tl.constexpr):
        """v rounded to DTYPE (to nearest even), through fp32."""
        v = v.to(tl.float32)
        if _RNE_BY_HAND and DTYPE == tl.bfloat16:
            bits = v.to(tl.uint32, bitcast=True)
            bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
            v = tl.where(v != v, v, bits.to(tl.float32, bitcast=True))
        return v.to(DTYPE)

    @triton.jit
    def _load_norm_input(X, R, x_off, r_off, cols, mask, residual_scale,
                         HAS_RESIDUAL: tl.constexpr, SCALE_RESIDUAL: tl.constexpr, SUM_DTYPE: tl.constexpr):
        """s = round(SUM_DTYPE, float(x) + float(round(r.dtype, scale * r))), returned in SUM_DTYPE."""
        x = tl.load(X + x_off + cols, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(R + r_off + cols, mask=mask, other=0.0)
            if SCALE_RESIDUAL:
                r = _round(r.to(tl.float32) * residual_scale, R.dtype.element_ty)
            s = _round(x.to(tl.float32) + r.to(tl.float32), SUM_DTYPE)
        else:
            s = _round(x, SUM_DTYPE)
        return s

    @triton.jit
    def _load_params(W, B, cols, mask, weight_offset, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr):
        """w' = float(w) + weight_offset and float(b) of one block (1 and 0 when absent)."""
        w = 1.0
        b = 0.0
        if HAS_WEIGHT:
            w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32) + weight_offset
        if HAS_BIAS:
            b = tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
        return w, b

    @triton.jit
    def _normalize_and_store(u, mean, rstd, w, b, Y, S, R, y_off, s_off, r_off, cols, mask, residual_scale,
                             HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, IS_RMS: tl.constexpr,
                             ROUND_FIRST: tl.constexpr, NORM_ROUND_DTYPE: tl.constexpr, OUT_DTYPE: tl.constexpr,
                             STORE_Y: tl.constexpr, POST_ADD: tl.constexpr, SCALE_RESIDUAL: tl.constexpr):
        """y = round(OUT_DTYPE, n * w' + b) (n rounded first when ROUND_FIRST); then the post-add."""
        if IS_RMS:
            n = u * rstd
        else:
            n = (u - mean) * rstd
        if ROUND_FIRST:
            n = _round(n, NORM_ROUND_DTYPE).to(tl.float32)
        if HAS_WEIGHT:
            n = n * w
        if HAS_BIAS:
            n = n + b
        y = _round(n, OUT_DTYPE)
        if STORE_Y:
            tl.store(Y + y_off + cols, y, mask=mask)
        if POST_ADD:
            r = tl.load(R + r_off + cols, mask=mask, other=0.0)
            if SCALE_RESIDUAL:
                r = _round(r.to(tl.float32) * residual_scale, R.dtype.element_ty)
            tl.store(S + s_off + cols, _round(r.to(tl.float32) + y.to(tl.float32), S.dtype.element_ty), mask=mask)

    @triton.jit
    def _add_norm_fwd_kernel(
        X, R, W, B, Y, S, MEAN, RSTD,                        # S: the sum (pre: s; POST_ADD: out)
        stride_x, stride_r, stride_y, stride_s,              # row strides, in elements
        n_rows, N, eps, weight_offset, residual_scale, rows_per_program,
        SUM_DTYPE: tl.constexpr, NORM_ROUND_DTYPE: tl.constexpr, OUT_DTYPE: tl.constexpr,
        HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, IS_RMS: tl.constexpr,
        ROUND_FIRST: tl.constexpr, STORE_SUM: tl.constexpr, STORE_Y: tl.constexpr, POST_ADD: tl.constexpr,
        SCALE_RESIDUAL: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        """A row fits one block: one read of each input and one write of each output per row."""
        cols = tl.arange(0, BLOCK_N)
        PARAMS_AFTER_STATS: tl.constexpr = BLOCK_N * X.dtype.element_ty.primitive_bitwidth // 8 >=             _PARAMS_AFTER_STATS_BYTES_C
        if not PARAMS_AFTER_STATS:
            w, b = _load_params(W, B, cols, cols < N, weight_offset, HAS_WEIGHT, HAS_BIAS)  # once per program
        for i in range(rows_per_program):
            row = tl.program_id(0) * rows_per_program + i
            mask = (cols < N) & (row < n_rows)
            row = row.to(tl.int64)
            s = _load_norm_input(X, R, row * stride_x, row * stride_r, cols, mask, residual_scale,
                                 HAS_RESIDUAL and not POST_ADD, SCALE_RESIDUAL, SUM_DTYPE)
            if STORE_SUM and not POST_ADD:
                tl.store(S + row * stride_s + cols, s, mask=mask)
            u = s.to(tl.float32)                                     # stats in fp32 registers
            if IS_RMS:
                mean = 0.0
                var = tl.sum(u * u, axis=0) / N
            else:
                mean = tl.sum(u, axis=0) / N
                d = tl.where(mask, u - mean, 0.0)
                var = tl.sum(d * d, axis=0) / N
                tl.store(MEAN + row, mean, mask=row < n_rows)
            rstd = tl.rsqrt(var + eps)
            tl.store(RSTD + row, rstd, mask=row < n_rows)
            if PARAMS_AFTER_STATS:
                w, b = _load_params(W, B, cols, cols < N, weight_offset, HAS_WEIGHT, HAS_BIAS)
            _normalize_and_store(u, mean, rstd, w, b, Y, S, R, row * stride_y, row * stride_s, row * stride_r,
                                 cols, mask, residual_scale, HAS_WEIGHT, HAS_BIAS, IS_RMS, ROUND_FIRST,
                                 NORM_ROUND_DTYPE, OUT_DTYPE, STORE_Y, POST_ADD, SCALE_RESIDUAL)

    @triton.jit
    def _add_norm_fwd_looped_kernel(
        X, R, W, B, Y, S, MEAN, RSTD,
        stride_x, stride_r, stride_y, stride_s,
        n_rows, N, eps, weight_offset, residual_scale, rows_per_program,
        SUM_DTYPE: tl.constexpr, NORM_ROUND_DTYPE: tl.constexpr, OUT_DTYPE: tl.constexpr,
        HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, IS_RMS: tl.constexpr,
        ROUND_FIRST: tl.constexpr, STORE_SUM: tl.constexpr, STORE_Y: tl.constexpr, POST_ADD: tl.constexpr,
        SCALE_RESIDUAL: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        """Rows wider than one block: pass 1 accumulates the stats block by block (Chan's
        parallel mean/M2 update for layer_norm), pass 2 re-reads the row and writes."""
        cols0 = tl.arange(0, BLOCK_N)
        zero = tl.sum(tl.zeros([BLOCK_N], dtype=tl.float32), axis=0)
        for i in range(rows_per_program):
            row = tl.program_id(0) * rows_per_program + i
            row_ok = row < n_rows
            row = row.to(tl.int64)
            mean = zero
            m2 = zero
            count = zero
            for start in range(0, N, BLOCK_N):
                cols = start + cols0
                mask = (cols < N) & row_ok
                s = _load_norm_input(X, R, row * stride_x, row * stride_r, cols, mask, residual_scale,
                                     HAS_RESIDUAL and not POST_ADD, SCALE_RESIDUAL, SUM_DTYPE)
                if STORE_SUM and not POST_ADD:
                    tl.store(S + row * stride_s + cols, s, mask=mask)
                u = s.to(tl.float32)
                if IS_RMS:
                    m2 += tl.sum(u * u, axis=0)
                else:
                    n_b = tl.sum((cols < N).to(tl.float32), axis=0)
                    mean_b = tl.sum(u, axis=0) / n_b
                    d = tl.where(mask, u - mean_b, 0.0)
                    total = count + n_b
                    delta = mean_b - mean
                    mean += delta * (n_b / total)
                    m2 += tl.sum(d * d, axis=0) + delta * delta * (count * n_b / total)
                    count = total
            rstd = tl.rsqrt(m2 / N + eps)
            tl.store(RSTD + row, rstd, mask=row_ok)
            if not IS_RMS:
                tl.store(MEAN + row, mean, mask=row_ok)
            for start in range(0, N, BLOCK_N):
                cols = start + cols0
                mask = (cols < N) & row_ok
                if STORE_SUM and not POST_ADD:
                    s = tl.load(S + row * stride_s + cols, mask=mask, other=0.0)
                else:
                    s = _load_norm_input(X, R, row * stride_x, row * stride_r, cols, mask, residual_scale,
                                         HAS_RESIDUAL and not POST_ADD, SCALE_RESIDUAL, SUM_DTYPE)
                w, b = _load_params(W, B, cols, mask, weight_offset, HAS_WEIGHT, HAS_BIAS)
                _normalize_and_store(s.to(tl.float32), mean, rstd, w, b, Y, S, R, row * stride_y, row * stride_s,
                                     row * stride_r, cols, mask, residual_scale, HAS_WEIGHT, HAS_BIAS, IS_RMS,
                                     ROUND_FIRST, NORM_ROUND_DTYPE, OUT_DTYPE, STORE_Y, POST_ADD, SCALE_RESIDUAL)

    @triton.jit
    def _row_grads(DY, DE, INP, w, row, stride_dy, stride_de, stride_inp, cols, mask, mean, rstd,
                   HAS_DEXTRA: tl.constexpr, HAS_WEIGHT: tl.constexpr, IS_RMS: tl.constexpr,
                   POST_ADD: tl.constexpr):
        """x_hat, the gradient into the norm output (dn) and g = dn * w' of one block of a row."""
        u = tl.load(INP + row * stride_inp + cols, mask=mask, other=0.0).to(tl.float32)
        if IS_RMS:
            xhat = u * rstd
        else:
            xhat = (u - mean) * rstd
        xhat = tl.where(mask, xhat, 0.0)
        dy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
        dn = dy
        if POST_ADD and HAS_DEXTRA:
            dn += tl.load(DE + row * stride_de + cols, mask=mask, other=0.0).to(tl.float32)
        g = dn
        if HAS_WEIGHT:
            g = dn * w
        return xhat, dy, dn, g

    @triton.jit
    def _block_grads(DY, DE, INP, W, row, row_ok, start, cols0, N, stride_dy, stride_de, stride_inp, mean, rstd,
                     weight_offset, HAS_DEXTRA: tl.constexpr, HAS_WEIGHT: tl.constexpr, IS_RMS: tl.constexpr,
                     POST_ADD: tl.constexpr):
        """One block of a wide row (looped backward): its columns, mask, and _row_grads."""
        cols = start + cols0
        mask = (cols < N) & row_ok
        w, _ = _load_params(W, W, cols, mask, weight_offset, HAS_WEIGHT, False)
        xhat, dy, dn, g = _row_grads(DY, DE, INP, w, row, stride_dy, stride_de, stride_inp, cols, mask,
                                     mean, rstd, HAS_DEXTRA, HAS_WEIGHT, IS_RMS, POST_ADD)
        return cols, mask, xhat, dy, dn, g

    @triton.jit
    def _store_input_grads(DE, DX, DRES, row, stride_de, stride_dx, stride_dres, cols, mask, xhat, dy, g, c1, c2,
                           rstd, residual_scale, HAS_DEXTRA: tl.constexpr, HAS_DRES: tl.constexpr,
                           IS_RMS: tl.constexpr, POST_ADD: tl.constexpr):
        """du = rstd * (g - mean(g) - x_hat * mean(g * x_hat)); dx, dresidual from it."""
        if IS_RMS:
            du = (g - xhat * c1) * rstd
        else:
            du = (g - c2 - xhat * c1) * rstd
        if HAS_DEXTRA and not POST_ADD:
            du += tl.load(DE + row * stride_de + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(DX + row * stride_dx + cols, _round(du, DX.dtype.element_ty), mask=mask)
        if HAS_DRES:
            dres = dy if POST_ADD else du
            tl.store(DRES + row * stride_dres + cols, _round(dres * residual_scale, DRES.dtype.element_ty),
                     mask=mask)

    @triton.jit
    def _add_norm_bwd_kernel(
        DY, DE, INP, MEAN, RSTD, W, DX, DRES, DW_PART, DB_PART,   # DE: grad of s (pre) / of y (POST_ADD)
        stride_dy, stride_de, stride_inp, stride_dx, stride_dres,
        n_rows, N, weight_offset, residual_scale, rows_per_program,
        HAS_DEXTRA: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_DRES: tl.constexpr,
        IS_RMS: tl.constexpr, POST_ADD: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        """Each program takes a contiguous chunk of rows and writes fp32 dw/db partials
        to row `pid` of [programs, N] buffers, summed on the host."""
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK_N)
        w, _ = _load_params(W, W, cols, cols < N, weight_offset, HAS_WEIGHT, False)  # once per program
        dw = tl.zeros([BLOCK_N], dtype=tl.float32)
        db = tl.zeros([BLOCK_N], dtype=tl.float32)
        for i in range(rows_per_program):
            row = pid * rows_per_program + i
            row_ok = row < n_rows
            mask = (cols < N) & row_ok
            row = row.to(tl.int64)
            rstd = tl.load(RSTD + row, mask=row_ok, other=0.0)
            mean = 0.0 if IS_RMS else tl.load(MEAN + row, mask=row_ok, other=0.0)
            xhat, dy, dn, g = _row_grads(DY, DE, INP, w, row, stride_dy, stride_de, stride_inp, cols, mask, mean,
                                         rstd, HAS_DEXTRA, HAS_WEIGHT, IS_RMS, POST_ADD)
            c1 = tl.sum(g * xhat, axis=0) / N
            c2 = 0.0 if IS_RMS else tl.sum(g, axis=0) / N
            _store_input_grads(DE, DX, DRES, row, stride_de, stride_dx, stride_dres, cols, mask, xhat, dy, g, c1,
                               c2, rstd, residual_scale, HAS_DEXTRA, HAS_DRES, IS_RMS, POST_ADD)
            dw += dn * xhat
            db += dn
        part = pid.to(tl.int64) * N + cols
        if HAS_WEIGHT:
            tl.store(DW_PART + part, dw, mask=cols < N)
        if HAS_BIAS:
            tl.store(DB_PART + part, db, mask=cols < N)

    @triton.jit
    def _add_norm_bwd_looped_kernel(
        DY, DE, INP, MEAN, RSTD, W, DX, DRES, DW_PART, DB_PART,
        stride_dy, stride_de, stride_inp, stride_dx, stride_dres,
        n_rows, N, weight_offset, residual_scale, rows_per_program,
        HAS_DEXTRA: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_DRES: tl.constexpr,
        IS_RMS: tl.constexpr, POST_ADD: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        """Rows wider than one block: pass 1 reduces mean(g * x_hat) and mean(g), pass 2
        writes the input grads and adds into this program's own partial row (zeroed
        on the host; read and written back by the same threads, so no atomics)."""
        pid = tl.program_id(0)
        cols0 = tl.arange(0, BLOCK_N)
        zero = tl.sum(tl.zeros([BLOCK_N], dtype=tl.float32), axis=0)
        for i in range(rows_per_program):
            row = pid * rows_per_program + i
            row_ok = row < n_rows
            row = row.to(tl.int64)
            rstd = tl.load(RSTD + row, mask=row_ok, other=0.0)
            mean = 0.0 if IS_RMS else tl.load(MEAN + row, mask=row_ok, other=0.0)
            c1 = zero
            c2 = zero
            for start in range(0, N, BLOCK_N):
                cols, mask, xhat, dy, dn, g = _block_grads(
                    DY, DE, INP, W, row, row_ok, start, cols0, N, stride_dy, stride_de, stride_inp, mean, rstd,
                    weight_offset, HAS_DEXTRA, HAS_WEIGHT, IS_RMS, POST_ADD)
                c1 += tl.sum(g * xhat, axis=0)
                c2 += tl.sum(g, axis=0)
            c1 = c1 / N
            c2 = c2 / N
            for start in range(0, N, BLOCK_N):
                cols, mask, xhat, dy, dn, g = _block_grads(
                    DY, DE, INP, W, row, row_ok, start, cols0, N, stride_dy, stride_de, stride_inp, mean, rstd,
                    weight_offset, HAS_DEXTRA, HAS_WEIGHT, IS_RMS, POST_ADD)
                _store_input_grads(DE, DX, DRES, row, stride_de, stride_dx, stride_dres, cols, mask, xhat, dy, g,
                                   c1, c2, rstd, residual_scale, HAS_DEXTRA, HAS_DRES, IS_RMS, POST_ADD)
                part = pid.to(tl.int64) * N + cols
                if HAS_WEIGHT:
                    tl.store(DW_PART + part, tl.load(DW_PART + part, mask=mask, other=0.0) + dn * xhat, mask=mask)
                if HAS_BIAS:
                    tl.store(DB_PART + part, tl.load(DB_PART + part, mask=mask, other=0.0) + dn, mask=mask)


# --------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------
# Block, warps and rows per program (no GPU query at import; the SM count is read on
# the first CUDA launch and cached):
#   * Forward: a row runs in one block when next_pow2(N) * element_size <= 64 KiB (N <=
#     32768 in bf16/fp16, 16384 in fp32). Backward: up to 16 KiB (N <= 8192 in bf16/fp16,
#     4096 in fp32). Wider rows use the looped kernels with 16 KiB blocks (8192 columns,
#     fp32: 4096). The backward keeps x_hat, g and the dw/db accumulators live in fp32
#     per column, which does not fit in registers at the next size up: compiled for
#     sm80/sm90 (benchmarks/bench_static_kernels.py), layer_norm at bf16 N = 16384 spills
#     360 B/thread, and still 64-152 B with the dw/db partials accumulated in memory.
#   * num_warps = clamp(BLOCK_N // 256, 1, 16): about 8 columns per thread, i.e. one
#     16-byte vector load of bf16 each; 16 warps (64 columns per thread) at the top.
#   * Forward: a program takes several rows when rows are short, to amortize the weight
#     load, while keeping at least 8 programs per SM:
#     rows_per_program = clamp(ceil(M / (8 * SMs)), 1, max(1, _MULTI_ROW_MAX_BLOCK // BLOCK_N)).
#   * Backward: programs = min(M, k * SMs), k = 4 for BLOCK_N <= 1024, 2 up to 4096,
#     else 1; each program takes ceil(M / programs) contiguous rows and one row of the
#     [programs, N] fp32 dw/db partials.

_MAX_FUSED_BYTES = 65536      # forward: one block per row up to this many bytes
_MAX_FUSED_BYTES_BWD = 16384  # backward
_LOOP_BLOCK_BYTES = 16384
_INTERPRETER_SMS = 4  # stands in for the SM count under the CPU interpreter
_TL_DTYPES = {} if triton is None else {torch.float32: tl.float32, torch.float16: tl.float16,
                                        torch.bfloat16: tl.bfloat16}


def _use_triton(x: Tensor, *dtypes) -> bool:
    """CUDA/ROCm tensors run Triton; CPU tensors run the reference unless NORMFUSE_TRITON_CPU=1."""
    if triton is None or any(d is not None and d not in _TL_DTYPES for d in (x.dtype, *dtypes)):
        return False
    if x.device.type == "cpu":
        if os.environ.get("NORMFUSE_TRITON_CPU") != "1":
            return False
        if not _INTERPRETED:
            raise InvalidOptionError(
                "NORMFUSE_TRITON_CPU=1 runs the Triton kernels on CPU under Triton's interpreter, which has to "
                "be on when the kernels are defined: set NORMFUSE_TRITON_CPU=1 (or TRITON_INTERPRET=1) before "
                "normfuse.kernels.add_norm and triton are first imported.")
        return True
    return x.device.type == "cuda"  # ROCm devices are "cuda" in torch too


_SM_COUNTS: dict = {}


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return _INTERPRETER_SMS
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNTS:
        _SM_COUNTS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNTS[index]


def _blocking(n_cols: int, element_size: int, backward: bool = False):
    """(BLOCK_N, num_warps, looped) for a row of n_cols elements, forward or backward."""
    block = triton.next_power_of_2(n_cols)
    looped = block * element_size > (_MAX_FUSED_BYTES_BWD if backward else _MAX_FUSED_BYTES)
    if looped:
        block = _LOOP_BLOCK_BYTES // element_size
    return block, min(max(block // 256, 1), 16), looped


def _rows_2d(t: Optional[Tensor], n_cols: int) -> Optional[Tensor]:
    """(M, N) view with a contiguous last dim: strided rows are kept, a strided last dim is copied once."""
    if t is None:
        return None
    if t.stride(-1) != 1:
        t = t.contiguous()
    try:
        return t.view(-1, n_cols)
    except RuntimeError:  # leading dims that do not collapse into one row stride
        return t.reshape(-1, n_cols)


def _param(t: Optional[Tensor]) -> Optional[Tensor]:
    return None if t is None else t.contiguous()


def _launch_fwd(x, residual, weight, bias, y, s, kind, eps, weight_offset, residual_scale, sum_dtype,
                norm_round_dtype, out_dtype, store_sum, store_y, post_add):
    """Shared by both orders; y and s are (M, N) outputs or None when not stored."""
    n_cols = x.shape[-1]
    x2, r2 = _rows_2d(x, n_cols), _rows_2d(residual, n_cols)
    n_rows = x2.shape[0]
    acc = torch.float32
    mean = x.new_empty((n_rows,) if kind == "layer_norm" else (0,), dtype=acc)
    rstd = x.new_empty((n_rows,), dtype=acc)
    if n_rows == 0:
        return mean, rstd
    block, num_warps, looped = _blocking(n_cols, max(x.element_size(), s.element_size() if s is not None else 0))
    rows_per_program = min(max(triton.cdiv(n_rows, 8 * _sm_count(x.device)), 1),
                           max(1, _MULTI_ROW_MAX_BLOCK // block))
    grid = (triton.cdiv(n_rows, rows_per_program),)
    kernel = _add_norm_fwd_looped_kernel if looped else _add_norm_fwd_kernel
    dummy = rstd  # stands in for absent pointers; never read or written
    kernel[grid](
        x2, dummy if r2 is None else r2, _param(weight) if weight is not None else dummy,
        _param(bias) if bias is not None else dummy, dummy if y is None else y, dummy if s is None else s,
        mean if kind == "layer_norm" else dummy, rstd,
        x2.stride(0), 0 if r2 is None else r2.stride(0), 0 if y is None else y.stride(0),
        0 if s is None else s.stride(0),
        n_rows, n_cols, eps, weight_offset, residual_scale, rows_per_program,
        SUM_DTYPE=_TL_DTYPES[sum_dtype], NORM_ROUND_DTYPE=_TL_DTYPES[norm_round_dtype or out_dtype],
        OUT_DTYPE=_TL_DTYPES[out_dtype], HAS_RESIDUAL=residual is not None, HAS_WEIGHT=weight is not None,
        HAS_BIAS=bias is not None, IS_RMS=kind == "rms_norm", ROUND_FIRST=norm_round_dtype is not None,
        STORE_SUM=store_sum, STORE_Y=store_y, POST_ADD=post_add, SCALE_RESIDUAL=residual_scale != 1.0,
        BLOCK_N=block, num_warps=num_warps)
    return mean, rstd


def _add_norm_fwd_triton(x, residual, weight, bias, kind, eps, weight_offset, residual_scale, sum_dtype,
                         norm_round_dtype, out_dtype, store_sum):
    y = x.new_empty(x.shape, dtype=out_dtype)
    s = x.new_empty(x.shape, dtype=sum_dtype) if store_sum else None
    n_cols = x.shape[-1]
    mean, rstd = _launch_fwd(x, residual, weight, bias, y.view(-1, n_cols), None if s is None else s.view(-1, n_cols),
                             kind, eps, weight_offset, residual_scale, sum_dtype, norm_round_dtype, out_dtype,
                             store_sum, True, False)
    return y, (s if s is not None else _empty(x, sum_dtype)), mean, rstd


def _norm_add_fwd_triton(x, residual, weight, bias, kind, eps, weight_offset, residual_scale, norm_round_dtype,
                         out_dtype, add_dtype, store_norm):
    out = x.new_empty(x.shape, dtype=add_dtype)
    y = x.new_empty(x.shape, dtype=out_dtype) if store_norm else None
    n_cols = x.shape[-1]
    mean, rstd = _launch_fwd(x, residual, weight, bias, None if y is None else y.view(-1, n_cols),
                             out.view(-1, n_cols), kind, eps, weight_offset, residual_scale, x.dtype,
                             norm_round_dtype, out_dtype, True, store_norm, True)
    return out, (y if y is not None else _empty(x, out_dtype)), mean, rstd


def _add_norm_bwd_triton(dy, dextra, inp, mean, rstd, weight, kind, weight_offset, residual_scale, post_add,
                         x_dtype, residual_dtype, bias_dtype):
    n_cols = inp.shape[-1]
    inp2, dy2, de2 = _rows_2d(inp, n_cols), _rows_2d(dy, n_cols), _rows_2d(dextra, n_cols)
    n_rows = inp2.shape[0]
    dx = inp.new_empty(inp.shape, dtype=x_dtype)
    dres = inp.new_empty(inp.shape, dtype=residual_dtype) if residual_dtype is not None else None
    block, num_warps, looped = _blocking(n_cols, max(inp.element_size(), dy.element_size()), backward=True)
    k = 4 if block <= 1024 else 2 if block <= 4096 else 1
    programs = max(1, min(n_rows, k * _sm_count(inp.device)))
    rows_per_program = triton.cdiv(n_rows, programs) if n_rows else 0
    alloc = torch.zeros if looped else torch.empty
    dw_part = alloc((programs, n_cols), dtype=torch.float32, device=inp.device) if weight is not None else None
    db_part = alloc((programs, n_cols), dtype=torch.float32, device=inp.device) if bias_dtype is not None else None
    if n_rows:
        dummy = rstd
        kernel = _add_norm_bwd_looped_kernel if looped else _add_norm_bwd_kernel
        kernel[(programs,)](
            dy2, dummy if de2 is None else de2, inp2, mean if kind == "layer_norm" else dummy, rstd,
            _param(weight) if weight is not None else dummy, dx.view(-1, n_cols),
            dummy if dres is None else dres.view(-1, n_cols), dummy if dw_part is None else dw_part,
            dummy if db_part is None else db_part,
            dy2.stride(0), 0 if de2 is None else de2.stride(0), inp2.stride(0), n_cols, n_cols,
            n_rows, n_cols, weight_offset, residual_scale, rows_per_program,
            HAS_DEXTRA=dextra is not None, HAS_WEIGHT=weight is not None, HAS_BIAS=bias_dtype is not None,
            HAS_DRES=dres is not None, IS_RMS=kind == "rms_norm", POST_ADD=post_add, BLOCK_N=block,
            num_warps=num_warps)
    elif dw_part is not None or db_part is not None:  # zero rows: the sums below must be zero
        dw_part = None if dw_part is None else dw_part.zero_()
        db_part = None if db_part is None else db_part.zero_()
    dw = _empty(inp, inp.dtype) if weight is None else dw_part.sum(0).to(weight.dtype)
    db = _empty(inp, inp.dtype) if bias_dtype is None else db_part.sum(0).to(bias_dtype)
    return dx, (dres if dres is not None else _empty(inp, inp.dtype)), dw, db


# --------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------

def _dtype_names(dtypes) -> str:
    return ", ".join(str(d) for d in dtypes)


_SUPPORTED_TEXT = _dtype_names(SUPPORTED_DTYPES) + " (and torch.float64 on CPU)"


def _validate(x, residual, weight, bias, kind, eps, rounding: dict):
    # runs on every call of the ops: the cheap checks first, message text only on error
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
    for name, t in (("x", x), ("residual", residual)):
        if t is not None and t.dtype not in ok:
            raise UnsupportedDtypeError(f"{name} has dtype {t.dtype} on {t.device}; the fused add+norm ops take "
                                        f"{_SUPPORTED_TEXT}. Cast it first, e.g. {name}.to(torch.bfloat16).")
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
                                        f"{_SUPPORTED_TEXT}.")


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


def _validate_and_route(x, residual, weight, bias, kind, eps, rounding: dict) -> bool:
    """Validate a forward call; True when it runs the Triton kernels, False for the reference."""
    _validate(x, residual, weight, bias, kind, eps, rounding)
    return _use_triton(x, *(t.dtype for t in (residual, weight, bias) if t is not None), *rounding.values())


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
    store_sum = store_sum and residual is not None
    if _validate_and_route(x, residual, weight, bias, kind, eps, {"sum_dtype": sum_dtype,
                           "norm_round_dtype": norm_round_dtype, "out_dtype": out_dtype}):
        return _fresh(_add_norm_fwd_triton(x, residual, weight, bias, kind, eps, weight_offset, residual_scale,
                                           sum_dtype, norm_round_dtype, out_dtype, store_sum), ())
    return _fresh(_add_norm_eager(x, residual, weight, bias, kind, eps, weight_offset, residual_scale, sum_dtype,
                                  norm_round_dtype, out_dtype, store_sum), (x, residual, weight, bias))


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
    if _validate_and_route(x, residual, weight, bias, kind, eps, {"norm_round_dtype": norm_round_dtype,
                           "out_dtype": out_dtype, "add_dtype": add_dtype}):
        return _fresh(_norm_add_fwd_triton(x, residual, weight, bias, kind, eps, weight_offset, residual_scale,
                                           norm_round_dtype, out_dtype, add_dtype, store_norm), ())
    return _fresh(_norm_add_eager(x, residual, weight, bias, kind, eps, weight_offset, residual_scale,
                                  norm_round_dtype, out_dtype, add_dtype, store_norm), (x, residual, weight, bias))


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
    if _use_triton(inp, dy.dtype, x_dtype, residual_dtype, bias_dtype, None if weight is None else weight.dtype):
        return _fresh(_add_norm_bwd_triton(dy, dextra, inp, mean, rstd, weight, kind, weight_offset,
                                           residual_scale, post_add, x_dtype, residual_dtype, bias_dtype), ())
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


def _norm_backward(ctx, saved, dy, dextra, inp, residual_dtype, post_add):
    """Shared tail of both autograd formulas: call the backward op, map empties to None.
    ``saved``: ctx.saved_tensors, read once (non-reentrant checkpointing allows one unpack)."""
    mean, rstd, weight = saved[-3:]
    if dy is None:
        dy = inp.new_zeros(inp.shape, dtype=ctx.dy_dtype)
    # With residual_scale 1 and matching dtypes the residual's grad is dx (add_norm) or the
    # incoming grad itself (norm_add): hand that tensor over instead of writing a copy.
    shared = (residual_dtype is not None and ctx.residual_scale == 1.0
              and residual_dtype == (dy.dtype if post_add else ctx.x_dtype))
    backward = _add_norm_bwd_cpu if getattr(ctx, "eager_cpu", False) else torch.ops.normfuse.add_norm_bwd
    dx, dres, dw, db = backward(
        dy, dextra, inp, mean, rstd, weight, ctx.kind, ctx.weight_offset, ctx.residual_scale, post_add,
        ctx.x_dtype, None if shared else residual_dtype, ctx.bias_dtype)
    if shared:
        dres = dy if post_add else dx
    return (dx, _grad_or_none(dres, residual_dtype is not None), _grad_or_none(dw, weight is not None),
            _grad_or_none(db, ctx.bias_dtype is not None))


def _save_common(ctx, x, weight, bias, kind, weight_offset, residual_scale, dy_dtype):
    # Unused outputs (s or y nobody read, mean, rstd) get None, not a materialized
    # zero tensor that backward would read and add.
    ctx.set_materialize_grads(False)
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
    saved = ctx.saved_tensors
    inp, residual = saved[:2]
    if not ctx.sum_stored:
        inp = _pre_sum(inp, residual, ctx.residual_scale, ctx.sum_dtype)
    ds = ds if ctx.sum_stored else None
    grads = _norm_backward(ctx, saved, dy, ds, inp, ctx.residual_dtype, post_add=False)
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
    saved = ctx.saved_tensors
    dy = dy if ctx.norm_stored else None
    grads = _norm_backward(ctx, saved, dout, dy, saved[0], ctx.residual_dtype, post_add=True)
    return (*grads, None, None, None, None, None, None, None, None)


norm_add_fwd.register_autograd(_norm_add_backward, setup_context=_norm_add_setup_context)


# --------------------------------------------------------------------------------------
# Eager CPU path
# --------------------------------------------------------------------------------------
# On real CPU tensors outside any tracing, the ops run the same reference forward and
# CPU backward as the custom ops, through autograd.Functions: the custom-op dispatcher's
# Python wrapper costs ~100 us a call (as much as a whole small norm), and custom ops may
# not return aliases, which costs copies. Traced calls (dynamo, AOT, export) and device
# tensors keep the custom ops, so graphs still show torch.ops.normfuse.*.

def _eager_cpu(*tensors) -> bool:
    if os.environ.get("NORMFUSE_TRITON_CPU") == "1" or torch.compiler.is_compiling():
        return False
    return all(t is None or (type(t) in (Tensor, torch.nn.Parameter) and t.device.type == "cpu") for t in tensors)


def _add_norm_eager(x, residual, weight, bias, kind, eps, weight_offset, residual_scale, sum_dtype,
                    norm_round_dtype, out_dtype, store_sum):
    """add_norm_fwd's outputs from the reference (the op's CPU branch, and the eager path)."""
    y, s, mean, rstd = _add_norm_fwd_ref(x, residual, weight, bias, kind, eps, weight_offset, residual_scale,
                                         sum_dtype, norm_round_dtype, out_dtype)
    return y, (s if store_sum and residual is not None else _empty(x, sum_dtype)), mean, rstd


def _norm_add_eager(x, residual, weight, bias, kind, eps, weight_offset, residual_scale, norm_round_dtype,
                    out_dtype, add_dtype, store_norm):
    """norm_add_fwd's outputs from the reference (the op's CPU branch, and the eager path)."""
    out, y, mean, rstd = _norm_add_fwd_ref(x, residual, weight, bias, kind, eps, weight_offset, residual_scale,
                                           norm_round_dtype, out_dtype, add_dtype)
    return out, (y if store_norm else _empty(x, out_dtype)), mean, rstd


def _eager_function(name: str, compute, setup_context, backward) -> type:
    """An autograd.Function running ``compute`` with the op's own setup_context and backward.
    forward(ctx, ...) style: the setup_context style binds the signature on every call."""
    def forward(ctx, *inputs):
        output = compute(*inputs)
        setup_context(ctx, inputs, output)
        ctx.eager_cpu = True  # _norm_backward then calls the CPU backward directly
        return output

    return type(name, (torch.autograd.Function,), {"forward": staticmethod(forward),
                                                   "backward": staticmethod(backward)})


_EagerAddNorm = _eager_function("_EagerAddNorm", _add_norm_eager, _add_norm_setup_context, _add_norm_backward)
_EagerNormAdd = _eager_function("_EagerNormAdd", _norm_add_eager, _norm_add_setup_context, _norm_add_backward)


# --------------------------------------------------------------------------------------
# Functional API
# --------------------------------------------------------------------------------------

def _grad_needed(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _one_call_when_fx_traced(fn):
    """Under torch.fx symbolic tracing (a rewritten GraphModule re-traced, or unpickled) record
    ``fn`` as one call: its argument checks cannot read Proxies."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if any(isinstance(a, torch.fx.Proxy) for a in args):
            proxy = next(a for a in args if isinstance(a, torch.fx.Proxy))
            return proxy.tracer.create_proxy("call_function", wrapper, args, kwargs)
        return fn(*args, **kwargs)
    return wrapper


@_one_call_when_fx_traced
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
    if _eager_cpu(x, residual, weight, bias):
        # with no autograd graph to record, the reference alone
        forward = _EagerAddNorm.apply if _grad_needed(x, residual, weight, bias) else _add_norm_eager
    else:
        forward = torch.ops.normfuse.add_norm_fwd
    y, s, _, _ = forward(x, residual, weight, bias, kind, float(eps), float(weight_offset), float(residual_scale),
                         sum_dtype, norm_round_dtype, out_dtype, store_sum)
    return y, (s if has_sum and return_sum else None)


@_one_call_when_fx_traced
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
    if _eager_cpu(x, residual, weight, bias):
        forward = _EagerNormAdd.apply if _grad_needed(x, residual, weight, bias) else _norm_add_eager
    else:
        forward = torch.ops.normfuse.norm_add_fwd
    out, y, _, _ = forward(x, residual, weight, bias, kind, float(eps), float(weight_offset), float(residual_scale),
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
