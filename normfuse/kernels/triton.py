"""The Triton backend: kernels and their launchers.

The same function as ``reference.py`` (read that first), with the same backend
interface: ``add_norm_fwd``, ``add_norm_quant_fwd``, ``norm_add_fwd`` and ``add_norm_bwd`` take the
op's grouped call (``specs.AddNormCall``, ``NormAddCall``, ``BackwardCall``: ``specs.call_of``) and
return None for outputs that do not exist.
CUDA/ROCm tensors run these kernels; CPU tensors run them under Triton's
interpreter when NORMFUSE_TRITON_CPU=1 (the tests do).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import sys
from typing import Optional

import torch
from torch import Tensor

from normfuse.kernels import reference
from normfuse.kernels.reference import channel_split, quant_scale_shape, sum_like
from normfuse.kernels.declarations import DECLARATIONS
from normfuse.kernels.specs import AddNormCall, BackwardCall, Fp8Quant, NormAddCall, stores_mean
from normfuse.vocabulary import QUANT_APPLY, QUANT_SCALE_FORMS


def cpu_requested() -> bool:
    """NORMFUSE_TRITON_CPU=1: run the Triton kernels on CPU tensors, under Triton's interpreter."""
    return os.environ.get("NORMFUSE_TRITON_CPU") == "1"


# The Triton interpreter is chosen when a kernel is decorated, so it has to be on
# before triton is imported.
if cpu_requested() and "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"

try:  # optional: without triton only the reference backend exists
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - platforms without triton
    triton = None
    tl = None

# --------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------
# One forward kernel (and its looped sibling for rows wider than one block) serves
# both orders. Pointer S holds "the residual sum" of either order: the pre-norm sum
# s of add_norm, or out = r' + y of norm_add (ADD_AFTER_NORM). Which operands a call has
# (None when absent) and its options are constexpr, so each combination compiles to
# straight-line code. Rows are addressed with 64-bit
# offsets (row * row_stride), so tensors past 2^31 elements and strided rows work.

# The interpreter's fp32 -> bf16 cast truncates (triton 3.8 passes it no rounding
# mode), unlike the GPU's round-to-nearest-even; under the interpreter _round does
# the rounding by hand so the CPU tests see the GPU's numbers.
INTERPRETED = triton is not None and os.environ.get("TRITON_INTERPRET") == "1"

# A forward program takes several rows (and loads w, b once for all of them) only for
# blocks up to this many columns.
_MULTI_ROW_MAX_BLOCK = 4096
# Row blocks of this many bytes of input (the widest single-pass ones: bf16 N = 32768,
# fp32 N = 16384) load w, b after the row's stats: held across the reductions they take
# registers the row itself needs, and those blocks spilled (such programs take one row).
_PARAMS_AFTER_STATS_BYTES = 65536

if triton is not None:
    _RNE_BY_HAND = tl.constexpr(INTERPRETED)
    _PARAMS_AFTER_STATS_BYTES_C = tl.constexpr(_PARAMS_AFTER_STATS_BYTES)
    _MULTI_ROW_MAX_BLOCK_C = tl.constexpr(_MULTI_ROW_MAX_BLOCK)

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
    def _keep_scale(v, row, cols, N, seed, dropout_p, dropout_scale):
        """v * keep * scale: dropout's mask regenerated from (seed, row * N + col) (Philox)."""
        keep = tl.rand(seed, row * N + cols) >= dropout_p
        return v * keep.to(tl.float32) * dropout_scale

    @triton.jit
    def _row_scale(RS, row, row_ok):
        """rowscale[row] (one scalar load per row)."""
        return tl.load(RS + row, mask=row_ok, other=0.0).to(tl.float32)

    @triton.jit
    def _load_norm_input(X, R, X1, RS, row, row_ok, x_off, r_off, x1_off, cols, mask, N, residual_scale, seed,
                         dropout_p, dropout_scale, HAS_RESIDUAL: tl.constexpr, SCALE_RESIDUAL: tl.constexpr,
                         SUM_DTYPE: tl.constexpr, ROUND_SUM_FIRST: tl.constexpr, HAS_X1: tl.constexpr,
                         HAS_ROWSCALE: tl.constexpr, HAS_DROPOUT: tl.constexpr, BRANCH_DTYPE: tl.constexpr,
                         XG=None):
        """(s, u): s = round(SUM_DTYPE, float(b) + float(round(r.dtype, scale * r))) with b the branch
        (x times its gate XG, rounded to BRANCH_DTYPE; x after dropout and rowscale, plus x1: each step
        rounded when ROUND_SUM_FIRST), and the norm input u in fp32: s, or the sum before any
        rounding (ROUND_SUM_FIRST off)."""
        u = tl.load(X + x_off + cols, mask=mask, other=0.0).to(tl.float32)
        if XG is not None:  # the gated residual branch: x * gate (per sample, per token or per column)
            gate = tl.load(XG[0] + _broadcast_row(XG, row) + cols, mask=mask, other=0.0).to(tl.float32)
            u = _round(u * gate, BRANCH_DTYPE).to(tl.float32)
        if HAS_DROPOUT:
            u = _keep_scale(u, row, cols, N, seed, dropout_p, dropout_scale)
            if ROUND_SUM_FIRST:
                u = _round(u, X.dtype.element_ty).to(tl.float32)
        if HAS_ROWSCALE:
            u = u * _row_scale(RS, row, row_ok)
            if ROUND_SUM_FIRST:
                u = _round(u, X.dtype.element_ty).to(tl.float32)
        if HAS_X1:
            u = u + tl.load(X1 + x1_off + cols, mask=mask, other=0.0).to(tl.float32)
            if ROUND_SUM_FIRST:
                u = _round(u, BRANCH_DTYPE).to(tl.float32)
        if HAS_RESIDUAL:
            r = tl.load(R + r_off + cols, mask=mask, other=0.0)
            if SCALE_RESIDUAL:
                r = _round(r.to(tl.float32) * residual_scale, R.dtype.element_ty)
            u = u + r.to(tl.float32)
        s = _round(u, SUM_DTYPE)
        if ROUND_SUM_FIRST:
            u = s.to(tl.float32)
        return s, u

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
                             STORE_Y: tl.constexpr, ADD_AFTER_NORM: tl.constexpr, SCALE_RESIDUAL: tl.constexpr,
                             gate=1.0, GATE_AFTER: tl.constexpr = False, GATE_OUT_DTYPE: tl.constexpr = None,
                             row=0, MOD=None, MOD_OPTS: tl.constexpr = None, Y1=None, y1_off=0):
        """y = round(OUT_DTYPE, n * w' + b) (n rounded first when ROUND_FIRST), times act(z) and rounded
        to GATE_OUT_DTYPE after a gate (GATE_AFTER: ``gate`` holds act(z)), or modulated (MOD: the scale
        and shift operands, _modulate; its second pair, when given, modulates the same y into Y1); then
        the post-add.
        Returns n (for the second norm output) and y (for the quantization epilogue)."""
        if IS_RMS:
            n = u * rstd
        else:
            n = (u - mean) * rstd
        if ROUND_FIRST:
            n = _round(n, NORM_ROUND_DTYPE).to(tl.float32)
        y = n
        if HAS_WEIGHT:
            y = y * w
        if HAS_BIAS:
            y = y + b
        y = _round(y, OUT_DTYPE)
        if GATE_AFTER:
            y = _round(y.to(tl.float32) * gate, GATE_OUT_DTYPE)
        if MOD is not None:
            if MOD[2][0] is not None or MOD[3][0] is not None:  # a second modulation of the same y: y1
                tl.store(Y1 + y1_off + cols, _modulate(y, MOD[2], MOD[3], row, cols, mask, MOD_OPTS), mask=mask)
            y = _modulate(y, MOD[0], MOD[1], row, cols, mask, MOD_OPTS)
        if STORE_Y:
            tl.store(Y + y_off + cols, y, mask=mask)
        if ADD_AFTER_NORM:
            r = tl.load(R + r_off + cols, mask=mask, other=0.0)
            if SCALE_RESIDUAL:
                r = _round(r.to(tl.float32) * residual_scale, R.dtype.element_ty)
            tl.store(S + s_off + cols, _round(r.to(tl.float32) + y.to(tl.float32), S.dtype.element_ty), mask=mask)
        return n, y

    @triton.jit
    def _broadcast_row(OP, row):
        """The offset of the row of a broadcast operand that x's row ``row`` reads: OP is (pointer,
        outer stride, period, inner stride), row = outer * period + inner over x's leading dims."""
        return (row // OP[2]) * OP[1] + (row % OP[2]) * OP[3]

    @triton.jit
    def _factor(MS, row, cols, mask, ONE_PLUS: tl.constexpr):
        """The modulation's factor in fp32: scale as read, or 1 + scale rounded to scale's dtype (ONE_PLUS)."""
        scale = tl.load(MS[0] + _broadcast_row(MS, row) + cols, mask=mask, other=0.0).to(tl.float32)
        if ONE_PLUS:
            scale = _round(scale + 1.0, MS[0].dtype.element_ty).to(tl.float32)
        return scale

    @triton.jit
    def _modulate(y, MS, MH, row, cols, mask, MOD_OPTS: tl.constexpr):
        """m = y * scale + shift (adaLN), y in MOD_OPTS[1] (rounded to it when narrower), rounded to
        MOD_OPTS[1] after the product and after the sum (once, as a fused multiply-add, with
        MOD_OPTS[0]), then to MOD_OPTS[2]; scale and shift read through their strides (per sample, per
        token or per column), the factor 1 + scale with MOD_OPTS[3]."""
        m = _round(y, MOD_OPTS[1]).to(tl.float32)
        if MS[0] is not None and MH[0] is not None and MOD_OPTS[0]:
            scale = _factor(MS, row, cols, mask, MOD_OPTS[3])
            shift = tl.load(MH[0] + _broadcast_row(MH, row) + cols, mask=mask, other=0.0).to(tl.float32)
            m = tl.fma(m, scale, shift)
        else:
            if MS[0] is not None:
                scale = _factor(MS, row, cols, mask, MOD_OPTS[3])
                m = _round(m * scale, MOD_OPTS[1]).to(tl.float32)
            if MH[0] is not None:
                m = m + tl.load(MH[0] + _broadcast_row(MH, row) + cols, mask=mask, other=0.0).to(tl.float32)
        return _round(_round(m, MOD_OPTS[1]), MOD_OPTS[2])

    @triton.jit
    def _store_second_norm(n, w1, b1, Y1, y1_off, cols, mask, HAS_B1: tl.constexpr, OUT_DTYPE: tl.constexpr):
        """y1 = round(OUT_DTYPE, n * w1' + b1): the same normalized n with the second parameters."""
        y1 = n * w1
        if HAS_B1:
            y1 = y1 + b1
        tl.store(Y1 + y1_off + cols, _round(y1, OUT_DTYPE), mask=mask)

    @triton.jit
    def _activation(z, SILU: tl.constexpr):
        """(act(z), act'(z)) in fp32: silu or sigmoid."""
        sig = 1.0 / (1.0 + tl.exp(-z))
        if SILU:
            return z * sig, sig * (1.0 + z * (1.0 - sig))
        return sig, sig * (1.0 - sig)

    @triton.jit
    def _load_gate(Z, z_off, cols, mask, HAS_GATE: tl.constexpr, GATE_SILU: tl.constexpr):
        """(act(z), act'(z)) of one block of the gate (1 and 0 without one)."""
        a = 1.0
        da = 0.0
        if HAS_GATE:
            a, da = _activation(tl.load(Z + z_off + cols, mask=mask, other=0.0).to(tl.float32), GATE_SILU)
        return a, da

    @triton.jit
    def _per_column(v, GROUP: tl.constexpr, BLOCK_N: tl.constexpr):
        """A value per group of GROUP columns, repeated over its columns: (BLOCK_N // GROUP,) -> (BLOCK_N,)."""
        return tl.reshape(tl.broadcast_to(v[:, None], (BLOCK_N // GROUP, GROUP)), (BLOCK_N,))

    @triton.jit
    def _group_sum(v, GROUP: tl.constexpr, BLOCK_N: tl.constexpr):
        """The sum over each group of GROUP columns, repeated over its columns."""
        return _per_column(tl.sum(tl.reshape(v, (BLOCK_N // GROUP, GROUP)), axis=1), GROUP, BLOCK_N)

    @triton.jit
    def _rms_rstd(sum_sq, N, eps, MEAN, stat, stat_ok, L2: tl.constexpr):
        """rstd of a row without its mean from its sum of squares: rsqrt(mean(u^2) + eps), or with L2
        (F.normalize's rule) sqrt(N) / max(||u||_2, eps), the norm stored where eps does not clamp it
        (0 where it does: the backward takes no gradient through the clamp)."""
        if L2:
            norm = tl.sqrt(sum_sq)
            tl.store(MEAN + stat, tl.where(norm >= eps, norm, 0.0), mask=stat_ok)
            return tl.sqrt(N.to(tl.float32)) / tl.maximum(norm, eps)
        return tl.rsqrt(sum_sq / N + eps)

    @triton.jit
    def _group_stats(u, mask, row_ok, start, N, eps, MEAN, RSTD, stat_off, IS_RMS: tl.constexpr,
                     GROUP: tl.constexpr, BLOCK_N: tl.constexpr):
        """mean and rstd of each group of GROUP columns of a block (columns start + [0, BLOCK_N)),
        stored flat per (row, group) and returned per column."""
        GROUPS: tl.constexpr = BLOCK_N // GROUP
        u2 = tl.reshape(u, (GROUPS, GROUP))                     # (groups, G)
        groups = tl.arange(0, GROUPS)
        group_ok = row_ok & (start + groups * GROUP < N)
        stat = stat_off + start // GROUP + groups
        if IS_RMS:
            mean = tl.zeros([GROUPS], dtype=tl.float32)
            var = tl.sum(u2 * u2, axis=1) / GROUP
        else:
            mean = tl.sum(u2, axis=1) / GROUP
            d = tl.where(tl.reshape(mask, (GROUPS, GROUP)), u2 - mean[:, None], 0.0)
            var = tl.sum(d * d, axis=1) / GROUP
            tl.store(MEAN + stat, mean, mask=group_ok)
        rstd = tl.rsqrt(var + eps)
        tl.store(RSTD + stat, rstd, mask=group_ok)
        return _per_column(mean, GROUP, BLOCK_N), _per_column(rstd, GROUP, BLOCK_N)

    @triton.jit
    def _fp8_bits(v, E5M2: tl.constexpr):
        """torch's fp32 -> float8 conversion (c10's fp8e4m3fn/fp8e5m2_from_fp32_value) of v, as the
        byte's bits in an int32: round to nearest even; e4m3fn saturates (+-inf too), e5m2 overflows
        to +-inf, NaN stays NaN. By hand on every device: the interpreter's cast rounds ties the wrong
        way and gives NaN past the range, the GPU's cvt (.satfinite) saturates e5m2 too, and sm80
        has no fp8 cvt at all."""
        bits = v.to(tl.int32, bitcast=True)
        a = bits & 0x7FFFFFFF
        if E5M2:
            past = tl.where(a > 0x7F800000, 0x7F, 0x7C)       # NaN; +-inf from 65536 up
            limit = 143 << 23                                  # 65536
            smallest_normal = 113 << 23                        # 2^-14
            # subnormals: the fp32 add rounds |v| to a multiple of 2^-16 (2^7's ulp)
            sub = (tl.abs(v) + 128.0).to(tl.int32, bitcast=True) - (134 << 23)
            normal = (a - (112 << 23) + 0xFFFFF + ((a >> 21) & 1)) >> 21
        else:
            past = tl.where(a > 0x7F800000, 0x7F, 0x7E)       # NaN; 448 from 480 up
            limit = 1087 << 20                                 # 480
            smallest_normal = 121 << 23                        # 2^-6
            sub = (tl.abs(v) + 16384.0).to(tl.int32, bitcast=True) - (141 << 23)
            normal = (a - (120 << 23) + 0x7FFFF + ((a >> 20) & 1)) >> 20
            normal = tl.where(normal == 0x7F, 0x7E, normal)   # [464, 480) rounds into NaN's code
        r = tl.where(a >= limit, past, tl.where(a < smallest_normal, sub, normal))
        return r | ((bits >> 24) & 0x80)

    @triton.jit
    def _abs_max_bits(v, mask, AXIS: tl.constexpr):
        """The bits of max |v| along AXIS (an int32): exact, and NaN when any element is NaN (the bit
        patterns of |v| order as the values do, NaN's above inf's; the GPU's float max drops NaN)."""
        return tl.max(tl.where(mask, v.to(tl.int32, bitcast=True) & 0x7FFFFFFF, 0), axis=AXIS)

    @triton.jit
    def _dynamic_scale(amax, quant_max, amax_min, scale_min, SCALE_FORM: tl.constexpr,
                       HAS_AMAX_MIN: tl.constexpr, HAS_SCALE_MIN: tl.constexpr):
        """scale from amax, each step one IEEE fp32 operation (div_rn: Triton's "/" is approximate on
        the GPU). The clamps keep NaN, as torch.clamp does."""
        if HAS_AMAX_MIN:
            amax = tl.where(amax < amax_min, amax_min, amax)
        if SCALE_FORM == 0:    # amax / qmax
            scale = tl.math.div_rn(amax, quant_max + tl.zeros_like(amax))
        elif SCALE_FORM == 1:  # qmax / amax
            scale = tl.math.div_rn(quant_max + tl.zeros_like(amax), amax)
        else:                  # fp32(1 / amax) * qmax
            scale = tl.math.div_rn(tl.full(amax.shape, 1.0, tl.float32), amax) * quant_max
        if HAS_SCALE_MIN:
            scale = tl.where(scale < scale_min, scale_min, scale)
        return scale

    @triton.jit
    def _quant_bits(yf, scale, quant_clamp, QUANT_APPLY: tl.constexpr, HAS_CLAMP: tl.constexpr,
                    E5M2: tl.constexpr):
        """The fp8 bits of clamp(yf op scale) (op: 0 divide, 1 multiply, 2 multiply by fp32(1 / scale))."""
        scale = scale + tl.zeros_like(yf)
        if QUANT_APPLY == 0:
            v = tl.math.div_rn(yf, scale)
        elif QUANT_APPLY == 1:
            v = yf * scale
        else:
            v = yf * tl.math.div_rn(tl.full(yf.shape, 1.0, tl.float32), scale)
        if HAS_CLAMP:
            v = tl.where(v < -quant_clamp, -quant_clamp, tl.where(v > quant_clamp, quant_clamp, v))
        return _fp8_bits(v, E5M2)

    @triton.jit
    def _scale_out(scale, SCALE_RECIPROCAL: tl.constexpr):
        if SCALE_RECIPROCAL:
            scale = tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)
        return scale

    @triton.jit
    def _quantize_and_store(y, mask, row_ok, start, cols, N, Q, QS, SC, q_off, qs_off, quant_max, amax_min, scale_min,
                            quant_clamp, QUANT_STATIC: tl.constexpr, QUANT_GROUP: tl.constexpr,
                            SCALE_FORM: tl.constexpr, HAS_AMAX_MIN: tl.constexpr, HAS_SCALE_MIN: tl.constexpr,
                            QUANT_APPLY: tl.constexpr, HAS_CLAMP: tl.constexpr, QUANT_E5M2: tl.constexpr,
                            SCALE_RECIPROCAL: tl.constexpr, BLOCK_N: tl.constexpr):
        """q of one block of y (columns start + [0, BLOCK_N)) with a static scale or one per group of
        QUANT_GROUP columns (the scale stored too). A dynamic scale per row is _quantize_row's."""
        yf = y.to(tl.float32)
        if QUANT_STATIC:
            bits = _quant_bits(yf, tl.load(SC).to(tl.float32), quant_clamp, QUANT_APPLY, HAS_CLAMP, QUANT_E5M2)
            tl.store(Q + q_off + cols, bits.to(tl.uint8), mask=mask)
        else:
            GROUPS: tl.constexpr = BLOCK_N // QUANT_GROUP
            y2 = tl.reshape(yf, (GROUPS, QUANT_GROUP))           # (groups, G)
            mask2 = tl.reshape(mask, (GROUPS, QUANT_GROUP))
            amax = _abs_max_bits(y2, mask2, 1).to(tl.float32, bitcast=True)
            scale = _dynamic_scale(amax, quant_max, amax_min, scale_min, SCALE_FORM, HAS_AMAX_MIN, HAS_SCALE_MIN)
            groups = tl.arange(0, GROUPS)
            tl.store(QS + qs_off + start // QUANT_GROUP + groups, _scale_out(scale, SCALE_RECIPROCAL),
                     mask=row_ok & (start + groups * QUANT_GROUP < N))
            bits = _quant_bits(y2, scale[:, None], quant_clamp, QUANT_APPLY, HAS_CLAMP, QUANT_E5M2)
            tl.store(Q + q_off + tl.reshape(cols, (GROUPS, QUANT_GROUP)), bits.to(tl.uint8), mask=mask2)

    @triton.jit
    def _quantize_row(y, mask, row_ok, cols, Q, QS, q_off, qs_off, quant_max, amax_min, scale_min, quant_clamp,
                      SCALE_FORM: tl.constexpr, HAS_AMAX_MIN: tl.constexpr, HAS_SCALE_MIN: tl.constexpr,
                      QUANT_APPLY: tl.constexpr, HAS_CLAMP: tl.constexpr, QUANT_E5M2: tl.constexpr,
                      SCALE_RECIPROCAL: tl.constexpr):
        """q of a row held in one block, with its own dynamic scale (stored too)."""
        yf = y.to(tl.float32)
        amax = _abs_max_bits(yf, mask, 0).to(tl.float32, bitcast=True)
        scale = _dynamic_scale(amax, quant_max, amax_min, scale_min, SCALE_FORM, HAS_AMAX_MIN, HAS_SCALE_MIN)
        tl.store(QS + qs_off, _scale_out(scale, SCALE_RECIPROCAL), mask=row_ok)
        bits = _quant_bits(yf, scale, quant_clamp, QUANT_APPLY, HAS_CLAMP, QUANT_E5M2)
        tl.store(Q + q_off + cols, bits.to(tl.uint8), mask=mask)

    # The kernels take one argument per operand: a row operand is (pointer, row stride in elements),
    # a vector (weights, a static scale, rowscale) its pointer; an absent operand is None ((None, 0) for a
    # row operand), and each kernel reads which operands it has from that (constexpr). Options come as
    # tuples: DROPOUT (seed, p, 1 / (1 - p)), QUANT (max, amax_min, scale_min, clamp: None when unset),
    # and the constexpr DTYPES (sum, norm round, out, branch), GATE_OPTS (after, silu, out dtype),
    # QUANT_OPTS (e5m2, group, scale form, apply, reciprocal scale out).

    @triton.jit
    def _residual_row(R, row):
        """The offset of the residual's row that x's row ``row`` adds: R is (pointer, row stride, period),
        a table broadcast over x's leading dims repeating every ``period`` rows (learned positions);
        period None: one row per x's row (no modulo: it costs registers at the widest rows)."""
        if R[2] is None:
            r = row
        else:
            r = row % R[2]
        return r * R[1]

    @triton.jit
    def _row_input(X, R, X1, RS, row, row_ok, cols, mask, N, residual_scale, DROPOUT, DTYPES: tl.constexpr,
                   ADD_RESIDUAL: tl.constexpr, SCALE_RESIDUAL: tl.constexpr, ROUND_SUM_FIRST: tl.constexpr):
        """_load_norm_input of one block of a row of the row operands (the residual only when ADD_RESIDUAL)."""
        return _load_norm_input(X[0], R[0], X1[0], RS, row, row_ok, row * X[1], _residual_row(R, row), row * X1[1],
                                cols, mask,
                                N, residual_scale, DROPOUT[0], DROPOUT[1], DROPOUT[2], ADD_RESIDUAL, SCALE_RESIDUAL,
                                DTYPES[0], ROUND_SUM_FIRST, X1[0] is not None, RS is not None,
                                DROPOUT[0] is not None, DTYPES[3], X[2])

    @triton.jit
    def _row_input_again(X, R, X1, RS, S, row, row_ok, cols, mask, N, residual_scale, DROPOUT,
                         DTYPES: tl.constexpr, ADD_AFTER_NORM: tl.constexpr, SCALE_RESIDUAL: tl.constexpr,
                         ROUND_SUM_FIRST: tl.constexpr):
        """u of one block in a later pass of the looped kernel: read back from the stored s when that is
        the norm input, else recomputed."""
        if S[0] is not None and not ADD_AFTER_NORM and ROUND_SUM_FIRST:
            u = tl.load(S[0] + row * S[1] + cols, mask=mask, other=0.0).to(tl.float32)
        else:
            _, u = _row_input(X, R, X1, RS, row, row_ok, cols, mask, N, residual_scale, DROPOUT, DTYPES,
                              R[0] is not None and not ADD_AFTER_NORM, SCALE_RESIDUAL, ROUND_SUM_FIRST)
        return u

    @triton.jit
    def _row_quantize(y, mask, row_ok, start, cols, N, Q, QS, SC, row, QUANT, QUANT_OPTS: tl.constexpr,
                      BLOCK_N: tl.constexpr):
        """_quantize_and_store of one block of a row (a static scale, or one per group within the block)."""
        _quantize_and_store(y, mask, row_ok, start, cols, N, Q[0], QS[0], SC, row * Q[1], row * QS[1], QUANT[0],
                            QUANT[1], QUANT[2], QUANT[3], SC is not None, QUANT_OPTS[1], QUANT_OPTS[2],
                            QUANT[1] is not None, QUANT[2] is not None, QUANT_OPTS[3], QUANT[3] is not None,
                            QUANT_OPTS[0], QUANT_OPTS[4], BLOCK_N)

    @triton.jit
    def _add_norm_fwd_kernel(
        X, R, W, B, Y, S, MEAN, RSTD,    # S: the sum (pre: s; ADD_AFTER_NORM: out)
        X1, RS, W1, B1, Y1, Z,           # add_norm's modes and the gate (None when off)
        Q, QS, SC,                       # fp8 bits of y, its scales, a static scale
        n_rows, N, eps, weight_offset, residual_scale, rows_per_program, DROPOUT, QUANT,
        DTYPES: tl.constexpr, IS_RMS: tl.constexpr, ROUND_FIRST: tl.constexpr, ADD_AFTER_NORM: tl.constexpr,
        SCALE_RESIDUAL: tl.constexpr, ROUND_SUM_FIRST: tl.constexpr, GATE_OPTS: tl.constexpr,
        NORM_GROUP: tl.constexpr, QUANT_OPTS: tl.constexpr, BLOCK_N: tl.constexpr, L2: tl.constexpr = False,
        MOD=None, MOD_OPTS: tl.constexpr = None,
    ):
        """A row fits one block: one read of each input and one write of each output per row."""
        HAS_W1: tl.constexpr = W1 is not None
        QUANT_ON: tl.constexpr = Q[0] is not None
        HAS_GATE: tl.constexpr = Z[0] is not None
        cols = tl.arange(0, BLOCK_N)
        # Also with a second weight set in blocks that take one row per program anyway: its four
        # parameter blocks held across the row's reductions spilled (sm90, bf16 N = 16384); and with
        # the fp8 epilogue, whose y held for its amax spilled 8 B/thread (sm80, bf16 N = 16384).
        PARAMS_AFTER_STATS: tl.constexpr = ((BLOCK_N * X[0].dtype.element_ty.primitive_bitwidth // 8
                                             >= _PARAMS_AFTER_STATS_BYTES_C)
                                            or ((HAS_W1 or QUANT_ON) and BLOCK_N > _MULTI_ROW_MAX_BLOCK_C))
        if not PARAMS_AFTER_STATS:  # once per program
            w, b = _load_params(W, B, cols, cols < N, weight_offset, W is not None, B is not None)
            w1, b1 = _load_params(W1, B1, cols, cols < N, weight_offset, HAS_W1, B1 is not None)
        for i in range(rows_per_program):
            row = tl.program_id(0) * rows_per_program + i
            row_ok = row < n_rows
            mask = (cols < N) & row_ok
            row = row.to(tl.int64)
            s, u = _row_input(X, R, X1, RS, row, row_ok, cols, mask, N, residual_scale, DROPOUT, DTYPES,
                              R[0] is not None and not ADD_AFTER_NORM, SCALE_RESIDUAL, ROUND_SUM_FIRST)
            if S[0] is not None and not ADD_AFTER_NORM:
                tl.store(S[0] + row * S[1] + cols, s, mask=mask)
            gate, _ = _load_gate(Z[0], row * Z[1], cols, mask, HAS_GATE, GATE_OPTS[1])
            if HAS_GATE and not GATE_OPTS[0]:
                u = u * gate  # the norm of the gated input, unrounded
            if NORM_GROUP > 0:
                mean, rstd = _group_stats(u, mask, row_ok, 0, N, eps, MEAN, RSTD, row * (N // NORM_GROUP), IS_RMS,
                                          NORM_GROUP, BLOCK_N)
            else:
                if IS_RMS:
                    mean = 0.0
                    rstd = _rms_rstd(tl.sum(u * u, axis=0), N, eps, MEAN, row, row < n_rows, L2)
                else:
                    mean = tl.sum(u, axis=0) / N
                    d = tl.where(mask, u - mean, 0.0)
                    tl.store(MEAN + row, mean, mask=row < n_rows)
                    rstd = tl.rsqrt(tl.sum(d * d, axis=0) / N + eps)
                tl.store(RSTD + row, rstd, mask=row < n_rows)
            if PARAMS_AFTER_STATS:
                w, b = _load_params(W, B, cols, cols < N, weight_offset, W is not None, B is not None)
            n, y = _normalize_and_store(u, mean, rstd, w, b, Y[0], S[0], R[0], row * Y[1], row * S[1],
                                        _residual_row(R, row),
                                        cols, mask, residual_scale, W is not None, B is not None, IS_RMS, ROUND_FIRST,
                                        DTYPES[1], DTYPES[2], Y[0] is not None, ADD_AFTER_NORM, SCALE_RESIDUAL,
                                        gate, HAS_GATE and GATE_OPTS[0], GATE_OPTS[2], row, MOD, MOD_OPTS, Y1[0],
                                        row * Y1[1])
            if QUANT_ON:
                if SC is not None or QUANT_OPTS[1] > 0:
                    _row_quantize(y, mask, row_ok, 0, cols, N, Q, QS, SC, row, QUANT, QUANT_OPTS, BLOCK_N)
                else:
                    _quantize_row(y, mask, row_ok, cols, Q[0], QS[0], row * Q[1], row * QS[1], QUANT[0], QUANT[1],
                                  QUANT[2], QUANT[3], QUANT_OPTS[2], QUANT[1] is not None, QUANT[2] is not None,
                                  QUANT_OPTS[3], QUANT[3] is not None, QUANT_OPTS[0], QUANT_OPTS[4])
            if HAS_W1:
                if PARAMS_AFTER_STATS:  # once y is written: four parameter blocks of these rows spill
                    w1, b1 = _load_params(W1, B1, cols, cols < N, weight_offset, HAS_W1, B1 is not None)
                _store_second_norm(n, w1, b1, Y1[0], row * Y1[1], cols, mask, B1 is not None, DTYPES[2])

    @triton.jit
    def _looped_stats(X, R, X1, RS, S, Z, MEAN, RSTD, row, row_ok, cols0, zero, N, eps, residual_scale, DROPOUT,
                      DTYPES: tl.constexpr, IS_RMS: tl.constexpr, ADD_AFTER_NORM: tl.constexpr,
                      SCALE_RESIDUAL: tl.constexpr, ROUND_SUM_FIRST: tl.constexpr, GATE_OPTS: tl.constexpr,
                      NORM_GROUP: tl.constexpr, BLOCK_N: tl.constexpr, L2: tl.constexpr):
        """Pass 1 of a wide row: s stored block by block, the row's stats accumulated (Chan's parallel
        mean/M2 update for layer_norm) and stored; returns (mean, rstd) (statistics per group: none
        here, a group lies within a block and takes its statistics in pass 2)."""
        HAS_GATE: tl.constexpr = Z[0] is not None
        mean = zero
        m2 = zero
        count = zero
        for start in range(0, N, BLOCK_N):
            cols = start + cols0
            mask = (cols < N) & row_ok
            s, u = _row_input(X, R, X1, RS, row, row_ok, cols, mask, N, residual_scale, DROPOUT, DTYPES,
                              R[0] is not None and not ADD_AFTER_NORM, SCALE_RESIDUAL, ROUND_SUM_FIRST)
            if S[0] is not None and not ADD_AFTER_NORM:
                tl.store(S[0] + row * S[1] + cols, s, mask=mask)
            if HAS_GATE and not GATE_OPTS[0]:
                u = u * _load_gate(Z[0], row * Z[1], cols, mask, HAS_GATE, GATE_OPTS[1])[0]
            if NORM_GROUP > 0:
                pass  # a group lies within a block: its statistics are taken in the second pass
            elif IS_RMS:
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
        rstd = zero
        if NORM_GROUP == 0:
            if IS_RMS:  # m2: the sum of squares
                rstd = _rms_rstd(m2, N, eps, MEAN, row, row_ok, L2)
            else:
                rstd = tl.rsqrt(m2 / N + eps)
                tl.store(MEAN + row, mean, mask=row_ok)
            tl.store(RSTD + row, rstd, mask=row_ok)
        return mean, rstd

    @triton.jit
    def _looped_write(X, R, W, B, Y, S, MEAN, RSTD, X1, RS, W1, B1, Y1, Z, Q, QS, SC, row, row_ok, cols0, mean,
                      rstd, N, eps, weight_offset, residual_scale, DROPOUT, QUANT, DTYPES: tl.constexpr,
                      IS_RMS: tl.constexpr, ROUND_FIRST: tl.constexpr, ADD_AFTER_NORM: tl.constexpr,
                      SCALE_RESIDUAL: tl.constexpr, ROUND_SUM_FIRST: tl.constexpr, GATE_OPTS: tl.constexpr,
                      NORM_GROUP: tl.constexpr, QUANT_OPTS: tl.constexpr, BLOCK_N: tl.constexpr, MOD,
                      MOD_OPTS: tl.constexpr):
        """Pass 2 of a wide row: re-reads the row (the dropout mask regenerated, not stored) and writes y,
        out, y1 and q (a static scale or one per group); returns the bits of the row's amax of y."""
        HAS_GATE: tl.constexpr = Z[0] is not None
        amax_bits = tl.sum(tl.zeros([BLOCK_N], dtype=tl.int32), axis=0)
        for start in range(0, N, BLOCK_N):
            cols = start + cols0
            mask = (cols < N) & row_ok
            u = _row_input_again(X, R, X1, RS, S, row, row_ok, cols, mask, N, residual_scale, DROPOUT, DTYPES,
                                 ADD_AFTER_NORM, SCALE_RESIDUAL, ROUND_SUM_FIRST)
            gate, _ = _load_gate(Z[0], row * Z[1], cols, mask, HAS_GATE, GATE_OPTS[1])
            if HAS_GATE and not GATE_OPTS[0]:
                u = u * gate
            w, b = _load_params(W, B, cols, mask, weight_offset, W is not None, B is not None)
            if NORM_GROUP > 0:
                mean_c, rstd_c = _group_stats(u, mask, row_ok, start, N, eps, MEAN, RSTD, row * (N // NORM_GROUP),
                                              IS_RMS, NORM_GROUP, BLOCK_N)
            else:
                mean_c, rstd_c = mean, rstd
            n, y = _normalize_and_store(u, mean_c, rstd_c, w, b, Y[0], S[0], R[0], row * Y[1], row * S[1],
                                        _residual_row(R, row), cols, mask, residual_scale, W is not None,
                                        B is not None, IS_RMS,
                                        ROUND_FIRST, DTYPES[1], DTYPES[2], Y[0] is not None, ADD_AFTER_NORM,
                                        SCALE_RESIDUAL, gate, HAS_GATE and GATE_OPTS[0], GATE_OPTS[2], row, MOD,
                                        MOD_OPTS, Y1[0], row * Y1[1])
            if W1 is not None:
                w1, b1 = _load_params(W1, B1, cols, mask, weight_offset, True, B1 is not None)
                _store_second_norm(n, w1, b1, Y1[0], row * Y1[1], cols, mask, B1 is not None, DTYPES[2])
            if Q[0] is not None:
                if SC is not None or QUANT_OPTS[1] > 0:  # a group lies within a block
                    _row_quantize(y, mask, row_ok, start, cols, N, Q, QS, SC, row, QUANT, QUANT_OPTS, BLOCK_N)
                else:
                    amax_bits = tl.maximum(amax_bits, _abs_max_bits(y.to(tl.float32), mask, 0))
        return amax_bits

    @triton.jit
    def _looped_quantize_row(X, R, W, B, S, X1, RS, Q, QS, row, row_ok, cols0, mean, rstd, amax_bits, N,
                             weight_offset, residual_scale, DROPOUT, QUANT, DTYPES: tl.constexpr,
                             IS_RMS: tl.constexpr, ROUND_FIRST: tl.constexpr, ADD_AFTER_NORM: tl.constexpr,
                             SCALE_RESIDUAL: tl.constexpr, ROUND_SUM_FIRST: tl.constexpr,
                             QUANT_OPTS: tl.constexpr, BLOCK_N: tl.constexpr):
        """Pass 3 of a wide row with a dynamic scale per row (it needs the whole row's amax): the scale
        stored, y recomputed (the same bits) and q written."""
        amax = amax_bits.to(tl.float32, bitcast=True)
        scale = _dynamic_scale(amax, QUANT[0], QUANT[1], QUANT[2], QUANT_OPTS[2], QUANT[1] is not None,
                               QUANT[2] is not None)
        tl.store(QS[0] + row * QS[1], _scale_out(scale, QUANT_OPTS[4]), mask=row_ok)
        for start in range(0, N, BLOCK_N):
            cols = start + cols0
            mask = (cols < N) & row_ok
            u = _row_input_again(X, R, X1, RS, S, row, row_ok, cols, mask, N, residual_scale, DROPOUT, DTYPES,
                                 ADD_AFTER_NORM, SCALE_RESIDUAL, ROUND_SUM_FIRST)
            w, b = _load_params(W, B, cols, mask, weight_offset, W is not None, B is not None)
            _, y = _normalize_and_store(u, mean, rstd, w, b, None, S[0], R[0], 0, row * S[1],
                                        _residual_row(R, row), cols,
                                        mask, residual_scale, W is not None, B is not None, IS_RMS, ROUND_FIRST,
                                        DTYPES[1], DTYPES[2], False, False, SCALE_RESIDUAL)
            bits = _quant_bits(y.to(tl.float32), scale, QUANT[3], QUANT_OPTS[3], QUANT[3] is not None,
                               QUANT_OPTS[0])
            tl.store(Q[0] + row * Q[1] + cols, bits.to(tl.uint8), mask=mask)

    @triton.jit
    def _add_norm_fwd_looped_kernel(
        X, R, W, B, Y, S, MEAN, RSTD,
        X1, RS, W1, B1, Y1, Z,
        Q, QS, SC,
        n_rows, N, eps, weight_offset, residual_scale, rows_per_program, DROPOUT, QUANT,
        DTYPES: tl.constexpr, IS_RMS: tl.constexpr, ROUND_FIRST: tl.constexpr, ADD_AFTER_NORM: tl.constexpr,
        SCALE_RESIDUAL: tl.constexpr, ROUND_SUM_FIRST: tl.constexpr, GATE_OPTS: tl.constexpr,
        NORM_GROUP: tl.constexpr, QUANT_OPTS: tl.constexpr, BLOCK_N: tl.constexpr, L2: tl.constexpr = False,
        MOD=None, MOD_OPTS: tl.constexpr = None,
    ):
        """Rows wider than one block: pass 1 accumulates the stats block by block, pass 2 re-reads the
        row and writes; a dynamic quantization scale per row takes a third pass."""
        cols0 = tl.arange(0, BLOCK_N)
        zero = tl.sum(tl.zeros([BLOCK_N], dtype=tl.float32), axis=0)
        for i in range(rows_per_program):
            row = tl.program_id(0) * rows_per_program + i
            row_ok = row < n_rows
            row = row.to(tl.int64)
            mean, rstd = _looped_stats(X, R, X1, RS, S, Z, MEAN, RSTD, row, row_ok, cols0, zero, N, eps,
                                       residual_scale, DROPOUT, DTYPES, IS_RMS, ADD_AFTER_NORM, SCALE_RESIDUAL,
                                       ROUND_SUM_FIRST, GATE_OPTS, NORM_GROUP, BLOCK_N, L2)
            amax_bits = _looped_write(X, R, W, B, Y, S, MEAN, RSTD, X1, RS, W1, B1, Y1, Z, Q, QS, SC, row, row_ok,
                                      cols0, mean, rstd, N, eps, weight_offset, residual_scale, DROPOUT, QUANT,
                                      DTYPES, IS_RMS, ROUND_FIRST, ADD_AFTER_NORM, SCALE_RESIDUAL, ROUND_SUM_FIRST,
                                      GATE_OPTS, NORM_GROUP, QUANT_OPTS, BLOCK_N, MOD, MOD_OPTS)
            if Q[0] is not None and SC is None and QUANT_OPTS[1] == 0:
                _looped_quantize_row(X, R, W, B, S, X1, RS, Q, QS, row, row_ok, cols0, mean, rstd, amax_bits, N,
                                     weight_offset, residual_scale, DROPOUT, QUANT, DTYPES, IS_RMS, ROUND_FIRST,
                                     ADD_AFTER_NORM, SCALE_RESIDUAL, ROUND_SUM_FIRST, QUANT_OPTS, BLOCK_N)

    @triton.jit
    def _row_grads(DY, DE, INP, DY1, Z, w, w1, b, row, cols, mask, mean, rstd, HAS_WEIGHT: tl.constexpr,
                   HAS_B: tl.constexpr, IS_RMS: tl.constexpr, ADD_AFTER_NORM: tl.constexpr, GATE_OPTS: tl.constexpr,
                   ADALN, ADALN_OPTS: tl.constexpr):
        """x_hat, the gradients into the norm outputs (dn, dn1) and g = dn * w' + dn1 * w1' of one
        block of a row; with a gate also the norm input u, act(z), act'(z) and (gate "after") dz; with a
        modulation m = y * factor + shift (ADALN) dy is m's gradient: dn = dy * factor, and the
        modulation's own gradients dy * y0 (y0 = n * w' + b unrounded: rounding is straight-through)
        and dy (0.0 without a scale / a shift)."""
        HAS_GATE: tl.constexpr = Z[0] is not None
        u = tl.load(INP[0] + row * INP[1] + cols, mask=mask, other=0.0).to(tl.float32)
        a, da = _load_gate(Z[0], row * Z[1], cols, mask, HAS_GATE, GATE_OPTS[1])
        h = u
        if HAS_GATE and not GATE_OPTS[0]:
            h = u * a
        if IS_RMS:
            xhat = h * rstd
        else:
            xhat = (h - mean) * rstd
        xhat = tl.where(mask, xhat, 0.0)
        dy = tl.load(DY[0] + row * DY[1] + cols, mask=mask, other=0.0).to(tl.float32)
        dn = dy
        if ADD_AFTER_NORM and DE[0] is not None:
            dn += tl.load(DE[0] + row * DE[1] + cols, mask=mask, other=0.0).to(tl.float32)
        dscale = 0.0
        dshift = 0.0
        if ADALN[1][0] is not None:
            dshift = dn
        if ADALN[0][0] is not None:
            y0 = xhat
            if HAS_WEIGHT:
                y0 = y0 * w
            if HAS_B:
                y0 = y0 + b
            dscale = dn * y0
            dn = dn * _factor(ADALN[0], row, cols, mask, ADALN_OPTS[0])
        dz = 0.0
        if HAS_GATE and GATE_OPTS[0]:  # y = y0 * act(z): dz = dy * y0 * act'(z), and y0 gets dy * act(z)
            y0 = xhat
            if HAS_WEIGHT:
                y0 = y0 * w
            if HAS_B:
                y0 = y0 + b
            dz = dn * y0 * da
            dn = dn * a
        g = dn
        if HAS_WEIGHT:
            g = dn * w
        dn1 = 0.0
        if DY1[0] is not None:
            dn1 = tl.load(DY1[0] + row * DY1[1] + cols, mask=mask, other=0.0).to(tl.float32)
            g = g + dn1 * w1
        return xhat, dy, dn, g, dn1, u, a, da, dz, dscale, dshift

    @triton.jit
    def _block_grads(DY, DE, INP, DY1, Z, W, B, W1, MEAN, RSTD, row, row_ok, start, cols0, N, mean, rstd,
                     weight_offset, IS_RMS: tl.constexpr, ADD_AFTER_NORM: tl.constexpr, GATE_OPTS: tl.constexpr,
                     NORM_GROUP: tl.constexpr, ADALN, ADALN_OPTS: tl.constexpr):
        """One block of a wide row (looped backward): its columns, mask, the statistics of its
        groups (NORM_GROUP: per column), and _row_grads."""
        cols = start + cols0
        mask = (cols < N) & row_ok
        if NORM_GROUP > 0:
            mean, rstd = _group_stats_of(RSTD, MEAN, row, cols, mask, N, IS_RMS, NORM_GROUP)
        w, b = _load_params(W, B, cols, mask, weight_offset, W is not None, B is not None)
        w1, _ = _load_params(W1, W1, cols, mask, weight_offset, DY1[0] is not None, False)
        xhat, dy, dn, g, dn1, u, a, da, dz, dscale, dshift = _row_grads(
            DY, DE, INP, DY1, Z, w, w1, b, row, cols, mask, mean, rstd, W is not None, B is not None, IS_RMS,
            ADD_AFTER_NORM, GATE_OPTS, ADALN, ADALN_OPTS)
        return cols, mask, xhat, dy, dn, g, dn1, u, a, da, dz, dscale, dshift

    @triton.jit
    def _through_clamp(c1, MEAN, row, row_ok, L2: tl.constexpr):
        """mean(g * x_hat), the gradient through the row's norm: none where eps clamps an L2 norm (its
        stored norm is 0 there; rstd = sqrt(N) / ||u|| makes the rest rms_norm's formula)."""
        if L2:
            c1 = tl.where(tl.load(MEAN + row, mask=row_ok, other=0.0) > 0.0, c1, 0.0)
        return c1

    @triton.jit
    def _group_stats_of(RSTD, MEAN, row, cols, mask, N, IS_RMS: tl.constexpr, NORM_GROUP: tl.constexpr):
        """The saved mean and rstd of each column's group (flat per (row, group))."""
        stat = row * (N // NORM_GROUP) + cols // NORM_GROUP
        rstd = tl.load(RSTD + stat, mask=mask, other=0.0)
        mean = 0.0
        if not IS_RMS:
            mean = tl.load(MEAN + stat, mask=mask, other=0.0)
        return mean, rstd

    @triton.jit
    def _store_input_grads(DE, DX, DRES, DX1, DZ, RS, row, row_ok, cols, mask, N, xhat, dy, g, c1, c2, rstd,
                           residual_scale, DROPOUT, u, a, da, dz, IS_RMS: tl.constexpr,
                           ADD_AFTER_NORM: tl.constexpr, GATE_OPTS: tl.constexpr, ADALN):
        """du = rstd * (g - mean(g) - x_hat * mean(g * x_hat)) (a gate "before": times act(z), and
        dz = du * u * act'(z)) (+ dextra); dx = du * keep * scale * rowscale, dresidual, dx1 from it.
        A gated branch b = x * x_gate (ADALN): dx = db * x_gate, and db * x, the x_gate's gradient
        before its sum, is returned (0.0 without one)."""
        if IS_RMS:
            du = (g - xhat * c1) * rstd
        else:
            du = (g - c2 - xhat * c1) * rstd
        if DZ[0] is not None:
            if not GATE_OPTS[0]:
                dz = du * u * da
                du = du * a
            tl.store(DZ[0] + row * DZ[1] + cols, _round(dz, DZ[0].dtype.element_ty), mask=mask)
        if DE[0] is not None and not ADD_AFTER_NORM:
            du += tl.load(DE[0] + row * DE[1] + cols, mask=mask, other=0.0).to(tl.float32)
        dx = du
        if DROPOUT[0] is not None:
            dx = _keep_scale(dx, row, cols, N, DROPOUT[0], DROPOUT[1], DROPOUT[2])
        if RS is not None:
            dx = dx * _row_scale(RS, row, row_ok)
        dx_gate = 0.0
        if ADALN[2][0] is not None:
            XG, XB = ADALN[2], ADALN[3]
            dx_gate = dx * tl.load(XB[0] + row * XB[1] + cols, mask=mask, other=0.0).to(tl.float32)
            dx = dx * tl.load(XG[0] + _broadcast_row(XG, row) + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(DX[0] + row * DX[1] + cols, _round(dx, DX[0].dtype.element_ty), mask=mask)
        if DRES[0] is not None:
            dres = dy if ADD_AFTER_NORM else du
            tl.store(DRES[0] + row * DRES[1] + cols, _round(dres * residual_scale, DRES[0].dtype.element_ty),
                     mask=mask)
        if DX1[0] is not None:
            tl.store(DX1[0] + row * DX1[1] + cols, _round(du, DX1[0].dtype.element_ty), mask=mask)
        return dx_gate

    @triton.jit
    def _adaln_grad(OUT, MODE: tl.constexpr, acc, v, row, cols, mask, N):
        """One of the adaLN chain's gradients (a scale's, a shift's, an x_gate's) for one block of a row:
        MODE 2 (the operand has a row per row of x) stored as that row's, rounded to its dtype; MODE 1
        (one row per run of x's rows, this program's rows all in one run) added to ``acc``, returned."""
        if MODE == 2:
            tl.store(OUT + row * N + cols, _round(v, OUT.dtype.element_ty), mask=mask)
        if MODE == 1:
            acc += tl.where(mask, v, 0.0)
        return acc

    @triton.jit
    def _add_norm_bwd_kernel(
        DY, DE, INP, DY1, Z,             # (pointer, row stride); DE: grad of s (pre) / of y (ADD_AFTER_NORM)
        MEAN, RSTD, W, B, W1, RS,        # B: the norm's bias (a gate "after" reads y0); None when absent
        DX, DRES, DX1, DZ,               # the input grads (pointer, row stride)
        DW_PART, DB_PART, DW1_PART, DB1_PART,
        n_rows, N, weight_offset, residual_scale, rows_per_program, DROPOUT,
        ADALN,                           # (scale, shift, x_gate, x, dscale, dshift, dx_gate): the adaLN chain's
        ADALN_OPTS: tl.constexpr,        # (one_plus, and the MODE of each of its three gradients: _adaln_grad)
        IS_RMS: tl.constexpr, ADD_AFTER_NORM: tl.constexpr, GATE_OPTS: tl.constexpr, NORM_GROUP: tl.constexpr,
        BLOCK_N: tl.constexpr, L2: tl.constexpr = False,
    ):
        """Each program takes a contiguous chunk of rows and writes fp32 dw/db (dw1/db1) partials
        to row `pid` of [programs, N] buffers, summed on the host; so are the adaLN chain's gradients
        per run of rows (MODE 1: a program's rows lie in one run)."""
        HAS_DY1: tl.constexpr = DY1[0] is not None
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK_N)
        w, b = _load_params(W, B, cols, cols < N, weight_offset, W is not None, B is not None)  # once per program
        w1, _ = _load_params(W1, W1, cols, cols < N, weight_offset, HAS_DY1, False)
        dw = tl.zeros([BLOCK_N], dtype=tl.float32)
        db = tl.zeros([BLOCK_N], dtype=tl.float32)
        dw1 = tl.zeros([BLOCK_N], dtype=tl.float32)
        db1 = tl.zeros([BLOCK_N], dtype=tl.float32)
        dscale_run = tl.zeros([BLOCK_N], dtype=tl.float32)
        dshift_run = tl.zeros([BLOCK_N], dtype=tl.float32)
        dx_gate_run = tl.zeros([BLOCK_N], dtype=tl.float32)
        for i in range(rows_per_program):
            row = pid * rows_per_program + i
            row_ok = row < n_rows
            mask = (cols < N) & row_ok
            row = row.to(tl.int64)
            if NORM_GROUP > 0:
                mean, rstd = _group_stats_of(RSTD, MEAN, row, cols, mask, N, IS_RMS, NORM_GROUP)
            else:
                rstd = tl.load(RSTD + row, mask=row_ok, other=0.0)
                mean = 0.0 if IS_RMS else tl.load(MEAN + row, mask=row_ok, other=0.0)
            xhat, dy, dn, g, dn1, u, a, da, dz, dscale, dshift = _row_grads(
                DY, DE, INP, DY1, Z, w, w1, b, row, cols, mask, mean, rstd, W is not None, B is not None, IS_RMS,
                ADD_AFTER_NORM, GATE_OPTS, ADALN, ADALN_OPTS)
            if NORM_GROUP > 0:  # the means over each column's group
                c1 = _group_sum(g * xhat, NORM_GROUP, BLOCK_N) / NORM_GROUP
                c2 = 0.0 if IS_RMS else _group_sum(g, NORM_GROUP, BLOCK_N) / NORM_GROUP
            else:
                c1 = _through_clamp(tl.sum(g * xhat, axis=0) / N, MEAN, row, row_ok, L2)
                c2 = 0.0 if IS_RMS else tl.sum(g, axis=0) / N
            dx_gate = _store_input_grads(DE, DX, DRES, DX1, DZ, RS, row, row_ok, cols, mask, N, xhat, dy, g, c1, c2,
                                         rstd, residual_scale, DROPOUT, u, a, da, dz, IS_RMS, ADD_AFTER_NORM,
                                         GATE_OPTS, ADALN)
            dscale_run = _adaln_grad(ADALN[4], ADALN_OPTS[1], dscale_run, dscale, row, cols, mask, N)
            dshift_run = _adaln_grad(ADALN[5], ADALN_OPTS[2], dshift_run, dshift, row, cols, mask, N)
            dx_gate_run = _adaln_grad(ADALN[6], ADALN_OPTS[3], dx_gate_run, dx_gate, row, cols, mask, N)
            dw += dn * xhat
            db += dn
            if HAS_DY1:
                dw1 += dn1 * xhat
                db1 += dn1
        part = pid.to(tl.int64) * N + cols
        if W is not None:
            tl.store(DW_PART + part, dw, mask=cols < N)
        if DB_PART is not None:
            tl.store(DB_PART + part, db, mask=cols < N)
        if HAS_DY1:
            tl.store(DW1_PART + part, dw1, mask=cols < N)
            if DB1_PART is not None:
                tl.store(DB1_PART + part, db1, mask=cols < N)
        if ADALN_OPTS[1] == 1:
            tl.store(ADALN[4] + part, dscale_run, mask=cols < N)
        if ADALN_OPTS[2] == 1:
            tl.store(ADALN[5] + part, dshift_run, mask=cols < N)
        if ADALN_OPTS[3] == 1:
            tl.store(ADALN[6] + part, dx_gate_run, mask=cols < N)

    @triton.jit
    def _add_to_partial(PART, part, v, mask):
        """PART[part] += v (this program's own row of the partials: no atomics)."""
        if PART is not None:
            tl.store(PART + part, tl.load(PART + part, mask=mask, other=0.0) + v, mask=mask)

    @triton.jit
    def _adaln_looped_grads(ADALN, ADALN_OPTS: tl.constexpr, part, grads, row, cols, mask, N):
        """The looped kernel's _adaln_grad of one block, for the scale, the shift and the x_gate: a
        run's sum added into this program's partial row, a row's stored."""
        _adaln_looped_grad(ADALN[4], ADALN_OPTS[1], part, grads[0], row, cols, mask, N)
        _adaln_looped_grad(ADALN[5], ADALN_OPTS[2], part, grads[1], row, cols, mask, N)
        _adaln_looped_grad(ADALN[6], ADALN_OPTS[3], part, grads[2], row, cols, mask, N)

    @triton.jit
    def _adaln_looped_grad(OUT, MODE: tl.constexpr, part, v, row, cols, mask, N):
        if MODE == 1:
            _add_to_partial(OUT, part, v, mask)
        if MODE == 2:
            _adaln_grad(OUT, 2, 0.0, v, row, cols, mask, N)

    @triton.jit
    def _add_norm_bwd_looped_kernel(
        DY, DE, INP, DY1, Z,
        MEAN, RSTD, W, B, W1, RS,
        DX, DRES, DX1, DZ,
        DW_PART, DB_PART, DW1_PART, DB1_PART,
        n_rows, N, weight_offset, residual_scale, rows_per_program, DROPOUT, ADALN, ADALN_OPTS: tl.constexpr,
        IS_RMS: tl.constexpr, ADD_AFTER_NORM: tl.constexpr, GATE_OPTS: tl.constexpr, NORM_GROUP: tl.constexpr,
        BLOCK_N: tl.constexpr, L2: tl.constexpr = False,
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
            rstd = 0.0
            mean = 0.0
            if NORM_GROUP == 0:
                rstd = tl.load(RSTD + row, mask=row_ok, other=0.0)
                mean = 0.0 if IS_RMS else tl.load(MEAN + row, mask=row_ok, other=0.0)
            c1 = zero
            c2 = zero
            if NORM_GROUP == 0:  # (a group lies within a block: its sums are taken in the second pass)
                for start in range(0, N, BLOCK_N):
                    cols, mask, xhat, dy, dn, g, dn1, u, a, da, dz, dscale, dshift = _block_grads(
                        DY, DE, INP, DY1, Z, W, B, W1, MEAN, RSTD, row, row_ok, start, cols0, N, mean, rstd,
                        weight_offset, IS_RMS, ADD_AFTER_NORM, GATE_OPTS, NORM_GROUP, ADALN, ADALN_OPTS)
                    c1 += tl.sum(g * xhat, axis=0)
                    c2 += tl.sum(g, axis=0)
                c1 = _through_clamp(c1 / N, MEAN, row, row_ok, L2)
                c2 = c2 / N
            for start in range(0, N, BLOCK_N):
                cols, mask, xhat, dy, dn, g, dn1, u, a, da, dz, dscale, dshift = _block_grads(
                    DY, DE, INP, DY1, Z, W, B, W1, MEAN, RSTD, row, row_ok, start, cols0, N, mean, rstd,
                    weight_offset, IS_RMS, ADD_AFTER_NORM, GATE_OPTS, NORM_GROUP, ADALN, ADALN_OPTS)
                c1_c, c2_c, rstd_c = c1, c2, rstd
                if NORM_GROUP > 0:  # the means over each column's group, within this block
                    c1_c = _group_sum(g * xhat, NORM_GROUP, BLOCK_N) / NORM_GROUP
                    c2_c = _group_sum(g, NORM_GROUP, BLOCK_N) / NORM_GROUP
                    rstd_c = _group_stats_of(RSTD, MEAN, row, cols, mask, N, IS_RMS, NORM_GROUP)[1]
                dx_gate = _store_input_grads(DE, DX, DRES, DX1, DZ, RS, row, row_ok, cols, mask, N, xhat, dy, g,
                                             c1_c, c2_c, rstd_c, residual_scale, DROPOUT, u, a, da, dz, IS_RMS,
                                             ADD_AFTER_NORM, GATE_OPTS, ADALN)
                part = pid.to(tl.int64) * N + cols
                _adaln_looped_grads(ADALN, ADALN_OPTS, part, (dscale, dshift, dx_gate), row, cols, mask, N)
                _add_to_partial(DW_PART, part, dn * xhat, mask)
                _add_to_partial(DB_PART, part, dn, mask)
                if DY1[0] is not None:
                    _add_to_partial(DW1_PART, part, dn1 * xhat, mask)
                    _add_to_partial(DB1_PART, part, dn1, mask)
    @triton.jit
    def _dropout_keep_kernel(KEEP, seed, dropout_p, numel, BLOCK: tl.constexpr):
        """The keep mask the kernels above draw: element i (= row * N + col) of tl.rand(seed, i)."""
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        keep = tl.rand(seed, offs) >= dropout_p
        tl.store(KEEP + offs, keep.to(tl.int8), mask=offs < numel)


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
TL_DTYPES = {} if triton is None else {torch.float32: tl.float32, torch.float16: tl.float16,
                                       torch.bfloat16: tl.bfloat16}

_SM_COUNTS: dict = {}


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return _INTERPRETER_SMS
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNTS:
        _SM_COUNTS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNTS[index]


def _blocking(n_cols: int, element_size: int, backward: bool = False, two_norms: bool = False,
              quant: bool = False, gated: bool = False):
    """(BLOCK_N, num_warps, looped) for a row of n_cols elements, forward or backward.
    two_norms (a second weight set, y1): single pass up to half as many bytes, as the second
    parameter blocks (and their gradient accumulators) spilled at the top sizes (sm90, bf16:
    forward N = 32768, backward N = 8192). quant (the fp8 epilogue) likewise: the row's y, held
    for its amax, spilled 136-152 B/thread at bf16 N = 32768 (sm90). gated (a gate or statistics per
    group) likewise: the gate's block spilled 8-88 B/thread at 16-bit N = 32768 (forward) and
    N = 8192 (backward) on sm80/sm90."""
    block = triton.next_power_of_2(n_cols)
    limit = _MAX_FUSED_BYTES_BWD if backward else _MAX_FUSED_BYTES
    looped = block * element_size > (limit // 2 if two_norms or quant or gated else limit)
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


# add_norm_bwd's outputs past the 8 gradients the channel-norm kernels write (they take no modulation and no
# gated branch): None
_BWD_NOT_WRITTEN = (None,) * (len(DECLARATIONS["add_norm_bwd"].outputs) - 8)
_SCALE_FORMS = {form: i for i, form in enumerate(QUANT_SCALE_FORMS)}
_QUANT_APPLY = {apply: i for i, apply in enumerate(QUANT_APPLY)}
_NO_ROWS = (None, 0)  # an absent row operand


def _residual_operand(r: Optional[Tensor], n_rows: int) -> tuple:
    """The residual as the forward kernels read it: (its (P, N) rows, their stride, P), x's row r adding
    the residual's row r % P (P: a table's rows, broadcast over x's leading dims); P None when the
    residual has x's ``n_rows`` rows."""
    if r is None:
        return None, 0, None
    return r, r.stride(0), None if r.shape[0] == n_rows else r.shape[0]


def _row_operand(t: Optional[Tensor]) -> tuple:
    """A row operand of the kernels: (its (M, N) rows, their stride), or (None, 0)."""
    return _NO_ROWS if t is None else (t, t.stride(0))


_NO_BROADCAST = (None, 0, 1, 0)  # an absent broadcast operand


def broadcast_operand(t: Optional[Tensor], x: Tensor) -> Optional[tuple]:
    """``t`` (broadcastable to x: per sample (B, 1, N), per token (B, S, N), per column (N,)) as the
    kernels read it without a copy: (t, outer stride, period, inner stride), x's row r reading t's
    row at (r // period) * outer + (r % period) * inner, columns contiguous; None when x's leading
    dims do not collapse into two such strides (then the modulation runs around the kernels)."""
    if t is None:
        return _NO_BROADCAST
    view = t.expand(x.shape)
    if x.shape[-1] > 1 and view.stride(-1) != 1:
        return None
    dims: list[list[int]] = []  # (size, stride) of x's leading dims, merged where they are one stride apart
    for size, stride in zip(x.shape[:-1], view.stride()[:-1]):
        if dims and dims[-1][1] == stride * size:
            dims[-1] = [dims[-1][0] * size, stride]
        elif size != 1:
            dims.append([size, stride])
    if len(dims) > 2:
        return None
    outer, inner = ([[1, 0]] * (2 - len(dims)) + dims)
    return view, outer[1], max(inner[0], 1), inner[1]


def _x_gate_operand(rows) -> Optional[tuple]:
    """The gated branch's gate as the forward kernels read it (broadcast_operand), None without one."""
    if rows.x_gate is None:
        return None
    operand = broadcast_operand(rows.x_gate, rows.x)
    assert operand is not None, "_kernel_part forms the gated branch the kernels cannot read before them"
    return operand


def _modulation_launch_args(call, y_dtype: torch.dtype) -> dict:
    """MOD and MOD_OPTS of the forward kernels: the modulation's scale and shift read through their
    strides, whether it is fused (addcmul) and the dtypes it rounds to; {} without a modulation."""
    mod = getattr(call, "modulation", None)
    if mod is None:
        return {}
    x = call.rows.x
    dtype, out_dtype = reference.modulation_dtypes(y_dtype, mod)
    return dict(MOD=tuple(broadcast_operand(t, x) for t in mod.operands),
                MOD_OPTS=(bool(mod.fused), TL_DTYPES[dtype], TL_DTYPES[out_dtype], bool(mod.one_plus)))


def _quant_launch_args(spec: Optional[Fp8Quant], q: Optional[Tensor] = None, scale: Optional[Tensor] = None) -> dict:
    """The quantization epilogue's kernel arguments (all off without ``spec``): q (the (M, N) uint8 view of
    the fp8 output) and scale (the (M, 1 or N // G) fp32 output, None for a static scale)."""
    if spec is None:
        return dict(Q=_NO_ROWS, QS=_NO_ROWS, SC=None, QUANT=(0.0, None, None, None), QUANT_OPTS=(False, 0, 0, 0, False))
    static = None if spec.scale is None else spec.scale.reshape(1).to(torch.float32)
    return dict(
        Q=_row_operand(q), QS=_row_operand(scale), SC=static,
        QUANT=(torch.finfo(spec.dtype).max, *(None if v is None else float(v)
                                               for v in (spec.amax_min, spec.scale_min, spec.clamp))),
        QUANT_OPTS=(spec.dtype == torch.float8_e5m2, spec.group or 0, _SCALE_FORMS[spec.scale_form],
                    _QUANT_APPLY[spec.apply], spec.scale_out == "reciprocal"))


def _dropout_args(dropout) -> tuple:
    """DROPOUT: (seed, p, 1 / (1 - p)), the seed None without dropout."""
    if dropout is None or dropout.p <= 0:
        return (None, 0.0, 1.0)
    return (int(dropout.seed), dropout.p, 1.0 / (1.0 - dropout.p))


def _launch_fwd(call, y: Optional[Tensor], s: Optional[Tensor], y1: Optional[Tensor] = None,
                quant: Optional[dict] = None):
    """Shared by both orders (a NormAddCall: the norm, then out = s); y, s and y1 are (M, N) outputs or
    None when not stored; quant: the (M, N) uint8 q and the scale of add_norm_quant_fwd's epilogue.
    A gate and norm_group (statistics per group: a power of two, ops.py routes others to the
    reference) come from the call. Returns (mean, rstd)."""
    rows, norm, rounding = call.rows, call.norm, call.rounding
    add_after_norm = isinstance(call, NormAddCall)
    second, dropout, gate = (None, None, None) if add_after_norm else (call.second, call.dropout, call.gate)
    spec = None if add_after_norm else call.quant
    x, norm_group = rows.x, norm.group
    n_cols = x.shape[-1]
    x2, r2, x12, z2 = (_rows_2d(t, n_cols) for t in (x, rows.residual, rows.x1, None if gate is None else gate.z))
    n_rows = x2.shape[0]
    stat_rows = n_rows * (n_cols // norm_group if norm_group else 1)
    mean = x.new_empty((stat_rows,) if stores_mean(norm.kind) else (0,), dtype=torch.float32)
    rstd = x.new_empty((stat_rows,), dtype=torch.float32)
    if n_rows == 0:
        return mean, rstd
    widest = max(t.element_size() for t in (x, s, rows.x1) if t is not None)
    block, num_warps, looped = _blocking(n_cols, widest, two_norms=second is not None or y1 is not None,
                                         quant=spec is not None,
                                         gated=gate is not None or bool(norm_group))
    if looped and spec is not None and (spec.group or 0) > block:
        block = spec.group  # a quantization group lies within one block of the loop
    if looped and (norm_group or 0) > block:
        block = norm_group  # so does a group of the statistics
    rows_per_program = min(max(triton.cdiv(n_rows, 8 * _sm_count(x.device)), 1),
                           max(1, _MULTI_ROW_MAX_BLOCK // block))
    kernel = _add_norm_fwd_looped_kernel if looped else _add_norm_fwd_kernel
    out_dtype = rounding.out_dtype
    sum_dtype = x.dtype if add_after_norm else rounding.sum_dtype  # norm_add: x's rows are the norm input
    branch_dtype = x.dtype if rows.x1 is None else torch.promote_types(x.dtype, rows.x1.dtype)
    if rows.x_gate is not None:  # the branch is x * x_gate, rounded once
        branch_dtype = torch.promote_types(x.dtype, rows.x_gate.dtype)
    gate_out = gate.out_dtype if gate is not None and gate.position == "after" else None
    kernel[(triton.cdiv(n_rows, rows_per_program),)](
        (x2, x2.stride(0), _x_gate_operand(rows)), _residual_operand(r2, n_rows), _param(norm.weight), _param(norm.bias),
        _row_operand(y),
        _row_operand(s), mean if stores_mean(norm.kind) else rstd, rstd,   # rms_norm: MEAN never written
        _row_operand(x12), None if rows.rowscale is None else rows.rowscale.reshape(-1).contiguous(),
        None if second is None else _param(second.weight), None if second is None else _param(second.bias),
        _row_operand(y1), _row_operand(z2),
        n_rows=n_rows, N=n_cols, eps=norm.eps, weight_offset=norm.weight_offset,
        residual_scale=rows.residual_scale, rows_per_program=rows_per_program, DROPOUT=_dropout_args(dropout),
        **_quant_launch_args(spec, **(quant or {})), **_modulation_launch_args(call, out_dtype),
        DTYPES=(TL_DTYPES[sum_dtype], TL_DTYPES[rounding.norm_round_dtype or out_dtype], TL_DTYPES[out_dtype],
                TL_DTYPES[branch_dtype]),
        IS_RMS=norm.kind != "layer_norm", L2=norm.kind == "l2_norm",
        ROUND_FIRST=rounding.norm_round_dtype is not None, ADD_AFTER_NORM=add_after_norm, SCALE_RESIDUAL=rows.residual_scale != 1.0,
        ROUND_SUM_FIRST=rounding.round_sum_first,
        GATE_OPTS=(gate is not None and gate.position == "after", gate is None or gate.activation == "silu",
                   TL_DTYPES[gate_out or out_dtype]),
        NORM_GROUP=norm_group or 0, BLOCK_N=block, num_warps=num_warps,
        enable_fp_fusion=False)  # fp32 steps round where eager's ops do: no product contracted into an add
    return mean, rstd


def _rows_of(t: Optional[Tensor]) -> Optional[Tensor]:
    return None if t is None else t.view(-1, t.shape[-1])


# The gated residual branch (x * x_gate) is the forward kernels' prologue and the adaLN modulation
# (y * scale + shift) their epilogue: the gate, scale and shift read through their strides
# (broadcast_operand), the branch rounded once before the add, y modulated as it is stored. Operands
# whose leading dims do not collapse into two strides run as the reference's torch ops around the
# kernels. The backward kernels take both too (see "the backward of the adaLN chain" below), but for
# layouts they cannot sum per run: there reference.modulation_grads recomputes y from the saved
# statistics and the gradient into the branch stays fp32 until the gate's, around the kernels.

def _modulation_in_kernels(call: AddNormCall) -> bool:
    """Whether the kernels can read the modulation's scale and shift in place and round as it does."""
    mod, x = call.modulation, call.rows.x
    return all(broadcast_operand(t, x) is not None for t in mod.operands) \
        and all(d in TL_DTYPES for d in reference.modulation_dtypes(call.rounding.out_dtype, mod))


def _x_gate_in_kernels(call: AddNormCall) -> bool:
    """Whether the kernels can read the branch's gate in place and round the product as the reference."""
    rows = call.rows
    return broadcast_operand(rows.x_gate, rows.x) is not None \
        and torch.promote_types(rows.x.dtype, rows.x_gate.dtype) in TL_DTYPES


def _kernel_part(call: AddNormCall) -> Optional[AddNormCall]:
    """None when the kernels take the whole call; else the call they take: the gated branch formed
    before them (its product as their x) and the modulation left to the caller, each where the
    kernels cannot read its operands in place. (Decided once per call: it is on the per-call path.)"""
    rows, mod = call.rows, call.modulation
    branch_around = rows.x_gate is not None and not _x_gate_in_kernels(call)
    mod_around = mod is not None and not _modulation_in_kernels(call)
    if not (branch_around or mod_around):
        return None
    if branch_around:
        rows = dataclasses.replace(rows, x=reference.gated_branch(rows.x, rows.x_gate), x_gate=None)
    return dataclasses.replace(call, rows=rows, modulation=None if mod_around else mod)


def add_norm_fwd(call: AddNormCall):
    """(y, s, mean, rstd, y1) of add_norm_fwd; s None unless call.store.sum (ops.py clears it when there is
    no sum), y1 None without a second norm or a second modulation."""
    part = _kernel_part(call)
    if part is not None:
        y, s, mean, rstd, y1 = add_norm_fwd(part)
        mod = call.modulation
        if mod is not None and part.modulation is None:
            y1 = reference.modulate(y, mod.second()) if mod.twice else y1
            y = reference.modulate(y, mod)
        return y, s, mean, rstd, y1
    x, rounding, gate = call.rows.x, call.rounding, call.gate
    j = strided_fwd_ok(call)
    if j is not None:  # a channel norm: x or the residual stored channels-first
        return _add_norm_fwd_strided(call, j)
    out_dtype = rounding.out_dtype
    gated_after = gate is not None and gate.position == "after"
    if call.modulation is not None:  # y is stored modulated (the kernels' epilogue)
        out_dtype = reference.modulation_dtypes(out_dtype, call.modulation)[1]
    y = x.new_empty(x.shape, dtype=(gate.out_dtype or out_dtype) if gated_after else out_dtype)
    s = x.new_empty(x.shape, dtype=rounding.sum_dtype) if call.store.sum else None
    twice = call.modulation is not None and call.modulation.twice  # y1: y modulated a second time
    y1 = x.new_empty(x.shape, dtype=out_dtype) if call.second is not None or twice else None
    mean, rstd = _launch_fwd(call, _rows_of(y), _rows_of(s), _rows_of(y1))
    return y, s, mean, rstd, y1


def add_norm_quant_fwd(call: AddNormCall):
    """(y, s, mean, rstd, y1, q, scale): add_norm_fwd's, y None unless call.store.y, and the fp8 epilogue's
    q (call.quant.dtype) and scale (None for a static one)."""
    x, rounding, spec = call.rows.x, call.rounding, call.quant
    out_dtype = rounding.out_dtype
    y = x.new_empty(x.shape, dtype=out_dtype) if call.store.y else None
    s = x.new_empty(x.shape, dtype=rounding.sum_dtype) if call.store.sum else None
    y1 = x.new_empty(x.shape, dtype=out_dtype) if call.second is not None else None
    q = x.new_empty(x.shape, dtype=spec.dtype)
    scale = None
    if spec.scale is None:
        scale = x.new_empty(quant_scale_shape(x.shape, spec.group), dtype=torch.float32)
    mean, rstd = _launch_fwd(call, _rows_of(y), _rows_of(s), _rows_of(y1),
                             dict(q=_rows_of(q.view(torch.uint8)), scale=_rows_of(scale)))
    return y, s, mean, rstd, y1, q, scale


def norm_add_fwd(call: NormAddCall):
    """(out, y, mean, rstd): out = round(add_dtype, residual_scale * residual + y), y None unless store.y."""
    x, rounding = call.rows.x, call.rounding
    out = x.new_empty(x.shape, dtype=rounding.sum_dtype)
    y = x.new_empty(x.shape, dtype=rounding.out_dtype) if call.store.y else None
    mean, rstd = _launch_fwd(call, _rows_of(y), _rows_of(out))
    return out, y, mean, rstd


def _bwd_plan(call: BackwardCall, n_rows: int, n_cols: int, device, adaln: bool = False) -> tuple:
    """(block, num_warps, looped, programs, rows_per_program) of a row backward (``adaln``: the kernels
    sum gradients of the adaLN chain per run of rows, up to three more fp32 accumulators a column: the
    DiT chain's spilled 8 B/thread at bf16 N = 5120 and 8192 on sm90 in one pass, so such rows loop)."""
    grads, gate, norm_group = call.grads, call.gate, call.norm.group
    inp = call.saved.inp
    block, num_warps, looped = _blocking(n_cols, max(inp.element_size(), grads.dy.element_size()), backward=True,
                                         two_norms=_has_y1(call), gated=gate is not None or bool(norm_group) or adaln)
    if looped and (norm_group or 0) > block:
        block = norm_group  # a group of the statistics lies within one block of the loop
    k = 4 if block <= 1024 else 2 if block <= 4096 else 1
    programs = max(1, min(n_rows, k * _sm_count(device)))
    return block, num_warps, looped, programs, triton.cdiv(n_rows, programs) if n_rows else 0


def _has_y1(call: BackwardCall) -> bool:
    return call.grads.dy1 is not None and call.second is not None


def _add_norm_bwd_around_kernels(call: BackwardCall) -> tuple:
    """add_norm_bwd with the modulation's and the gated branch's gradients taken as the reference
    takes them, around the kernels' backward of the add and the norm."""
    grads, dtypes = call.grads, call.dtypes
    dscale = dshift = dscale1 = dshift1 = None
    if call.modulation is not None:
        dn, dscale, dshift, dscale1, dshift1 = reference.modulation_grads(grads.dy, call, grads.dy1)
        grads = dataclasses.replace(grads, dy=dn, dy1=None if call.modulation.twice else grads.dy1)
    if call.x_gate is not None:  # the branch's gradient kept in fp32 for the gate's products
        dtypes = dataclasses.replace(dtypes, x=torch.float32)
    out = list(add_norm_bwd(dataclasses.replace(call, grads=grads, dtypes=dtypes, modulation=None, x_gate=None)))
    out[8], out[9], out[11], out[12] = dscale, dshift, dscale1, dshift1
    if call.x_gate is not None:
        dx, out[10] = reference.gated_branch_grads(out[0], call.x_gate)
        out[0] = dx.to(call.dtypes.x)
    return tuple(out)


# The backward of the adaLN chain (the modulation's scale and shift, the gated branch's x_gate) runs in the
# row kernels when each operand is read per row of x or per run of consecutive rows (per sample: (B, 1, N),
# a run per sample; per column: one run): a per-row gradient is stored as the row's, a run's is summed in
# fp32 by each program over its rows, which lie in one run (rows_per_program divides the runs' length),
# and the programs' partial rows of a run are summed on the host. Other layouts, a second modulation and a
# gated norm keep the torch ops around the kernels; a channel norm's input is read as rows (a copy).

_NO_ADALN = ((_NO_BROADCAST, _NO_BROADCAST, _NO_BROADCAST, _NO_ROWS, None, None, None), (False, 0, 0, 0))


def _adaln_grad_layout(t: Optional[Tensor], inp: Tensor) -> Optional[tuple]:
    """(t, MODE, period, t as the kernels read it: broadcast_operand) of the gradient of an adaLN operand
    ``t`` read along x's rows (``inp`` has x's shape): MODE 0 without one, 2 when t has a row per row of
    x, 1 with period P when one row of t serves each run of P consecutive rows (P = 0: every row); None
    otherwise (a table shared across the batch)."""
    if t is None:
        return t, 0, 0, _NO_BROADCAST
    operand = broadcast_operand(t, inp)
    if operand is None or t.dtype not in TL_DTYPES:
        return None
    _, outer, period, inner = operand
    n_cols = inp.shape[-1]
    n_rows = inp.numel() // n_cols if n_cols else 0
    if t.numel() == inp.numel():
        return t, 2, 0, operand
    if inner == 0 and outer == 0 and t.numel() == n_cols:
        return t, 1, 0, operand
    if inner == 0 and n_rows % period == 0 and t.numel() == n_rows // period * n_cols:
        return t, 1, period, operand
    return None


def _adaln_in_kernels(call: BackwardCall) -> Optional[list]:
    """How the row kernels take the adaLN chain's backward: the layout of each gradient (scale, shift,
    x_gate, in that order: _adaln_grad_layout), or None when the torch ops around the kernels take it."""
    mod, x_gate = call.modulation, call.x_gate
    if call.add_after_norm or call.gate is not None or call.norm.group or call.second is not None \
            or (mod is not None and mod.twice) or (x_gate is not None and x_gate.x is None):
        return None
    operands = (None if mod is None else mod.scale, None if mod is None else mod.shift,
                None if x_gate is None else x_gate.gate)
    layouts = [_adaln_grad_layout(t, call.saved.inp) for t in operands]
    return None if None in layouts else layouts


def _rows_dividing(period: int, rows_per_program: int, n_rows: int, sms: int) -> int:
    """Rows per program that divide ``period`` (a program's rows then lie in one run), near the planned
    ``rows_per_program``: the largest divisor up to it, unless that is under half of it (a period with
    no small divisor: 4097 = 17 x 241 would take one row a program, and as many fp32 partial rows as x
    has rows), then the smallest divisor above it that leaves a program per SM."""
    below = next(d for d in range(min(rows_per_program, period), 0, -1) if period % d == 0)
    if 2 * below >= rows_per_program:
        return below
    above = next((d for d in range(rows_per_program + 1, period + 1) if period % d == 0), period)
    return above if n_rows // above >= sms else below


def _adaln_launch(call: BackwardCall, layouts: Optional[list], n_rows: int, n_cols: int, programs: int,
                  alloc) -> tuple[tuple, tuple, list]:
    """ADALN and ADALN_OPTS of the backward kernels (``programs`` of them) and, per gradient, (operand,
    MODE, period, buffer)."""
    if layouts is None:
        return (*_NO_ADALN, [])
    mod, x_gate, inp = call.modulation, call.x_gate, call.saved.inp
    outs = []
    for t, mode, period, _ in layouts:
        shape = (n_rows, n_cols) if mode == 2 else (programs, n_cols)
        dtype = t.dtype if mode == 2 else torch.float32
        outs.append((t, mode, period, None if mode == 0 else alloc(shape, dtype=dtype, device=inp.device)))
    x = None if x_gate is None else _rows_2d(x_gate.x, n_cols)
    adaln = (*(layout[3] for layout in layouts), _row_operand(x), *(o[3] for o in outs))
    one_plus = mod is not None and mod.one_plus
    return adaln, (one_plus, *(o[1] for o in outs)), outs


def _adaln_grad_of(t: Optional[Tensor], mode: int, period: int, buffer: Optional[Tensor], n_rows: int,
                   rows_per_program: int) -> Optional[Tensor]:
    """The gradient of adaLN operand ``t`` from what the kernels wrote (_adaln_launch's buffer)."""
    if t is None:
        return None
    if n_rows == 0:
        return t.new_zeros(t.shape)
    if mode == 2:
        return buffer.reshape(t.shape)
    if period == 0:
        total = buffer.sum(0)
    else:
        total = buffer.view(n_rows // period, period // rows_per_program, -1).sum(1)
    return total.reshape(t.shape).to(t.dtype)


def add_norm_bwd(call: BackwardCall):
    """The op's outputs: the 8 gradients (dx, dresidual, dweight, dbias, dx1, dweight1, dbias1, dgate), None
    where that input does not exist, then the modulation's and the gated branch's (dmod_scale, dmod_shift,
    dx_gate), and None for the second modulation's (taken around the kernels)."""
    layouts = None
    if call.modulation is not None or call.x_gate is not None:
        layouts = _adaln_in_kernels(call)
        if layouts is None:
            return _add_norm_bwd_around_kernels(call)
    j = strided_bwd_ok(call) if layouts is None else None
    if j is not None:  # a channel norm: its input stored channels-first
        return _add_norm_bwd_strided(call, j)
    grads, saved, norm, dtypes, gate = call.grads, call.saved, call.norm, call.dtypes, call.gate
    inp, weight, has_y1 = saved.inp, norm.weight, _has_y1(call)
    n_cols = inp.shape[-1]
    inp2, dy2, de2, dy12, z2 = (_rows_2d(t, n_cols) for t in (inp, grads.dy, grads.dextra,
                                                               grads.dy1 if has_y1 else None,
                                                               None if gate is None else gate.z))
    n_rows = inp2.shape[0]
    dx = inp.new_empty(inp.shape, dtype=dtypes.x)
    dz = None if gate is None else inp.new_empty(inp.shape, dtype=gate.z.dtype)
    dres = inp.new_empty(inp.shape, dtype=dtypes.residual) if dtypes.residual is not None else None
    dx1 = inp.new_empty(inp.shape, dtype=dtypes.x1) if dtypes.x1 is not None else None
    runs = [period for _, mode, period, _ in layouts or () if mode == 1]
    block, num_warps, looped, programs, rows_per_program = _bwd_plan(call, n_rows, n_cols, inp.device,
                                                                      adaln=bool(runs))
    runs = [period for period in runs if period]
    if runs and n_rows:  # a program's rows lie in one run of each per-run operand
        rows_per_program = _rows_dividing(functools.reduce(math.gcd, runs), rows_per_program, n_rows,
                                          _sm_count(inp.device))
        programs = n_rows // rows_per_program
    alloc = torch.zeros if looped or not n_rows else torch.empty  # zero rows: the sums below must be zero

    def partials(exists):
        return alloc((programs, n_cols), dtype=torch.float32, device=inp.device) if exists else None
    dw_part, db_part = partials(weight is not None), partials(dtypes.bias is not None)
    dw1_part, db1_part = partials(has_y1), partials(has_y1 and dtypes.bias1 is not None)
    adaln, adaln_opts, adaln_outs = _adaln_launch(call, layouts, n_rows, n_cols, programs, alloc)
    if n_rows:
        def out_rows(t):
            return _NO_ROWS if t is None else (t.view(-1, n_cols), n_cols)
        kernel = _add_norm_bwd_looped_kernel if looped else _add_norm_bwd_kernel
        kernel[(programs,)](
            _row_operand(dy2), _row_operand(de2), _row_operand(inp2), _row_operand(dy12), _row_operand(z2),
            saved.mean if stores_mean(norm.kind) else saved.rstd, saved.rstd,   # rms_norm: MEAN never read
            _param(weight), _param(norm.bias),
            _param(call.second.weight) if has_y1 else None,
            None if call.rowscale is None else call.rowscale.reshape(-1).contiguous(),
            out_rows(dx), out_rows(dres), out_rows(dx1), out_rows(dz), dw_part, db_part, dw1_part, db1_part,
            n_rows, n_cols, norm.weight_offset, call.residual_scale, rows_per_program, _dropout_args(call.dropout),
            adaln, adaln_opts,
            IS_RMS=norm.kind != "layer_norm", L2=norm.kind == "l2_norm", ADD_AFTER_NORM=call.add_after_norm,
            GATE_OPTS=(gate is not None and gate.position == "after", gate is None or gate.activation == "silu"),
            NORM_GROUP=norm.group or 0, BLOCK_N=block, num_warps=num_warps)
    # the [programs, N] fp32 partials are summed in fp32, rounded once to the parameter's dtype

    def reduced(part, dtype):
        return None if part is None else part.sum(0).to(dtype)
    weight1 = None if call.second is None else call.second.weight
    dscale, dshift, dx_gate = (_adaln_grad_of(*out, n_rows, rows_per_program) for out in adaln_outs) \
        if adaln_outs else (None, None, None)
    return (dx, dres, reduced(dw_part, None if weight is None else weight.dtype), reduced(db_part, dtypes.bias), dx1,
            reduced(dw1_part, None if weight1 is None else weight1.dtype), reduced(db1_part, dtypes.bias1), dz,
            dscale, dshift, dx_gate, None, None)


def dropout_keep(seed, n_rows: int, n_cols: int, p: float, device) -> Tensor:
    """This backend's keep mask (bool, (n_rows, n_cols)): element (row, col) is
    tl.rand(seed, row * n_cols + col) >= p, the draw the kernels make (Philox)."""
    keep = torch.empty((n_rows, n_cols), dtype=torch.bool, device=device)
    numel, block = keep.numel(), 1024
    if numel:
        _dropout_keep_kernel[(triton.cdiv(numel, block),)](keep.view(torch.int8), int(seed), p, numel, BLOCK=block)
    return keep


# --------------------------------------------------------------------------------------
# Channel norms: the normalized dim read with a stride
# --------------------------------------------------------------------------------------
# A vision model normalizes an NCHW tensor over C through ``x.permute(0, 2, 3, 1)``: the
# rows (one per position) are not contiguous, the positions are. These kernels read every
# tensor as (outer, positions, channels) with its own three strides, e.g. NCHW over C:
# row m = (n, hw), element (m, c) at n*C*HW + c*HW + hw. A program takes a tile of BLOCK_HW
# consecutive positions of one outer index and all channels, so loads run along the
# contiguous positions. The arithmetic is the row kernels' (the same helpers, the same
# rounding points); only the addressing differs. The modes (x1, rowscale, dropout, gate,
# groups, second norm, fp8 epilogue) and the norm-then-add order keep the row kernels: a
# channel norm comes without them, and such a call copies its operands to rows first.

if triton is not None:

    @triton.jit
    def _add_norm_fwd_strided_kernel(
        X, R, Y, S,                      # (pointer, outer, position and channel strides); absent: (None, 0, 0, 0)
        W, B, MEAN, RSTD,
        HW, N, eps, weight_offset, residual_scale, tiles_per_outer,
        DTYPES: tl.constexpr, IS_RMS: tl.constexpr, ROUND_FIRST: tl.constexpr, SCALE_RESIDUAL: tl.constexpr,
        ROUND_SUM_FIRST: tl.constexpr, BLOCK_HW: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        """One tile of BLOCK_HW rows x all N channels: one read of each input, one write of each output.
        DTYPES: (sum, norm round, out)."""
        pid = tl.program_id(0)
        outer = (pid // tiles_per_outer).to(tl.int64)
        hw = (pid % tiles_per_outer) * BLOCK_HW + tl.arange(0, BLOCK_HW)
        cols = tl.arange(0, BLOCK_N)
        hw_ok = hw < HW
        mask = hw_ok[:, None] & (cols < N)[None, :]
        h = hw.to(tl.int64)[:, None]
        c = cols.to(tl.int64)[None, :]
        row = outer * HW + hw.to(tl.int64)                       # (BLOCK_HW,): the row-major index of the rows
        s, u = _load_norm_input(X[0], R[0], None, None, row, hw_ok, outer * X[1] + h * X[2] + c * X[3],
                                outer * R[1] + h * R[2] + c * R[3], 0, 0, mask, N, residual_scale, None, 0.0, 1.0,
                                R[0] is not None, SCALE_RESIDUAL, DTYPES[0], ROUND_SUM_FIRST, False, False, False,
                                DTYPES[0])
        if S[0] is not None:
            tl.store(S[0] + outer * S[1] + h * S[2] + c * S[3], s, mask=mask)
        if IS_RMS:
            mean = 0.0
            var = tl.sum(u * u, axis=1) / N
        else:
            mean = tl.sum(u, axis=1) / N
            d = tl.where(mask, u - mean[:, None], 0.0)
            var = tl.sum(d * d, axis=1) / N
            tl.store(MEAN + row, mean, mask=hw_ok)
            mean = mean[:, None]
        rstd = tl.rsqrt(var + eps)
        tl.store(RSTD + row, rstd, mask=hw_ok)
        w, b = _load_params(W, B, cols, cols < N, weight_offset, W is not None, B is not None)
        if W is not None:
            w = w[None, :]
        if B is not None:
            b = b[None, :]
        _normalize_and_store(u, mean, rstd[:, None], w, b, Y[0], None, None, outer * Y[1] + h * Y[2] + c * Y[3], 0,
                             0, 0, mask, residual_scale, W is not None, B is not None, IS_RMS, ROUND_FIRST, DTYPES[1],
                             DTYPES[2], True, False, False)

    @triton.jit
    def _add_norm_bwd_strided_kernel(
        DY, DE, INP, DX, DRES,           # (pointer, outer, position and channel strides); DE: the gradient of s
        MEAN, RSTD, W, DW_PART, DB_PART,
        HW, N, n_tiles, tiles_per_outer, tiles_per_program, weight_offset, residual_scale,
        IS_RMS: tl.constexpr, BLOCK_HW: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        """Each program takes a run of tiles and writes fp32 dw/db partials to row `pid` of
        [programs, N] buffers, summed on the host (the row kernels' formulas, per tile)."""
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK_N)
        c = cols.to(tl.int64)[None, :]
        w, _ = _load_params(W, W, cols, cols < N, weight_offset, W is not None, False)
        if W is not None:
            w = w[None, :]
        dw = tl.zeros([BLOCK_N], dtype=tl.float32)
        db = tl.zeros([BLOCK_N], dtype=tl.float32)
        for i in range(tiles_per_program):
            tile = pid * tiles_per_program + i
            outer = (tile // tiles_per_outer).to(tl.int64)
            hw = (tile % tiles_per_outer) * BLOCK_HW + tl.arange(0, BLOCK_HW)
            hw_ok = (hw < HW) & (tile < n_tiles)
            mask = hw_ok[:, None] & (cols < N)[None, :]
            h = hw.to(tl.int64)[:, None]
            row = outer * HW + hw.to(tl.int64)
            rstd = tl.load(RSTD + row, mask=hw_ok, other=0.0)[:, None]
            u = tl.load(INP[0] + outer * INP[1] + h * INP[2] + c * INP[3], mask=mask, other=0.0).to(tl.float32)
            if IS_RMS:
                xhat = u * rstd
            else:
                xhat = (u - tl.load(MEAN + row, mask=hw_ok, other=0.0)[:, None]) * rstd
            xhat = tl.where(mask, xhat, 0.0)
            dy = tl.load(DY[0] + outer * DY[1] + h * DY[2] + c * DY[3], mask=mask, other=0.0).to(tl.float32)
            g = dy
            if W is not None:
                g = dy * w
            c1 = tl.sum(g * xhat, axis=1)[:, None] / N
            if IS_RMS:
                du = (g - xhat * c1) * rstd
            else:
                du = (g - tl.sum(g, axis=1)[:, None] / N - xhat * c1) * rstd
            if DE[0] is not None:
                du += tl.load(DE[0] + outer * DE[1] + h * DE[2] + c * DE[3], mask=mask, other=0.0).to(tl.float32)
            tl.store(DX[0] + outer * DX[1] + h * DX[2] + c * DX[3], _round(du, DX[0].dtype.element_ty), mask=mask)
            if DRES[0] is not None:
                tl.store(DRES[0] + outer * DRES[1] + h * DRES[2] + c * DRES[3],
                         _round(du * residual_scale, DRES[0].dtype.element_ty), mask=mask)
            dw += tl.sum(dy * xhat, axis=0)
            db += tl.sum(dy, axis=0)
        part = pid.to(tl.int64) * N + cols
        if W is not None:
            tl.store(DW_PART + part, dw, mask=cols < N)
        if DB_PART is not None:
            tl.store(DB_PART + part, db, mask=cols < N)


# Tile sizes: BLOCK_HW positions x next_pow2(C) channels, up to this many elements (forward /
# backward, whose tile holds x_hat, dy and g in fp32 at once); channels past one tile (C > 4096
# forward, 2048 backward) take the row kernels on a copy. num_warps: one per 512 elements, 1 to 8
# (forward: 40-79 registers, sm90); backward one per 128, up to 16 (with one per 256 it took
# 80-127 registers and kept occupancy at 0.25; benchmarks/bench_static_kernels.py).
_STRIDED_TILE = 4096
_STRIDED_TILE_BWD = 2048


def _as_3d(t: Optional[Tensor], j: int) -> Optional[Tensor]:
    """(outer, positions, channels) view of t, copying t to rows when its dims do not collapse so."""
    if t is None:
        return None
    shape = (math.prod(t.shape[:j]), math.prod(t.shape[j:-1]), t.shape[-1])
    try:
        return t.view(shape)
    except RuntimeError:
        return t.contiguous().view(shape)


def _strides_3d(t: Optional[Tensor]) -> tuple:
    return (0, 0, 0) if t is None else tuple(t.stride())


def _operand_3d(t: Optional[Tensor]) -> tuple:
    """A channel-norm kernel operand: (pointer, outer, position and channel strides), or (None, 0, 0, 0)."""
    return (t, *_strides_3d(t))


def _strided_tile(positions: int, n_cols: int, backward: bool) -> tuple[int, int, int]:
    """(BLOCK_HW, BLOCK_N, num_warps) of a channel-norm tile (C within one tile: strided_*_ok)."""
    block_n = triton.next_power_of_2(n_cols)
    tile = _STRIDED_TILE_BWD if backward else _STRIDED_TILE
    block_hw = max(1, min(tile // block_n, triton.next_power_of_2(max(positions, 1))))
    if backward:  # 4 elements a thread (at 8, fp32 LayerNorm's 4 x 512 tile kept a stack frame on sm90), 8
        # for a tile of one position (at 4, fp32 RMSNorm's 1 x 2048 one did)
        return block_hw, block_n, min(max(block_hw * block_n // (128 if block_hw > 1 else 256), 1), 16)
    return block_hw, block_n, min(max(block_hw * block_n // 512, 1), 8)


def strided_fwd_ok(call: AddNormCall) -> Optional[int]:
    """The split j (channel_split) of x or the residual when an add_norm call runs the
    channel-norm kernel, else None."""
    x, residual = call.rows.x, call.rows.residual
    if call.rows.x1 is not None or call.rows.rowscale is not None or call.second is not None \
            or call.dropout is not None and call.dropout.p > 0 or call.gate is not None or call.norm.group \
            or call.norm.kind == "l2_norm" or call.modulation is not None or call.rows.x_gate is not None \
            or triton is None or triton.next_power_of_2(x.shape[-1]) > _STRIDED_TILE \
            or residual is not None and residual.shape != x.shape:
        return None
    j = channel_split(x)
    return j if j is not None or residual is None else channel_split(residual)


def _add_norm_fwd_strided(call: AddNormCall, j: int):
    """add_norm_fwd's outputs for x or the residual stored channels-first (split j): y with contiguous rows (what
    a norm call returns), s in its residual's layout (reference.sum_like)."""
    rows, norm, rounding = call.rows, call.norm, call.rounding
    x, residual, kind, out_dtype = rows.x, rows.residual, norm.kind, rounding.out_dtype
    n_cols = x.shape[-1]
    y = x.new_empty(x.shape, dtype=out_dtype)
    s = sum_like(x if residual is None else residual, rounding.sum_dtype) if call.store.sum else None
    x3, r3, y3, s3 = (_as_3d(t, j) for t in (x, residual, y, s))
    n_rows = x.numel() // n_cols
    mean = x.new_empty((n_rows,) if kind == "layer_norm" else (0,), dtype=torch.float32)
    rstd = x.new_empty((n_rows,), dtype=torch.float32)
    if n_rows == 0:
        return y, s, mean, rstd, None
    positions = x3.shape[1]
    block_hw, block_n, num_warps = _strided_tile(positions, n_cols, backward=False)
    tiles_per_outer = triton.cdiv(positions, block_hw)
    _add_norm_fwd_strided_kernel[(x3.shape[0] * tiles_per_outer,)](
        _operand_3d(x3), _operand_3d(r3), _operand_3d(y3), _operand_3d(s3), _param(norm.weight), _param(norm.bias),
        mean if kind == "layer_norm" else rstd, rstd,   # rms_norm: MEAN never written
        positions, n_cols, norm.eps, norm.weight_offset, rows.residual_scale, tiles_per_outer,
        DTYPES=(TL_DTYPES[rounding.sum_dtype], TL_DTYPES[rounding.norm_round_dtype or out_dtype],
                TL_DTYPES[out_dtype]),
        IS_RMS=kind == "rms_norm", ROUND_FIRST=rounding.norm_round_dtype is not None,
        SCALE_RESIDUAL=rows.residual_scale != 1.0, ROUND_SUM_FIRST=rounding.round_sum_first,
        BLOCK_HW=block_hw, BLOCK_N=block_n, num_warps=num_warps, enable_fp_fusion=False)  # as the row kernels
    return y, s, mean, rstd, None


def _add_norm_bwd_strided(call: BackwardCall, j: int):
    """add_norm_bwd's gradients for a norm input stored channels-first (split j); dx and dresidual
    with contiguous rows, as the row kernels write them."""
    saved, norm, dtypes, weight = call.saved, call.norm, call.dtypes, call.norm.weight
    inp, rstd = saved.inp, saved.rstd
    n_cols = inp.shape[-1]
    dx = inp.new_empty(inp.shape, dtype=dtypes.x)
    dres = inp.new_empty(inp.shape, dtype=dtypes.residual) if dtypes.residual is not None else None
    i3, dy3, de3, dx3, dr3 = (_as_3d(t, j) for t in (inp, call.grads.dy, call.grads.dextra, dx, dres))
    positions = i3.shape[1]
    block_hw, block_n, num_warps = _strided_tile(positions, n_cols, backward=True)
    tiles_per_outer = triton.cdiv(positions, block_hw)
    n_tiles = i3.shape[0] * tiles_per_outer
    k = 4 if block_hw * block_n <= 1024 else 2
    programs = max(1, min(n_tiles, k * _sm_count(inp.device)))
    tiles_per_program = triton.cdiv(n_tiles, programs) if n_tiles else 0
    alloc = torch.empty if n_tiles else torch.zeros  # zero rows: the sums below must be zero

    def partials(exists):
        return alloc((programs, n_cols), dtype=torch.float32, device=inp.device) if exists else None
    dw_part, db_part = partials(weight is not None), partials(dtypes.bias is not None)
    if n_tiles:
        _add_norm_bwd_strided_kernel[(programs,)](
            _operand_3d(dy3), _operand_3d(de3), _operand_3d(i3), _operand_3d(dx3), _operand_3d(dr3),
            saved.mean if norm.kind == "layer_norm" else rstd, rstd, _param(weight), dw_part, db_part,
            positions, n_cols, n_tiles, tiles_per_outer, tiles_per_program, norm.weight_offset, call.residual_scale,
            IS_RMS=norm.kind == "rms_norm", BLOCK_HW=block_hw, BLOCK_N=block_n, num_warps=num_warps)
    # the [programs, N] fp32 partials are summed in fp32, rounded once to the parameter's dtype
    return (dx, dres, None if dw_part is None else dw_part.sum(0).to(weight.dtype),
            None if db_part is None else db_part.sum(0).to(dtypes.bias), None, None, None, None, *_BWD_NOT_WRITTEN)


def strided_bwd_ok(call: BackwardCall) -> Optional[int]:
    """The split j when an add_norm backward runs the channel-norm kernel, else None."""
    inp = call.saved.inp
    if _has_y1(call) or call.rowscale is not None or call.dropout is not None and call.dropout.p > 0 \
            or call.gate is not None or call.norm.group or call.add_after_norm or call.dtypes.x1 is not None \
            or call.norm.kind == "l2_norm" \
            or triton is None or triton.next_power_of_2(inp.shape[-1]) > _STRIDED_TILE_BWD:
        return None
    return channel_split(inp)
