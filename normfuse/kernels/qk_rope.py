"""QK-norm fused with rotary position embedding (RoPE): semantics, reference, custom ops, functional API.

This docstring is the one statement of what ``qk_norm_rope`` computes; ``qk_norm_rope_ref`` below is
its plain-PyTorch form (the reference backend, the CPU path and the tests' oracle), and the Triton
kernels (``triton_rope.py``) compute the same function.

q is (B, S, H, D), k is (B, S, Hk, D) (GQA: Hk != H), the layout a model has right after
``q_proj(x).view(B, S, H, D)``, before its ``.transpose(1, 2)``. Each of q and k, with its own weight::

    u  = a row of x: the D columns of one head (norm_width "head": Qwen3, Gemma 3, GLM-4 MoE,
         torchtitan), or the H * D columns of one position (norm_width "row": OLMo 2, whose q_norm /
         k_norm normalize the projection before the view); weight is then (D,) or (H * D,)
    y  = reference.normalize(u, weight, bias, kind, eps, weight_offset, norm_round_dtype,
                             norm_out_dtype)                   # add_norm's norm, same rounding modes:
         = round(norm_out_dtype, n * w' + b)                   #   norm_round_dtype None (Gemma, F.rms_norm)
         = round(norm_out_dtype, float(round(norm_round_dtype, n)) * w' + b)   # a dtype (HF Llama, Qwen3)
         with w' = float(weight) + weight_offset, b = float(bias) (0 without one: an RMSNorm has none),
         kind "rms_norm": n = u * rsqrt(mean(u^2) + eps) in fp32;
         kind "layer_norm" (CogVideoX, CogView4): n = (u - mean(u)) * rsqrt(var(u) + eps) in fp32
    then per head, on its first R = rotary_dim columns (R even, R <= D), with P(j) j's partner and
    sign(j) its sign:
         neox (rotate_half):  j < R/2: P = j + R/2, sign -1;   j >= R/2: P = j - R/2, sign +1
         gptj (pairs):        j even:  P = j + 1,   sign -1;   j odd:    P = j - 1,   sign +1
    a  = round(rope_dtype, y[j] * c[j])
    b  = round(rope_dtype, sign(j) * y[P(j)] * s[j])            # y[j], c, s first rounded to rope_dtype
    o  = round(out_dtype, round(rope_dtype, a + b))
    and on the other D - R columns (partial rotary) o = round(out_dtype, y[j]).

That is the models' ``q * cos + rotate_half(q) * sin`` op by op: a 16-bit rope_dtype rounds the two
products and the sum (three roundings, as eager's bf16 ops do); rope_dtype fp32 computes the three
steps in fp32 (no fused multiply-add) and rounds once to out_dtype.

cos, sin: one value per position and rotary column, broadcastable to (B, S, 1, R): a 4-d tensor
(1 or B, 1 or S, 1, R), HF's 3-d (1 or B, S, R) (the heads axis is added), or diffusers' 2-d (S, R). A half table of last
dim R / 2 holds one value per pair (torchtitan's ``freqs_cis``); c[j] is then cos[j mod R/2]
(neox) or cos[j // 2] (gptj), and rotary_dim must be given. The tables are not differentiated.

Defaults: norm_out_dtype as add_norm's out_dtype (the input dtype; with norm_round_dtype,
promote(norm_round_dtype, weight.dtype)); rope_dtype = promote(norm_out_dtype, cos.dtype,
sin.dtype), what eager's ``y * cos`` computes in; out_dtype = rope_dtype. The families:

    qwen3, glm4_moe (use_qk_norm)  norm_round_dtype = x.dtype (``weight * h.to(input_dtype)``); cos/sin in
                                   x.dtype, so rope_dtype = x.dtype: three roundings; neox (GLM: partial,
                                   R = cos.shape[-1], the rest concatenated back unchanged)
    gemma3                         weight_offset = 1, norm_round_dtype None (``(n * (1 + w)).type_as(x)``);
                                   rope in x.dtype, neox
    olmo2                          norm_width "row", norm_round_dtype None (``(w * h).to(input_dtype)``);
                                   cos/sin stay fp32, so rope_dtype fp32, out_dtype = x.dtype
                                   (``q_embed.to(q_type)``); neox
    torchtitan                     nn.RMSNorm (norm_round_dtype None); ComplexRoPE: layout "gptj",
                                   cos = freqs_cis.real, sin = freqs_cis.imag (half table, rotary_dim = D),
                                   rope_dtype fp32, out_dtype = x.dtype (``view_as_complex(x.float()) *
                                   freqs_cis`` is the pair rotation in fp32, rounded once by ``type_as``);
                                   CosSinRoPE: "neox", rope_dtype fp32, out_dtype = x.dtype

Outputs: q_out, k_out, (B, S, H, D) contiguous, or (B, H, S, D) contiguous with transpose_out
(what attention reads after the models' ``.transpose(1, 2)``).

Backward (fp32; fp64 inputs in fp64; every rounding step straight-through, as add_norm's)::

    g  = float(dout);  on the rotary columns dy[j] = g[j] * c[j] + sign(Q(j)) * g[Q(j)] * s[Q(j)],
         Q(j) the column whose partner is j (the transposed rotation); dy[j] = g[j] on the others
    du = rstd * (dy * w' - x_hat * mean(dy * w' * x_hat)) over each norm row, x_hat = u * rstd (rms_norm)
    du = rstd * (dy * w' - mean(dy * w') - x_hat * mean(dy * w' * x_hat)), x_hat = (u - mean(u)) * rstd
         (layer_norm: the mean recomputed from u, which the backward reads anyway)
    dq = round(q.dtype, du);  dq_weight = round(weight.dtype, sum over rows of dy * x_hat (fp32));
    dq_bias = round(bias.dtype, sum over rows of dy (fp32))
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from normfuse.errors import InvalidOptionError, ShapeMismatchError, UnsupportedDtypeError, closest
from normfuse.kernels import triton as triton_backend
from normfuse.kernels.library import implement, implement_autograd, implement_fake, on_call
from normfuse.kernels.specs import OP_OUTPUTS, SUPPORTED_TEXT, dtypes_on, op_gradients
from normfuse.kernels.specs import QkNorm, QkNormRopeBackwardCall, QkNormRopeCall, QkRounding, QkRows, Rope
from normfuse.kernels.ops import _backend, _eager_cpu, _eager_function, _grad_needed, _op_outputs
from normfuse.kernels.reference import (_default_out_dtype, _norm_grads,
                                        acc_dtype, normalize)

__all__ = ["qk_norm_rope", "qk_norm_rope_ref", "qk_norm_rope_bwd_ref", "qk_norm_rope_dtypes", "LAYOUTS",
           "NORM_WIDTHS"]

LAYOUTS = ("neox", "gptj")   # rotate_half (HF, torchtitan CosSinRoPE) / adjacent pairs (GPT-J, complex form)
KINDS = ("rms_norm", "layer_norm")  # the q/k norms (QK-LayerNorm: CogVideoX, CogView4, Persimmon)
NORM_WIDTHS = ("head", "row")  # statistics per head / over all heads of a position (OLMo 2)


# --------------------------------------------------------------------------------------
# Reference (the module docstring in plain PyTorch)
# --------------------------------------------------------------------------------------

def qk_norm_rope_dtypes(x: Tensor, weight: Optional[Tensor], cos: Tensor, sin: Tensor, norm_round_dtype=None,
                        norm_out_dtype=None, rope_dtype=None, out_dtype=None) -> tuple:
    """(norm_out_dtype, rope_dtype, out_dtype) of one of q, k, with the docstring's defaults filled in."""
    norm_out_dtype = norm_out_dtype or _default_out_dtype(x.dtype, weight, norm_round_dtype)
    rope_dtype = rope_dtype or torch.promote_types(torch.promote_types(norm_out_dtype, cos.dtype), sin.dtype)
    return norm_out_dtype, rope_dtype, out_dtype or rope_dtype


def _rotate(x: Tensor, layout: str) -> Tensor:
    """rot(x)[j] = sign(j) * x[P(j)]: neox ``cat(-x2, x1)``; gptj (-x1, x0, -x3, x2, ...)."""
    if layout == "neox":
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)
    pairs = x.unflatten(-1, (-1, 2))
    return torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)


def _rotate_t(g: Tensor, layout: str) -> Tensor:
    """The transpose of _rotate: neox ``cat(g2, -g1)``; gptj (g1, -g0, g3, -g2, ...)."""
    if layout == "neox":
        g1, g2 = g.chunk(2, dim=-1)
        return torch.cat((g2, -g1), dim=-1)
    pairs = g.unflatten(-1, (-1, 2))
    return torch.stack((pairs[..., 1], -pairs[..., 0]), dim=-1).flatten(-2)


def rope_tables(cos: Tensor, sin: Tensor, layout: str, rotary_dim: int) -> tuple[Tensor, Tensor]:
    """(c, s) with one value per rotary column: a half table (last dim R / 2) repeated as the layout
    pairs its columns; a full table as given."""
    if cos.shape[-1] == rotary_dim:
        return cos, sin
    if layout == "neox":
        return torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
    return cos.repeat_interleave(2, dim=-1), sin.repeat_interleave(2, dim=-1)


def _norm_rows(x: Tensor, full_width: bool) -> Tensor:
    """The rows the norm reduces: (B, S, H, D) per head, (B, S, H * D) per position."""
    return x.flatten(2) if full_width else x


def _fwd_one(x, weight, bias, rope: Rope, norm: QkNorm, rounding: QkRounding, transpose_out: bool):
    y, _, rstd = normalize(_norm_rows(x, norm.full_width), weight, bias, norm.kind, norm.eps, norm.weight_offset,
                           rounding.norm_round_dtype, rounding.norm_out_dtype)
    y = y.reshape(x.shape)                                        # (B, S, H, D)
    rotary_dim, rope_dtype, out_dtype = rope.rotary_dim, rounding.rope_dtype, rounding.out_dtype
    c, s = rope_tables(rope.cos, rope.sin, rope.layout, rotary_dim)   # (B | 1, S | 1, 1, R)
    yr = y[..., :rotary_dim].to(rope_dtype)
    o = yr * c.to(rope_dtype) + _rotate(yr, rope.layout) * s.to(rope_dtype)   # eager's three roundings
    out = o.to(out_dtype)
    if rotary_dim < x.shape[-1]:
        out = torch.cat((out, y[..., rotary_dim:].to(out_dtype)), dim=-1)
    if transpose_out:
        out = out.transpose(1, 2).contiguous()                    # (B, H, S, D)
    return out, rstd


def qk_norm_rope_fwd_ref(call: QkNormRopeCall):
    """Backend form (the op's call): (q_out, k_out, q_rstd, k_rstd); k's are None without k.
    rstd is fp32 (fp64 for fp64 input), flat per norm row."""
    settings = (call.rope, call.norm, call.rounding, call.transpose_out)
    q_out, q_rstd = _fwd_one(call.q.x, call.q.weight, call.q.bias, *settings)
    k_out, k_rstd = (None, None) if call.k is None else _fwd_one(call.k.x, call.k.weight, call.k.bias, *settings)
    return q_out, k_out, q_rstd, k_rstd


def _bwd_one(rows: QkRows, rope: Rope, norm: QkNorm):
    x, weight, rotary_dim = rows.x, rows.weight, rope.rotary_dim
    acc = acc_dtype(x.dtype)
    g = rows.dout.to(acc)                                         # (B, S, H, D)
    c, s = (t.to(acc) for t in rope_tables(rope.cos, rope.sin, rope.layout, rotary_dim))
    gr = g[..., :rotary_dim]
    dy = gr * c + _rotate_t(gr * s, rope.layout)
    if rotary_dim < x.shape[-1]:
        dy = torch.cat((dy, g[..., rotary_dim:]), dim=-1)
    u = _norm_rows(x, norm.full_width)
    # a LayerNorm's mean recomputed from u (the forward keeps rstd only)
    mean = u.to(acc).mean(-1).reshape(-1) if norm.kind == "layer_norm" else u.new_empty(0, dtype=acc)
    bias_dtype = None if rows.bias is None else rows.bias.dtype
    du, dw, db = _norm_grads(_norm_rows(dy, norm.full_width), u, mean, rows.rstd, weight, norm.kind,
                             norm.weight_offset, bias_dtype)[:3]
    return (du.reshape(x.shape).to(x.dtype), None if dw is None else dw.to(weight.dtype),
            None if db is None else db.to(bias_dtype))


def qk_norm_rope_bwd_ref(call: QkNormRopeBackwardCall):
    """Backward of qk_norm_rope_fwd_ref: (dq, dk, dq_weight, dk_weight, dq_bias, dk_bias), None for what
    does not exist. q.dout, k.dout: the output grads as (B, S, H, D) views (transposed back when the
    forward transposed its outputs)."""
    dq, dwq, dbq = _bwd_one(call.q, call.rope, call.norm)
    dk, dwk, dbk = (None, None, None) if call.k is None else _bwd_one(call.k, call.rope, call.norm)
    return dq, dk, dwq, dwk, dbq, dbk


def qk_norm_rope_ref(q, k, q_weight, k_weight, cos, sin, *, eps, weight_offset=0.0, norm_round_dtype=None,
                     norm_out_dtype=None, rope_dtype=None, out_dtype=None, layout="neox", rotary_dim=None,
                     norm_width="head", transpose_out=False, q_bias=None, k_bias=None, kind="rms_norm"):
    """Plain-PyTorch :func:`qk_norm_rope` (same arguments), differentiable with plain autograd (with
    its rounding steps: for an fp64 reference pass fp64 tensors and fp64 dtypes). Returns (q_out,
    k_out), k_out None without k."""
    cos, sin, rotary_dim = _tables(cos, sin, rotary_dim)
    rope = Rope(cos, sin, layout, rotary_dim)
    norm = QkNorm(float(eps), float(weight_offset), norm_width == "row", kind)
    outs = []
    for x, w, b in ((q, q_weight, q_bias), (k, k_weight, k_bias)):
        if x is None:
            outs.append(None)
            continue
        dtypes = qk_norm_rope_dtypes(x, w, cos, sin, norm_round_dtype, norm_out_dtype, rope_dtype, out_dtype)
        outs.append(_fwd_one(x, w, b, rope, norm, QkRounding(norm_round_dtype, *dtypes), transpose_out)[0])
    return tuple(outs)


# --------------------------------------------------------------------------------------
# Validation (once per functional call; the fakes check shapes only)
# --------------------------------------------------------------------------------------

def _tables(cos: Tensor, sin: Tensor, rotary_dim: Optional[int]) -> tuple[Tensor, Tensor, int]:
    """cos and sin as 4-d (1 | B, 1 | S, 1, R or R / 2) views, and rotary_dim (default cos.shape[-1]);
    what is not a tensor is left to validate's message."""
    def as_4d(t):
        if isinstance(t, Tensor) and t.dim() == 2:
            t = t.unsqueeze(0)  # diffusers' (S, R): one row per position, the batch's
        if isinstance(t, Tensor) and t.dim() == 3:
            t = t.unsqueeze(2)  # HF's (B, S, R): the heads axis it unsqueezes in apply_rotary_pos_emb
        return t
    cos, sin = as_4d(cos), as_4d(sin)
    if rotary_dim is None and isinstance(cos, Tensor):
        rotary_dim = cos.shape[-1]
    return cos, sin, rotary_dim


def _check_tensor(name: str, t, device) -> None:
    if not isinstance(t, Tensor):
        raise InvalidOptionError(f"{name} must be a tensor; got {type(t).__name__}.")
    if t.dtype not in dtypes_on(t.device):
        raise UnsupportedDtypeError(f"{name} has dtype {t.dtype} on {t.device}; qk_norm_rope takes {SUPPORTED_TEXT}. "
                                    f"Cast it first, e.g. {name}.to(torch.bfloat16).")
    if t.device != device:
        raise InvalidOptionError(f"{name} is on {t.device} but q is on {device}; move them to one device.")


def validate(q, k, q_weight, k_weight, cos, sin, eps, layout, rotary_dim, norm_width, rounding: dict,
             q_bias=None, k_bias=None, kind="rms_norm") -> None:
    """Raise a normfuse error naming the problem and the fix. cos, sin: as _tables returns them."""
    if not isinstance(q, Tensor) or q.dim() != 4:
        raise ShapeMismatchError(f"q must be a (batch, seq, heads, head_dim) tensor, the layout of "
                                 f"q_proj(x).view(B, S, H, D) before the transpose; got "
                                 f"{tuple(getattr(q, 'shape', ()))}.")
    _check_tensor("q", q, q.device)
    B, S, H, D = q.shape
    if D == 0 or H == 0:
        raise ShapeMismatchError(f"q has shape {tuple(q.shape)}: no heads or an empty head_dim to normalize.")
    if k is not None:
        _check_tensor("k", k, q.device)
        if k.dim() != 4 or k.shape[:2] != q.shape[:2] or k.shape[3] != D or k.shape[2] == 0:
            raise ShapeMismatchError(f"k has shape {tuple(k.shape)} but q has {tuple(q.shape)}; k must be (B, S, Hk, D) "
                                     f"= ({B}, {S}, Hk, {D}) with any number of heads Hk >= 1 (GQA).")
    if layout not in LAYOUTS:
        raise InvalidOptionError(f"layout={layout!r} is not a rotary layout the op computes; use one of {LAYOUTS} "
                                 f"(\"neox\": rotate_half, \"gptj\": adjacent pairs and the complex form)."
                                 + closest(str(layout), LAYOUTS))
    if norm_width not in NORM_WIDTHS:
        raise InvalidOptionError(f"norm_width={norm_width!r} must be one of {NORM_WIDTHS} (\"head\": statistics per "
                                 f"head, \"row\": over all heads of a position, OLMo 2)." + closest(str(norm_width),
                                                                                                   NORM_WIDTHS))
    if kind not in KINDS:
        raise InvalidOptionError(f"kind={kind!r} is not a q/k norm the op computes; use one of {KINDS}."
                                 + closest(str(kind), KINDS))
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps < 0:
        raise InvalidOptionError(f"eps={eps!r} must be a finite number >= 0 (e.g. 1e-6).")
    if kind == "rms_norm" and (q_bias is not None or k_bias is not None):
        raise InvalidOptionError("q_bias / k_bias were given with kind=\"rms_norm\", which has no bias; pass "
                                 "kind=\"layer_norm\" for a LayerNorm's bias, or no bias.")
    for name, x, w in (("q_weight", q, q_weight), ("k_weight", k, k_weight), ("q_bias", q, q_bias),
                       ("k_bias", k, k_bias)):
        if w is None or x is None:
            continue
        _check_tensor(name, w, q.device)
        want = (x.shape[2] * D,) if norm_width == "row" else (D,)
        if tuple(w.shape) != want:
            what = f"heads * head_dim = {want[0]}" if norm_width == "row" else f"head_dim = {D}"
            raise ShapeMismatchError(f"{name} has shape {tuple(w.shape)} but {name[0]} has shape {tuple(x.shape)}; with "
                                     f"norm_width={norm_width!r} the norm is over {what}, so {name} must have shape "
                                     f"{want}.")
    for name, t in (("cos", cos), ("sin", sin)):
        _check_tensor(name, t, q.device)
        if t.requires_grad and torch.is_grad_enabled():
            raise InvalidOptionError(f"{name} requires grad, but qk_norm_rope does not differentiate the rotary "
                                     f"tables (they are functions of the positions); pass {name}.detach().")
    if cos.shape != sin.shape:
        raise ShapeMismatchError(f"cos has shape {tuple(cos.shape)} but sin has {tuple(sin.shape)}; they must match.")
    if isinstance(rotary_dim, bool) or not isinstance(rotary_dim, int):
        raise InvalidOptionError(f"rotary_dim={rotary_dim!r} must be an int (the number of rotated columns per head).")
    if rotary_dim % 2 or not 0 < rotary_dim <= D:
        raise ShapeMismatchError(f"rotary_dim={rotary_dim} must be even and in [2, head_dim = {D}]: the rotation "
                                 f"pairs columns, and the columns past rotary_dim pass through.")
    if (cos.dim() != 4 or cos.shape[2] != 1 or cos.shape[0] not in (1, B) or cos.shape[1] not in (1, S)
            or cos.shape[3] not in (rotary_dim, rotary_dim // 2)):
        raise ShapeMismatchError(f"cos and sin have shape {tuple(cos.shape)}; they must broadcast to (B, S, 1, R) = "
                                 f"({B}, {S}, 1, {rotary_dim}): (1 | B, 1 | S, 1, R), HF's (1 | B, S, R), (S, R), "
                                 f"or a half table of last dim R / 2 = {rotary_dim // 2} (freqs_cis.real / .imag) "
                                 f"with rotary_dim given.")
    for name, dtype in rounding.items():
        if dtype is not None and dtype not in dtypes_on(q.device):
            raise UnsupportedDtypeError(f"{name}={dtype} is not a dtype qk_norm_rope rounds to; use one of "
                                        f"{SUPPORTED_TEXT}.")


# --------------------------------------------------------------------------------------
# Custom ops: forward, backward, fakes
# --------------------------------------------------------------------------------------

def _backend_of(x: Tensor, dtypes):
    """(forward, backward) of the backend ops.py's routing picks for these tensors and dtypes."""
    if _backend(x, dtypes) is triton_backend:
        from normfuse.kernels import triton_rope
        return triton_rope.qk_norm_rope_fwd, triton_rope.qk_norm_rope_bwd
    return qk_norm_rope_fwd_ref, qk_norm_rope_bwd_ref


def _dtypes(*items) -> tuple:
    return tuple(t.dtype if isinstance(t, Tensor) else t for t in items if t is not None)


@implement("qk_norm_rope_fwd")
def qk_norm_rope_fwd(call: QkNormRopeCall):
    """QK-norm + RoPE of the module docstring, q and k in one launch. cos, sin: 4-d (1 | B, 1 | S, 1, R or
    R / 2). Returns (q_out, k_out, q_rstd, k_rstd): k's empty without k; rstd flat per norm row, fp32."""
    q, k, rope, rounding = call.q, call.k, call.rope, call.rounding
    tensors = (q.x, q.weight, q.bias, *((k.x, k.weight, k.bias) if k else ()), rope.cos, rope.sin)
    forward, _ = _backend_of(q.x, _dtypes(*tensors, rounding.norm_round_dtype, rounding.norm_out_dtype,
                                          rounding.rope_dtype, rounding.out_dtype))
    return _op_outputs(forward(call), (None, rounding.out_dtype, None, acc_dtype(q.x.dtype)), q.x, tensors)


def _out_shape(x: Tensor, transpose_out: bool) -> tuple:
    B, S, H, D = x.shape
    return (B, H, S, D) if transpose_out else (B, S, H, D)


def _rstd_rows(x: Tensor, full_width: bool) -> int:
    return x.shape[0] * x.shape[1] * (1 if full_width else x.shape[2])


@implement_fake("qk_norm_rope_fwd")
def _qk_norm_rope_fwd_fake(call: QkNormRopeCall):
    q, k, out_dtype, full_width = call.q.x, call.k, call.rounding.out_dtype, call.norm.full_width
    acc = acc_dtype(q.dtype)
    q_out = q.new_empty(_out_shape(q, call.transpose_out), dtype=out_dtype)
    q_rstd = q.new_empty((_rstd_rows(q, full_width),), dtype=acc)
    if k is None:
        return q_out, q.new_empty(0, dtype=out_dtype), q_rstd, q.new_empty(0, dtype=acc)
    return (q_out, k.x.new_empty(_out_shape(k.x, call.transpose_out), dtype=out_dtype), q_rstd,
            k.x.new_empty((_rstd_rows(k.x, full_width),), dtype=acc))


def _backward_tensors(call: QkNormRopeBackwardCall) -> tuple:
    rows = [call.q] + ([call.k] if call.k else [])
    return (*(t for r in rows for t in (r.dout, r.x, r.weight, r.rstd, r.bias)), call.rope.cos, call.rope.sin)


@implement("qk_norm_rope_bwd")
def qk_norm_rope_bwd(call: QkNormRopeBackwardCall):
    """Backward of qk_norm_rope_fwd (see qk_norm_rope_bwd_ref): (dq, dk, dq_weight, dk_weight, dq_bias,
    dk_bias), each empty when that input does not exist. dq_out, dk_out: (B, S, H, D)-shaped, any strides."""
    q = call.q.x
    tensors = _backward_tensors(call)
    _, backward = _backend_of(q, _dtypes(*tensors))
    return _op_outputs(backward(call), (None, q.dtype, q.dtype, q.dtype, q.dtype, q.dtype), q, tensors)


@implement_fake("qk_norm_rope_bwd")
def _qk_norm_rope_bwd_fake(call: QkNormRopeBackwardCall):
    q, k = call.q, call.k

    def like(t):
        return q.x.new_empty(0, dtype=q.x.dtype) if t is None else t.new_empty(t.shape, dtype=t.dtype)
    return (like(q.x), like(None if k is None else k.x), like(q.weight), like(None if k is None else k.weight),
            like(q.bias), like(None if k is None else k.bias))


# --------------------------------------------------------------------------------------
# Autograd (the custom op's, and the eager CPU path's)
# --------------------------------------------------------------------------------------

def _setup_context(ctx, call: QkNormRopeCall, output):
    q, k, rope = call.q, call.k, call.rope
    out = dict(zip(OP_OUTPUTS["qk_norm_rope_fwd"], output))
    ctx.set_materialize_grads(False)  # an unused q_out or k_out gets None, not a zero tensor to read
    ctx.save_for_backward(q.x, None if k is None else k.x, q.weight, None if k is None else k.weight, rope.cos,
                          rope.sin, out["q_rstd"], out["k_rstd"], q.bias, None if k is None else k.bias)
    ctx.weight_offset, ctx.layout, ctx.rotary_dim = call.norm.weight_offset, rope.layout, rope.rotary_dim
    ctx.kind = call.norm.kind
    ctx.full_width, ctx.transpose_out, ctx.out_dtype = call.norm.full_width, call.transpose_out, call.rounding.out_dtype
    ctx.eager_cpu = False  # the eager path's autograd.Function sets it after this


def _backward(ctx, dq_out, dk_out, dq_rstd, dk_rstd):
    q, k, q_weight, k_weight, cos, sin, q_rstd, k_rstd, q_bias, k_bias = ctx.saved_tensors

    def as_rows(g, x):
        """The grad of an output as a (B, S, H, D) view; zeros for an output nobody used."""
        if g is None or g.numel() != x.numel():  # a traced backward may pass a tangent of the empty k_out
            return x.new_zeros(x.shape, dtype=ctx.out_dtype)
        return g.transpose(1, 2) if ctx.transpose_out else g
    has_k = k is not None
    dq_out = as_rows(dq_out, q)
    dk_out = as_rows(dk_out, k) if has_k else None
    backward = _REFERENCE_BACKWARD if ctx.eager_cpu else torch.ops.normfuse.qk_norm_rope_bwd
    dq, dk, dwq, dwk, dbq, dbk = backward(dq_out, dk_out, q, k if has_k else None, q_weight,
                                          k_weight if has_k else None, cos, sin, q_rstd, k_rstd if has_k else None,
                                          ctx.weight_offset, ctx.layout, ctx.rotary_dim, ctx.full_width, q_bias,
                                          k_bias if has_k else None, ctx.kind)
    return op_gradients("qk_norm_rope_fwd", {"q": dq, "k": dk if has_k else None,
                                             "q_weight": dwq if q_weight is not None else None,
                                             "k_weight": dwk if has_k and k_weight is not None else None,
                                             "q_bias": dbq if q_bias is not None else None,
                                             "k_bias": dbk if has_k and k_bias is not None else None})


implement_autograd("qk_norm_rope_fwd", _backward, setup_context=_setup_context)

# the reference backend with the ops' flat arguments (the eager CPU path)
_REFERENCE_FORWARD = on_call("qk_norm_rope_fwd", qk_norm_rope_fwd_ref)
_REFERENCE_BACKWARD = on_call("qk_norm_rope_bwd", qk_norm_rope_bwd_ref)
_EAGER = _eager_function("_EagerQKNormRope", "qk_norm_rope_fwd", qk_norm_rope_fwd_ref, _setup_context, _backward)


# --------------------------------------------------------------------------------------
# Functional API
# --------------------------------------------------------------------------------------

def qk_norm_rope(q, k, q_weight, k_weight, cos, sin, *, eps, weight_offset=0.0, norm_round_dtype=None,
                 norm_out_dtype=None, rope_dtype=None, out_dtype=None, layout="neox", rotary_dim=None,
                 norm_width="head", transpose_out=False, q_bias=None, k_bias=None, kind="rms_norm"):
    """Fused per-head norm of q and k, then RoPE: returns (q_out, k_out) (k_out None when k is None).

    q: (B, S, H, D), k: (B, S, Hk, D), fp32/fp16/bf16; q_weight, k_weight: (D,) (or (H * D,), (Hk * D,)
    with norm_width="row", OLMo 2), any of those dtypes, or None; cos, sin: (1 | B, 1 | S, 1, R), HF's
    (1 | B, S, R), diffusers' (S, R), or half tables of last dim R / 2 (freqs_cis.real, freqs_cis.imag,
    with rotary_dim).
    eps, weight_offset (Gemma: 1.0), norm_round_dtype: the RMSNorm as in add_norm. norm_out_dtype: the
    norm output's dtype (the rounding before RoPE); rope_dtype: the dtype RoPE's products and sum round
    to (a 16-bit one: HF's three roundings; fp32: computed in fp32); out_dtype: the outputs' dtype.
    layout: "neox" (rotate_half) or "gptj" (adjacent pairs; the complex form). rotary_dim: the rotated
    columns per head (default cos.shape[-1]); the rest pass through. transpose_out: return (B, H, S, D).
    kind: "rms_norm" (default) or "layer_norm" (then q_bias, k_bias: the LayerNorms' biases, shaped as
    the weights, or None).
    The exact semantics, defaults and each model family's settings are in this module's docstring.
    Differentiable in q, k and the weights; cos and sin must not require grad.
    """
    cos, sin, rotary_dim = _tables(cos, sin, rotary_dim)
    validate(q, k, q_weight, k_weight, cos, sin, eps, layout, rotary_dim, norm_width,
             {"norm_round_dtype": norm_round_dtype, "norm_out_dtype": norm_out_dtype, "rope_dtype": rope_dtype,
              "out_dtype": out_dtype}, q_bias, k_bias, kind)
    common = (float(eps), float(weight_offset), norm_round_dtype)
    tail = (layout, int(rotary_dim), norm_width == "row", bool(transpose_out))
    q_dtypes = qk_norm_rope_dtypes(q, q_weight, cos, sin, norm_round_dtype, norm_out_dtype, rope_dtype, out_dtype)
    calls = [(q, k, q_weight, k_weight, q_bias, k_bias, q_dtypes)]
    if k is not None:
        k_dtypes = qk_norm_rope_dtypes(k, k_weight, cos, sin, norm_round_dtype, norm_out_dtype, rope_dtype, out_dtype)
        if k_dtypes != q_dtypes or k.dtype != q.dtype:  # one launch takes one set of dtypes: one each
            calls = [(q, None, q_weight, None, q_bias, None, q_dtypes),
                     (k, None, k_weight, None, k_bias, None, k_dtypes)]
    outs = []
    for x, x2, w, w2, b, b2, dtypes in calls:
        tensors = (x, x2, w, w2, cos, sin)
        if _eager_cpu(*tensors, b, b2):
            forward = _EAGER.apply if _grad_needed(x, x2, w, w2, b, b2) else _REFERENCE_FORWARD
        else:
            forward = torch.ops.normfuse.qk_norm_rope_fwd
        out, out2, _, _ = forward(*tensors, *common, *dtypes, *tail, b, b2, kind)
        outs += [out] if x2 is None else [out, out2]
    return outs[0], (outs[1] if k is not None else None)
