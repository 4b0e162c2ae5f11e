"""The semantics of the fused add+norm ops, in plain PyTorch: the reference backend.

This is the one statement of what the ops compute. The tests, the equivalence
checker and the CPU path all run it; the Triton kernels (``triton.py``) compute
the same function.

Add-then-norm (pre-norm and post-norm blocks), normalizing over the last dim N::

    r' = round(residual.dtype, residual_scale * residual)      # skipped when residual_scale == 1
    s  = round(sum_dtype, float(x) + float(r'))                # no residual: s = round(sum_dtype, x)
    u  = float32(s)                                            # statistics always accumulate in fp32
    n  = (u - mean(u)) * rsqrt(var(u) + eps)                   # layer_norm
       = u * rsqrt(mean(u^2) + eps)                            # rms_norm
       = u / max(||u||_2, eps) * sqrt(N)                       # l2_norm (F.normalize(u, dim=-1, eps=eps) * sqrt(N))
    w' = float(weight) + weight_offset                         # 1 when there is no weight
    y  = round(out_dtype, n * w' + float(bias))                          # norm_round_dtype None: "multiply then round"
    y  = round(out_dtype, float(round(norm_round_dtype, n)) * w' + float(bias))   # "round then multiply"

Optional modes of add-then-norm (each off by default; flash-attn's ``layer_norm_fn`` has the
same ones). They change how the norm input is formed and add a second output::

    b = x
    dropout:  b = round(x.dtype, float(b) * keep * scale)       # keep in {0, 1}, scale = fp32(1 / (1 - p))
                                                                # (eager's native_dropout: input * mask * scale)
    rowscale: b = round(x.dtype, float(b) * float(rowscale[row]))        # per-row scale (stochastic depth)
    x1:       b = round(promote(b.dtype, x1.dtype), float(b) + float(x1))  # a second branch
    s  = round(sum_dtype, float(b) + float(r'))     # sum_dtype default: promote(x, x1, residual)
    y1 = the same normalized n with weight1 / bias1 (same kind, eps, weight_offset, rounding modes; out_dtype)

``keep`` is regenerated from (seed, row * N + col) wherever it is needed, never stored:
``dropout_keep(seed, n_rows, n_cols, p, device)`` (one per backend) draws it. This backend
draws ``torch.rand(M, N, generator=g) >= p`` with a torch.Generator on x's device seeded with
the seed; the Triton backend draws ``tl.rand(seed, row * N + col) >= p`` (Philox). The two
streams differ: a mask is only ever replayed by the backend that drew it. dropout_p = 0 draws
nothing. With any of these modes (or a residual) s exists (the op returns it when stored).

Backward of the modes (fp32, rounding steps straight-through)::

    ds  = norm_bwd(g = dn * w' + dy1 * w1') + dextra     # the input-grad formula is linear in g
    dx  = round(x.dtype, ds * keep * scale * rowscale[row])
    dx1 = round(x1.dtype, ds);  dweight1 = sum_rows(dy1 * x_hat);  dbias1 = sum_rows(dy1)
    dresidual = round(residual.dtype, residual_scale * ds)                        # as without the modes

``round_sum_first=False`` normalizes the unrounded sum instead (``u = float32(float(x) +
float(r'))``, with the modes ``u = float(x) * keep * scale * rowscale + float(x1) + float(r')``, no
intermediate rounding; s = round(sum_dtype, u) is still returned): flash-attn's and quack's kernels
and vLLM's native RMSNorm do this; graphs that add in the model dtype round first.

``sum_dtype`` defaults to ``promote_types(x.dtype, residual.dtype)`` (``x.dtype``
without a residual); ``out_dtype`` to ``sum_dtype`` when multiplying then
rounding (``F.layer_norm``, ``F.rms_norm``, Gemma's ``1 + w``), and to
``promote_types(norm_round_dtype, weight.dtype)`` when rounding then multiplying
(HF Llama: ``weight * h.to(input_dtype)``). A plain norm returns ``s=None``.

Norm-then-add (res-post blocks ``x + norm(f)``: Swin v2, OLMo2)::

    y   = the norm of x as above (no pre-sum; the norm input dtype is x.dtype)
    out = round(add_dtype, float(round(residual.dtype, residual_scale * residual)) + float(y))

Backward treats every rounding step as the identity (straight-through) and
computes in fp32; fp64 inputs (CPU only, for gradcheck) compute in fp64. The
weight and bias gradients are always reduced over the rows in fp32 (or fp64).

Gated norms and grouped statistics of add-then-norm (off unless ``gate`` / ``norm_group`` is set:
Mamba2 / NemotronH ``MambaRMSNormGated``, Qwen3-Next ``Qwen3NextRMSNormGated``, Kimi-Linear
``KimiLinearRMSNormGated``)::

    act(v) = silu(v) (gate_activation "silu") or sigmoid(v) ("sigmoid"), in fp32 (torch's F.silu,
             torch.sigmoid: the Triton kernels' exp differs in the last bits)
    "before": h = float32(u) * act(float32(z))                  # the norm input gated, not rounded
              (Mamba2: ``h = x.to(float32) * silu(gate.to(float32))``), then the norm of h
    "after":  y0 = y as above (rounded to out_dtype)
              y  = round(gate_out_dtype, float32(y0) * act(float32(z)))   # gate_out_dtype default out_dtype
              (Qwen3-Next: ``(weight * h.to(in_dtype)) * silu(gate.float())``, then ``.to(in_dtype)``:
              norm_round_dtype = out_dtype = in_dtype; Kimi: ``(weight.float() * h) * sigmoid(gate.float())``
              then ``.to(in_dtype)``: out_dtype = fp32, gate_out_dtype = in_dtype)
    norm_group G: the statistics (mean, variance) of each group of G contiguous columns, over a
              view (..., N // G, G) as Mamba2 takes them; the weight and bias stay per column.
              mean and rstd are then flat per (row, group), row-major.

The gate z has x's shape. Backward (fp32, rounding straight-through): "before": with dh the
norm's input gradient at h, du = dh * act(z) and dz = dh * u * act'(z); "after": the norm gets
dy * act(z), and dz = dy * y0 * act'(z) with y0 = n * w' + b in fp32.

Quantization epilogue of add-then-norm (off unless ``quant_dtype`` is set): the norm output
is also written in fp8 (``torch.float8_e4m3fn`` or ``torch.float8_e5m2``, largest finite value
``qmax`` = 448 or 57344), for the next linear to read (vLLM's RMSNorm + quant fusion, FlashInfer's
fused_add_rmsnorm_quant, TensorRT-LLM, Transformer Engine). y is computed as above, rounded to
out_dtype, and every step below is one IEEE fp32 operation on fp32(y), the value a graph holds::

    dynamic (quant_scale None), over each row (quant_group None) or group of G columns:
      amax  = max |fp32(y)|                                   # exact; a NaN in the row/group gives NaN
      amax  = max(amax, quant_amax_min)                       # when given (e.g. 1e-12)
      scale = amax / qmax              "amax/max"             # quant_scale_form
            = qmax / amax              "max/amax"             #   (one division: torch.div(qmax_t, amax))
            = fp32(1 / amax) * qmax    "max*(1/amax)"         #   (Python's ``qmax / amax``: Tensor.__rtruediv__
                                                              #    is reciprocal, then multiply)
      scale = max(scale, quant_scale_min)                     # when given (vLLM: 1 / (qmax * 512))
    static (quant_scale: a 1-element fp32 tensor): scale = quant_scale
    v = fp32(y) / scale                "div"                  # quant_apply
      = fp32(y) * scale                "mul"
      = fp32(y) * fp32(1 / scale)      "mul_reciprocal"
    v = min(max(v, -quant_clamp), quant_clamp)                # when given
    q = quant_dtype(v)                                        # torch's conversion, round to nearest even

The clamps propagate NaN (as torch.clamp). The conversion is torch's own (c10): float8_e4m3fn
saturates (|v| >= 464 and +-inf give +-448), float8_e5m2 overflows to +-inf (|v| >= 61440), NaN
stays NaN (q's sign bit of a NaN is unspecified). So q equals ``v.to(quant_dtype)`` on every device,
with or without an explicit clamp. The returned scale is ``scale`` (fp32; shape (*y.shape[:-1], 1)
per row, (*y.shape[:-1], N // G) per group), or ``fp32(1 / scale)`` with quant_scale_out
"reciprocal" (what torchao hands to the matmul); a static scale is returned as given. Dynamic
scaling per tensor is not row-local and is not offered. Backward: q and scale are not
differentiable; y (when returned) and s are differentiated exactly as without the epilogue.

Layouts (values never depend on them). x and residual may be strided views; a channel norm's
operands arrive as ``t.permute(0, 2, 3, 1)`` of NCHW tensors, rows strided, positions contiguous
(``channel_split``). y (and y1, q) and the gradients have contiguous rows, as a norm call returns
them; s has the residual's layout (x's without one) when that is stored so (``sum_like``), as the
add it stands for returned it (eager's add takes its first operand's layout: the stream's).

Backend interface (shared with ``triton.py``; positional arguments as in the custom
ops, None for an output that does not exist): ``add_norm_fwd``, ``add_norm_quant_fwd``,
``norm_add_fwd``, ``add_norm_bwd``, and ``dropout_keep``. Where one of eager's fused CPU kernels computes exactly the
function above, it is used: default modes then equal ``F.layer_norm`` /
``F.rms_norm`` bit for bit, forward and input gradients.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from normfuse.kernels.specs import (SUPPORTED_DTYPES, AddNormCall, BackwardCall, DropoutMask, Modulation, Norm,
                                    NormAddCall, Rounding, Rows, SecondNorm, Store, XGate)
from normfuse.kernels.specs import Gate
from normfuse.vocabulary import KINDS

__all__ = ["add_norm_ref", "norm_add_ref", "add_norm_bwd_ref", "dropout_keep", "quantize", "KINDS",
           "SUPPORTED_DTYPES"]



def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Statistics accumulate in fp32; fp64 inputs (gradcheck, fp64 references) stay fp64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# ---- layouts ---------------------------------------------------------------------------

def channel_split(t: Tensor) -> Optional[int]:
    """j such that t, of shape (*outer, *positions, C) with outer = t.shape[:j], is stored
    channels-first: ``t.movedim(-1, j)`` is contiguous while t's last dim is not (e.g. an NCHW
    tensor permuted to NHWC: j = 1). None for any other layout (rows contiguous, or neither)."""
    if t.dim() < 2 or t.stride(-1) == 1 or t.shape[-1] == 1:
        return None
    return next((j for j in range(t.dim() - 1) if t.movedim(-1, j).is_contiguous()), None)


def sum_like(x: Tensor, dtype: torch.dtype) -> Tensor:
    """An empty tensor of x's shape in x's layout when x is stored channels-first, else with
    contiguous rows: the sum s, in its residual's layout (x's without one)."""
    j = channel_split(x)
    if j is None:
        return x.new_empty(x.shape, dtype=dtype)
    return x.new_empty(x.movedim(-1, j).shape, dtype=dtype).movedim(j, -1)


# ---- default dtypes (resolved once per call, by the functional API and the *_ref functions) ----

def add_norm_dtypes(x: Tensor, residual: Optional[Tensor], weight: Optional[Tensor], sum_dtype, norm_round_dtype,
                    out_dtype, x1: Optional[Tensor] = None, x_gate: Optional[Tensor] = None,
                    ) -> tuple[torch.dtype, torch.dtype]:
    """(sum_dtype, out_dtype) of add-then-norm with their defaults filled in (x's dtype: x * x_gate's)."""
    if sum_dtype is None:
        sum_dtype = x.dtype if x_gate is None else torch.promote_types(x.dtype, x_gate.dtype)
        for t in (x1, residual):
            sum_dtype = sum_dtype if t is None else torch.promote_types(sum_dtype, t.dtype)
    return sum_dtype, out_dtype or _default_out_dtype(sum_dtype, weight, norm_round_dtype)


def norm_add_dtypes(x: Tensor, residual: Tensor, weight: Optional[Tensor], norm_round_dtype, out_dtype,
                    add_dtype) -> tuple[torch.dtype, torch.dtype]:
    """(out_dtype, add_dtype) of norm-then-add with their defaults filled in."""
    out_dtype = out_dtype or _default_out_dtype(x.dtype, weight, norm_round_dtype)
    return out_dtype, add_dtype or torch.promote_types(residual.dtype, out_dtype)


def _default_out_dtype(norm_in_dtype: torch.dtype, weight: Optional[Tensor],
                       norm_round_dtype: Optional[torch.dtype]) -> torch.dtype:
    if norm_round_dtype is None:
        return norm_in_dtype
    return norm_round_dtype if weight is None else torch.promote_types(norm_round_dtype, weight.dtype)


# ---- forward ---------------------------------------------------------------------------

def _scale_residual(residual: Tensor, residual_scale: float) -> Tensor:
    # Eager computes alpha * r in r's dtype (in fp32 registers, rounded once).
    return residual if residual_scale == 1.0 else residual * residual_scale


def dropout_keep(seed, n_rows: int, n_cols: int, p: float, device) -> Tensor:
    """This backend's keep mask (True: kept) of dropout with probability p, (n_rows, n_cols) bool:
    torch.rand on a torch.Generator of ``device`` seeded with ``seed`` (an int or a CPU int64
    tensor of shape ()); element (row, col) is draw number row * n_cols + col."""
    generator = torch.Generator(device=device)
    generator.manual_seed(int(seed))
    return torch.rand(n_rows, n_cols, generator=generator, device=device) >= p


def has_sum(residual: Optional[Tensor], x1: Optional[Tensor], rowscale: Optional[Tensor], dropout_p: float) -> bool:
    """Whether add-then-norm forms a sum s other than x itself (else it is a plain norm)."""
    return residual is not None or x1 is not None or rowscale is not None or dropout_p > 0


def branch(x: Tensor, x1: Optional[Tensor], rowscale: Optional[Tensor], keep: Optional[Tensor], dropout_p: float,
           acc: Optional[torch.dtype] = None) -> Tensor:
    """b of the module docstring: x after dropout and rowscale, plus x1. Each step rounded as
    eager's ops round it; with ``acc`` (fp32/fp64) accumulated in that dtype, unrounded."""
    b = x if acc is None else x.to(acc)
    if keep is not None:
        b = b * keep.view(x.shape) * (1.0 / (1.0 - dropout_p))  # x * mask exact, then one rounding
    if rowscale is not None:
        b = b * (rowscale[..., None] if acc is None else rowscale[..., None].to(acc))
        b = b.to(x.dtype) if acc is None else b
    if x1 is not None:
        b = b + (x1 if acc is None else x1.to(acc))
    return b


def norm_input(x: Tensor, residual: Optional[Tensor], residual_scale: float, sum_dtype: torch.dtype,
               round_sum_first: bool, x1: Optional[Tensor] = None, rowscale: Optional[Tensor] = None,
               keep: Optional[Tensor] = None, dropout_p: float = 0.0) -> tuple[Tensor, Tensor]:
    """(s, u): the sum rounded to sum_dtype and the norm input (s, or the unrounded sum)."""
    if round_sum_first:
        s = pre_sum(branch(x, x1, rowscale, keep, dropout_p), residual, residual_scale, sum_dtype)
        return s, s
    u = unrounded_sum(branch(x, x1, rowscale, keep, dropout_p, acc_dtype(sum_dtype)), residual, residual_scale,
                      sum_dtype)
    return u.to(sum_dtype), u


def pre_sum(x: Tensor, residual: Optional[Tensor], residual_scale: float, sum_dtype: torch.dtype) -> Tensor:
    """s = round(sum_dtype, float(x) + float(r'))."""
    if residual is None:
        return x.to(sum_dtype)
    r = _scale_residual(residual, residual_scale)
    if sum_dtype == torch.promote_types(x.dtype, r.dtype):
        return torch.add(x, r)  # eager adds in fp32 (opmath) and rounds once to sum_dtype
    wide = acc_dtype(sum_dtype if sum_dtype == torch.float64 else torch.promote_types(x.dtype, r.dtype))
    return torch.add(x.to(wide), r.to(wide)).to(sum_dtype)


def unrounded_sum(x: Tensor, residual: Optional[Tensor], residual_scale: float, sum_dtype: torch.dtype) -> Tensor:
    """u = float(x) + float(r') before any rounding to sum_dtype (fp32; fp64 for an fp64 sum_dtype)."""
    acc = acc_dtype(sum_dtype)
    return x.to(acc) if residual is None else x.to(acc) + _scale_residual(residual, residual_scale).to(acc)


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
    return acc_dtype(u.dtype) if u.dtype in (torch.float32, torch.float64) or mixed else u.dtype


def _fused_rms_norm_ok(u: Tensor, w: Optional[Tensor], b: Optional[Tensor]) -> bool:
    if b is not None:
        return False
    return w is None or w.dtype == u.dtype or (w.dtype == torch.float32 and u.dtype != torch.float64)


def activation(z: Tensor, gate_activation: str) -> Tensor:
    """act(z) of the gate, in z's dtype (fp32 for the models' spellings)."""
    return F.silu(z) if gate_activation == "silu" else torch.sigmoid(z)


def activation_grad(z: Tensor, gate_activation: str) -> Tensor:
    """act'(z): silu' = s * (1 + z * (1 - s)), sigmoid' = s * (1 - s), with s = sigmoid(z)."""
    sig = torch.sigmoid(z)
    return sig * (1 + z * (1 - sig)) if gate_activation == "silu" else sig * (1 - sig)


def gated_input(u: Tensor, gate: Tensor, gate_activation: str) -> Tensor:
    """h = float32(u) * act(float32(z)) (fp64 for fp64 input): the norm input of a gate "before"."""
    acc = acc_dtype(u.dtype)
    return u.to(acc) * activation(gate.to(acc), gate_activation)


def _groups(t: Optional[Tensor], norm_group: int) -> Optional[Tensor]:
    """(..., N) as (..., N // G, G): each group of G columns a row of its own."""
    return None if t is None else t.unflatten(-1, (t.shape[-1] // norm_group, norm_group))


def normalize(u: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], kind: str, eps: float,
              weight_offset: float, norm_round_dtype: Optional[torch.dtype], out_dtype: torch.dtype,
              norm_group: Optional[int] = None):
    """Normalize ``u`` (the norm input, any float dtype) over its last dim, or over each group of
    norm_group columns.

    Returns (y, mean, rstd) with mean/rstd flat per row (per row and group) in fp32 (fp64 for fp64
    input); mean is an empty tensor for rms_norm.
    """
    if norm_group:
        y, mean, rstd = _normalize(_groups(u, norm_group), _groups(weight, norm_group), _groups(bias, norm_group),
                                   kind, eps, weight_offset, norm_round_dtype, out_dtype, fast=False)
        return y.flatten(-2), mean, rstd
    return _normalize(u, weight, bias, kind, eps, weight_offset, norm_round_dtype, out_dtype)


def _normalize(u: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], kind: str, eps: float,
               weight_offset: float, norm_round_dtype: Optional[torch.dtype], out_dtype: torch.dtype,
               fast: bool = True):
    acc = acc_dtype(u.dtype)
    n_cols = u.shape[-1]
    if u.numel() == 0:  # zero rows (kept differentiable for autograd through the reference)
        return (u.to(acc) * 0).to(out_dtype), u.new_empty(0, dtype=acc), u.new_empty(0, dtype=acc)
    w = _effective_weight(weight, weight_offset, acc)
    if fast and norm_round_dtype is None and out_dtype == acc != u.dtype:
        # a 16-bit input normalized into fp32 (autocast's fp32 policy): the norm of the exact fp32
        # upcasts of u, weight and bias, as eager computes it then
        u, w, bias = (t if t is None else t.to(acc) for t in (u, w, bias))
    if fast and norm_round_dtype is None and out_dtype == u.dtype:
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
    elif kind == "l2_norm":  # F.normalize's steps: the norm, its clamp, the quotient, then the scale
        norm = uf.norm(2, -1, keepdim=True)
        denom = norm.clamp_min(eps)
        n = uf / denom * math.sqrt(n_cols)
        rstd = math.sqrt(n_cols) / denom
        mean = torch.where(norm >= eps, norm, 0.0).reshape(-1)  # 0: eps clamps the norm (specs.stores_mean)
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


def add_norm_fwd(call: AddNormCall):
    """(y, s, mean, rstd, y1) of add-then-norm; s is None unless stored (and there is a sum), y1
    None without a second norm."""
    rows, norm, rounding, gate, dropout = call.rows, call.norm, call.rounding, call.gate, call.dropout
    x = gated_branch(rows.x, rows.x_gate)
    p = 0.0 if dropout is None else dropout.p
    keep = None if dropout is None else dropout_keep(dropout.seed, x.numel() // x.shape[-1], x.shape[-1], p, x.device)
    s, u = norm_input(x, rows.residual, rows.residual_scale, rounding.sum_dtype, rounding.round_sum_first, rows.x1,
                      rows.rowscale, keep, p)
    if gate is not None and gate.position == "before":
        u = gated_input(u, gate.z, gate.activation)
    y, mean, rstd = normalize(u, norm.weight, norm.bias, norm.kind, norm.eps, norm.weight_offset,
                              rounding.norm_round_dtype, rounding.out_dtype, norm.group)
    if gate is not None and gate.position == "after":
        acc = acc_dtype(y.dtype)
        y = (y.to(acc) * activation(gate.z.to(acc), gate.activation)).to(gate.out_dtype or rounding.out_dtype)
    y1 = None
    if call.modulation is not None:
        if call.modulation.twice:  # y1: the same y modulated a second time
            y1 = modulate(y, call.modulation.second())
        y = modulate(y, call.modulation)
    # y1 normalizes the same u (same stats) with its own parameters
    second = call.second
    if second is not None:
        y1 = normalize(u, second.weight, second.bias, norm.kind, norm.eps, norm.weight_offset,
                       rounding.norm_round_dtype, rounding.out_dtype)[0]
    return y, (s if call.store.sum and call_has_sum(call) else None), mean, rstd, y1


def gated_branch(x: Tensor, x_gate: Optional[Tensor]) -> Tensor:
    """x * x_gate as the graph computes it (``gate.unsqueeze(1) * attn_output``: one rounding to the
    promoted dtype), or x without a gate."""
    return x if x_gate is None else x * x_gate


def modulation_factor(scale: Optional[Tensor], one_plus: bool) -> Optional[Tensor]:
    """The factor y is multiplied by: scale, or ``1 + scale`` in scale's dtype (as the graph's add)."""
    return 1 + scale if one_plus and scale is not None else scale


def modulation_dtypes(y_dtype: torch.dtype, modulation: Modulation) -> tuple[torch.dtype, torch.dtype]:
    """(the dtype each step of the modulation rounds to, its output's dtype), defaults filled in."""
    dtype = modulation.dtype or y_dtype
    if modulation.dtype is None:
        for t in (modulation.scale, modulation.shift):
            dtype = dtype if t is None else torch.promote_types(dtype, t.dtype)
    return dtype, modulation.out_dtype or dtype


def modulate(y: Tensor, modulation: Modulation) -> Tensor:
    """m = y * scale + shift as the graph rounds it: y in the modulation's dtype (rounded to it when
    that is narrower: FP32LayerNorm's ``.to(x.dtype)`` before the product), then to that dtype after
    the product and after the sum (once, fused: ``addcmul``, a fused multiply-add), then to its
    out_dtype. In fp32 (fp64 for fp64)."""
    dtype, out_dtype = modulation_dtypes(y.dtype, modulation)
    acc = acc_dtype(dtype)
    m, scale, shift = y.to(dtype).to(acc), modulation_factor(modulation.scale, modulation.one_plus), modulation.shift
    if modulation.fused and scale is not None and shift is not None:
        m = torch.addcmul(shift.to(acc), m, scale.to(acc))  # one rounding (a fused multiply-add), as eager's
    else:
        if scale is not None:
            m = (m * scale.to(acc)).to(dtype).to(acc)
        if shift is not None:
            m = m + shift.to(acc)
    return m.to(dtype).to(out_dtype)


def call_has_sum(call: AddNormCall) -> bool:
    """Whether the call forms a sum s other than x itself (has_sum of its rows and dropout)."""
    rows = call.rows
    return has_sum(rows.residual, rows.x1, rows.rowscale, 0.0 if call.dropout is None else call.dropout.p)


# ---- quantization epilogue -------------------------------------------------------------

def quant_max(quant_dtype: torch.dtype) -> float:
    """qmax: the largest finite value of the fp8 dtype (448 for e4m3fn, 57344 for e5m2)."""
    return torch.finfo(quant_dtype).max


def quant_scale_shape(shape, quant_group: Optional[int]) -> tuple:
    """Shape of a dynamic scale for a y of ``shape``: one per row, or one per group of G columns."""
    return (*shape[:-1], 1 if not quant_group else shape[-1] // quant_group)


def quantize(y: Tensor, quant_dtype, quant_scale, quant_group, scale_form, amax_min, scale_min, apply, clamp,
             scale_out) -> tuple[Tensor, Optional[Tensor]]:
    """(q, scale) of the module docstring's epilogue, in torch ops spelled as models spell them; scale
    is None for a static scale (the caller returns the one it was given)."""
    n_cols = y.shape[-1]
    yf = y.to(torch.float32)
    if quant_group:
        yf = yf.unflatten(-1, (n_cols // quant_group, quant_group))  # (..., N // G, G)
    qmax = quant_max(quant_dtype)
    if quant_scale is None:
        amax = yf.abs().amax(-1, keepdim=True)  # (..., 1) or (..., N // G, 1)
        if amax_min is not None:
            amax = amax.clamp(min=amax_min)
        if scale_form == "amax/max":
            scale = amax / qmax
        elif scale_form == "max/amax":
            scale = torch.full_like(amax, qmax) / amax
        else:  # "max*(1/amax)"
            scale = amax.reciprocal() * qmax
        if scale_min is not None:
            scale = scale.clamp(min=scale_min)
    else:
        scale = quant_scale.reshape(())
    if apply == "div":
        v = yf / scale
    elif apply == "mul":
        v = yf * scale
    else:  # "mul_reciprocal"
        v = yf * scale.reciprocal()
    if clamp is not None:
        v = v.clamp(-clamp, clamp)
    q = v.to(quant_dtype).reshape(y.shape)
    if quant_scale is not None:
        return q, None
    out = scale if scale_out == "scale" else scale.reciprocal()
    return q, out.reshape(quant_scale_shape(y.shape, quant_group))


def add_norm_quant_fwd(call: AddNormCall):
    """(y, s, mean, rstd, y1, q, scale) of add-then-norm with the quantization epilogue (call.quant);
    y is None unless call.store.y, scale None for a static scale."""
    y, s, mean, rstd, y1 = add_norm_fwd(call)
    quant = call.quant
    q, scale = quantize(y.detach(), quant.dtype, quant.scale, quant.group, quant.scale_form, quant.amax_min,
                        quant.scale_min, quant.apply, quant.clamp, quant.scale_out)
    return (y if call.store.y else None), s, mean, rstd, y1, q, scale


def norm_add_fwd(call: NormAddCall):
    """(out, y, mean, rstd) of norm-then-add; y is None unless stored (call.store.y).
    out = round(add_dtype, float(round(residual.dtype, residual_scale * residual)) + float(y)), add_dtype
    being call.rounding.sum_dtype."""
    rows, norm, rounding = call.rows, call.norm, call.rounding
    y, mean, rstd = normalize(rows.x, norm.weight, norm.bias, norm.kind, norm.eps, norm.weight_offset,
                              rounding.norm_round_dtype, rounding.out_dtype)
    out = pre_sum(_scale_residual(rows.residual, rows.residual_scale), y, 1.0, rounding.sum_dtype)
    return out, (y if call.store.y else None), mean, rstd


def add_norm_ref(x, residual=None, weight=None, bias=None, *, kind, eps, weight_offset=0.0,
                 residual_scale=1.0, sum_dtype=None, norm_round_dtype=None, out_dtype=None,
                 return_sum=True, round_sum_first=True, x1=None, rowscale=None, weight1=None, bias1=None,
                 dropout_p=0.0, seed=None, quant_dtype=None, quant_scale=None, quant_group=None,
                 quant_scale_form="amax/max", quant_amax_min=None, quant_scale_min=None, quant_apply="div",
                 quant_clamp=None, quant_scale_out="scale", return_norm=False, gate=None, gate_position="before",
                 gate_activation="silu", norm_group=None, gate_out_dtype=None, modulation=None,
                 x_gate=None):
    """Plain-PyTorch add-then-norm with the semantics of the module docstring: returns (y, s),
    or (y, y1, s) with weight1, or (q, scale, y or None, s) with quant_dtype.

    Same arguments as :func:`normfuse.add_norm` (dropout needs an explicit ``seed``). A plain
    norm (no residual and no mode) returns s=None, as does ``return_sum=False``. For an fp64
    reference, pass fp64 tensors and fp64 rounding dtypes. Differentiable with plain autograd.
    """
    sum_dtype, out_dtype = add_norm_dtypes(x, residual, weight, sum_dtype, norm_round_dtype, out_dtype, x1, x_gate)
    call = AddNormCall(
        Rows(x, residual, residual_scale, x1, rowscale, x_gate),
        Norm(kind, weight, bias, eps, weight_offset, norm_group),
        Rounding(sum_dtype, norm_round_dtype, out_dtype, round_sum_first), Store(sum=return_sum),
        second=None if weight1 is None else SecondNorm(weight1, bias1),
        dropout=DropoutMask(dropout_p, seed) if dropout_p > 0 else None,
        gate=None if gate is None else Gate(gate, gate_position, gate_activation, gate_out_dtype),
        modulation=modulation)
    y, s, _, _, y1 = add_norm_fwd(call)
    if quant_dtype is not None:
        q, scale = quantize(y.detach(), quant_dtype, quant_scale, quant_group, quant_scale_form, quant_amax_min,
                            quant_scale_min, quant_apply, quant_clamp, quant_scale_out)
        return q, (quant_scale if scale is None else scale), (y if return_norm else None), s
    return (y, s) if weight1 is None else (y, y1, s)


def norm_add_ref(x, residual, weight=None, bias=None, *, kind, eps, weight_offset=0.0, residual_scale=1.0,
                 norm_round_dtype=None, out_dtype=None, add_dtype=None, return_norm=False):
    """Plain-PyTorch norm-then-add: returns (out, y); y is None unless return_norm."""
    out_dtype, add_dtype = norm_add_dtypes(x, residual, weight, norm_round_dtype, out_dtype, add_dtype)
    call = NormAddCall(Rows(x, residual, residual_scale), Norm(kind, weight, bias, eps, weight_offset),
                       Rounding(add_dtype, norm_round_dtype, out_dtype), Store(y=return_norm))
    out, y, _, _ = norm_add_fwd(call)
    return out, y


# ---- backward --------------------------------------------------------------------------

def _eager_layer_norm_backward_ok(dn: Tensor, inp: Tensor, mean: Tensor, rstd: Tensor, w: Optional[Tensor],
                                  bias_dtype) -> bool:
    """Eager's fused LayerNorm backward computes the formula below only where it keeps the stats in
    fp32: with bf16/fp16 input and parameters it rounds mean/rstd to that dtype, and x_hat's error,
    times rstd, is then far above the reference's (fuzzing found 2e-2 against 5e-7 at N = 2, eps = 0).
    Nor at N = 2, where the result is itself rounding noise: eager forms dx as ``a * g + b * x + c``,
    whose ``b * x + c`` cancels to ``b * (x - mean)`` and multiplies that noise by ~|mean| / std
    (3x the x_hat formula's on random rows; see docs/semantics.md)."""
    acc = acc_dtype(inp.dtype)
    bias_like = None if bias_dtype is None else inp.new_empty(0, dtype=bias_dtype)
    return (inp.numel() > 0 and inp.shape[-1] != 2 and dn.dtype == inp.dtype and mean.dtype == rstd.dtype == acc
            and _native_layer_norm_ok(inp, w, bias_like) and _native_stats_dtype(inp, w) == acc)


def _norm_grads(dn: Tensor, inp: Tensor, mean: Tensor, rstd: Tensor, weight: Optional[Tensor], kind: str,
                weight_offset: float, bias_dtype, dn1: Optional[Tensor] = None, weight1: Optional[Tensor] = None,
                bias1_dtype=None, grouped: bool = False):
    """(du, dweight, dbias, dweight1, dbias1) of the norm alone, given dn (and dn1, of the second
    output y1 = n * w1' + b1), the gradients of its outputs.

    du = rstd * (g - mean(g) - x_hat * mean(g * x_hat)) with g = dn * w' + dn1 * w1' (no mean(g)
    for rms_norm; the formula is linear in g, so one pass serves both outputs).
    dweight = sum_rows(dn * x_hat) and dbias = sum_rows(dn) are reduced in fp32: eager's CPU
    LayerNorm backward reduces them in the 16-bit input dtype when the parameters are fp32, far
    less accurately (26x (fp16) and 48x (bf16) the error of an fp32 reduction at 4096 rows of
    192), so it only supplies them for fp32/fp64 input.
    """
    acc = acc_dtype(inp.dtype)
    stat_shape = (*inp.shape[:-1], 1)
    rows = tuple(range(inp.dim() - (2 if grouped else 1)))  # grouped: (..., groups, G), parameters (groups, G)
    w = _effective_weight(weight, weight_offset, acc)
    want_dw, want_db = weight is not None, bias_dtype is not None
    du = None
    if (dn1 is None and not grouped and kind == "layer_norm"
            and _eager_layer_norm_backward_ok(dn, inp, mean, rstd, w, bias_dtype)):
        params_too = inp.dtype == acc
        du, dw, db = torch.ops.aten.native_layer_norm_backward(
            dn, inp, [inp.shape[-1]], mean.reshape(stat_shape), rstd.reshape(stat_shape), w,
            inp.new_zeros(inp.shape[-1], dtype=bias_dtype) if want_db else None,
            [True, params_too and want_dw, params_too and want_db])
        if params_too or not (want_dw or want_db):
            return du, dw, db, None, None
    u = inp.to(acc)
    rstd = rstd.to(acc).reshape(stat_shape)
    xhat = (u - mean.to(acc).reshape(stat_shape)) * rstd if kind == "layer_norm" else u * rstd
    dn = dn.to(acc)
    if du is None:
        g = dn * w.to(acc) if w is not None else dn
        if dn1 is not None:
            w1 = _effective_weight(weight1, weight_offset, acc)
            g = g + (dn1.to(acc) * w1.to(acc) if w1 is not None else dn1.to(acc))
        c1 = (g * xhat).mean(-1, keepdim=True)
        if kind == "l2_norm":  # rstd = sqrt(N) / ||u||: the rms_norm formula; none through a clamped norm
            c1 = c1 * (mean.to(acc).reshape(stat_shape) > 0)
        if kind == "layer_norm":
            du = (g - g.mean(-1, keepdim=True) - xhat * c1) * rstd
        else:
            du = (g - xhat * c1) * rstd
    dw = (dn * xhat).sum(rows) if want_dw else None
    db = dn.sum(rows) if want_db else None
    if dn1 is None:
        return du, dw, db, None, None
    dn1 = dn1.to(acc)
    dw1 = (dn1 * xhat).sum(rows) if weight1 is not None else None
    db1 = dn1.sum(rows) if bias1_dtype is not None else None
    return du, dw, db, dw1, db1


def _gated_norm_grads(dn, inp, mean, rstd, weight, bias, kind, weight_offset, bias_dtype, gate, gate_position,
                      gate_activation, norm_group):
    """(du, dweight, dbias, dgate) of a gated norm and/or one with grouped statistics (module
    docstring); inp is the norm input u before the gate."""
    acc = acc_dtype(inp.dtype)
    u, dn = inp.to(acc), dn.to(acc)
    a = da = None
    if gate is not None:
        z = gate.to(acc)
        a, da = activation(z, gate_activation), activation_grad(z, gate_activation)
    h = u * a if gate_position == "before" and a is not None else u
    if gate_position == "after" and a is not None:
        dgate = dn * _norm_output(h, mean, rstd, weight, bias, kind, weight_offset, norm_group) * da
        dn = dn * a
    group = norm_group or h.shape[-1]
    shape = h.shape
    dh, dw, db, _, _ = _norm_grads(_groups(dn, group), _groups(h, group), mean, rstd, _groups(weight, group), kind,
                                   weight_offset, bias_dtype, grouped=True)
    dh = dh.reshape(shape)
    dw = None if dw is None else dw.reshape(-1)
    db = None if db is None else db.reshape(-1)
    if gate_position == "before" and a is not None:
        dgate = dh * u * da
        dh = dh * a
    return dh, dw, db, (None if gate is None else dgate.to(gate.dtype))


def _norm_output(h, mean, rstd, weight, bias, kind, weight_offset, norm_group) -> Tensor:
    """y0 = n * w' + b in fp32 (unrounded), from the saved statistics: what a gate "after" multiplies."""
    acc = acc_dtype(h.dtype)
    group = norm_group or h.shape[-1]
    hg = _groups(h, group)
    stat_shape = (*hg.shape[:-1], 1)
    n = (hg - mean.reshape(stat_shape)) * rstd.reshape(stat_shape) if kind == "layer_norm" \
        else hg * rstd.reshape(stat_shape)
    n = n.flatten(-2)
    w = _effective_weight(weight, weight_offset, acc)
    y0 = n if w is None else n * w.to(acc)
    return y0 if bias is None else y0 + bias.to(acc)


def modulation_grads(dm: Tensor, call: BackwardCall, dm1: Optional[Tensor] = None) -> tuple:
    """(the gradient into the norm output, dscale, dshift, dscale1, dshift1) of m = y * scale + shift
    and of the second modulation m1 = y * scale1 + shift1 (``dm1``: its gradient; None when there is
    none or nothing read it), rounding straight-through, each summed over what it broadcasts across."""
    saved, norm, mod = call.saved, call.norm, call.modulation
    acc = acc_dtype(saved.inp.dtype)
    y = None
    if mod.scale is not None:
        y = _norm_output(saved.inp.to(acc), saved.mean, saved.rstd, norm.weight, norm.bias, norm.kind,
                         norm.weight_offset, norm.group)
    dy, dscale, dshift = _modulation_grads(dm.to(acc), y, mod.scale, mod.shift, mod.one_plus)
    dscale1 = dshift1 = None
    if mod.twice and dm1 is not None:
        dy1, dscale1, dshift1 = _modulation_grads(dm1.to(acc), y, mod.scale1, mod.shift1, mod.one_plus)
        dy = dy + dy1
    return dy, dscale, dshift, dscale1, dshift1


def _modulation_grads(dm: Tensor, y: Optional[Tensor], scale: Optional[Tensor], shift: Optional[Tensor],
                      one_plus: bool = False) -> tuple:
    """(dy, dscale, dshift) of m = y * factor + shift from dm (in the accumulation dtype); the factor's
    gradient is the scale's (d(1 + scale) = d scale)."""
    dshift = None if shift is None else dm.sum_to_size(shift.shape).to(shift.dtype)
    if scale is None:
        return dm, None, dshift
    factor = modulation_factor(scale, one_plus)
    return dm * factor.to(dm.dtype), (dm * y).sum_to_size(scale.shape).to(scale.dtype), dshift


def add_norm_bwd(call: BackwardCall):
    """Backend form (the op's call) of :func:`add_norm_bwd_ref`."""
    grads, saved, norm, dtypes, gate = call.grads, call.saved, call.norm, call.dtypes, call.gate
    inp = saved.inp
    acc = acc_dtype(inp.dtype)
    dextra, add_after_norm = grads.dextra, call.add_after_norm
    dn = grads.dy + dextra if (add_after_norm and dextra is not None) else grads.dy  # gradient into the norm's output
    dscale = dshift = dscale1 = dshift1 = None
    if call.modulation is not None:
        dn, dscale, dshift, dscale1, dshift1 = modulation_grads(dn, call, grads.dy1)
    dgate = None
    if gate is None and not norm.group:
        weight1 = None if call.second is None else call.second.weight
        du, dw, db, dw1, db1 = _norm_grads(dn, inp, saved.mean, saved.rstd, norm.weight, norm.kind, norm.weight_offset,
                                           dtypes.bias, None if weight1 is None else grads.dy1, weight1, dtypes.bias1)
    else:
        du, dw, db, dgate = _gated_norm_grads(dn, inp, saved.mean, saved.rstd, norm.weight, norm.bias, norm.kind,
                                              norm.weight_offset, dtypes.bias, None if gate is None else gate.z,
                                              "before" if gate is None else gate.position,
                                              "silu" if gate is None else gate.activation, norm.group)
        dw1 = db1 = None
    if not add_after_norm and dextra is not None:
        du = du + dextra.to(du.dtype)
    dres = None
    if dtypes.residual is not None:
        src = grads.dy if add_after_norm else du
        scale = call.residual_scale
        dres = (src if scale == 1.0 else src.to(acc) * scale).to(dtypes.residual)
    dx1 = None if dtypes.x1 is None else du.to(dtypes.x1)
    dx = du
    if call.dropout is not None:
        p, n_cols = call.dropout.p, inp.shape[-1]
        keep = dropout_keep(call.dropout.seed, inp.numel() // n_cols, n_cols, p, inp.device)
        dx = dx.to(acc) * keep.view(inp.shape) * (1.0 / (1.0 - p))
    if call.rowscale is not None:
        dx = dx.to(acc) * call.rowscale[..., None].to(acc)
    dx_gate = None
    if call.x_gate is not None:
        dx, dx_gate = gated_branch_grads(dx.to(acc), call.x_gate)
    return (dx.to(dtypes.x), dres, None if dw is None else dw.to(norm.weight.dtype),
            None if db is None else db.to(dtypes.bias), dx1, None if dw1 is None else dw1.to(call.second.weight.dtype),
            None if db1 is None else db1.to(dtypes.bias1), dgate, dscale, dshift, dx_gate, dscale1, dshift1)


def gated_branch_grads(db: Tensor, x_gate: XGate) -> tuple[Tensor, Tensor]:
    """(dx, dgate) of the branch b = x * gate from db (in the accumulation dtype; dx stays in it,
    dgate summed over what the gate broadcasts across, in the gate's dtype)."""
    gate, x = x_gate.gate, x_gate.x
    return db * gate.to(db.dtype), (db * x.to(db.dtype)).sum_to_size(gate.shape).to(gate.dtype)


def add_norm_bwd_ref(call: BackwardCall):
    """Backward of both orders; rounding steps are identities, math in fp32 (fp64 for fp64).

    ``call.saved``: inp, the norm input (s, or the unrounded sum, or x for norm_add), mean and rstd
    its flat per-row stats (mean empty for rms_norm). ``call.grads``:
    add_norm (add_after_norm=False): dy = grad of y, dextra = grad of s (or None);
        ds = norm_bwd(dy) + dextra; dx = ds; dresidual = residual_scale * ds.
    norm_add (add_after_norm=True): dy = grad of out, dextra = grad of y (or None);
        dx = norm_bwd(dy + dextra); dresidual = residual_scale * dy.
    The add_norm modes (module docstring): dy1 (grad of y1) with call.second's weight and
    call.dtypes.bias1; dtypes.x1 for dx1; rowscale and call.dropout (the forward's mask,
    regenerated) scale dx. call.dtypes: each input gradient's dtype (None: no such input).
    Gated / grouped norms: call.gate, call.norm.group, and call.norm.bias (a gate "after" multiplies
    n * w' + b); inp is then the norm input before the gate.
    call.modulation: dy is the gradient of the modulated output (scale and shift as the forward's);
    with a second modulation (scale1, shift1), dy1 is the gradient of y1, the second modulated output.
    call.x_gate: the branch was x * gate (the gate and x given): dx and dx_gate from the branch's
    gradient.
    Returns (dx, dresidual, dweight, dbias, dx1, dweight1, dbias1, dgate, dmod_scale, dmod_shift, dx_gate,
    dmod1_scale, dmod1_shift);
    None for inputs that do not exist.
    """
    return add_norm_bwd(call)
