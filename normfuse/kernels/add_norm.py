"""Residual add fused with LayerNorm / RMSNorm, in both orders: the functional API.

The package reads in this order: ``reference.py`` (the semantics, in plain PyTorch:
read its docstring first) -> ``triton.py`` (the kernels and launchers) -> ``ops.py``
(the ``torch.ops.normfuse.*`` custom ops, and which path a call runs) -> this
module, the functions users and the rewritten graphs call::

    add_norm(x, residual, weight, bias, kind=..., eps=..., ...)  -> (y, s)     # y = norm(x + r), s = x + r
    add_norm(..., weight1=w1)                                    -> (y, y1, s) # y1 = norm(s) with w1
    add_norm(..., quant_dtype=torch.float8_e4m3fn)               -> (q, scale, y or None, s)  # q = fp8(y / scale)
    add_norm(..., gate=z, gate_position="before", norm_group=G)  -> (y, s)     # gated norms (Mamba2, Qwen3-Next)
    norm_add(x, residual, weight, bias, kind=..., eps=..., ...)  -> (out, y)   # out = r + norm(x)

with the shorthands ``add_rms_norm``, ``add_layer_norm``, ``rms_norm_add``,
``layer_norm_add``. Arguments are validated here, once per call.
"""

from __future__ import annotations

import functools

import torch

from normfuse.errors import InvalidOptionError
from normfuse.kernels.ops import (_grad_needed, forward_for, seed_tensor, validate, validate_gate, validate_modes,
                                  validate_quant)
from normfuse.kernels.reference import (KINDS, SUPPORTED_DTYPES, add_norm_bwd_ref, add_norm_dtypes,
                                        add_norm_ref, norm_add_dtypes, norm_add_ref)
from normfuse.kernels.reference import has_sum as has_sum_of

# Names other modules and the benchmarks import from here (kept working after the split
# into reference / triton / ops).
from normfuse.kernels.ops import _eager_cpu  # noqa: F401
from normfuse.kernels.triton import (  # noqa: F401
    _add_norm_bwd_kernel, _add_norm_bwd_looped_kernel, _add_norm_fwd_kernel, _add_norm_fwd_looped_kernel,
    _blocking)

__all__ = [
    "add_norm", "add_rms_norm", "add_layer_norm",
    "norm_add", "rms_norm_add", "layer_norm_add",
    "add_norm_ref", "norm_add_ref", "add_norm_bwd_ref",
    "KINDS", "SUPPORTED_DTYPES",
]


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
             sum_dtype=None, norm_round_dtype=None, out_dtype=None, return_sum=True, round_sum_first=True,
             x1=None, rowscale=None, weight1=None, bias1=None, dropout_p=0.0, generator=None, seed=None,
             quant_dtype=None, quant_scale=None, quant_group=None, quant_scale_form="amax/max", quant_amax_min=None,
             quant_scale_min=None, quant_apply="div", quant_clamp=None, quant_scale_out="scale", return_norm=False,
             gate=None, gate_position="before", gate_activation="silu", norm_group=None, gate_out_dtype=None):
    """Fused ``s = x + residual_scale * residual; y = norm(s)``: returns (y, s), or (y, y1, s)
    with weight1, or (q, scale, y or None, s) with quant_dtype.

    kind: "rms_norm" or "layer_norm", over the last dim N. x, residual: (..., N) of
    equal shape, fp32/fp16/bf16; weight, bias: (N,), fp32/fp16/bf16 (any, whatever x's dtype:
    they are used in fp32; flash-attn's layer_norm_fn takes the same).
    weight_offset: w' = weight + offset in fp32 (Gemma: 1.0). residual_scale: the
    residual is scaled in its own dtype before the add (DeepNorm). sum_dtype: dtype
    the sum is rounded to (default: promoted dtype of x and residual).
    norm_round_dtype: None multiplies by the weight then rounds once (F.layer_norm,
    F.rms_norm, Gemma); a dtype rounds the normalized value to it first (HF Llama).
    out_dtype: dtype of y (default: see normfuse.kernels.reference).
    s is None for a plain norm (residual=None) or return_sum=False.
    round_sum_first: True normalizes s, the sum rounded to sum_dtype (what a graph that adds in
    the model dtype computes); False normalizes the unrounded fp32 sum and still returns s
    rounded (flash-attn's ``layer_norm_fn(x, w, b, residual=r, prenorm=True)``, quack, vLLM's
    native RMSNorm).

    Modes (off by default; the semantics are in normfuse.kernels.reference; flash-attn's
    ``layer_norm_fn`` takes the same arguments):
    x1: a second branch of x's shape added in the same kernel (parallel blocks: attn + mlp + r).
    rowscale: x.shape[:-1], scales each row of x (stochastic depth / drop_path); not differentiated
    (pass it detached).
    weight1, bias1: a second norm of the same sum with its own parameters (bias1 needs weight1);
    add_norm then returns (y, y1, s), y1 in y's dtype.
    dropout_p in [0, 1): dropout on x (before rowscale and x1), scaled by 1 / (1 - p). The mask is
    regenerated from a seed in the backward, never stored. seed: an int or an int64 CPU tensor of
    shape () (reproducible); without one a seed is drawn from ``generator`` (a CPU
    torch.Generator; default: torch's). normfuse.kernels.dropout_keep_mask(x, p, seed) returns the
    mask. The reference (CPU) and Triton backends draw different masks from one seed.
    s exists (unless return_sum=False) whenever a residual or any mode forms a sum.

    Quantization epilogue (off unless quant_dtype is set; the exact steps are in
    normfuse.kernels.reference): y is also written as q in quant_dtype (torch.float8_e4m3fn or
    torch.float8_e5m2) with a scale, for an fp8 linear to read; add_norm then returns
    (q, scale, y, s), y None unless return_norm. q and scale are not differentiable; y and s are as
    without the epilogue. Not with weight1.
    quant_scale: a static per-tensor scale (a 1-element fp32 tensor, returned as scale); None: a
    dynamic scale from the amax of each row's rounded y, or of each group of quant_group columns (a
    power of two dividing N: 128, 64); scale is then fp32 of shape (*y.shape[:-1], 1) or
    (*y.shape[:-1], N // quant_group).
    quant_scale_form: "amax/max" (scale = amax / qmax), "max/amax" (qmax / amax, one division), or
    "max*(1/amax)" (what Python's ``qmax / amax`` computes: the reciprocal, then a multiply).
    quant_amax_min, quant_scale_min: lower clamps of amax (e.g. 1e-12) and of the scale (vLLM's
    1 / (qmax * 512)). quant_apply: q = y / scale ("div"), y * scale ("mul"), or y * (1 / scale)
    ("mul_reciprocal"). quant_clamp: clamp to [-c, c] before the cast (without it the cast itself
    saturates e4m3fn and overflows e5m2 to inf, as torch's does). quant_scale_out: return the scale
    ("scale") or its reciprocal ("reciprocal": the dequantization scale torchao passes on).

    Gated norms (Mamba2 / NemotronH, Qwen3-Next, Kimi-Linear; the exact rounding points are in
    normfuse.kernels.reference): gate, x's shape, multiplies by act(gate) in fp32 (gate_activation
    "silu" or "sigmoid") either the norm input ("before": Mamba2's MambaRMSNormGated, then the norm of
    the unrounded product) or the norm output ("after": y0 rounded as usual, then
    round(gate_out_dtype, y0 * act(gate)); gate_out_dtype defaults to out_dtype). norm_group: the
    statistics of each group of norm_group contiguous columns (Mamba2's group_size; the weight stays
    per column), with or without a gate. Differentiable in x, residual, weight, bias and gate. Not
    with weight1 or quant_dtype.
    """
    validate(x, residual, weight, bias, kind, eps,
             {"sum_dtype": sum_dtype, "norm_round_dtype": norm_round_dtype, "out_dtype": out_dtype})
    validate_modes(x, x1, rowscale, weight1, bias1, dropout_p, seed, generator)
    dropout_p = float(dropout_p)
    if dropout_p > 0:
        seed = seed_tensor(seed) if seed is not None else torch.randint(0, 2**62, (), generator=generator)
    else:
        seed = None  # p = 0 draws nothing
    sum_dtype, out_dtype = add_norm_dtypes(x, residual, weight, sum_dtype, norm_round_dtype, out_dtype, x1)
    has_sum = has_sum_of(residual, x1, rowscale, dropout_p)
    if gate is not None or norm_group is not None:
        validate_gate(x, gate, gate_position, gate_activation, norm_group, gate_out_dtype, weight1, quant_dtype)
        norm_group = None if norm_group == x.shape[-1] else norm_group  # one group: the whole row
    modes = tuple(t for t in (x1, rowscale, weight1, bias1, seed, gate) if t is not None)
    store_sum = has_sum and (return_sum or _grad_needed(x, residual, weight, bias, *modes))
    if quant_dtype is not None:
        validate_quant(x, quant_dtype, quant_scale, quant_group, quant_scale_form, quant_amax_min, quant_scale_min,
                       quant_apply, quant_clamp, quant_scale_out, weight1)
        if quant_group is not None and quant_group == x.shape[-1]:
            quant_group = None  # one group per row: the scale per row, shaped (..., 1) either way
        forward = forward_for("add_norm_quant_fwd", x, residual, weight, bias, *modes,
                              *(() if quant_scale is None else (quant_scale,)))
        y, s, _, _, _, q, scale = forward(
            x, residual, weight, bias, kind, float(eps), float(weight_offset), float(residual_scale), sum_dtype,
            norm_round_dtype, out_dtype, store_sum, bool(round_sum_first), x1, rowscale, weight1, bias1, dropout_p,
            seed, bool(return_norm), quant_dtype, quant_scale, quant_group, quant_scale_form,
            _float_or_none(quant_amax_min), _float_or_none(quant_scale_min), quant_apply, _float_or_none(quant_clamp),
            quant_scale_out)
        q = q if q.dtype == quant_dtype else q.view(quant_dtype)  # the op returns q's bytes
        return (q, quant_scale if quant_scale is not None else scale, y if return_norm else None,
                s if has_sum and return_sum else None)
    forward = forward_for("add_norm_fwd", x, residual, weight, bias, *modes)
    gated = () if gate is None and norm_group is None else (gate, gate_position, gate_activation, norm_group,
                                                            gate_out_dtype)
    y, s, _, _, y1 = forward(x, residual, weight, bias, kind, float(eps), float(weight_offset),
                             float(residual_scale), sum_dtype, norm_round_dtype, out_dtype, store_sum,
                             bool(round_sum_first), x1, rowscale, weight1, bias1, dropout_p, seed, *gated)
    s = s if has_sum and return_sum else None
    return (y, s) if weight1 is None else (y, y1, s)


def _float_or_none(value):
    return None if value is None else float(value)


@_one_call_when_fx_traced
def norm_add(x, residual, weight=None, bias=None, *, kind, eps, weight_offset=0.0, residual_scale=1.0,
             norm_round_dtype=None, out_dtype=None, add_dtype=None, return_norm=False):
    """Fused ``y = norm(x); out = residual_scale * residual + y`` (res-post blocks): returns (out, y).

    y is None unless return_norm. out_dtype is y's dtype (default as in add_norm with
    x.dtype as the norm input dtype); add_dtype is out's dtype (default: promoted dtype
    of residual and y). Other arguments as in :func:`add_norm`.
    """
    if residual is None:
        raise InvalidOptionError("norm_add needs a residual to add the norm to; for a plain norm call "
                                 "add_norm(x, None, weight, bias, kind=..., eps=...).")
    validate(x, residual, weight, bias, kind, eps,
             {"norm_round_dtype": norm_round_dtype, "out_dtype": out_dtype, "add_dtype": add_dtype})
    out_dtype, add_dtype = norm_add_dtypes(x, residual, weight, norm_round_dtype, out_dtype, add_dtype)
    forward = forward_for("norm_add_fwd", x, residual, weight, bias)
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
