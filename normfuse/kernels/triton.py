"""The Triton backend: kernels and their launchers.

The same function as ``reference.py`` (read that first), with the same backend
interface: ``add_norm_fwd``, ``norm_add_fwd``, ``add_norm_bwd`` take the custom
ops' arguments positionally and return None for outputs that do not exist.
CUDA/ROCm tensors run these kernels; CPU tensors run them under Triton's
interpreter when NORMFUSE_TRITON_CPU=1 (the tests do).
"""

from __future__ import annotations

import math
import os
import sys
from typing import Optional

import torch
from torch import Tensor

from normfuse.kernels.reference import channel_split, quant_scale_shape, sum_like
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
# s of add_norm, or out = r' + y of norm_add (ADD_AFTER_NORM). Flags are constexpr, so
# each combination compiles to straight-line code. Rows are addressed with 64-bit
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
                         HAS_ROWSCALE: tl.constexpr, HAS_DROPOUT: tl.constexpr, BRANCH_DTYPE: tl.constexpr):
        """(s, u): s = round(SUM_DTYPE, float(b) + float(round(r.dtype, scale * r))) with b the branch
        (x after dropout and rowscale, plus x1: each step rounded when ROUND_SUM_FIRST), and the
        norm input u in fp32: s, or the sum before any rounding (ROUND_SUM_FIRST off)."""
        u = tl.load(X + x_off + cols, mask=mask, other=0.0).to(tl.float32)
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
                             gate=1.0, GATE_AFTER: tl.constexpr = False, GATE_OUT_DTYPE: tl.constexpr = None):
        """y = round(OUT_DTYPE, n * w' + b) (n rounded first when ROUND_FIRST), times act(z) and rounded
        to GATE_OUT_DTYPE after a gate (GATE_AFTER: ``gate`` holds act(z)); then the post-add.
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
        if STORE_Y:
            tl.store(Y + y_off + cols, y, mask=mask)
        if ADD_AFTER_NORM:
            r = tl.load(R + r_off + cols, mask=mask, other=0.0)
            if SCALE_RESIDUAL:
                r = _round(r.to(tl.float32) * residual_scale, R.dtype.element_ty)
            tl.store(S + s_off + cols, _round(r.to(tl.float32) + y.to(tl.float32), S.dtype.element_ty), mask=mask)
        return n, y

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

    @triton.jit
    def _add_norm_fwd_kernel(
        X, R, W, B, Y, S, MEAN, RSTD,                        # S: the sum (pre: s; ADD_AFTER_NORM: out)
        X1, RS, W1, B1, Y1,                                  # add_norm's modes (dummies when off)
        Q, QS, SC,                                           # fp8 bits of y, its scales, a static scale
        stride_x, stride_r, stride_y, stride_s, stride_x1, stride_y1,   # row strides, in elements
        stride_q, stride_qs,
        n_rows, N, eps, weight_offset, residual_scale, rows_per_program, seed, dropout_p, dropout_scale,
        quant_max, quant_amax_min, quant_scale_min, quant_clamp,
        Z, stride_z,                                         # the gate (a dummy without one)
        SUM_DTYPE: tl.constexpr, NORM_ROUND_DTYPE: tl.constexpr, OUT_DTYPE: tl.constexpr,
        HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, IS_RMS: tl.constexpr,
        ROUND_FIRST: tl.constexpr, STORE_SUM: tl.constexpr, STORE_Y: tl.constexpr, ADD_AFTER_NORM: tl.constexpr,
        SCALE_RESIDUAL: tl.constexpr, ROUND_SUM_FIRST: tl.constexpr, HAS_X1: tl.constexpr,
        HAS_ROWSCALE: tl.constexpr, HAS_W1: tl.constexpr, HAS_B1: tl.constexpr, HAS_DROPOUT: tl.constexpr,
        BRANCH_DTYPE: tl.constexpr,
        QUANT: tl.constexpr, QUANT_E5M2: tl.constexpr, QUANT_STATIC: tl.constexpr, QUANT_GROUP: tl.constexpr,
        SCALE_FORM: tl.constexpr, HAS_AMAX_MIN: tl.constexpr, HAS_SCALE_MIN: tl.constexpr,
        QUANT_APPLY: tl.constexpr, HAS_CLAMP: tl.constexpr, SCALE_RECIPROCAL: tl.constexpr,
        HAS_GATE: tl.constexpr, GATE_AFTER: tl.constexpr, GATE_SILU: tl.constexpr, NORM_GROUP: tl.constexpr,
        GATE_OUT_DTYPE: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        """A row fits one block: one read of each input and one write of each output per row."""
        cols = tl.arange(0, BLOCK_N)
        # Also with a second weight set in blocks that take one row per program anyway: its four
        # parameter blocks held across the row's reductions spilled (sm90, bf16 N = 16384); and with
        # the fp8 epilogue, whose y held for its amax spilled 8 B/thread (sm80, bf16 N = 16384).
        PARAMS_AFTER_STATS: tl.constexpr = ((BLOCK_N * X.dtype.element_ty.primitive_bitwidth // 8
                                             >= _PARAMS_AFTER_STATS_BYTES_C)
                                            or ((HAS_W1 or QUANT) and BLOCK_N > _MULTI_ROW_MAX_BLOCK_C))
        if not PARAMS_AFTER_STATS:  # once per program
            w, b = _load_params(W, B, cols, cols < N, weight_offset, HAS_WEIGHT, HAS_BIAS)
            w1, b1 = _load_params(W1, B1, cols, cols < N, weight_offset, HAS_W1, HAS_B1)
        for i in range(rows_per_program):
            row = tl.program_id(0) * rows_per_program + i
            row_ok = row < n_rows
            mask = (cols < N) & row_ok
            row = row.to(tl.int64)
            s, u = _load_norm_input(X, R, X1, RS, row, row_ok, row * stride_x, row * stride_r, row * stride_x1, cols,
                                    mask, N, residual_scale, seed, dropout_p, dropout_scale,
                                    HAS_RESIDUAL and not ADD_AFTER_NORM, SCALE_RESIDUAL, SUM_DTYPE, ROUND_SUM_FIRST,
                                    HAS_X1, HAS_ROWSCALE, HAS_DROPOUT, BRANCH_DTYPE)
            if STORE_SUM and not ADD_AFTER_NORM:
                tl.store(S + row * stride_s + cols, s, mask=mask)
            gate, _ = _load_gate(Z, row * stride_z, cols, mask, HAS_GATE, GATE_SILU)
            if HAS_GATE and not GATE_AFTER:
                u = u * gate  # the norm of the gated input, unrounded
            if NORM_GROUP > 0:
                mean, rstd = _group_stats(u, mask, row_ok, 0, N, eps, MEAN, RSTD, row * (N // NORM_GROUP), IS_RMS,
                                          NORM_GROUP, BLOCK_N)
            else:
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
            n, y = _normalize_and_store(u, mean, rstd, w, b, Y, S, R, row * stride_y, row * stride_s,
                                        row * stride_r, cols, mask, residual_scale, HAS_WEIGHT, HAS_BIAS, IS_RMS,
                                        ROUND_FIRST, NORM_ROUND_DTYPE, OUT_DTYPE, STORE_Y, ADD_AFTER_NORM, SCALE_RESIDUAL,
                                        gate, HAS_GATE and GATE_AFTER, GATE_OUT_DTYPE)
            if QUANT:
                if QUANT_STATIC or QUANT_GROUP > 0:
                    _quantize_and_store(y, mask, row_ok, 0, cols, N, Q, QS, SC, row * stride_q, row * stride_qs,
                                        quant_max, quant_amax_min, quant_scale_min, quant_clamp, QUANT_STATIC,
                                        QUANT_GROUP, SCALE_FORM, HAS_AMAX_MIN, HAS_SCALE_MIN, QUANT_APPLY, HAS_CLAMP,
                                        QUANT_E5M2, SCALE_RECIPROCAL, BLOCK_N)
                else:
                    _quantize_row(y, mask, row_ok, cols, Q, QS, row * stride_q, row * stride_qs, quant_max,
                                  quant_amax_min, quant_scale_min, quant_clamp, SCALE_FORM, HAS_AMAX_MIN,
                                  HAS_SCALE_MIN, QUANT_APPLY, HAS_CLAMP, QUANT_E5M2, SCALE_RECIPROCAL)
            if HAS_W1:
                if PARAMS_AFTER_STATS:  # once y is written: four parameter blocks of these rows spill
                    w1, b1 = _load_params(W1, B1, cols, cols < N, weight_offset, HAS_W1, HAS_B1)
                _store_second_norm(n, w1, b1, Y1, row * stride_y1, cols, mask, HAS_B1, OUT_DTYPE)

    @triton.jit
    def _add_norm_fwd_looped_kernel(
        X, R, W, B, Y, S, MEAN, RSTD,
        X1, RS, W1, B1, Y1,
        Q, QS, SC,
        stride_x, stride_r, stride_y, stride_s, stride_x1, stride_y1,
        stride_q, stride_qs,
        n_rows, N, eps, weight_offset, residual_scale, rows_per_program, seed, dropout_p, dropout_scale,
        quant_max, quant_amax_min, quant_scale_min, quant_clamp,
        Z, stride_z,                                         # the gate (a dummy without one)
        SUM_DTYPE: tl.constexpr, NORM_ROUND_DTYPE: tl.constexpr, OUT_DTYPE: tl.constexpr,
        HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, IS_RMS: tl.constexpr,
        ROUND_FIRST: tl.constexpr, STORE_SUM: tl.constexpr, STORE_Y: tl.constexpr, ADD_AFTER_NORM: tl.constexpr,
        SCALE_RESIDUAL: tl.constexpr, ROUND_SUM_FIRST: tl.constexpr, HAS_X1: tl.constexpr,
        HAS_ROWSCALE: tl.constexpr, HAS_W1: tl.constexpr, HAS_B1: tl.constexpr, HAS_DROPOUT: tl.constexpr,
        BRANCH_DTYPE: tl.constexpr,
        QUANT: tl.constexpr, QUANT_E5M2: tl.constexpr, QUANT_STATIC: tl.constexpr, QUANT_GROUP: tl.constexpr,
        SCALE_FORM: tl.constexpr, HAS_AMAX_MIN: tl.constexpr, HAS_SCALE_MIN: tl.constexpr,
        QUANT_APPLY: tl.constexpr, HAS_CLAMP: tl.constexpr, SCALE_RECIPROCAL: tl.constexpr,
        HAS_GATE: tl.constexpr, GATE_AFTER: tl.constexpr, GATE_SILU: tl.constexpr, NORM_GROUP: tl.constexpr,
        GATE_OUT_DTYPE: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        """Rows wider than one block: pass 1 accumulates the stats block by block (Chan's
        parallel mean/M2 update for layer_norm), pass 2 re-reads the row and writes (the
        dropout mask is regenerated, not stored); a dynamic quantization scale per row takes a
        third pass."""
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
                s, u = _load_norm_input(X, R, X1, RS, row, row_ok, row * stride_x, row * stride_r, row * stride_x1,
                                        cols, mask, N, residual_scale, seed, dropout_p, dropout_scale,
                                        HAS_RESIDUAL and not ADD_AFTER_NORM, SCALE_RESIDUAL, SUM_DTYPE, ROUND_SUM_FIRST,
                                        HAS_X1, HAS_ROWSCALE, HAS_DROPOUT, BRANCH_DTYPE)
                if STORE_SUM and not ADD_AFTER_NORM:
                    tl.store(S + row * stride_s + cols, s, mask=mask)
                if HAS_GATE and not GATE_AFTER:
                    u = u * _load_gate(Z, row * stride_z, cols, mask, HAS_GATE, GATE_SILU)[0]
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
            if NORM_GROUP == 0:
                rstd = tl.rsqrt(m2 / N + eps)
                tl.store(RSTD + row, rstd, mask=row_ok)
                if not IS_RMS:
                    tl.store(MEAN + row, mean, mask=row_ok)
            amax_bits = tl.sum(tl.zeros([BLOCK_N], dtype=tl.int32), axis=0)
            for start in range(0, N, BLOCK_N):
                cols = start + cols0
                mask = (cols < N) & row_ok
                if STORE_SUM and not ADD_AFTER_NORM and ROUND_SUM_FIRST:
                    u = tl.load(S + row * stride_s + cols, mask=mask, other=0.0).to(tl.float32)
                else:
                    _, u = _load_norm_input(X, R, X1, RS, row, row_ok, row * stride_x, row * stride_r,
                                            row * stride_x1, cols, mask, N, residual_scale, seed, dropout_p,
                                            dropout_scale, HAS_RESIDUAL and not ADD_AFTER_NORM, SCALE_RESIDUAL,
                                            SUM_DTYPE, ROUND_SUM_FIRST, HAS_X1, HAS_ROWSCALE, HAS_DROPOUT, BRANCH_DTYPE)
                gate, _ = _load_gate(Z, row * stride_z, cols, mask, HAS_GATE, GATE_SILU)
                if HAS_GATE and not GATE_AFTER:
                    u = u * gate
                w, b = _load_params(W, B, cols, mask, weight_offset, HAS_WEIGHT, HAS_BIAS)
                if NORM_GROUP > 0:
                    mean_c, rstd_c = _group_stats(u, mask, row_ok, start, N, eps, MEAN, RSTD, row * (N // NORM_GROUP),
                                                  IS_RMS, NORM_GROUP, BLOCK_N)
                else:
                    mean_c, rstd_c = mean, rstd
                n, y = _normalize_and_store(u, mean_c, rstd_c, w, b, Y, S, R, row * stride_y, row * stride_s,
                                            row * stride_r, cols, mask, residual_scale, HAS_WEIGHT, HAS_BIAS, IS_RMS,
                                            ROUND_FIRST, NORM_ROUND_DTYPE, OUT_DTYPE, STORE_Y, ADD_AFTER_NORM,
                                            SCALE_RESIDUAL, gate, HAS_GATE and GATE_AFTER, GATE_OUT_DTYPE)
                if HAS_W1:
                    w1, b1 = _load_params(W1, B1, cols, mask, weight_offset, HAS_W1, HAS_B1)
                    _store_second_norm(n, w1, b1, Y1, row * stride_y1, cols, mask, HAS_B1, OUT_DTYPE)
                if QUANT:
                    if QUANT_STATIC or QUANT_GROUP > 0:  # a group lies within a block
                        _quantize_and_store(y, mask, row_ok, start, cols, N, Q, QS, SC, row * stride_q,
                                            row * stride_qs, quant_max, quant_amax_min, quant_scale_min, quant_clamp,
                                            QUANT_STATIC, QUANT_GROUP, SCALE_FORM, HAS_AMAX_MIN, HAS_SCALE_MIN,
                                            QUANT_APPLY, HAS_CLAMP, QUANT_E5M2, SCALE_RECIPROCAL, BLOCK_N)
                    else:
                        amax_bits = tl.maximum(amax_bits, _abs_max_bits(y.to(tl.float32), mask, 0))
            if QUANT and not QUANT_STATIC and QUANT_GROUP == 0:
                # a scale per row needs the whole row's amax: a third pass recomputes y (the same
                # bits) and writes q
                amax = amax_bits.to(tl.float32, bitcast=True)
                scale = _dynamic_scale(amax, quant_max, quant_amax_min, quant_scale_min, SCALE_FORM, HAS_AMAX_MIN,
                                       HAS_SCALE_MIN)
                tl.store(QS + row * stride_qs, _scale_out(scale, SCALE_RECIPROCAL), mask=row_ok)
                for start in range(0, N, BLOCK_N):
                    cols = start + cols0
                    mask = (cols < N) & row_ok
                    if STORE_SUM and not ADD_AFTER_NORM and ROUND_SUM_FIRST:
                        u = tl.load(S + row * stride_s + cols, mask=mask, other=0.0).to(tl.float32)
                    else:
                        _, u = _load_norm_input(X, R, X1, RS, row, row_ok, row * stride_x, row * stride_r,
                                                row * stride_x1, cols, mask, N, residual_scale, seed, dropout_p,
                                                dropout_scale, HAS_RESIDUAL and not ADD_AFTER_NORM, SCALE_RESIDUAL,
                                                SUM_DTYPE, ROUND_SUM_FIRST, HAS_X1, HAS_ROWSCALE, HAS_DROPOUT,
                                                BRANCH_DTYPE)
                    w, b = _load_params(W, B, cols, mask, weight_offset, HAS_WEIGHT, HAS_BIAS)
                    _, y = _normalize_and_store(u, mean, rstd, w, b, Y, S, R, row * stride_y, row * stride_s,
                                                row * stride_r, cols, mask, residual_scale, HAS_WEIGHT, HAS_BIAS,
                                                IS_RMS, ROUND_FIRST, NORM_ROUND_DTYPE, OUT_DTYPE, False, False,
                                                SCALE_RESIDUAL)
                    bits = _quant_bits(y.to(tl.float32), scale, quant_clamp, QUANT_APPLY, HAS_CLAMP, QUANT_E5M2)
                    tl.store(Q + row * stride_q + cols, bits.to(tl.uint8), mask=mask)

    @triton.jit
    def _row_grads(DY, DE, INP, DY1, w, w1, row, stride_dy, stride_de, stride_inp, stride_dy1, cols, mask, mean,
                   rstd, HAS_DEXTRA: tl.constexpr, HAS_WEIGHT: tl.constexpr, IS_RMS: tl.constexpr,
                   ADD_AFTER_NORM: tl.constexpr, HAS_DY1: tl.constexpr, Z=None, stride_z=0, b=0.0,
                   HAS_GATE: tl.constexpr = False, GATE_AFTER: tl.constexpr = False, GATE_SILU: tl.constexpr = True,
                   HAS_B: tl.constexpr = False):
        """x_hat, the gradients into the norm outputs (dn, dn1) and g = dn * w' + dn1 * w1' of one
        block of a row; with a gate also the norm input u, act(z), act'(z) and (gate "after") dz."""
        u = tl.load(INP + row * stride_inp + cols, mask=mask, other=0.0).to(tl.float32)
        a, da = _load_gate(Z, row * stride_z, cols, mask, HAS_GATE, GATE_SILU)
        h = u
        if HAS_GATE and not GATE_AFTER:
            h = u * a
        if IS_RMS:
            xhat = h * rstd
        else:
            xhat = (h - mean) * rstd
        xhat = tl.where(mask, xhat, 0.0)
        dy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
        dn = dy
        if ADD_AFTER_NORM and HAS_DEXTRA:
            dn += tl.load(DE + row * stride_de + cols, mask=mask, other=0.0).to(tl.float32)
        dz = 0.0
        if HAS_GATE and GATE_AFTER:  # y = y0 * act(z): dz = dy * y0 * act'(z), and y0 gets dy * act(z)
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
        if HAS_DY1:
            dn1 = tl.load(DY1 + row * stride_dy1 + cols, mask=mask, other=0.0).to(tl.float32)
            g = g + dn1 * w1
        return xhat, dy, dn, g, dn1, u, a, da, dz

    @triton.jit
    def _block_grads(DY, DE, INP, DY1, W, W1, row, row_ok, start, cols0, N, stride_dy, stride_de, stride_inp,
                     stride_dy1, mean, rstd, weight_offset, HAS_DEXTRA: tl.constexpr, HAS_WEIGHT: tl.constexpr,
                     IS_RMS: tl.constexpr, ADD_AFTER_NORM: tl.constexpr, HAS_DY1: tl.constexpr, Z, stride_z, B, RSTD, MEAN,
                     HAS_GATE: tl.constexpr, GATE_AFTER: tl.constexpr, GATE_SILU: tl.constexpr, HAS_B: tl.constexpr,
                     NORM_GROUP: tl.constexpr):
        """One block of a wide row (looped backward): its columns, mask, the statistics of its
        groups (NORM_GROUP: per column), and _row_grads."""
        cols = start + cols0
        mask = (cols < N) & row_ok
        if NORM_GROUP > 0:
            mean, rstd = _group_stats_of(RSTD, MEAN, row, cols, mask, N, IS_RMS, NORM_GROUP)
        w, b = _load_params(W, B, cols, mask, weight_offset, HAS_WEIGHT, HAS_B)
        w1, _ = _load_params(W1, W1, cols, mask, weight_offset, HAS_DY1, False)
        xhat, dy, dn, g, dn1, u, a, da, dz = _row_grads(
            DY, DE, INP, DY1, w, w1, row, stride_dy, stride_de, stride_inp, stride_dy1, cols, mask, mean, rstd,
            HAS_DEXTRA, HAS_WEIGHT, IS_RMS, ADD_AFTER_NORM, HAS_DY1, Z, stride_z, b, HAS_GATE, GATE_AFTER, GATE_SILU,
            HAS_B)
        return cols, mask, xhat, dy, dn, g, dn1, u, a, da, dz

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
    def _store_input_grads(DE, DX, DRES, DX1, RS, row, row_ok, stride_de, stride_dx, stride_dres, stride_dx1, cols,
                           mask, N, xhat, dy, g, c1, c2, rstd, residual_scale, seed, dropout_p, dropout_scale,
                           HAS_DEXTRA: tl.constexpr, HAS_DRES: tl.constexpr, IS_RMS: tl.constexpr,
                           ADD_AFTER_NORM: tl.constexpr, HAS_DX1: tl.constexpr, HAS_ROWSCALE: tl.constexpr,
                           HAS_DROPOUT: tl.constexpr, DZ=None, stride_dz=0, u=0.0, a=1.0, da=0.0, dz=0.0,
                           HAS_GATE: tl.constexpr = False, GATE_AFTER: tl.constexpr = False):
        """du = rstd * (g - mean(g) - x_hat * mean(g * x_hat)) (a gate "before": times act(z), and
        dz = du * u * act'(z)) (+ dextra); dx = du * keep * scale * rowscale, dresidual, dx1 from it."""
        if IS_RMS:
            du = (g - xhat * c1) * rstd
        else:
            du = (g - c2 - xhat * c1) * rstd
        if HAS_GATE:
            if not GATE_AFTER:
                dz = du * u * da
                du = du * a
            tl.store(DZ + row * stride_dz + cols, _round(dz, DZ.dtype.element_ty), mask=mask)
        if HAS_DEXTRA and not ADD_AFTER_NORM:
            du += tl.load(DE + row * stride_de + cols, mask=mask, other=0.0).to(tl.float32)
        dx = du
        if HAS_DROPOUT:
            dx = _keep_scale(dx, row, cols, N, seed, dropout_p, dropout_scale)
        if HAS_ROWSCALE:
            dx = dx * _row_scale(RS, row, row_ok)
        tl.store(DX + row * stride_dx + cols, _round(dx, DX.dtype.element_ty), mask=mask)
        if HAS_DRES:
            dres = dy if ADD_AFTER_NORM else du
            tl.store(DRES + row * stride_dres + cols, _round(dres * residual_scale, DRES.dtype.element_ty),
                     mask=mask)
        if HAS_DX1:
            tl.store(DX1 + row * stride_dx1 + cols, _round(du, DX1.dtype.element_ty), mask=mask)

    @triton.jit
    def _add_norm_bwd_kernel(
        DY, DE, INP, MEAN, RSTD, W, DX, DRES, DW_PART, DB_PART,   # DE: grad of s (pre) / of y (ADD_AFTER_NORM)
        DY1, W1, RS, DX1, DW1_PART, DB1_PART,                     # add_norm's modes (dummies when off)
        stride_dy, stride_de, stride_inp, stride_dx, stride_dres, stride_dy1, stride_dx1,
        n_rows, N, weight_offset, residual_scale, rows_per_program, seed, dropout_p, dropout_scale,
        Z, DZ, B, stride_z, stride_dz,                            # the gate, its grad, the bias (gate "after")
        HAS_DEXTRA: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_DRES: tl.constexpr,
        IS_RMS: tl.constexpr, ADD_AFTER_NORM: tl.constexpr, HAS_DY1: tl.constexpr, HAS_B1: tl.constexpr,
        HAS_DX1: tl.constexpr, HAS_ROWSCALE: tl.constexpr, HAS_DROPOUT: tl.constexpr,
        HAS_GATE: tl.constexpr, GATE_AFTER: tl.constexpr, GATE_SILU: tl.constexpr, HAS_B: tl.constexpr,
        NORM_GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        """Each program takes a contiguous chunk of rows and writes fp32 dw/db (dw1/db1) partials
        to row `pid` of [programs, N] buffers, summed on the host."""
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK_N)
        w, b = _load_params(W, B, cols, cols < N, weight_offset, HAS_WEIGHT, HAS_B)  # once per program
        w1, _ = _load_params(W1, W1, cols, cols < N, weight_offset, HAS_DY1, False)
        dw = tl.zeros([BLOCK_N], dtype=tl.float32)
        db = tl.zeros([BLOCK_N], dtype=tl.float32)
        dw1 = tl.zeros([BLOCK_N], dtype=tl.float32)
        db1 = tl.zeros([BLOCK_N], dtype=tl.float32)
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
            xhat, dy, dn, g, dn1, u, a, da, dz = _row_grads(
                DY, DE, INP, DY1, w, w1, row, stride_dy, stride_de, stride_inp, stride_dy1, cols, mask, mean, rstd,
                HAS_DEXTRA, HAS_WEIGHT, IS_RMS, ADD_AFTER_NORM, HAS_DY1, Z, stride_z, b, HAS_GATE, GATE_AFTER, GATE_SILU,
                HAS_B)
            if NORM_GROUP > 0:  # the means over each column's group
                c1 = _group_sum(g * xhat, NORM_GROUP, BLOCK_N) / NORM_GROUP
                c2 = 0.0 if IS_RMS else _group_sum(g, NORM_GROUP, BLOCK_N) / NORM_GROUP
            else:
                c1 = tl.sum(g * xhat, axis=0) / N
                c2 = 0.0 if IS_RMS else tl.sum(g, axis=0) / N
            _store_input_grads(DE, DX, DRES, DX1, RS, row, row_ok, stride_de, stride_dx, stride_dres, stride_dx1, cols,
                               mask, N, xhat, dy, g, c1, c2, rstd, residual_scale, seed, dropout_p, dropout_scale,
                               HAS_DEXTRA, HAS_DRES, IS_RMS, ADD_AFTER_NORM, HAS_DX1, HAS_ROWSCALE, HAS_DROPOUT, DZ,
                               stride_dz, u, a, da, dz, HAS_GATE, GATE_AFTER)
            dw += dn * xhat
            db += dn
            if HAS_DY1:
                dw1 += dn1 * xhat
                db1 += dn1
        part = pid.to(tl.int64) * N + cols
        if HAS_WEIGHT:
            tl.store(DW_PART + part, dw, mask=cols < N)
        if HAS_BIAS:
            tl.store(DB_PART + part, db, mask=cols < N)
        if HAS_DY1:
            tl.store(DW1_PART + part, dw1, mask=cols < N)
            if HAS_B1:
                tl.store(DB1_PART + part, db1, mask=cols < N)

    @triton.jit
    def _add_norm_bwd_looped_kernel(
        DY, DE, INP, MEAN, RSTD, W, DX, DRES, DW_PART, DB_PART,
        DY1, W1, RS, DX1, DW1_PART, DB1_PART,
        stride_dy, stride_de, stride_inp, stride_dx, stride_dres, stride_dy1, stride_dx1,
        n_rows, N, weight_offset, residual_scale, rows_per_program, seed, dropout_p, dropout_scale,
        Z, DZ, B, stride_z, stride_dz,                            # the gate, its grad, the bias (gate "after")
        HAS_DEXTRA: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_DRES: tl.constexpr,
        IS_RMS: tl.constexpr, ADD_AFTER_NORM: tl.constexpr, HAS_DY1: tl.constexpr, HAS_B1: tl.constexpr,
        HAS_DX1: tl.constexpr, HAS_ROWSCALE: tl.constexpr, HAS_DROPOUT: tl.constexpr,
        HAS_GATE: tl.constexpr, GATE_AFTER: tl.constexpr, GATE_SILU: tl.constexpr, HAS_B: tl.constexpr,
        NORM_GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
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
                    cols, mask, xhat, dy, dn, g, dn1, u, a, da, dz = _block_grads(
                        DY, DE, INP, DY1, W, W1, row, row_ok, start, cols0, N, stride_dy, stride_de, stride_inp,
                        stride_dy1, mean, rstd, weight_offset, HAS_DEXTRA, HAS_WEIGHT, IS_RMS, ADD_AFTER_NORM, HAS_DY1, Z,
                        stride_z, B, RSTD, MEAN, HAS_GATE, GATE_AFTER, GATE_SILU, HAS_B, NORM_GROUP)
                    c1 += tl.sum(g * xhat, axis=0)
                    c2 += tl.sum(g, axis=0)
                c1 = c1 / N
                c2 = c2 / N
            for start in range(0, N, BLOCK_N):
                cols, mask, xhat, dy, dn, g, dn1, u, a, da, dz = _block_grads(
                    DY, DE, INP, DY1, W, W1, row, row_ok, start, cols0, N, stride_dy, stride_de, stride_inp,
                    stride_dy1, mean, rstd, weight_offset, HAS_DEXTRA, HAS_WEIGHT, IS_RMS, ADD_AFTER_NORM, HAS_DY1, Z,
                    stride_z, B, RSTD, MEAN, HAS_GATE, GATE_AFTER, GATE_SILU, HAS_B, NORM_GROUP)
                c1_c, c2_c, rstd_c = c1, c2, rstd
                if NORM_GROUP > 0:  # the means over each column's group, within this block
                    c1_c = _group_sum(g * xhat, NORM_GROUP, BLOCK_N) / NORM_GROUP
                    c2_c = _group_sum(g, NORM_GROUP, BLOCK_N) / NORM_GROUP
                    rstd_c = _group_stats_of(RSTD, MEAN, row, cols, mask, N, IS_RMS, NORM_GROUP)[1]
                _store_input_grads(DE, DX, DRES, DX1, RS, row, row_ok, stride_de, stride_dx, stride_dres, stride_dx1,
                                   cols, mask, N, xhat, dy, g, c1_c, c2_c, rstd_c, residual_scale, seed, dropout_p,
                                   dropout_scale, HAS_DEXTRA, HAS_DRES, IS_RMS, ADD_AFTER_NORM, HAS_DX1, HAS_ROWSCALE,
                                   HAS_DROPOUT, DZ, stride_dz, u, a, da, dz, HAS_GATE, GATE_AFTER)
                part = pid.to(tl.int64) * N + cols
                if HAS_WEIGHT:
                    tl.store(DW_PART + part, tl.load(DW_PART + part, mask=mask, other=0.0) + dn * xhat, mask=mask)
                if HAS_BIAS:
                    tl.store(DB_PART + part, tl.load(DB_PART + part, mask=mask, other=0.0) + dn, mask=mask)
                if HAS_DY1:
                    tl.store(DW1_PART + part, tl.load(DW1_PART + part, mask=mask, other=0.0) + dn1 * xhat,
                             mask=mask)
                    if HAS_B1:
                        tl.store(DB1_PART + part, tl.load(DB1_PART + part, mask=mask, other=0.0) + dn1, mask=mask)

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


_SCALE_FORMS = {form: i for i, form in enumerate(QUANT_SCALE_FORMS)}
_QUANT_APPLY = {apply: i for i, apply in enumerate(QUANT_APPLY)}


def _quant_launch_args(quant: Optional[dict], dummy: Tensor) -> dict:
    """The quantization epilogue's kernel arguments (all off without ``quant``). ``quant``: q (the
    (M, N) uint8 view of the fp8 output), scale (the (M, 1 or N // G) fp32 output, None for a static
    scale), and the op's quant_* arguments without their prefix."""
    if quant is None:
        return dict(Q=dummy, QS=dummy, SC=dummy, stride_q=0, stride_qs=0, quant_max=0.0, quant_amax_min=0.0,
                    quant_scale_min=0.0, quant_clamp=0.0, QUANT=False, QUANT_E5M2=False, QUANT_STATIC=False,
                    QUANT_GROUP=0, SCALE_FORM=0, HAS_AMAX_MIN=False, HAS_SCALE_MIN=False, QUANT_APPLY=0,
                    HAS_CLAMP=False, SCALE_RECIPROCAL=False)
    static, scale = quant["static"], quant["scale"]
    return dict(
        Q=quant["q"], QS=dummy if scale is None else scale, SC=dummy if static is None else static,
        stride_q=quant["q"].stride(0), stride_qs=0 if scale is None else scale.stride(0),
        quant_max=torch.finfo(quant["dtype"]).max, quant_amax_min=float(quant["amax_min"] or 0.0),
        quant_scale_min=float(quant["scale_min"] or 0.0), quant_clamp=float(quant["clamp"] or 0.0),
        QUANT=True, QUANT_E5M2=quant["dtype"] == torch.float8_e5m2, QUANT_STATIC=static is not None,
        QUANT_GROUP=quant["group"] or 0, SCALE_FORM=_SCALE_FORMS[quant["scale_form"]],
        HAS_AMAX_MIN=quant["amax_min"] is not None, HAS_SCALE_MIN=quant["scale_min"] is not None,
        QUANT_APPLY=_QUANT_APPLY[quant["apply"]], HAS_CLAMP=quant["clamp"] is not None,
        SCALE_RECIPROCAL=quant["scale_out"] == "reciprocal")


def _launch_fwd(x, residual, weight, bias, y, s, kind, eps, weight_offset, residual_scale, sum_dtype,
                norm_round_dtype, out_dtype, store_sum, store_y, add_after_norm, round_sum_first=True, x1=None,
                rowscale=None, weight1=None, bias1=None, y1=None, dropout_p=0.0, seed=None, quant=None, gate=None,
                gate_position="before", gate_activation="silu", norm_group=None, gate_out_dtype=None):
    """Shared by both orders; y, s and y1 are (M, N) outputs or None when not stored; quant: the
    quantization epilogue's outputs and options (``_quant_launch_args``); gate and norm_group: the
    gated norm and the statistics per group (a power of two, ops.py routes others to the reference)."""
    n_cols = x.shape[-1]
    x2, r2, x12, z2 = (_rows_2d(t, n_cols) for t in (x, residual, x1, gate))
    n_rows = x2.shape[0]
    acc = torch.float32
    stat_rows = n_rows * (n_cols // norm_group if norm_group else 1)
    mean = x.new_empty((stat_rows,) if kind == "layer_norm" else (0,), dtype=acc)
    rstd = x.new_empty((stat_rows,), dtype=acc)
    if n_rows == 0:
        return mean, rstd
    widest = max(t.element_size() for t in (x, s, x1) if t is not None)
    block, num_warps, looped = _blocking(n_cols, widest, two_norms=weight1 is not None, quant=quant is not None,
                                         gated=gate is not None or bool(norm_group))
    if looped and quant is not None and (quant["group"] or 0) > block:
        block = quant["group"]  # a quantization group lies within one block of the loop
    if looped and (norm_group or 0) > block:
        block = norm_group  # so does a group of the statistics
    rows_per_program = min(max(triton.cdiv(n_rows, 8 * _sm_count(x.device)), 1),
                           max(1, _MULTI_ROW_MAX_BLOCK // block))
    grid = (triton.cdiv(n_rows, rows_per_program),)
    kernel = _add_norm_fwd_looped_kernel if looped else _add_norm_fwd_kernel
    dummy = rstd  # stands in for absent pointers; never read or written

    def ptr(t):
        return dummy if t is None else t

    def stride(t):
        return 0 if t is None else t.stride(0)
    branch_dtype = x.dtype if x1 is None else torch.promote_types(x.dtype, x1.dtype)
    has_dropout = dropout_p > 0
    kernel[grid](
        x2, ptr(r2), ptr(_param(weight)), ptr(_param(bias)), ptr(y), ptr(s), mean if kind == "layer_norm" else dummy,
        rstd, ptr(x12), ptr(None if rowscale is None else rowscale.reshape(-1).contiguous()), ptr(_param(weight1)),
        ptr(_param(bias1)), ptr(y1),
        stride_x=x2.stride(0), stride_r=stride(r2), stride_y=stride(y), stride_s=stride(s), stride_x1=stride(x12),
        stride_y1=stride(y1), n_rows=n_rows, N=n_cols, eps=eps, weight_offset=weight_offset,
        residual_scale=residual_scale, rows_per_program=rows_per_program, seed=int(seed) if has_dropout else 0,
        dropout_p=dropout_p, dropout_scale=1.0 / (1.0 - dropout_p), **_quant_launch_args(quant, dummy),
        Z=ptr(z2), stride_z=stride(z2), HAS_GATE=gate is not None, GATE_AFTER=gate_position == "after",
        GATE_SILU=gate_activation == "silu", NORM_GROUP=norm_group or 0,
        GATE_OUT_DTYPE=TL_DTYPES[gate_out_dtype or out_dtype],
        SUM_DTYPE=TL_DTYPES[sum_dtype], NORM_ROUND_DTYPE=TL_DTYPES[norm_round_dtype or out_dtype],
        OUT_DTYPE=TL_DTYPES[out_dtype], HAS_RESIDUAL=residual is not None, HAS_WEIGHT=weight is not None,
        HAS_BIAS=bias is not None, IS_RMS=kind == "rms_norm", ROUND_FIRST=norm_round_dtype is not None,
        STORE_SUM=store_sum, STORE_Y=store_y, ADD_AFTER_NORM=add_after_norm, SCALE_RESIDUAL=residual_scale != 1.0,
        ROUND_SUM_FIRST=round_sum_first, HAS_X1=x1 is not None, HAS_ROWSCALE=rowscale is not None,
        HAS_W1=weight1 is not None, HAS_B1=bias1 is not None, HAS_DROPOUT=has_dropout,
        BRANCH_DTYPE=TL_DTYPES[branch_dtype], BLOCK_N=block, num_warps=num_warps)
    return mean, rstd


def add_norm_fwd(x, residual, weight, bias, kind, eps, weight_offset, residual_scale, sum_dtype, norm_round_dtype,
                 out_dtype, store_sum, round_sum_first=True, x1=None, rowscale=None, weight1=None, bias1=None,
                 dropout_p=0.0, seed=None, gate=None, gate_position="before", gate_activation="silu",
                 norm_group=None, gate_out_dtype=None):
    j = strided_fwd_ok(x, residual, x1, rowscale, weight1, dropout_p, gate, norm_group)
    if j is not None:  # a channel norm: x or the residual stored channels-first
        return _add_norm_fwd_strided(x, residual, weight, bias, kind, eps, weight_offset, residual_scale, sum_dtype,
                                     norm_round_dtype, out_dtype, store_sum, round_sum_first, j)
    gated_after = gate is not None and gate_position == "after"
    y = x.new_empty(x.shape, dtype=(gate_out_dtype or out_dtype) if gated_after else out_dtype)
    s = x.new_empty(x.shape, dtype=sum_dtype) if store_sum else None
    y1 = x.new_empty(x.shape, dtype=out_dtype) if weight1 is not None else None
    n_cols = x.shape[-1]

    def rows(t):
        return None if t is None else t.view(-1, n_cols)
    mean, rstd = _launch_fwd(x, residual, weight, bias, rows(y), rows(s), kind, eps, weight_offset, residual_scale,
                             sum_dtype, norm_round_dtype, out_dtype, store_sum, True, False, round_sum_first, x1,
                             rowscale, weight1, bias1, rows(y1), dropout_p, seed, None, gate, gate_position,
                             gate_activation, norm_group, gate_out_dtype if gated_after else None)
    return y, s, mean, rstd, y1


def add_norm_quant_fwd(x, residual, weight, bias, kind, eps, weight_offset, residual_scale, sum_dtype,
                       norm_round_dtype, out_dtype, store_sum, round_sum_first, x1, rowscale, weight1, bias1,
                       dropout_p, seed, store_y, quant_dtype, quant_scale, quant_group, quant_scale_form,
                       quant_amax_min, quant_scale_min, quant_apply, quant_clamp, quant_scale_out):
    n_cols = x.shape[-1]
    y = x.new_empty(x.shape, dtype=out_dtype) if store_y else None
    s = x.new_empty(x.shape, dtype=sum_dtype) if store_sum else None
    y1 = x.new_empty(x.shape, dtype=out_dtype) if weight1 is not None else None
    q = x.new_empty(x.shape, dtype=quant_dtype)
    scale = None
    if quant_scale is None:
        scale = x.new_empty(quant_scale_shape(x.shape, quant_group), dtype=torch.float32)

    def rows(t):
        return None if t is None else t.view(-1, t.shape[-1])
    quant = dict(q=rows(q.view(torch.uint8)), scale=rows(scale),
                 static=None if quant_scale is None else quant_scale.reshape(1).to(torch.float32),
                 dtype=quant_dtype, group=quant_group, scale_form=quant_scale_form, amax_min=quant_amax_min,
                 scale_min=quant_scale_min, apply=quant_apply, clamp=quant_clamp, scale_out=quant_scale_out)
    mean, rstd = _launch_fwd(x, residual, weight, bias, rows(y), rows(s), kind, eps, weight_offset, residual_scale,
                             sum_dtype, norm_round_dtype, out_dtype, store_sum, store_y, False, round_sum_first, x1,
                             rowscale, weight1, bias1, rows(y1), dropout_p, seed, quant)
    return y, s, mean, rstd, y1, q, scale


def norm_add_fwd(x, residual, weight, bias, kind, eps, weight_offset, residual_scale, norm_round_dtype, out_dtype,
                 add_dtype, store_norm):
    out = x.new_empty(x.shape, dtype=add_dtype)
    y = x.new_empty(x.shape, dtype=out_dtype) if store_norm else None
    n_cols = x.shape[-1]
    mean, rstd = _launch_fwd(x, residual, weight, bias, None if y is None else y.view(-1, n_cols),
                             out.view(-1, n_cols), kind, eps, weight_offset, residual_scale, x.dtype,
                             norm_round_dtype, out_dtype, True, store_norm, True)
    return out, y, mean, rstd


def add_norm_bwd(dy, dextra, inp, mean, rstd, weight, kind, weight_offset, residual_scale, add_after_norm, x_dtype,
                 residual_dtype, bias_dtype, dy1=None, weight1=None, bias1_dtype=None, x1_dtype=None, rowscale=None,
                 dropout_p=0.0, seed=None, gate=None, gate_position="before", gate_activation="silu",
                 norm_group=None, bias=None):
    j = strided_bwd_ok(inp, dy1 if weight1 is not None else None, rowscale, dropout_p, gate, norm_group,
                       add_after_norm, x1_dtype)
    if j is not None:  # a channel norm: its input stored channels-first
        return _add_norm_bwd_strided(dy, dextra, inp, mean, rstd, weight, kind, weight_offset, residual_scale,
                                     x_dtype, residual_dtype, bias_dtype, j)
    n_cols = inp.shape[-1]
    inp2, dy2, de2, dy12, z2 = (_rows_2d(t, n_cols) for t in (inp, dy, dextra, dy1, gate))
    n_rows = inp2.shape[0]
    dx = inp.new_empty(inp.shape, dtype=x_dtype)
    dz = None if gate is None else inp.new_empty(inp.shape, dtype=gate.dtype)
    dres = inp.new_empty(inp.shape, dtype=residual_dtype) if residual_dtype is not None else None
    dx1 = inp.new_empty(inp.shape, dtype=x1_dtype) if x1_dtype is not None else None
    has_y1 = dy1 is not None and weight1 is not None
    block, num_warps, looped = _blocking(n_cols, max(inp.element_size(), dy.element_size()), backward=True,
                                         two_norms=has_y1, gated=gate is not None or bool(norm_group))
    if looped and (norm_group or 0) > block:
        block = norm_group  # a group of the statistics lies within one block of the loop
    k = 4 if block <= 1024 else 2 if block <= 4096 else 1
    programs = max(1, min(n_rows, k * _sm_count(inp.device)))
    rows_per_program = triton.cdiv(n_rows, programs) if n_rows else 0
    alloc = torch.zeros if looped or not n_rows else torch.empty  # zero rows: the sums below must be zero

    def partials(exists):
        return alloc((programs, n_cols), dtype=torch.float32, device=inp.device) if exists else None
    dw_part, db_part = partials(weight is not None), partials(bias_dtype is not None)
    dw1_part, db1_part = partials(has_y1), partials(has_y1 and bias1_dtype is not None)
    if n_rows:
        dummy = rstd

        def ptr(t):
            return dummy if t is None else t

        def rows(t):
            return None if t is None else t.view(-1, n_cols)
        kernel = _add_norm_bwd_looped_kernel if looped else _add_norm_bwd_kernel
        has_dropout = dropout_p > 0
        kernel[(programs,)](
            dy2, ptr(de2), inp2, mean if kind == "layer_norm" else dummy, rstd, ptr(_param(weight)), rows(dx),
            ptr(rows(dres)), ptr(dw_part), ptr(db_part),
            ptr(dy12), ptr(_param(weight1) if has_y1 else None),
            ptr(None if rowscale is None else rowscale.reshape(-1).contiguous()), ptr(rows(dx1)), ptr(dw1_part),
            ptr(db1_part),
            dy2.stride(0), 0 if de2 is None else de2.stride(0), inp2.stride(0), n_cols, n_cols,
            0 if dy12 is None else dy12.stride(0), n_cols,
            n_rows, n_cols, weight_offset, residual_scale, rows_per_program,
            int(seed) if has_dropout else 0, dropout_p, 1.0 / (1.0 - dropout_p),
            ptr(z2), ptr(rows(dz)), ptr(_param(bias)), 0 if z2 is None else z2.stride(0), n_cols,
            HAS_GATE=gate is not None, GATE_AFTER=gate_position == "after", GATE_SILU=gate_activation == "silu",
            HAS_B=bias is not None, NORM_GROUP=norm_group or 0,
            HAS_DEXTRA=dextra is not None, HAS_WEIGHT=weight is not None, HAS_BIAS=bias_dtype is not None,
            HAS_DRES=dres is not None, IS_RMS=kind == "rms_norm", ADD_AFTER_NORM=add_after_norm, HAS_DY1=has_y1,
            HAS_B1=bias1_dtype is not None, HAS_DX1=dx1 is not None, HAS_ROWSCALE=rowscale is not None,
            HAS_DROPOUT=has_dropout, BLOCK_N=block, num_warps=num_warps)
    # the [programs, N] fp32 partials are summed in fp32, rounded once to the parameter's dtype

    def reduced(part, dtype):
        return None if part is None else part.sum(0).to(dtype)
    return (dx, dres, reduced(dw_part, None if weight is None else weight.dtype), reduced(db_part, bias_dtype), dx1,
            reduced(dw1_part, None if weight1 is None else weight1.dtype), reduced(db1_part, bias1_dtype), dz)


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
        X, R, W, B, Y, S, MEAN, RSTD,
        sx_o, sx_h, sx_c, sr_o, sr_h, sr_c, sy_o, sy_h, sy_c, ss_o, ss_h, ss_c,  # (outer, position, channel)
        HW, N, eps, weight_offset, residual_scale, tiles_per_outer,
        SUM_DTYPE: tl.constexpr, NORM_ROUND_DTYPE: tl.constexpr, OUT_DTYPE: tl.constexpr,
        HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, IS_RMS: tl.constexpr,
        ROUND_FIRST: tl.constexpr, STORE_SUM: tl.constexpr, SCALE_RESIDUAL: tl.constexpr,
        ROUND_SUM_FIRST: tl.constexpr, BLOCK_HW: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        """One tile of BLOCK_HW rows x all N channels: one read of each input, one write of each output."""
        pid = tl.program_id(0)
        outer = (pid // tiles_per_outer).to(tl.int64)
        hw = (pid % tiles_per_outer) * BLOCK_HW + tl.arange(0, BLOCK_HW)
        cols = tl.arange(0, BLOCK_N)
        hw_ok = hw < HW
        mask = hw_ok[:, None] & (cols < N)[None, :]
        h = hw.to(tl.int64)[:, None]
        c = cols.to(tl.int64)[None, :]
        row = outer * HW + hw.to(tl.int64)                       # (BLOCK_HW,): the row-major index of the rows
        s, u = _load_norm_input(X, R, X, RSTD, row, hw_ok, outer * sx_o + h * sx_h + c * sx_c,
                                outer * sr_o + h * sr_h + c * sr_c, 0, 0, mask, N, residual_scale, 0, 0.0, 1.0,
                                HAS_RESIDUAL, SCALE_RESIDUAL, SUM_DTYPE, ROUND_SUM_FIRST, False, False, False,
                                SUM_DTYPE)
        if STORE_SUM:
            tl.store(S + outer * ss_o + h * ss_h + c * ss_c, s, mask=mask)
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
        w, b = _load_params(W, B, cols, cols < N, weight_offset, HAS_WEIGHT, HAS_BIAS)
        if HAS_WEIGHT:
            w = w[None, :]
        if HAS_BIAS:
            b = b[None, :]
        _normalize_and_store(u, mean, rstd[:, None], w, b, Y, S, R, outer * sy_o + h * sy_h + c * sy_c, 0, 0, 0,
                             mask, residual_scale, HAS_WEIGHT, HAS_BIAS, IS_RMS, ROUND_FIRST, NORM_ROUND_DTYPE,
                             OUT_DTYPE, True, False, False)

    @triton.jit
    def _add_norm_bwd_strided_kernel(
        DY, DE, INP, MEAN, RSTD, W, DX, DRES, DW_PART, DB_PART,   # DE: the gradient of s
        sdy_o, sdy_h, sdy_c, sde_o, sde_h, sde_c, si_o, si_h, si_c, sdx_o, sdx_h, sdx_c, sdr_o, sdr_h, sdr_c,
        HW, N, n_tiles, tiles_per_outer, tiles_per_program, weight_offset, residual_scale,
        HAS_DEXTRA: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_DRES: tl.constexpr,
        IS_RMS: tl.constexpr, BLOCK_HW: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        """Each program takes a run of tiles and writes fp32 dw/db partials to row `pid` of
        [programs, N] buffers, summed on the host (the row kernels' formulas, per tile)."""
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK_N)
        c = cols.to(tl.int64)[None, :]
        w, _ = _load_params(W, W, cols, cols < N, weight_offset, HAS_WEIGHT, False)
        if HAS_WEIGHT:
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
            u = tl.load(INP + outer * si_o + h * si_h + c * si_c, mask=mask, other=0.0).to(tl.float32)
            if IS_RMS:
                xhat = u * rstd
            else:
                xhat = (u - tl.load(MEAN + row, mask=hw_ok, other=0.0)[:, None]) * rstd
            xhat = tl.where(mask, xhat, 0.0)
            dy = tl.load(DY + outer * sdy_o + h * sdy_h + c * sdy_c, mask=mask, other=0.0).to(tl.float32)
            g = dy
            if HAS_WEIGHT:
                g = dy * w
            c1 = tl.sum(g * xhat, axis=1)[:, None] / N
            if IS_RMS:
                du = (g - xhat * c1) * rstd
            else:
                du = (g - tl.sum(g, axis=1)[:, None] / N - xhat * c1) * rstd
            if HAS_DEXTRA:
                du += tl.load(DE + outer * sde_o + h * sde_h + c * sde_c, mask=mask, other=0.0).to(tl.float32)
            tl.store(DX + outer * sdx_o + h * sdx_h + c * sdx_c, _round(du, DX.dtype.element_ty), mask=mask)
            if HAS_DRES:
                tl.store(DRES + outer * sdr_o + h * sdr_h + c * sdr_c,
                         _round(du * residual_scale, DRES.dtype.element_ty), mask=mask)
            dw += tl.sum(dy * xhat, axis=0)
            db += tl.sum(dy, axis=0)
        part = pid.to(tl.int64) * N + cols
        if HAS_WEIGHT:
            tl.store(DW_PART + part, dw, mask=cols < N)
        if HAS_BIAS:
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


def _strided_tile(positions: int, n_cols: int, backward: bool) -> tuple[int, int, int]:
    """(BLOCK_HW, BLOCK_N, num_warps) of a channel-norm tile (C within one tile: strided_*_ok)."""
    block_n = triton.next_power_of_2(n_cols)
    tile = _STRIDED_TILE_BWD if backward else _STRIDED_TILE
    block_hw = max(1, min(tile // block_n, triton.next_power_of_2(max(positions, 1))))
    if backward:  # 4 elements a thread (at 8, fp32 LayerNorm's 4 x 512 tile kept a stack frame on sm90), 8
        # for a tile of one position (at 4, fp32 RMSNorm's 1 x 2048 one did)
        return block_hw, block_n, min(max(block_hw * block_n // (128 if block_hw > 1 else 256), 1), 16)
    return block_hw, block_n, min(max(block_hw * block_n // 512, 1), 8)


def strided_fwd_ok(x: Tensor, residual, x1, rowscale, weight1, dropout_p, gate, norm_group) -> Optional[int]:
    """The split j (channel_split) of x or the residual when an add_norm call runs the
    channel-norm kernel, else None."""
    if x1 is not None or rowscale is not None or weight1 is not None or dropout_p > 0 or gate is not None \
            or norm_group or triton is None or triton.next_power_of_2(x.shape[-1]) > _STRIDED_TILE:
        return None
    j = channel_split(x)
    return j if j is not None or residual is None else channel_split(residual)


def _add_norm_fwd_strided(x, residual, weight, bias, kind, eps, weight_offset, residual_scale, sum_dtype,
                          norm_round_dtype, out_dtype, store_sum, round_sum_first, j):
    """add_norm_fwd's outputs for x or the residual stored channels-first (split j): y with contiguous rows (what
    a norm call returns), s in its residual's layout (reference.sum_like)."""
    n_cols = x.shape[-1]
    y = x.new_empty(x.shape, dtype=out_dtype)
    s = sum_like(x if residual is None else residual, sum_dtype) if store_sum else None
    x3, r3, y3, s3 = (_as_3d(t, j) for t in (x, residual, y, s))
    n_rows = x.numel() // n_cols
    mean = x.new_empty((n_rows,) if kind == "layer_norm" else (0,), dtype=torch.float32)
    rstd = x.new_empty((n_rows,), dtype=torch.float32)
    if n_rows == 0:
        return y, s, mean, rstd, None
    positions = x3.shape[1]
    block_hw, block_n, num_warps = _strided_tile(positions, n_cols, backward=False)
    tiles_per_outer = triton.cdiv(positions, block_hw)
    dummy = rstd
    _add_norm_fwd_strided_kernel[(x3.shape[0] * tiles_per_outer,)](
        x3, dummy if r3 is None else r3, dummy if weight is None else _param(weight),
        dummy if bias is None else _param(bias), y3, dummy if s3 is None else s3,
        mean if kind == "layer_norm" else dummy, rstd,
        *_strides_3d(x3), *_strides_3d(r3), *_strides_3d(y3), *_strides_3d(s3),
        positions, n_cols, eps, weight_offset, residual_scale, tiles_per_outer,
        SUM_DTYPE=TL_DTYPES[sum_dtype], NORM_ROUND_DTYPE=TL_DTYPES[norm_round_dtype or out_dtype],
        OUT_DTYPE=TL_DTYPES[out_dtype], HAS_RESIDUAL=residual is not None, HAS_WEIGHT=weight is not None,
        HAS_BIAS=bias is not None, IS_RMS=kind == "rms_norm", ROUND_FIRST=norm_round_dtype is not None,
        STORE_SUM=s is not None, SCALE_RESIDUAL=residual_scale != 1.0, ROUND_SUM_FIRST=round_sum_first,
        BLOCK_HW=block_hw, BLOCK_N=block_n, num_warps=num_warps)
    return y, s, mean, rstd, None


def _add_norm_bwd_strided(dy, dextra, inp, mean, rstd, weight, kind, weight_offset, residual_scale, x_dtype,
                          residual_dtype, bias_dtype, j):
    """add_norm_bwd's gradients for a norm input stored channels-first (split j); dx and dresidual
    with contiguous rows, as the row kernels write them."""
    n_cols = inp.shape[-1]
    dx = inp.new_empty(inp.shape, dtype=x_dtype)
    dres = inp.new_empty(inp.shape, dtype=residual_dtype) if residual_dtype is not None else None
    i3, dy3, de3, dx3, dr3 = (_as_3d(t, j) for t in (inp, dy, dextra, dx, dres))
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
    dw_part, db_part = partials(weight is not None), partials(bias_dtype is not None)
    if n_tiles:
        dummy = rstd
        _add_norm_bwd_strided_kernel[(programs,)](
            dy3, dummy if de3 is None else de3, i3, mean if kind == "layer_norm" else dummy, rstd,
            dummy if weight is None else _param(weight), dx3, dummy if dr3 is None else dr3,
            dummy if dw_part is None else dw_part, dummy if db_part is None else db_part,
            *_strides_3d(dy3), *_strides_3d(de3), *_strides_3d(i3), *_strides_3d(dx3), *_strides_3d(dr3),
            positions, n_cols, n_tiles, tiles_per_outer, tiles_per_program, weight_offset, residual_scale,
            HAS_DEXTRA=dextra is not None, HAS_WEIGHT=weight is not None, HAS_BIAS=bias_dtype is not None,
            HAS_DRES=dres is not None, IS_RMS=kind == "rms_norm", BLOCK_HW=block_hw, BLOCK_N=block_n,
            num_warps=num_warps)
    # the [programs, N] fp32 partials are summed in fp32, rounded once to the parameter's dtype
    return (dx, dres, None if dw_part is None else dw_part.sum(0).to(weight.dtype),
            None if db_part is None else db_part.sum(0).to(bias_dtype), None, None, None, None)


def strided_bwd_ok(inp: Tensor, dy1, rowscale, dropout_p, gate, norm_group, add_after_norm, x1_dtype) -> Optional[int]:
    """The split j when an add_norm backward runs the channel-norm kernel, else None."""
    if dy1 is not None or rowscale is not None or dropout_p > 0 or gate is not None or norm_group \
            or add_after_norm or x1_dtype is not None or triton is None \
            or triton.next_power_of_2(inp.shape[-1]) > _STRIDED_TILE_BWD:
        return None
    return channel_split(inp)
