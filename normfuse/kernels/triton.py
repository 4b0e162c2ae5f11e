"""The Triton backend: kernels and their launchers.

The same function as ``reference.py`` (read that first), with the same backend
interface: ``add_norm_fwd``, ``norm_add_fwd``, ``add_norm_bwd`` take the custom
ops' arguments positionally and return None for outputs that do not exist.
CUDA/ROCm tensors run these kernels; CPU tensors run them under Triton's
interpreter when NORMFUSE_TRITON_CPU=1 (the tests do).
"""

from __future__ import annotations

import os
import sys
from typing import Optional

import torch
from torch import Tensor


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
# s of add_norm, or out = r' + y of norm_add (POST_ADD). Flags are constexpr, so
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
    def _load_norm_input(X, R, x_off, r_off, cols, mask, residual_scale, HAS_RESIDUAL: tl.constexpr,
                         SCALE_RESIDUAL: tl.constexpr, SUM_DTYPE: tl.constexpr, ROUND_SUM_FIRST: tl.constexpr):
        """(s, u): s = round(SUM_DTYPE, float(x) + float(round(r.dtype, scale * r))), and the norm
        input u in fp32: s, or the sum before that rounding (ROUND_SUM_FIRST off)."""
        u = tl.load(X + x_off + cols, mask=mask, other=0.0).to(tl.float32)
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
        SCALE_RESIDUAL: tl.constexpr, ROUND_SUM_FIRST: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        """A row fits one block: one read of each input and one write of each output per row."""
        cols = tl.arange(0, BLOCK_N)
        PARAMS_AFTER_STATS: tl.constexpr = (BLOCK_N * X.dtype.element_ty.primitive_bitwidth // 8
                                            >= _PARAMS_AFTER_STATS_BYTES_C)
        if not PARAMS_AFTER_STATS:
            w, b = _load_params(W, B, cols, cols < N, weight_offset, HAS_WEIGHT, HAS_BIAS)  # once per program
        for i in range(rows_per_program):
            row = tl.program_id(0) * rows_per_program + i
            mask = (cols < N) & (row < n_rows)
            row = row.to(tl.int64)
            s, u = _load_norm_input(X, R, row * stride_x, row * stride_r, cols, mask, residual_scale,
                                    HAS_RESIDUAL and not POST_ADD, SCALE_RESIDUAL, SUM_DTYPE, ROUND_SUM_FIRST)
            if STORE_SUM and not POST_ADD:
                tl.store(S + row * stride_s + cols, s, mask=mask)
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
        SCALE_RESIDUAL: tl.constexpr, ROUND_SUM_FIRST: tl.constexpr, BLOCK_N: tl.constexpr,
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
                s, u = _load_norm_input(X, R, row * stride_x, row * stride_r, cols, mask, residual_scale,
                                        HAS_RESIDUAL and not POST_ADD, SCALE_RESIDUAL, SUM_DTYPE, ROUND_SUM_FIRST)
                if STORE_SUM and not POST_ADD:
                    tl.store(S + row * stride_s + cols, s, mask=mask)
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
                if STORE_SUM and not POST_ADD and ROUND_SUM_FIRST:
                    u = tl.load(S + row * stride_s + cols, mask=mask, other=0.0).to(tl.float32)
                else:
                    _, u = _load_norm_input(X, R, row * stride_x, row * stride_r, cols, mask, residual_scale,
                                            HAS_RESIDUAL and not POST_ADD, SCALE_RESIDUAL, SUM_DTYPE,
                                            ROUND_SUM_FIRST)
                w, b = _load_params(W, B, cols, mask, weight_offset, HAS_WEIGHT, HAS_BIAS)
                _normalize_and_store(u, mean, rstd, w, b, Y, S, R, row * stride_y, row * stride_s,
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
                norm_round_dtype, out_dtype, store_sum, store_y, post_add, round_sum_first=True):
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
        SUM_DTYPE=TL_DTYPES[sum_dtype], NORM_ROUND_DTYPE=TL_DTYPES[norm_round_dtype or out_dtype],
        OUT_DTYPE=TL_DTYPES[out_dtype], HAS_RESIDUAL=residual is not None, HAS_WEIGHT=weight is not None,
        HAS_BIAS=bias is not None, IS_RMS=kind == "rms_norm", ROUND_FIRST=norm_round_dtype is not None,
        STORE_SUM=store_sum, STORE_Y=store_y, POST_ADD=post_add, SCALE_RESIDUAL=residual_scale != 1.0,
        ROUND_SUM_FIRST=round_sum_first, BLOCK_N=block, num_warps=num_warps)
    return mean, rstd


def add_norm_fwd(x, residual, weight, bias, kind, eps, weight_offset, residual_scale, sum_dtype, norm_round_dtype,
                 out_dtype, store_sum, round_sum_first=True, x1=None, rowscale=None, weight1=None, bias1=None,
                 dropout_p=0.0, seed=None):
    if x1 is not None or rowscale is not None or weight1 is not None or dropout_p > 0:
        from normfuse.kernels import reference  # the modes' kernels are not written yet
        return reference.add_norm_fwd(x, residual, weight, bias, kind, eps, weight_offset, residual_scale, sum_dtype,
                                      norm_round_dtype, out_dtype, store_sum, round_sum_first, x1, rowscale,
                                      weight1, bias1, dropout_p, seed)
    y = x.new_empty(x.shape, dtype=out_dtype)
    s = x.new_empty(x.shape, dtype=sum_dtype) if store_sum else None
    n_cols = x.shape[-1]
    mean, rstd = _launch_fwd(x, residual, weight, bias, y.view(-1, n_cols), None if s is None else s.view(-1, n_cols),
                             kind, eps, weight_offset, residual_scale, sum_dtype, norm_round_dtype, out_dtype,
                             store_sum, True, False, round_sum_first)
    return y, s, mean, rstd, None


def norm_add_fwd(x, residual, weight, bias, kind, eps, weight_offset, residual_scale, norm_round_dtype, out_dtype,
                 add_dtype, store_norm):
    out = x.new_empty(x.shape, dtype=add_dtype)
    y = x.new_empty(x.shape, dtype=out_dtype) if store_norm else None
    n_cols = x.shape[-1]
    mean, rstd = _launch_fwd(x, residual, weight, bias, None if y is None else y.view(-1, n_cols),
                             out.view(-1, n_cols), kind, eps, weight_offset, residual_scale, x.dtype,
                             norm_round_dtype, out_dtype, True, store_norm, True)
    return out, y, mean, rstd


def add_norm_bwd(dy, dextra, inp, mean, rstd, weight, kind, weight_offset, residual_scale, post_add, x_dtype,
                 residual_dtype, bias_dtype, dy1=None, weight1=None, bias1_dtype=None, x1_dtype=None, rowscale=None,
                 dropout_p=0.0, seed=None):
    if dy1 is not None or x1_dtype is not None or rowscale is not None or dropout_p > 0:
        from normfuse.kernels import reference
        return reference.add_norm_bwd(dy, dextra, inp, mean, rstd, weight, kind, weight_offset, residual_scale,
                                      post_add, x_dtype, residual_dtype, bias_dtype, dy1, weight1, bias1_dtype,
                                      x1_dtype, rowscale, dropout_p, seed)
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
    # the [programs, N] fp32 partials are summed in fp32, rounded once to the parameter's dtype
    dw = None if weight is None else dw_part.sum(0).to(weight.dtype)
    db = None if bias_dtype is None else db_part.sum(0).to(bias_dtype)
    return dx, dres, dw, db, None, None, None


def dropout_keep(seed, n_rows, n_cols, p, device):
    from normfuse.kernels import reference
    return reference.dropout_keep(seed, n_rows, n_cols, p, device)

