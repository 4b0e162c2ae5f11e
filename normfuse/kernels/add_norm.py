"""Residual add fused with LayerNorm / RMSNorm, in both orders: the functional API.

The package reads in this order: ``reference.py`` (the semantics, in plain PyTorch:
read its docstring first) -> ``triton.py`` (the kernels and launchers) -> ``ops.py``
(the ``torch.ops.normfuse.*`` custom ops, and which path a call runs) -> this
module, the functions users and the rewritten graphs call::

    add_norm(x, residual, weight, bias, kind=..., eps=..., ...)  -> (y, s)     # y = norm(x + r), s = x + r
    add_norm(..., weight1=w1)                                    -> (y, y1, s) # y1 = norm(s) with w1
    add_norm(..., quant=Fp8Quant())                              -> (q, scale, y or None, s)  # q = fp8(y / scale)
    add_norm(..., gate=Gate(z), norm_group=G)                    -> (y, s)     # gated norms (Mamba2, Qwen3-Next)
    add_norm(..., dropout=Dropout(0.1, seed=s))                  -> (y, s)     # dropout on x, mask from the seed
    norm_add(x, residual, weight, bias, kind=..., eps=..., ...)  -> (out, y)   # out = r + norm(x)

with the shorthands ``add_rms_norm``, ``add_layer_norm``, ``rms_norm_add``,
``layer_norm_add``. The option groups (Gate, Fp8Quant, Dropout) and the names of the outputs
are in ``specs.py``. ``fused_add_norm`` takes the same options as flat keywords: the rewritten
graphs call it (fx cannot see a tensor inside a dataclass), and add_norm calls it.
Arguments are validated here, once per call.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import sys
import warnings

import torch
from torch import Tensor

from normfuse.errors import InvalidOptionError, closest
from normfuse.kernels.ops import (_grad_needed, check_broadcast, check_modulation_shapes, forward_for, seed_tensor,
                                  validate, validate_modes, validate_norm_group)
from normfuse.kernels.specs import SPECS, Dropout, Fp8Quant, Gate, Modulation, check_operand
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
    "add_norm", "fused_add_norm", "Gate", "Fp8Quant", "Dropout", "add_rms_norm", "add_layer_norm",
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
def fused_add_norm(x, residual=None, weight=None, bias=None, *, kind, eps, weight_offset=0.0, residual_scale=1.0,
                   sum_dtype=None, norm_round_dtype=None, out_dtype=None, return_sum=True, round_sum_first=True,
                   x1=None, rowscale=None, weight1=None, bias1=None, dropout_p=0.0, generator=None, seed=None,
                   quant_dtype=None, quant_scale=None, quant_group=None, quant_scale_form="amax/max",
                   quant_amax_min=None, quant_scale_min=None, quant_apply="div", quant_clamp=None,
                   quant_scale_out="scale", return_norm=False, gate=None, gate_position="before",
                   gate_activation="silu", norm_group=None, gate_out_dtype=None, mod_scale=None, mod_shift=None,
                   mod_dtype=None, mod_fused=False, mod_out_dtype=None, x_gate=None, mod1_scale=None, mod1_shift=None,
                   mod_one_plus=False):
    """:func:`add_norm` with every option a flat keyword: what the rewritten graphs call (a
    tensor inside a Gate or Fp8Quant would be invisible to torch.fx) and the one route of
    add_norm to the ops. gate, gate_*: the fields of :class:`Gate`; quant_*: those of
    :class:`Fp8Quant` (quantizes when quant_dtype is set); dropout_p, seed, generator: those of
    :class:`Dropout`; mod_*: those of :class:`Modulation` (mod1_scale, mod1_shift: its scale1 and shift1,
    a second modulation returned as y1; mod_one_plus: its one_plus). Returns what add_norm returns
    (normfuse.kernels.specs.api_outputs)."""
    validate(x, residual, weight, bias, kind, eps,
             {"sum_dtype": sum_dtype, "norm_round_dtype": norm_round_dtype, "out_dtype": out_dtype})
    validate_modes(x, x1, rowscale, weight1, bias1)
    if seed is not None or generator is not None or type(dropout_p) not in (float, int) or dropout_p != 0:
        Dropout(dropout_p, seed, generator)  # checks its values
    dropout_p = float(dropout_p)
    if dropout_p > 0:
        seed = seed_tensor(seed) if seed is not None else torch.randint(0, 2**62, (), generator=generator)
    else:
        seed = None  # p = 0 draws nothing
    if x_gate is not None:
        _check_x_gate(x, x_gate, x1, rowscale, dropout_p, gate, quant_dtype)
    sum_dtype, out_dtype = add_norm_dtypes(x, residual, weight, sum_dtype, norm_round_dtype, out_dtype, x1, x_gate)
    has_sum = has_sum_of(residual, x1, rowscale, dropout_p)
    if gate is not None or norm_group is not None:
        if kind == "l2_norm":
            raise InvalidOptionError("kind='l2_norm' takes no gate and no norm_group yet (F.normalize over the "
                                     "whole row); apply the gate separately, or use rms_norm for grouped statistics.")
        if gate is not None:
            Gate(gate, gate_position, gate_activation, gate_out_dtype).check(x)
        if norm_group is not None:
            validate_norm_group(x, norm_group)
        if weight1 is not None:
            raise InvalidOptionError("a second norm output (weight1) cannot be combined with gate or norm_group; "
                                     "call add_norm once per output.")
        if quant_dtype is not None:
            raise InvalidOptionError("the fp8 epilogue (quant_dtype) cannot be combined with gate or norm_group yet; "
                                     "quantize the gated output separately.")
        norm_group = None if norm_group == x.shape[-1] else norm_group  # one group: the whole row
    modulated = mod_scale is not None or mod_shift is not None
    twice = mod1_scale is not None or mod1_shift is not None
    if twice and not modulated:
        raise InvalidOptionError("a second modulation (mod1_scale, mod1_shift) needs the first (mod_scale, "
                                 "mod_shift): y1 modulates the same y with the same steps.")
    if modulated:
        Modulation(mod_scale, mod_shift, mod_dtype, bool(mod_fused), mod_out_dtype, mod1_scale, mod1_shift,
                   bool(mod_one_plus)).check(x)
        check_modulation_shapes(x, Modulation(mod_scale, mod_shift, scale1=mod1_scale, shift1=mod1_shift))
        if gate is not None or weight1 is not None or quant_dtype is not None:
            raise InvalidOptionError("the modulation epilogue cannot be combined with gate, weight1 or quant_dtype "
                                     "yet; modulate the norm output separately.")
    modes = tuple(t for t in (x1, rowscale, weight1, bias1, seed, gate, mod_scale, mod_shift, x_gate, mod1_scale,
                              mod1_shift) if t is not None)
    store_sum = has_sum and (return_sum or _grad_needed(x, residual, weight, bias, *modes))
    if quant_dtype is not None:
        Fp8Quant(quant_dtype, quant_scale, quant_group, quant_scale_form, quant_amax_min, quant_scale_min,
                 quant_apply, quant_clamp, quant_scale_out).check(x)
        if weight1 is not None:
            raise InvalidOptionError("the quantization epilogue quantizes the one norm output y: a second norm "
                                     "output (weight1) cannot be combined with quant_dtype; call add_norm twice, or "
                                     "quantize y1 separately.")
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
    gated = () if gate is None and norm_group is None and not modulated and x_gate is None else (
        gate, gate_position, gate_activation, norm_group, gate_out_dtype)
    if modulated or x_gate is not None:
        gated += (mod_scale, mod_shift, mod_dtype, bool(mod_fused), mod_out_dtype, x_gate, mod1_scale, mod1_shift,
                  bool(mod_one_plus))
    y, s, _, _, y1 = forward(x, residual, weight, bias, kind, float(eps), float(weight_offset),
                             float(residual_scale), sum_dtype, norm_round_dtype, out_dtype, store_sum,
                             bool(round_sum_first), x1, rowscale, weight1, bias1, dropout_p, seed, *gated)
    s = s if has_sum and return_sum else None
    return (y, s) if weight1 is None and not twice else (y, y1, s)


# The flat keywords add_norm took before the grouped specs: name -> (the add_norm keyword of its
# group, the spec, its field). They keep working for one release, with a FutureWarning.
_FLAT = {
    "gate_position": ("gate", Gate, "position"), "gate_activation": ("gate", Gate, "activation"),
    "gate_out_dtype": ("gate", Gate, "out_dtype"),
    **{f"quant_{field}": ("quant", Fp8Quant, field)
       for field in ("dtype", "scale", "group", "scale_form", "amax_min", "scale_min", "apply", "clamp", "scale_out")},
    "dropout_p": ("dropout", Dropout, "p"), "seed": ("dropout", Dropout, "seed"),
    "generator": ("dropout", Dropout, "generator"),
}
_FIELDS = {spec: tuple(field.name for field in dataclasses.fields(spec)) for spec in SPECS}
_PLAIN = frozenset(name for name in inspect.signature(fused_add_norm).parameters
                   if name not in _FLAT and name != "gate" and not name.startswith(("mod_", "mod1_")))


def _one_call_unless_grouped(fn):
    """Under torch.fx symbolic tracing, record ``fn`` as one call when its options are flat (a
    rewritten graph re-traced keeps its add_norm calls); a call with a spec goes on to
    fused_add_norm, which records itself with the spec's tensors as arguments."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        proxy = next((a for a in args if isinstance(a, torch.fx.Proxy)), None)
        if proxy is not None and not any(isinstance(v, SPECS) for v in kwargs.values()):
            return proxy.tracer.create_proxy("call_function", wrapper, args, kwargs)
        return fn(*args, **kwargs)
    return wrapper


@_one_call_unless_grouped
def add_norm(x, residual=None, weight=None, bias=None, *, kind, eps, weight_offset=0.0, residual_scale=1.0,
             sum_dtype=None, norm_round_dtype=None, out_dtype=None, return_sum=True, round_sum_first=True,
             x1=None, rowscale=None, weight1=None, bias1=None, norm_group=None, return_norm=False,
             gate: Gate | None = None, quant: Fp8Quant | None = None, dropout: Dropout | None = None,
             modulation: Modulation | None = None, x_gate=None, **flat):
    """Fused ``s = x + residual_scale * residual; y = norm(s)``: returns (y, s), or (y, y1, s)
    with weight1, or (q, scale, y or None, s) with quant (normfuse.kernels.specs.api_outputs).

    kind: "rms_norm", "layer_norm" or "l2_norm" (``F.normalize(s, dim=-1, eps=eps) * sqrt(N)``: eps
    clamps the row's L2 norm), over the last dim N. x, residual: (..., N) of
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
    norm_group: the statistics of each group of norm_group contiguous columns (Mamba2's
    group_size; the weight stays per column), with or without a gate.
    dropout: a :class:`~normfuse.kernels.specs.Dropout` (p, seed or generator) on x, before
    rowscale and x1. normfuse.kernels.dropout_keep_mask(x, p, seed) returns its mask.
    s exists (unless return_sum=False) whenever a residual or any mode forms a sum.
    quant: an :class:`~normfuse.kernels.specs.Fp8Quant`: y is also written as fp8 q with a scale;
    add_norm returns (q, scale, y, s), y None unless return_norm. q and scale are not
    differentiable; y and s are as without it. Not with weight1.
    gate: a :class:`~normfuse.kernels.specs.Gate` (Mamba2 / NemotronH, Qwen3-Next, Kimi-Linear).
    Differentiable in x, residual, weight, bias and the gate. Not with weight1 or quant.
    x_gate: a gated residual branch, s = residual + x * x_gate (diffusion transformers'
    ``hidden_states + gate.unsqueeze(1) * attn_output``), x_gate broadcasting to x (per sample or per
    token); the product rounded as eager's. Differentiable. With x1 (of the product's dtype): (x * x_gate + x1)
    + residual. Not with rowscale, dropout, gate or quant.
    modulation: a :class:`~normfuse.kernels.specs.Modulation` (diffusion transformers' adaLN: y * scale +
    shift, per sample or per token): y is then the modulated output; with its scale1 / shift1 the same
    y modulated a second time is returned as y1 (y, y1, s). Differentiable in scale and
    shift. Not with gate, weight1 or quant.

    Deprecated (one release): the flat keywords gate=<tensor>, gate_position, gate_activation,
    gate_out_dtype, quant_dtype and the other quant_*, dropout_p, seed, generator. They warn
    (FutureWarning) and map onto the specs; mixing them with the spec of their group raises.
    The rewritten graphs' calls, flat until they call fused_add_norm, do not warn.
    """
    if flat or (gate is not None and not isinstance(gate, Gate)):
        gate, quant, dropout = _from_flat(flat, gate, quant, dropout)
    for name, value, spec in (("gate", gate, Gate), ("quant", quant, Fp8Quant), ("dropout", dropout, Dropout),
                              ("modulation", modulation, Modulation)):
        if value is not None and not isinstance(value, spec):
            raise InvalidOptionError(f"add_norm({name}=...) takes a normfuse.kernels.{spec.__name__} or None; got "
                                     f"{type(value).__name__}.")
    if modulation is not None and modulation.scale is None and modulation.shift is None:
        modulation.check(x)  # raises: it modulates nothing
    options = {}
    for spec in (gate, quant, dropout, modulation):
        if spec is not None:
            options.update(spec.kernel_args())
    return fused_add_norm(x, residual, weight, bias, kind=kind, eps=eps, weight_offset=weight_offset,
                          residual_scale=residual_scale, sum_dtype=sum_dtype, norm_round_dtype=norm_round_dtype,
                          out_dtype=out_dtype, return_sum=return_sum, round_sum_first=round_sum_first, x1=x1,
                          rowscale=rowscale, weight1=weight1, bias1=bias1, norm_group=norm_group,
                          return_norm=return_norm, x_gate=x_gate, **options)


def _from_flat(flat: dict, gate, quant, dropout):
    """The specs the deprecated flat keywords stand for (a FutureWarning per group used)."""
    unknown = [name for name in flat if name not in _FLAT]
    if unknown:
        known = sorted(_PLAIN | set(_FLAT) | {"gate", "quant", "dropout", "modulation"})
        raise InvalidOptionError(f"add_norm got an unexpected keyword {unknown[0]}={flat[unknown[0]]!r}."
                                 + closest(unknown[0], known))
    fields: dict[str, dict] = {"gate": {}, "quant": {}, "dropout": {}}
    for name, value in flat.items():
        fields[_FLAT[name][0]][_FLAT[name][2]] = value
    if isinstance(gate, Tensor):
        fields["gate"]["z"] = gate
        gate = None
    given = {"gate": gate, "quant": quant, "dropout": dropout}
    specs = {"gate": Gate, "quant": Fp8Quant, "dropout": Dropout}
    # traced by dynamo: nothing warns (and frames are not walked); eager calls warn at their caller
    frame, level = _caller() if not torch.compiler.is_compiling() else (None, 1)
    warn = frame is not None and not _in_graph_code(frame)
    for group, values in fields.items():
        if not values:
            continue
        spec = specs[group]
        flat_names = [name for name in (*(("gate",) if "z" in values else ()), *flat)
                      if name == "gate" or _FLAT[name][0] == group]
        values = {name: values[name] for name in _FIELDS[spec] if name in values}  # in the spec's order
        if given[group] is not None:
            raise InvalidOptionError(
                f"add_norm got {group}={spec.__name__}(...) and the flat keyword(s) {', '.join(flat_names)} of the "
                f"same options; pass them inside {spec.__name__}(...) only (e.g. {group}={spec.__name__}("
                f"{', '.join(f'{field}=...' for field in values)})).")
        if warn:
            warnings.warn(f"add_norm({', '.join(f'{name}=...' for name in flat_names)}) is deprecated; pass "
                          f"{group}={spec.__name__}({', '.join(f'{field}=...' for field in values)})",
                          FutureWarning, stacklevel=level)
        given[group] = _spec_of(group, spec, values)
    return given["gate"], given["quant"], given["dropout"]


def _spec_of(group: str, spec, values: dict):
    """The spec for the flat values, None where the old keywords meant "off" (no gate tensor,
    quant_dtype None, dropout_p 0 without a seed or generator)."""
    if group == "gate" and values.get("z") is None:
        return None
    if group == "quant" and values.get("dtype") is None:
        return None
    if group == "dropout":
        values = {"p": 0.0, **values}
        off = (values.get("seed") is None and values.get("generator") is None
               and type(values["p"]) in (float, int) and values["p"] == 0)
        if off:
            return None
    return spec(**values)


def _caller() -> tuple:
    """(the first frame outside this module, its stacklevel for warnings.warn from _from_flat):
    the user's call, through add_norm or a shorthand (add_rms_norm, ...)."""
    frame, level = sys._getframe(1), 1  # _from_flat
    while frame is not None and frame.f_code.co_filename == __file__:
        frame, level = frame.f_back, level + 1
    return frame, level


def _in_graph_code(frame) -> bool:
    """Whether the caller is the code torch.fx generated for a GraphModule: a graph rewritten by
    normfuse 0.1 calls add_norm with the flat keywords (the rewrite now calls fused_add_norm); a
    model loaded with such a graph is not the user's call to change."""
    return frame.f_code.co_filename.startswith("<eval_with_key>")


def _check_x_gate(x, x_gate, x1, rowscale, dropout_p, gate, quant_dtype) -> None:
    """A gated residual branch: a tensor broadcasting to x; with x1 (``(x * x_gate + x1) + residual``: SD3.5's
    two gated branches, one summed with the stream first) of the product's dtype; not with the other modes."""
    check_operand("x_gate", x_gate, x)
    check_broadcast("x_gate", x_gate, x)
    if rowscale is not None or dropout_p or gate is not None or quant_dtype is not None:
        raise InvalidOptionError("x_gate (a gated residual branch, x * x_gate) cannot be combined with rowscale, "
                                 "dropout, gate or quant_dtype yet; gate the branch before add_norm.")
    product = torch.promote_types(x.dtype, x_gate.dtype)
    if x1 is not None and x1.dtype != product:
        raise InvalidOptionError(f"x1 is {x1.dtype} and x * x_gate is {product}: with x_gate, x1 must have the "
                                 "product's dtype (the kernels round the product and its sum with x1 to it); cast x1.")


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
