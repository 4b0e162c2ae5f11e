"""The Triton backend of qk_norm_rope: kernels and launchers.

The same function as ``qk_rope.py``'s reference (read its docstring first), with the same backend
interface: ``qk_norm_rope_fwd`` and ``qk_norm_rope_bwd`` take the op's grouped call
(``specs.QkNormRopeCall``, ``QkNormRopeBackwardCall``) and return None for outputs that do not exist.
q and k go through one launch: program axis 1 picks the tensor (0: q, 1: k), axis 0 the position
(forward) or a chunk of positions (backward).

A program holds one position's heads as tiles of (heads, columns), each column loaded once: the
rotated columns as two halves A and B that rotate into each other (neox: columns [0, R/2) and
[R/2, R); gptj: the even and the odd columns), and the pass-through columns [R, D) as a third tile.
The norm's statistics sum the three; the rotation is elementwise between A and B.
"""

from __future__ import annotations

import torch

from normfuse.kernels.specs import QkNormRopeBackwardCall, QkNormRopeCall
from normfuse.kernels.triton import TL_DTYPES, _round, _sm_count, triton, tl

# Elements of one (heads, columns) tile: the forward keeps x and y of a tile live, the backward x,
# dout, dy and three weight-gradient accumulators (fp32). Per-head norms loop over chunks of heads;
# a whole-row norm (OLMo 2) takes all heads of a position in one tile.
_TILE_FWD = 4096
_TILE_BWD = 2048

if triton is not None:

    @triton.jit
    def _load_ab(P, rows, row_ok, col_stride, R: tl.constexpr, NEOX: tl.constexpr, HALF: tl.constexpr,
                 HALF_TABLE: tl.constexpr = False):
        """The two halves (a, b) of the rotated columns of some rows (offsets ``rows``), (rows, HALF) fp32.
        neox: columns [0, R/2) and [R/2, R), two loads; gptj: one contiguous load of [0, R) split into
        the even and odd columns (vector loads either way). HALF_TABLE: a table of one value per
        pair (R / 2 columns), a = b."""
        i = tl.arange(0, HALF)
        if HALF_TABLE:
            a = tl.load(P + rows[:, None] + i[None, :] * col_stride, mask=row_ok[:, None] & (i < R // 2)[None, :],
                        other=0.0).to(tl.float32)
            b = a
        elif NEOX:
            m = row_ok[:, None] & (i < R // 2)[None, :]
            a = tl.load(P + rows[:, None] + i[None, :] * col_stride, mask=m, other=0.0).to(tl.float32)
            b = tl.load(P + rows[:, None] + (i + R // 2)[None, :] * col_stride, mask=m, other=0.0).to(tl.float32)
        else:
            j = tl.arange(0, 2 * HALF)
            ab = tl.load(P + rows[:, None] + j[None, :] * col_stride, mask=row_ok[:, None] & (j < R)[None, :],
                         other=0.0).to(tl.float32)
            a, b = tl.split(tl.reshape(ab, (ab.shape[0], HALF, 2)))
        return a, b

    @triton.jit
    def _store_ab(P, rows, row_ok, a, b, R: tl.constexpr, NEOX: tl.constexpr, HALF: tl.constexpr):
        """Store the halves of _load_ab (contiguous columns)."""
        if NEOX:
            i = tl.arange(0, HALF)
            m = row_ok[:, None] & (i < R // 2)[None, :]
            tl.store(P + rows[:, None] + i[None, :], a, mask=m)
            tl.store(P + rows[:, None] + (i + R // 2)[None, :], b, mask=m)
        else:
            j = tl.arange(0, 2 * HALF)
            ab = tl.reshape(tl.join(a, b), (a.shape[0], 2 * HALF))
            tl.store(P + rows[:, None] + j[None, :], ab, mask=row_ok[:, None] & (j < R)[None, :])

    @triton.jit
    def _load_pass(P, rows, row_ok, START: tl.constexpr, D: tl.constexpr, PASS: tl.constexpr):
        """A block of the pass-through columns, [START, min(START + PASS, D)), of some rows, (rows, PASS) fp32."""
        j = START + tl.arange(0, PASS)
        return tl.load(P + rows[:, None] + j[None, :], mask=row_ok[:, None] & (j < D)[None, :],
                       other=0.0).to(tl.float32)

    @triton.jit
    def _store_pass(P, rows, row_ok, v, START: tl.constexpr, D: tl.constexpr, PASS: tl.constexpr):
        j = START + tl.arange(0, PASS)
        tl.store(P + rows[:, None] + j[None, :], v, mask=row_ok[:, None] & (j < D)[None, :])

    @triton.jit
    def _weights(W, heads, h_ok, weight_offset, D: tl.constexpr, R: tl.constexpr, HAS_W: tl.constexpr,
                 ROW_NORM: tl.constexpr, NEOX: tl.constexpr, HALF: tl.constexpr, PASS: tl.constexpr,
                 HAS_PASS: tl.constexpr, PASS2: tl.constexpr):
        """w' = float(w) + weight_offset of the tiles (a, b, pass, pass2): one row (1, columns) for a head
        norm, a row per head for a row norm (W spans all heads); 1.0 without a weight (unused then). A
        LayerNorm's bias is read the same way, with weight_offset 0."""
        wa = 1.0  # one return: the compiler (not the interpreter) rejects a constexpr branch returning early
        wb = 1.0
        wp = 1.0
        wp2 = 1.0
        if HAS_W:
            if ROW_NORM:
                rows = heads * D
                ok = h_ok
            else:
                rows = tl.zeros([1], dtype=tl.int32)
                ok = rows == 0
            wa, wb = _load_ab(W, rows, ok, 1, R, NEOX, HALF)
            wa += weight_offset
            wb += weight_offset
            if HAS_PASS:
                wp = _load_pass(W, rows, ok, R, D, PASS) + weight_offset
            if PASS2 > 0:
                wp2 = _load_pass(W, rows, ok, R + PASS, D, PASS2) + weight_offset
        return wa, wb, wp, wp2

    @triton.jit
    def _norm_out(x, rstd, w, b, HAS_W: tl.constexpr, HAS_B: tl.constexpr, ROUND_FIRST: tl.constexpr,
                  NORM_ROUND_DTYPE: tl.constexpr, NORM_OUT_DTYPE: tl.constexpr):
        """y = round(NORM_OUT_DTYPE, n * w' + b) with n = x * rstd (x centered for a LayerNorm; n rounded
        first when ROUND_FIRST), in fp32."""
        n = x * rstd[:, None]
        if ROUND_FIRST:
            n = _round(n, NORM_ROUND_DTYPE).to(tl.float32)
        if HAS_W:
            n = n * w
        if HAS_B:
            n = n + b
        return _round(n, NORM_OUT_DTYPE).to(tl.float32)

    @triton.jit
    def _centered(xa, xb, xp, xp2, h_ok, H, D: tl.constexpr, R: tl.constexpr, ROW_NORM: tl.constexpr,
                  HB: tl.constexpr, HALF: tl.constexpr, PASS: tl.constexpr, PASS2: tl.constexpr):
        """A LayerNorm's tiles less their row's mean (per head, or over all heads for a row norm), zero
        where masked off; and the mean, (HB,)."""
        HAS_PASS: tl.constexpr = D > R
        total = tl.sum(xa, axis=1) + tl.sum(xb, axis=1)  # masked-off lanes load as 0
        if HAS_PASS:
            total += tl.sum(xp, axis=1)
        if PASS2 > 0:
            total += tl.sum(xp2, axis=1)
        if ROW_NORM:
            mean = tl.zeros([HB], dtype=tl.float32) + tl.sum(total, axis=0) / (H * D)
        else:
            mean = total / D
        m = h_ok[:, None] & (tl.arange(0, HALF) < R // 2)[None, :]
        xa = tl.where(m, xa - mean[:, None], 0.0)
        xb = tl.where(m, xb - mean[:, None], 0.0)
        if HAS_PASS:
            xp = tl.where(h_ok[:, None] & ((R + tl.arange(0, PASS)) < D)[None, :], xp - mean[:, None], 0.0)
        if PASS2 > 0:
            xp2 = tl.where(h_ok[:, None] & ((R + PASS + tl.arange(0, PASS2)) < D)[None, :], xp2 - mean[:, None], 0.0)
        return xa, xb, xp, xp2, mean

    @triton.jit
    def _rope_step(v, ROPE_DTYPE: tl.constexpr):
        return _round(v, ROPE_DTYPE).to(tl.float32)

    # The kernels take one argument per operand: q, k, their outputs and output gradients as (pointer,
    # batch, position and head strides) of a (B, S, H, D) view; the weights, rstd and dq/dk (contiguous) as
    # their pointers (None: no weight); the rope tables as one ROPE = (cos, sin, batch, position and column
    # strides) (cos and sin share their strides). DTYPES: (norm round, norm out, rope, out).

    @triton.jit
    def _fwd_position(X, W, BIAS, O, RSTD, ROPE, pos, b, s, H, eps, weight_offset, D: tl.constexpr, R: tl.constexpr,
                      ROW_NORM: tl.constexpr, NEOX: tl.constexpr, HALF_TABLE: tl.constexpr, LAYER: tl.constexpr,
                      ROUND_FIRST: tl.constexpr, DTYPES: tl.constexpr, HB: tl.constexpr, HALF: tl.constexpr,
                      PASS: tl.constexpr, PASS2: tl.constexpr):
        """The norm and RoPE of every head of one position of q (or k)."""
        HAS_W: tl.constexpr = W is not None
        HAS_B: tl.constexpr = BIAS is not None
        HAS_PASS: tl.constexpr = D > R
        NORM_ROUND_DTYPE: tl.constexpr = DTYPES[0]
        NORM_OUT_DTYPE: tl.constexpr = DTYPES[1]
        ROPE_DTYPE: tl.constexpr = DTYPES[2]
        OUT_DTYPE: tl.constexpr = DTYPES[3]
        # the tables, (1, HALF), rounded to ROPE_DTYPE as eager's y * cos promotes them (shared by all heads)
        c_row = tl.zeros([1], dtype=tl.int64) + b * ROPE[2] + s * ROPE[3]
        cos_a, cos_b = _load_ab(ROPE[0], c_row, c_row >= 0, ROPE[4], R, NEOX, HALF, HALF_TABLE)
        sin_a, sin_b = _load_ab(ROPE[1], c_row, c_row >= 0, ROPE[4], R, NEOX, HALF, HALF_TABLE)
        cos_a, cos_b = _rope_step(cos_a, ROPE_DTYPE), _rope_step(cos_b, ROPE_DTYPE)
        sin_a, sin_b = _rope_step(sin_a, ROPE_DTYPE), _rope_step(sin_b, ROPE_DTYPE)
        x_base = b * X[1] + s * X[2]
        o_base = b * O[1] + s * O[2]
        for h0 in range(0, H, HB):  # ROW_NORM: HB >= H, one pass
            heads = h0 + tl.arange(0, HB)
            h_ok = heads < H
            x_rows = x_base + heads * X[3]
            xa, xb = _load_ab(X[0], x_rows, h_ok, 1, R, NEOX, HALF)
            xp = xa  # no pass-through: unused
            xp2 = xa
            if HAS_PASS:
                xp = _load_pass(X[0], x_rows, h_ok, R, D, PASS)
            if PASS2 > 0:  # the rest of a pass-through that is not a power of two (R = D / 4: D / 2 + D / 4)
                xp2 = _load_pass(X[0], x_rows, h_ok, R + PASS, D, PASS2)
            if LAYER:  # x less its mean: the sums below are then the variance's
                xa, xb, xp, xp2, _ = _centered(xa, xb, xp, xp2, h_ok, H, D, R, ROW_NORM, HB, HALF, PASS, PASS2)
            ss = tl.sum(xa * xa, axis=1) + tl.sum(xb * xb, axis=1)
            if HAS_PASS:
                ss += tl.sum(xp * xp, axis=1)
            if PASS2 > 0:
                ss += tl.sum(xp2 * xp2, axis=1)
            if ROW_NORM:
                rstd_row = tl.rsqrt(tl.sum(ss, axis=0) / (H * D) + eps)
                tl.store(RSTD + pos, rstd_row)
                rstd = tl.zeros([HB], dtype=tl.float32) + rstd_row
            else:
                rstd = tl.rsqrt(ss / D + eps)
                tl.store(RSTD + pos * H + heads, rstd, mask=h_ok)
            wa, wb, wp, wp2 = _weights(W, heads, h_ok, weight_offset, D, R, HAS_W, ROW_NORM, NEOX, HALF, PASS,
                                       HAS_PASS, PASS2)
            ba, bb, bp, bp2 = _weights(BIAS, heads, h_ok, 0.0, D, R, HAS_B, ROW_NORM, NEOX, HALF, PASS, HAS_PASS,
                                       PASS2)
            ya = _rope_step(_norm_out(xa, rstd, wa, ba, HAS_W, HAS_B, ROUND_FIRST, NORM_ROUND_DTYPE, NORM_OUT_DTYPE),
                            ROPE_DTYPE)
            yb = _rope_step(_norm_out(xb, rstd, wb, bb, HAS_W, HAS_B, ROUND_FIRST, NORM_ROUND_DTYPE, NORM_OUT_DTYPE),
                            ROPE_DTYPE)
            # o = round(rope, round(rope, y * c) + round(rope, sign * y[P] * s)): eager's three ops
            oa = _rope_step(_rope_step(ya * cos_a, ROPE_DTYPE) + _rope_step(-(yb * sin_a), ROPE_DTYPE), ROPE_DTYPE)
            ob = _rope_step(_rope_step(yb * cos_b, ROPE_DTYPE) + _rope_step(ya * sin_b, ROPE_DTYPE), ROPE_DTYPE)
            o_rows = o_base + heads * O[3]
            _store_ab(O[0], o_rows, h_ok, _round(oa, OUT_DTYPE), _round(ob, OUT_DTYPE), R, NEOX, HALF)
            if HAS_PASS:
                yp = _norm_out(xp, rstd, wp, bp, HAS_W, HAS_B, ROUND_FIRST, NORM_ROUND_DTYPE, NORM_OUT_DTYPE)
                _store_pass(O[0], o_rows, h_ok, _round(yp, OUT_DTYPE), R, D, PASS)
            if PASS2 > 0:
                yp2 = _norm_out(xp2, rstd, wp2, bp2, HAS_W, HAS_B, ROUND_FIRST, NORM_ROUND_DTYPE, NORM_OUT_DTYPE)
                _store_pass(O[0], o_rows, h_ok, _round(yp2, OUT_DTYPE), R + PASS, D, PASS2)

    @triton.jit
    def _qk_rope_fwd_kernel(
        Q, K, QO, KO,                    # (pointer, batch, position and head strides): inputs, outputs (B, S, H, D)
        WQ, WK, BQ, BK, RSTD_Q, RSTD_K, ROPE,
        S, HQ, HK, eps, weight_offset,
        D: tl.constexpr, R: tl.constexpr,                                          # constexpr: the masks fold
        ROW_NORM: tl.constexpr, NEOX: tl.constexpr, HALF_TABLE: tl.constexpr, LAYER: tl.constexpr,
        ROUND_FIRST: tl.constexpr, DTYPES: tl.constexpr, HB: tl.constexpr, HALF: tl.constexpr, PASS: tl.constexpr,
        PASS2: tl.constexpr,
    ):
        """Program (position, tensor): the norm and RoPE of all heads of q (axis 1 = 0) or k (1) at one
        position."""
        pos = tl.program_id(0).to(tl.int64)
        b = pos // S
        s = pos % S
        if tl.program_id(1) == 0:
            _fwd_position(Q, WQ, BQ, QO, RSTD_Q, ROPE, pos, b, s, HQ, eps, weight_offset, D, R, ROW_NORM, NEOX,
                          HALF_TABLE, LAYER, ROUND_FIRST, DTYPES, HB, HALF, PASS, PASS2)
        else:
            _fwd_position(K, WK, BK, KO, RSTD_K, ROPE, pos, b, s, HK, eps, weight_offset, D, R, ROW_NORM, NEOX,
                          HALF_TABLE, LAYER, ROUND_FIRST, DTYPES, HB, HALF, PASS, PASS2)

    @triton.jit
    def _store_weight_partials(DW_PART, pid, H, acc_a, acc_b, acc_p, acc_p2, D: tl.constexpr, R: tl.constexpr,
                               ROW_NORM: tl.constexpr, NEOX: tl.constexpr, HB: tl.constexpr, HALF: tl.constexpr,
                               PASS: tl.constexpr, PASS2: tl.constexpr):
        """This program's row of the fp32 weight-gradient partials: per head and column for a row norm,
        the heads summed (per column) for a head norm."""
        HAS_PASS: tl.constexpr = D > R
        if ROW_NORM:  # one partial per head and column
            heads = tl.arange(0, HB)
            rows = pid.to(tl.int64) * (H * D) + heads * D
            _store_ab(DW_PART, rows, heads < H, acc_a, acc_b, R, NEOX, HALF)
            if HAS_PASS:
                _store_pass(DW_PART, rows, heads < H, acc_p, R, D, PASS)
            if PASS2 > 0:
                _store_pass(DW_PART, rows, heads < H, acc_p2, R + PASS, D, PASS2)
        else:  # the heads summed: one partial per column
            rows = tl.zeros([1], dtype=tl.int64) + pid.to(tl.int64) * D
            _store_ab(DW_PART, rows, rows >= 0, tl.sum(acc_a, axis=0)[None, :], tl.sum(acc_b, axis=0)[None, :],
                      R, NEOX, HALF)
            if HAS_PASS:
                _store_pass(DW_PART, rows, rows >= 0, tl.sum(acc_p, axis=0)[None, :], R, D, PASS)
            if PASS2 > 0:
                _store_pass(DW_PART, rows, rows >= 0, tl.sum(acc_p2, axis=0)[None, :], R + PASS, D, PASS2)

    @triton.jit
    def _bwd_positions(DO, X, W, DX, RSTD, ROPE, DW_PART, DB_PART, pid, rows_per_program, n_pos, S, H, weight_offset,
                       D: tl.constexpr, R: tl.constexpr, ROW_NORM: tl.constexpr, NEOX: tl.constexpr,
                       HALF_TABLE: tl.constexpr, LAYER: tl.constexpr, HB: tl.constexpr, HALF: tl.constexpr,
                       PASS: tl.constexpr, PASS2: tl.constexpr):
        """dx of rows_per_program contiguous positions of q (or k), and this program's row of the fp32
        weight- and bias-gradient partials (per column; per head and column for a row norm)."""
        HAS_W: tl.constexpr = W is not None
        HAS_B: tl.constexpr = DB_PART is not None
        HAS_PASS: tl.constexpr = D > R
        acc_a = tl.zeros((HB, HALF), dtype=tl.float32)
        acc_b = tl.zeros((HB, HALF), dtype=tl.float32)
        acc_p = tl.zeros((HB, PASS), dtype=tl.float32)
        acc_p2 = acc_p  # no second pass-through block: unused
        if PASS2 > 0:
            acc_p2 = tl.zeros((HB, PASS2), dtype=tl.float32)
        bcc_a = tl.zeros((HB, HALF), dtype=tl.float32)  # the bias's: sum of dy
        bcc_b = tl.zeros((HB, HALF), dtype=tl.float32)
        bcc_p = tl.zeros((HB, PASS), dtype=tl.float32)
        bcc_p2 = bcc_p
        if PASS2 > 0:
            bcc_p2 = tl.zeros((HB, PASS2), dtype=tl.float32)
        for i in range(rows_per_program):
            pos = (pid * rows_per_program + i).to(tl.int64)
            pos_ok = pos < n_pos
            b = pos // S
            s = pos % S
            c_row = tl.zeros([1], dtype=tl.int64) + b * ROPE[2] + s * ROPE[3]
            cos_a, cos_b = _load_ab(ROPE[0], c_row, c_row * 0 + pos < n_pos, ROPE[4], R, NEOX, HALF, HALF_TABLE)
            sin_a, sin_b = _load_ab(ROPE[1], c_row, c_row * 0 + pos < n_pos, ROPE[4], R, NEOX, HALF, HALF_TABLE)
            for h0 in range(0, H, HB):  # ROW_NORM: HB >= H, one pass
                heads = h0 + tl.arange(0, HB)
                h_ok = (heads < H) & pos_ok
                if ROW_NORM:
                    rstd = tl.zeros([HB], dtype=tl.float32) + tl.load(RSTD + pos, mask=pos_ok, other=0.0)
                else:
                    rstd = tl.load(RSTD + pos * H + heads, mask=h_ok, other=0.0)
                do_rows = b * DO[1] + s * DO[2] + heads * DO[3]
                ga, gb = _load_ab(DO[0], do_rows, h_ok, 1, R, NEOX, HALF)
                # dy = dout * c + rot^T(dout * s): A takes B's sin term, B gives A's back negated
                dya = ga * cos_a + gb * sin_b
                dyb = gb * cos_b - ga * sin_a
                x_rows = b * X[1] + s * X[2] + heads * X[3]
                xa, xb = _load_ab(X[0], x_rows, h_ok, 1, R, NEOX, HALF)
                xp = xa  # no pass-through: unused
                xp2 = xa
                dyp = dya
                dyp2 = dya
                if HAS_PASS:
                    dyp = _load_pass(DO[0], do_rows, h_ok, R, D, PASS)
                    xp = _load_pass(X[0], x_rows, h_ok, R, D, PASS)
                if PASS2 > 0:
                    dyp2 = _load_pass(DO[0], do_rows, h_ok, R + PASS, D, PASS2)
                    xp2 = _load_pass(X[0], x_rows, h_ok, R + PASS, D, PASS2)
                if LAYER:  # x_hat = (x - mean) * rstd, the mean recomputed from x
                    xa, xb, xp, xp2, _ = _centered(xa, xb, xp, xp2, h_ok, H, D, R, ROW_NORM, HB, HALF, PASS, PASS2)
                xha = xa * rstd[:, None]
                xhb = xb * rstd[:, None]
                wa, wb, wp, wp2 = _weights(W, heads, h_ok, weight_offset, D, R, HAS_W, ROW_NORM, NEOX, HALF, PASS,
                                           HAS_PASS, PASS2)
                dna = dya * wa
                dnb = dyb * wb
                dot = tl.sum(dna * xha, axis=1) + tl.sum(dnb * xhb, axis=1)
                sdn = tl.sum(dna, axis=1) + tl.sum(dnb, axis=1)
                xhp = xha  # unused without a pass-through
                xhp2 = xha
                dnp = dna
                dnp2 = dna
                if HAS_PASS:
                    xhp = xp * rstd[:, None]
                    dnp = dyp * wp
                    dot += tl.sum(dnp * xhp, axis=1)
                    sdn += tl.sum(dnp, axis=1)
                if PASS2 > 0:
                    xhp2 = xp2 * rstd[:, None]
                    dnp2 = dyp2 * wp2
                    dot += tl.sum(dnp2 * xhp2, axis=1)
                    sdn += tl.sum(dnp2, axis=1)
                c0 = tl.zeros([HB], dtype=tl.float32)  # mean(dn): a LayerNorm's only
                if ROW_NORM:
                    c1 = c0 + tl.sum(dot, axis=0) / (H * D)
                    if LAYER:
                        c0 += tl.sum(sdn, axis=0) / (H * D)
                else:
                    c1 = dot / D
                    if LAYER:
                        c0 += sdn / D
                # du = rstd * (dn - mean(dn) - x_hat * mean(dn * x_hat)) (no mean(dn) for an RMSNorm),
                # dx = round(x.dtype, du); DX is contiguous
                dx_rows = pos * H * D + heads * D
                dx_ty = DX.dtype.element_ty
                _store_ab(DX, dx_rows, h_ok, _round((dna - c0[:, None] - xha * c1[:, None]) * rstd[:, None], dx_ty),
                          _round((dnb - c0[:, None] - xhb * c1[:, None]) * rstd[:, None], dx_ty), R, NEOX, HALF)
                if HAS_W:
                    acc_a += dya * xha
                    acc_b += dyb * xhb
                if HAS_B:
                    bcc_a += dya
                    bcc_b += dyb
                if HAS_PASS:
                    _store_pass(DX, dx_rows, h_ok, _round((dnp - c0[:, None] - xhp * c1[:, None]) * rstd[:, None],
                                                          dx_ty), R, D, PASS)
                    if HAS_W:
                        acc_p += dyp * xhp
                    if HAS_B:
                        bcc_p += dyp
                if PASS2 > 0:
                    _store_pass(DX, dx_rows, h_ok, _round((dnp2 - c0[:, None] - xhp2 * c1[:, None]) * rstd[:, None],
                                                          dx_ty), R + PASS, D, PASS2)
                    if HAS_W:
                        acc_p2 += dyp2 * xhp2
                    if HAS_B:
                        bcc_p2 += dyp2
        if HAS_W:
            _store_weight_partials(DW_PART, pid, H, acc_a, acc_b, acc_p, acc_p2, D, R, ROW_NORM, NEOX, HB, HALF, PASS,
                                   PASS2)
        if HAS_B:
            _store_weight_partials(DB_PART, pid, H, bcc_a, bcc_b, bcc_p, bcc_p2, D, R, ROW_NORM, NEOX, HB, HALF, PASS,
                                   PASS2)

    @triton.jit
    def _qk_rope_bwd_kernel(
        DQO, DKO, Q, K,                  # (pointer, batch, position and head strides): output grads, inputs
        WQ, WK, DQ, DK, RSTD_Q, RSTD_K, ROPE, DWQ_PART, DWK_PART, DBQ_PART, DBK_PART,
        n_pos, rows_per_program, S, HQ, HK, weight_offset,
        D: tl.constexpr, R: tl.constexpr, ROW_NORM: tl.constexpr, NEOX: tl.constexpr, HALF_TABLE: tl.constexpr,
        LAYER: tl.constexpr, HB: tl.constexpr, HALF: tl.constexpr, PASS: tl.constexpr, PASS2: tl.constexpr,
    ):
        """Program (chunk, tensor): dq (axis 1 = 0) or dk (1) of a chunk of positions, and its weight
        and bias gradient partials."""
        pid = tl.program_id(0)
        if tl.program_id(1) == 0:
            _bwd_positions(DQO, Q, WQ, DQ, RSTD_Q, ROPE, DWQ_PART, DBQ_PART, pid, rows_per_program, n_pos, S, HQ,
                           weight_offset, D, R, ROW_NORM, NEOX, HALF_TABLE, LAYER, HB, HALF, PASS, PASS2)
        else:
            _bwd_positions(DKO, K, WK, DK, RSTD_K, ROPE, DWK_PART, DBK_PART, pid, rows_per_program, n_pos, S, HK,
                           weight_offset, D, R, ROW_NORM, NEOX, HALF_TABLE, LAYER, HB, HALF, PASS, PASS2)


# --------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------

def _tables_3d(t: torch.Tensor, B: int, S: int) -> torch.Tensor:
    """A (1 | B, 1 | S, 1, R') table as a (B, S, R') view (stride 0 where it broadcasts)."""
    return t.squeeze(2).expand(B, S, t.shape[-1])


def _tile(H: int, D: int, rotary_dim: int, row_norm: bool, budget: int) -> tuple[int, int, int, int]:
    """(HB, HALF, PASS, PASS2): heads per tile and the column blocks of the A/B halves and of the
    pass-through: the largest power of two in it, and the rest (0: none) rounded up to one (R = D / 4:
    D / 2 + D / 4, where one block of D would leave 20% of the tile's columns masked off)."""
    half = triton.next_power_of_2(rotary_dim // 2)
    rest = D - rotary_dim
    pas = 1 << (rest.bit_length() - 1) if rest else 1
    pas2 = triton.next_power_of_2(rest - pas) if rest > pas else 0
    heads = triton.next_power_of_2(H)
    if not row_norm:
        heads = min(heads, max(1, budget // _columns(half, pas, pas2)))
        heads = 1 << (heads.bit_length() - 1)  # a power of two
    return heads, half, pas, pas2


def _columns(half: int, pas: int, pas2: int) -> int:
    return 2 * half + pas + pas2


def _warps(hb: int, columns: int, backward: bool = False) -> int:
    """About 8 elements of a tile per thread forward, 4 backward (more values live: x, dout, dy and the
    weight-gradient accumulators; gptj at head_dim 256 took an 8-byte stack frame on sm90 with 8 per
    thread), as a power of two from 1 to 8 (the compiler takes no other counts)."""
    warps = max(hb * columns // (128 if backward else 256), 1)
    return min(1 << (warps.bit_length() - 1), 8)


def _operand(t: torch.Tensor) -> tuple:
    """A (B, S, H, D) operand of the kernels: (pointer, batch, position and head strides)."""
    return (t, t.stride(0), t.stride(1), t.stride(2))


def _rope_tables(rope, B: int, S: int) -> tuple:
    """ROPE: (cos, sin, batch, position and column strides), the tables as (B, S, R') views."""
    c3, s3 = _tables_3d(rope.cos, B, S), _tables_3d(rope.sin, B, S)
    if c3.stride() != s3.stride():  # one set of strides serves both
        c3, s3 = c3.contiguous(), s3.contiguous()
    return (c3, s3, *c3.stride())


def qk_norm_rope_fwd(call: QkNormRopeCall):
    """(q_out, k_out, q_rstd, k_rstd); k's None without k."""
    q, k, rope, norm, rounding = call.q.x, None if call.k is None else call.k.x, call.rope, call.norm, call.rounding
    transpose_out, full_width, rotary_dim = call.transpose_out, norm.full_width, rope.rotary_dim
    B, S, H, D = q.shape
    outs, rstds = [], []
    for x in (q, k):
        if x is None:
            outs.append(None)
            rstds.append(None)
            continue
        h = x.shape[2]
        o = x.new_empty((B, h, S, D) if transpose_out else (B, S, h, D), dtype=rounding.out_dtype)
        outs.append(o.transpose(1, 2) if transpose_out else o)  # written through its (B, S, H, D) view
        rstds.append(x.new_empty((B * S * (1 if full_width else h),), dtype=torch.float32))
    if B * S:
        q2, k2 = (None if x is None else (x if x.stride(-1) == 1 else x.contiguous()) for x in (q, k))
        hb, half, pas, pas2 = _tile(max(H, 0 if k is None else k.shape[2]), D, rotary_dim, full_width, _TILE_FWD)
        qo, ko = outs
        kk, kko = (q2, qo) if k is None else (k2, ko)   # k absent: axis 1 has one program, k's arguments unused
        norm_out = rounding.norm_out_dtype
        _qk_rope_fwd_kernel[(B * S, 1 if k is None else 2)](
            _operand(q2), _operand(kk), _operand(qo), _operand(kko), call.q.weight,
            None if k is None else call.k.weight, call.q.bias, None if k is None else call.k.bias, rstds[0],
            rstds[1] if k is not None else rstds[0], _rope_tables(rope, B, S), S, H, kk.shape[2], norm.eps,
            norm.weight_offset, D=D, R=rotary_dim, ROW_NORM=full_width, NEOX=rope.layout == "neox",
            HALF_TABLE=rope.cos.shape[-1] != rotary_dim, LAYER=norm.kind == "layer_norm",
            ROUND_FIRST=rounding.norm_round_dtype is not None,
            DTYPES=(TL_DTYPES[rounding.norm_round_dtype or norm_out], TL_DTYPES[norm_out],
                    TL_DTYPES[rounding.rope_dtype], TL_DTYPES[rounding.out_dtype]),
            HB=hb, HALF=half, PASS=pas, PASS2=pas2, num_warps=_warps(hb, _columns(half, pas, pas2)),
            enable_fp_fusion=False)  # an fp32 rope_dtype rounds y * c before the add, as eager does
    q_out, k_out = (None if o is None else (o.transpose(1, 2) if transpose_out else o) for o in outs)
    return q_out, k_out, rstds[0], rstds[1]


def qk_norm_rope_bwd(call: QkNormRopeBackwardCall):
    """(dq, dk, dq_weight, dk_weight, dq_bias, dk_bias); k's None without k, a weight's (bias's) None
    without that weight (bias)."""
    q, k, rope, full_width, rotary_dim = call.q.x, None if call.k is None else call.k.x, call.rope, \
        call.norm.full_width, call.rope.rotary_dim
    q_weight, q_rstd, q_bias = call.q.weight, call.q.rstd, call.q.bias
    k_weight, k_rstd, dk_out, k_bias = (None,) * 4 if k is None else (call.k.weight, call.k.rstd, call.k.dout,
                                                                       call.k.bias)
    B, S, H, D = q.shape
    n_pos = B * S
    programs = max(1, min(n_pos, 4 * _sm_count(q.device)))
    rows_per_program = triton.cdiv(n_pos, programs) if n_pos else 0

    def rows(t):
        return None if t is None else (t if t.stride(-1) == 1 else t.contiguous())

    def partials(w):
        # every program writes its row (zeros when it has no positions); no launch without positions
        alloc = torch.empty if n_pos else torch.zeros
        return None if w is None else alloc((programs, w.numel()), dtype=torch.float32, device=q.device)
    q2, k2, dq2, dk2 = (rows(t) for t in (q, k, call.q.dout, dk_out))
    dq = q.new_empty(q.shape)
    dk = None if k is None else k.new_empty(k.shape)
    dwq, dwk, dbq, dbk = partials(q_weight), partials(k_weight), partials(q_bias), partials(k_bias)
    if n_pos:
        hb, half, pas, pas2 = _tile(max(H, 0 if k is None else k.shape[2]), D, rotary_dim, full_width, _TILE_BWD)
        kk, dkk, dko = (q2, dq, dq2) if k is None else (k2, dk, dk2)  # k absent: one program per chunk on axis 1
        _qk_rope_bwd_kernel[(programs, 1 if k is None else 2)](
            _operand(dq2), _operand(dko), _operand(q2), _operand(kk), q_weight, k_weight, dq, dkk, q_rstd,
            q_rstd if k is None else k_rstd, _rope_tables(rope, B, S), dwq, dwk, dbq, dbk,
            n_pos, rows_per_program, S, H, kk.shape[2], call.norm.weight_offset, D=D, R=rotary_dim,
            ROW_NORM=full_width, NEOX=rope.layout == "neox", HALF_TABLE=rope.cos.shape[-1] != rotary_dim,
            LAYER=call.norm.kind == "layer_norm", HB=hb, HALF=half, PASS=pas, PASS2=pas2,
            num_warps=_warps(hb, _columns(half, pas, pas2), backward=True))

    def summed(partial, like):  # the [programs, N] fp32 partials summed in fp32, rounded once to like's dtype
        return None if partial is None else partial.sum(0).to(like.dtype)
    return dq, dk, summed(dwq, q_weight), summed(dwk, k_weight), summed(dbq, q_bias), summed(dbk, k_bias)
