"""The Triton backend of qk_norm_rope: kernels and launchers.

The same function as ``qk_rope.py``'s reference (read its docstring first), with the same backend
interface: ``qk_norm_rope_fwd`` and ``qk_norm_rope_bwd`` take the custom ops' arguments positionally
and return None for outputs that do not exist. q and k go through one launch: program axis 1 picks
the tensor (0: q, 1: k), axis 0 the position (forward) or a chunk of positions (backward).

A program holds one position's heads as tiles of (heads, columns), each column loaded once: the
rotated columns as two halves A and B that rotate into each other (neox: columns [0, R/2) and
[R/2, R); gptj: the even and the odd columns), and the pass-through columns [R, D) as a third tile.
The norm's statistics sum the three; the rotation is elementwise between A and B.
"""

from __future__ import annotations

import torch

from normfuse.kernels.triton import TL_DTYPES, _round, _sm_count, triton, tl

# Elements of one (heads, columns) tile: the forward keeps x and y of a tile live, the backward x,
# dout, dy and three weight-gradient accumulators (fp32). Per-head norms loop over chunks of heads;
# a whole-row norm (OLMo 2) takes all heads of a position in one tile.
_TILE_FWD = 4096
_TILE_BWD = 2048

if triton is not None:

    @triton.jit
    def _columns(R, D, NEOX: tl.constexpr, HALF_TABLE: tl.constexpr, HALF: tl.constexpr, PASS: tl.constexpr):
        """The column indices of tiles A, B, P, their table columns, and their masks."""
        i = tl.arange(0, HALF)
        half = R // 2
        i_ok = i < half
        if NEOX:
            col_a = i
            col_b = i + half
        else:
            col_a = 2 * i
            col_b = 2 * i + 1
        if HALF_TABLE:  # one value per pair (freqs_cis)
            tab_a = i
            tab_b = i
        else:
            tab_a = col_a
            tab_b = col_b
        col_p = R + tl.arange(0, PASS)
        return col_a, col_b, col_p, tab_a, tab_b, i_ok, col_p < D

    @triton.jit
    def _load_tile(X, base, heads, stride_h, cols, mask):
        return tl.load(X + base + heads[:, None] * stride_h + cols[None, :], mask=mask, other=0.0).to(tl.float32)

    @triton.jit
    def _load_weight(W, heads, h_ok, cols, col_ok, D, weight_offset, HAS_W: tl.constexpr, ROW_NORM: tl.constexpr):
        """w' = float(w) + weight_offset of a tile's columns: per column (head norm), or per head and
        column (row norm: W spans all heads)."""
        if HAS_W:
            if ROW_NORM:
                w = tl.load(W + heads[:, None] * D + cols[None, :], mask=h_ok[:, None] & col_ok[None, :],
                            other=0.0).to(tl.float32)
            else:
                w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            return w + weight_offset
        return 1.0

    @triton.jit
    def _norm_out(x, rstd, w, HAS_W: tl.constexpr, ROUND_FIRST: tl.constexpr, NORM_ROUND_DTYPE: tl.constexpr,
                  NORM_OUT_DTYPE: tl.constexpr):
        """y = round(NORM_OUT_DTYPE, n * w') with n = x * rstd (rounded first when ROUND_FIRST), in fp32."""
        n = x * rstd[:, None]
        if ROUND_FIRST:
            n = _round(n, NORM_ROUND_DTYPE).to(tl.float32)
        if HAS_W:
            n = n * w
        return _round(n, NORM_OUT_DTYPE).to(tl.float32)

    @triton.jit
    def _rope_step(v, ROPE_DTYPE: tl.constexpr):
        return _round(v, ROPE_DTYPE).to(tl.float32)

    @triton.jit
    def _fwd_position(X, W, O, RSTD, COS, SIN, pos, b, s, H, D, R, eps, weight_offset,
                      stride_xb, stride_xs, stride_xh, stride_ob, stride_os, stride_oh, stride_cb, stride_cs,
                      stride_cc, HAS_W: tl.constexpr, ROW_NORM: tl.constexpr, NEOX: tl.constexpr,
                      HALF_TABLE: tl.constexpr, ROUND_FIRST: tl.constexpr, NORM_ROUND_DTYPE: tl.constexpr,
                      NORM_OUT_DTYPE: tl.constexpr, ROPE_DTYPE: tl.constexpr, OUT_DTYPE: tl.constexpr,
                      HB: tl.constexpr, HALF: tl.constexpr, PASS: tl.constexpr, HAS_PASS: tl.constexpr):
        """The norm and RoPE of every head of one position of q (or k)."""
        col_a, col_b, col_p, tab_a, tab_b, i_ok, p_ok = _columns(R, D, NEOX, HALF_TABLE, HALF, PASS)
        c_base = b * stride_cb + s * stride_cs
        # the tables, rounded to ROPE_DTYPE as eager's y * cos promotes them (shared by all heads)
        cos_a = _rope_step(tl.load(COS + c_base + tab_a * stride_cc, mask=i_ok, other=0.0), ROPE_DTYPE)[None, :]
        cos_b = _rope_step(tl.load(COS + c_base + tab_b * stride_cc, mask=i_ok, other=0.0), ROPE_DTYPE)[None, :]
        sin_a = _rope_step(tl.load(SIN + c_base + tab_a * stride_cc, mask=i_ok, other=0.0), ROPE_DTYPE)[None, :]
        sin_b = _rope_step(tl.load(SIN + c_base + tab_b * stride_cc, mask=i_ok, other=0.0), ROPE_DTYPE)[None, :]
        x_base = b * stride_xb + s * stride_xs
        o_base = b * stride_ob + s * stride_os
        for h0 in range(0, H, HB):  # ROW_NORM: HB >= H, one pass
            heads = h0 + tl.arange(0, HB)
            h_ok = heads < H
            m_ab = h_ok[:, None] & i_ok[None, :]
            m_p = h_ok[:, None] & p_ok[None, :]
            xa = _load_tile(X, x_base, heads, stride_xh, col_a, m_ab)
            xb = _load_tile(X, x_base, heads, stride_xh, col_b, m_ab)
            ss = tl.sum(xa * xa, axis=1) + tl.sum(xb * xb, axis=1)
            if HAS_PASS:
                xp = _load_tile(X, x_base, heads, stride_xh, col_p, m_p)
                ss += tl.sum(xp * xp, axis=1)
            if ROW_NORM:
                rstd_row = tl.rsqrt(tl.sum(ss, axis=0) / (H * D) + eps)
                tl.store(RSTD + pos, rstd_row)
                rstd = tl.zeros([HB], dtype=tl.float32) + rstd_row
            else:
                rstd = tl.rsqrt(ss / D + eps)
                tl.store(RSTD + pos * H + heads, rstd, mask=h_ok)
            ya = _norm_out(xa, rstd, _load_weight(W, heads, h_ok, col_a, i_ok, D, weight_offset, HAS_W, ROW_NORM), HAS_W,
                           ROUND_FIRST, NORM_ROUND_DTYPE, NORM_OUT_DTYPE)
            yb = _norm_out(xb, rstd, _load_weight(W, heads, h_ok, col_b, i_ok, D, weight_offset, HAS_W, ROW_NORM), HAS_W,
                           ROUND_FIRST, NORM_ROUND_DTYPE, NORM_OUT_DTYPE)
            ya = _rope_step(ya, ROPE_DTYPE)
            yb = _rope_step(yb, ROPE_DTYPE)
            # o = round(rope, round(rope, y * c) + round(rope, sign * y[P] * s)): eager's three ops
            oa = _rope_step(_rope_step(ya * cos_a, ROPE_DTYPE) + _rope_step(-(yb * sin_a), ROPE_DTYPE), ROPE_DTYPE)
            ob = _rope_step(_rope_step(yb * cos_b, ROPE_DTYPE) + _rope_step(ya * sin_b, ROPE_DTYPE), ROPE_DTYPE)
            tl.store(O + o_base + heads[:, None] * stride_oh + col_a[None, :], _round(oa, OUT_DTYPE), mask=m_ab)
            tl.store(O + o_base + heads[:, None] * stride_oh + col_b[None, :], _round(ob, OUT_DTYPE), mask=m_ab)
            if HAS_PASS:
                yp = _norm_out(xp, rstd, _load_weight(W, heads, h_ok, col_p, p_ok, D, weight_offset, HAS_W, ROW_NORM),
                               HAS_W, ROUND_FIRST, NORM_ROUND_DTYPE, NORM_OUT_DTYPE)
                tl.store(O + o_base + heads[:, None] * stride_oh + col_p[None, :], _round(yp, OUT_DTYPE), mask=m_p)

    @triton.jit
    def _qk_rope_fwd_kernel(
        Q, K, WQ, WK, QO, KO, RSTD_Q, RSTD_K, COS, SIN,
        S, HQ, HK, D, R, eps, weight_offset,
        stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,          # inputs (B, S, H, D)
        stride_qob, stride_qos, stride_qoh, stride_kob, stride_kos, stride_koh,    # outputs, as (B, S, H, D)
        stride_cb, stride_cs, stride_cc,                                           # tables (B, S, R or R / 2)
        HAS_WQ: tl.constexpr, HAS_WK: tl.constexpr, ROW_NORM: tl.constexpr, NEOX: tl.constexpr,
        HALF_TABLE: tl.constexpr, ROUND_FIRST: tl.constexpr, NORM_ROUND_DTYPE: tl.constexpr,
        NORM_OUT_DTYPE: tl.constexpr, ROPE_DTYPE: tl.constexpr, OUT_DTYPE: tl.constexpr,
        HB: tl.constexpr, HALF: tl.constexpr, PASS: tl.constexpr, HAS_PASS: tl.constexpr,
    ):
        """Program (position, tensor): the norm and RoPE of all heads of q (axis 1 = 0) or k (1) at one
        position."""
        pos = tl.program_id(0).to(tl.int64)
        b = pos // S
        s = pos % S
        if tl.program_id(1) == 0:
            _fwd_position(Q, WQ, QO, RSTD_Q, COS, SIN, pos, b, s, HQ, D, R, eps, weight_offset, stride_qb, stride_qs,
                          stride_qh, stride_qob, stride_qos, stride_qoh, stride_cb, stride_cs, stride_cc, HAS_WQ,
                          ROW_NORM, NEOX, HALF_TABLE, ROUND_FIRST, NORM_ROUND_DTYPE, NORM_OUT_DTYPE, ROPE_DTYPE,
                          OUT_DTYPE, HB, HALF, PASS, HAS_PASS)
        else:
            _fwd_position(K, WK, KO, RSTD_K, COS, SIN, pos, b, s, HK, D, R, eps, weight_offset, stride_kb, stride_ks,
                          stride_kh, stride_kob, stride_kos, stride_koh, stride_cb, stride_cs, stride_cc, HAS_WK,
                          ROW_NORM, NEOX, HALF_TABLE, ROUND_FIRST, NORM_ROUND_DTYPE, NORM_OUT_DTYPE, ROPE_DTYPE,
                          OUT_DTYPE, HB, HALF, PASS, HAS_PASS)

    @triton.jit
    def _bwd_positions(DO, X, W, DX, RSTD, COS, SIN, DW_PART, pid, rows_per_program, n_pos, S, H, D, R,
                       weight_offset, stride_db, stride_ds, stride_dh, stride_xb, stride_xs, stride_xh, stride_cb,
                       stride_cs, stride_cc, HAS_W: tl.constexpr, ROW_NORM: tl.constexpr, NEOX: tl.constexpr,
                       HALF_TABLE: tl.constexpr, HB: tl.constexpr, HALF: tl.constexpr, PASS: tl.constexpr,
                       HAS_PASS: tl.constexpr):
        """dx of rows_per_program contiguous positions of q (or k), and this program's row of the fp32
        weight-gradient partials (per column; per head and column for a row norm)."""
        col_a, col_b, col_p, tab_a, tab_b, i_ok, p_ok = _columns(R, D, NEOX, HALF_TABLE, HALF, PASS)
        acc_a = tl.zeros((HB, HALF), dtype=tl.float32)
        acc_b = tl.zeros((HB, HALF), dtype=tl.float32)
        acc_p = tl.zeros((HB, PASS), dtype=tl.float32)
        for i in range(rows_per_program):
            pos = (pid * rows_per_program + i).to(tl.int64)
            pos_ok = pos < n_pos
            b = pos // S
            s = pos % S
            c_base = b * stride_cb + s * stride_cs
            t_ok = i_ok & pos_ok
            cos_a = tl.load(COS + c_base + tab_a * stride_cc, mask=t_ok, other=0.0).to(tl.float32)[None, :]
            cos_b = tl.load(COS + c_base + tab_b * stride_cc, mask=t_ok, other=0.0).to(tl.float32)[None, :]
            sin_a = tl.load(SIN + c_base + tab_a * stride_cc, mask=t_ok, other=0.0).to(tl.float32)[None, :]
            sin_b = tl.load(SIN + c_base + tab_b * stride_cc, mask=t_ok, other=0.0).to(tl.float32)[None, :]
            x_base = b * stride_xb + s * stride_xs
            d_base = b * stride_db + s * stride_ds
            for h0 in range(0, H, HB):  # ROW_NORM: HB >= H, one pass
                heads = h0 + tl.arange(0, HB)
                h_ok = (heads < H) & pos_ok
                m_ab = h_ok[:, None] & i_ok[None, :]
                m_p = h_ok[:, None] & p_ok[None, :]
                if ROW_NORM:
                    rstd = tl.zeros([HB], dtype=tl.float32) + tl.load(RSTD + pos, mask=pos_ok, other=0.0)
                else:
                    rstd = tl.load(RSTD + pos * H + heads, mask=h_ok, other=0.0)
                ga = _load_tile(DO, d_base, heads, stride_dh, col_a, m_ab)
                gb = _load_tile(DO, d_base, heads, stride_dh, col_b, m_ab)
                # dy = dout * c + rot^T(dout * s): A takes B's sin term, B gives A's back negated
                dya = ga * cos_a + gb * sin_b
                dyb = gb * cos_b - ga * sin_a
                xha = _load_tile(X, x_base, heads, stride_xh, col_a, m_ab) * rstd[:, None]
                xhb = _load_tile(X, x_base, heads, stride_xh, col_b, m_ab) * rstd[:, None]
                dna = dya * _load_weight(W, heads, h_ok, col_a, i_ok, D, weight_offset, HAS_W, ROW_NORM)
                dnb = dyb * _load_weight(W, heads, h_ok, col_b, i_ok, D, weight_offset, HAS_W, ROW_NORM)
                dot = tl.sum(dna * xha, axis=1) + tl.sum(dnb * xhb, axis=1)
                if HAS_PASS:
                    dyp = _load_tile(DO, d_base, heads, stride_dh, col_p, m_p)
                    xhp = _load_tile(X, x_base, heads, stride_xh, col_p, m_p) * rstd[:, None]
                    dnp = dyp * _load_weight(W, heads, h_ok, col_p, p_ok, D, weight_offset, HAS_W, ROW_NORM)
                    dot += tl.sum(dnp * xhp, axis=1)
                if ROW_NORM:
                    c1 = tl.zeros([HB], dtype=tl.float32) + tl.sum(dot, axis=0) / (H * D)
                else:
                    c1 = dot / D
                # du = rstd * (dn - x_hat * mean(dn * x_hat)), dx = round(x.dtype, du); DX is contiguous
                dx_base = pos * H * D + heads[:, None] * D
                dx_ty = DX.dtype.element_ty
                tl.store(DX + dx_base + col_a[None, :], _round((dna - xha * c1[:, None]) * rstd[:, None], dx_ty),
                         mask=m_ab)
                tl.store(DX + dx_base + col_b[None, :], _round((dnb - xhb * c1[:, None]) * rstd[:, None], dx_ty),
                         mask=m_ab)
                if HAS_W:
                    acc_a += dya * xha
                    acc_b += dyb * xhb
                if HAS_PASS:
                    tl.store(DX + dx_base + col_p[None, :], _round((dnp - xhp * c1[:, None]) * rstd[:, None], dx_ty),
                             mask=m_p)
                    if HAS_W:
                        acc_p += dyp * xhp
        if HAS_W:
            heads = tl.arange(0, HB)
            if ROW_NORM:  # one partial per head and column
                part = DW_PART + pid.to(tl.int64) * (H * D) + heads[:, None] * D
                h_ok = heads < H
                tl.store(part + col_a[None, :], acc_a, mask=h_ok[:, None] & i_ok[None, :])
                tl.store(part + col_b[None, :], acc_b, mask=h_ok[:, None] & i_ok[None, :])
                if HAS_PASS:
                    tl.store(part + col_p[None, :], acc_p, mask=h_ok[:, None] & p_ok[None, :])
            else:  # the heads summed: one partial per column
                part = DW_PART + pid.to(tl.int64) * D
                tl.store(part + col_a, tl.sum(acc_a, axis=0), mask=i_ok)
                tl.store(part + col_b, tl.sum(acc_b, axis=0), mask=i_ok)
                if HAS_PASS:
                    tl.store(part + col_p, tl.sum(acc_p, axis=0), mask=p_ok)

    @triton.jit
    def _qk_rope_bwd_kernel(
        DQO, DKO, Q, K, WQ, WK, DQ, DK, RSTD_Q, RSTD_K, COS, SIN, DWQ_PART, DWK_PART,
        n_pos, rows_per_program, S, HQ, HK, D, R, weight_offset,
        stride_dqb, stride_dqs, stride_dqh, stride_dkb, stride_dks, stride_dkh,   # output grads, as (B, S, H, D)
        stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,         # inputs (B, S, H, D)
        stride_cb, stride_cs, stride_cc,                                          # tables (B, S, R or R / 2)
        HAS_WQ: tl.constexpr, HAS_WK: tl.constexpr, ROW_NORM: tl.constexpr, NEOX: tl.constexpr,
        HALF_TABLE: tl.constexpr, HB: tl.constexpr, HALF: tl.constexpr, PASS: tl.constexpr, HAS_PASS: tl.constexpr,
    ):
        """Program (chunk, tensor): dq (axis 1 = 0) or dk (1) of a chunk of positions, and its weight
        gradient partials."""
        pid = tl.program_id(0)
        if tl.program_id(1) == 0:
            _bwd_positions(DQO, Q, WQ, DQ, RSTD_Q, COS, SIN, DWQ_PART, pid, rows_per_program, n_pos, S, HQ, D, R,
                           weight_offset, stride_dqb, stride_dqs, stride_dqh, stride_qb, stride_qs, stride_qh,
                           stride_cb, stride_cs, stride_cc, HAS_WQ, ROW_NORM, NEOX, HALF_TABLE, HB, HALF, PASS,
                           HAS_PASS)
        else:
            _bwd_positions(DKO, K, WK, DK, RSTD_K, COS, SIN, DWK_PART, pid, rows_per_program, n_pos, S, HK, D, R,
                           weight_offset, stride_dkb, stride_dks, stride_dkh, stride_kb, stride_ks, stride_kh,
                           stride_cb, stride_cs, stride_cc, HAS_WK, ROW_NORM, NEOX, HALF_TABLE, HB, HALF, PASS,
                           HAS_PASS)


# --------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------

def _tables_3d(t: torch.Tensor, B: int, S: int) -> torch.Tensor:
    """A (1 | B, 1 | S, 1, R') table as a (B, S, R') view (stride 0 where it broadcasts)."""
    return t.squeeze(2).expand(B, S, t.shape[-1])


def _tile(H: int, D: int, rotary_dim: int, row_norm: bool, budget: int) -> tuple[int, int, int]:
    """(HB, HALF, PASS): heads per tile and the column blocks of the A/B halves and the pass-through."""
    half = triton.next_power_of_2(rotary_dim // 2)
    pas = triton.next_power_of_2(D - rotary_dim) if D > rotary_dim else 1
    heads = triton.next_power_of_2(H)
    if not row_norm:
        heads = min(heads, max(1, budget // (2 * half + pas)))
        heads = 1 << (heads.bit_length() - 1)  # a power of two
    return heads, half, pas


def _warps(hb: int, half: int, pas: int) -> int:
    return min(max(hb * (2 * half + pas) // 256, 1), 8)


def qk_norm_rope_fwd(q, k, q_weight, k_weight, cos, sin, eps, weight_offset, norm_round_dtype, norm_out_dtype,
                     rope_dtype, out_dtype, layout, rotary_dim, full_width, transpose_out):
    B, S, H, D = q.shape
    outs, rstds = [], []
    for x in (q, k):
        if x is None:
            outs.append(None)
            rstds.append(None)
            continue
        h = x.shape[2]
        o = x.new_empty((B, h, S, D) if transpose_out else (B, S, h, D), dtype=out_dtype)
        outs.append(o.transpose(1, 2) if transpose_out else o)  # written through its (B, S, H, D) view
        rstds.append(x.new_empty((B * S * (1 if full_width else h),), dtype=torch.float32))
    if B * S:
        c3, s3 = _tables_3d(cos, B, S), _tables_3d(sin, B, S)
        if c3.stride() != s3.stride():  # one set of strides serves both
            c3, s3 = c3.contiguous(), s3.contiguous()
        q2, k2 = (None if x is None else (x if x.stride(-1) == 1 else x.contiguous()) for x in (q, k))
        hb, half, pas = _tile(max(H, 0 if k is None else k.shape[2]), D, rotary_dim, full_width, _TILE_FWD)
        qo, ko = outs
        kk, kko = (q2, qo) if k is None else (k2, ko)   # k absent: axis 1 has one program, k's arguments unused
        wk = k_weight if k is not None else None
        _qk_rope_fwd_kernel[(B * S, 1 if k is None else 2)](
            q2, kk, q_weight if q_weight is not None else q2, wk if wk is not None else q2, qo, kko, rstds[0],
            rstds[1] if k is not None else rstds[0], c3, s3,
            S, H, kk.shape[2], D, rotary_dim, eps, weight_offset,
            q2.stride(0), q2.stride(1), q2.stride(2), kk.stride(0), kk.stride(1), kk.stride(2),
            qo.stride(0), qo.stride(1), qo.stride(2), kko.stride(0), kko.stride(1), kko.stride(2),
            c3.stride(0), c3.stride(1), c3.stride(2),
            HAS_WQ=q_weight is not None, HAS_WK=wk is not None, ROW_NORM=full_width, NEOX=layout == "neox",
            HALF_TABLE=cos.shape[-1] != rotary_dim, ROUND_FIRST=norm_round_dtype is not None,
            NORM_ROUND_DTYPE=TL_DTYPES[norm_round_dtype or norm_out_dtype], NORM_OUT_DTYPE=TL_DTYPES[norm_out_dtype],
            ROPE_DTYPE=TL_DTYPES[rope_dtype], OUT_DTYPE=TL_DTYPES[out_dtype], HB=hb, HALF=half, PASS=pas,
            HAS_PASS=D > rotary_dim, num_warps=_warps(hb, half, pas),
            enable_fp_fusion=False)  # an fp32 rope_dtype rounds y * c before the add, as eager does
    q_out, k_out = (None if o is None else (o.transpose(1, 2) if transpose_out else o) for o in outs)
    return q_out, k_out, rstds[0], rstds[1]


def qk_norm_rope_bwd(dq_out, dk_out, q, k, q_weight, k_weight, cos, sin, q_rstd, k_rstd, weight_offset, layout,
                     rotary_dim, full_width):
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
    q2, k2, dq2, dk2 = (rows(t) for t in (q, k, dq_out, dk_out))
    dq = q.new_empty(q.shape)
    dk = None if k is None else k.new_empty(k.shape)
    k_weight = None if k is None else k_weight
    dwq, dwk = partials(q_weight), partials(k_weight)
    if n_pos:
        c3, s3 = _tables_3d(cos, B, S), _tables_3d(sin, B, S)
        if c3.stride() != s3.stride():  # one set of strides serves both
            c3, s3 = c3.contiguous(), s3.contiguous()
        hb, half, pas = _tile(max(H, 0 if k is None else k.shape[2]), D, rotary_dim, full_width, _TILE_BWD)
        kk, dkk, dko = (q2, dq, dq2) if k is None else (k2, dk, dk2)  # k absent: one program per chunk on axis 1
        dummy = q_rstd
        _qk_rope_bwd_kernel[(programs, 1 if k is None else 2)](
            dq2, dko, q2, kk, dummy if q_weight is None else q_weight, dummy if k_weight is None else k_weight,
            dq, dkk, q_rstd, q_rstd if k is None else k_rstd, c3, s3, dummy if dwq is None else dwq,
            dummy if dwk is None else dwk,
            n_pos, rows_per_program, S, H, kk.shape[2], D, rotary_dim, weight_offset,
            dq2.stride(0), dq2.stride(1), dq2.stride(2), dko.stride(0), dko.stride(1), dko.stride(2),
            q2.stride(0), q2.stride(1), q2.stride(2), kk.stride(0), kk.stride(1), kk.stride(2),
            c3.stride(0), c3.stride(1), c3.stride(2),
            HAS_WQ=q_weight is not None, HAS_WK=k_weight is not None, ROW_NORM=full_width, NEOX=layout == "neox",
            HALF_TABLE=cos.shape[-1] != rotary_dim, HB=hb, HALF=half, PASS=pas, HAS_PASS=D > rotary_dim,
            num_warps=_warps(hb, half, pas))
    # the [programs, N] fp32 partials summed in fp32, rounded once to the weight's dtype
    return (dq, dk, None if dwq is None else dwq.sum(0).to(q_weight.dtype),
            None if dwk is None else dwk.sum(0).to(k_weight.dtype))
