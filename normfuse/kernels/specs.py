"""What the fused calls take and return, stated once.

Outputs. ``OP_OUTPUTS`` names each ``torch.ops.normfuse`` op's outputs in order; the functional
API's tuples are ``api_outputs(...)`` (``add_norm``) and ``NORM_ADD_OUTPUTS``. Everything that
indexes an output (the autograd formulas in ops.py, the rewrite, the checker) asks here::

    OP_OUTPUTS["add_norm_fwd"]            == ("y", "s", "mean", "rstd", "y1")
    api_outputs(second_norm=True)         == ("y", "y1", "s")
    api_index("scale", quantized=True)    == 1

Arguments. ``op_arguments(op)`` and ``op_defaults(op)`` are read from the op's declaration in
``normfuse.kernels.declarations``; ``bind(op, inputs)`` names an op call's inputs,
``call_of(op, inputs)`` groups them into the op's call (``AddNormCall``, ``BackwardCall``, ...:
what the kernel, the fake, the reference and the Triton launcher take), and
``op_gradients(op, grads)`` turns {argument name: gradient} into the tuple an autograd formula
returns, in the schema's order. No argument position is counted by hand.

Groups of ``add_norm``'s options, frozen dataclasses that are also the kernel-facing argument
group (``kernel_args()`` gives the flat keywords of ``fused_add_norm`` each stands for)::

    Gate(z, position="before", activation="silu", out_dtype=None)
    Fp8Quant(dtype=torch.float8_e4m3fn, scale=None, group=None, scale_form="amax/max", amax_min=None,
             scale_min=None, apply="div", clamp=None, scale_out="scale")
    Dropout(p, seed=None, generator=None)

Each validates its own values when built (``__post_init__``); Gate and Fp8Quant also against x
with ``check(x)`` (shapes, devices, dtypes a device takes). The error messages name the flat keywords, which the
rewritten graphs still spell.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import typing
from typing import Any, Optional

import torch
from torch import Tensor

from normfuse.errors import InvalidOptionError, ShapeMismatchError, UnsupportedDtypeError, closest
from normfuse.kernels.declarations import DECLARATIONS, NAMESPACE, REQUIRED, schema as _schema_text
from normfuse.vocabulary import KERNEL_DTYPES
from normfuse.vocabulary import (GATE_ACTIVATIONS, GATE_POSITIONS, QUANT_APPLY, QUANT_DTYPES, QUANT_SCALE_FORMS,
                                 QUANT_SCALE_OUT)

__all__ = ["OP_OUTPUTS", "NORM_ADD_OUTPUTS", "GRADIENT_OF", "api_outputs", "api_index", "op_arguments",
           "op_defaults", "op_output_index", "bind", "call_of", "op_gradients", "Gate", "Fp8Quant", "Dropout", "SPECS",
           "Rows", "Norm", "Rounding", "Store", "SecondNorm", "DropoutMask", "Grads", "Saved", "GradDtypes", "Linears",
           "QkRows", "Rope", "QkNorm", "stores_mean",
           "Modulation", "XGate", "QkRounding", "AddNormCall", "NormAddCall", "BackwardCall", "KeepMaskCall",
           "NormLinearsCall", "QkNormRopeCall", "QkNormRopeBackwardCall"]


# --------------------------------------------------------------------------------------
# Outputs
# --------------------------------------------------------------------------------------

# Each op's outputs, in order (declared with the op; tests/test_declarations.py checks them against the schema).
OP_OUTPUTS: dict[str, tuple[str, ...]] = {name: op.outputs for name, op in DECLARATIONS.items()}

# add_norm_bwd's outputs -> the forward argument each is the gradient of
GRADIENT_OF: dict[str, str] = {"dx": "x", "dresidual": "residual", "dweight": "weight", "dbias": "bias",
                               "dx1": "x1", "dweight1": "weight1", "dbias1": "bias1", "dgate": "gate",
                               "dmod_scale": "mod_scale", "dmod_shift": "mod_shift", "dx_gate": "x_gate",
                               "dmod1_scale": "mod1_scale", "dmod1_shift": "mod1_shift"}

# what norm_add returns
NORM_ADD_OUTPUTS: tuple[str, ...] = ("out", "y")


def api_outputs(second_norm: bool = False, quantized: bool = False) -> tuple[str, ...]:
    """The names of what ``add_norm`` returns, in order: (y, s); (y, y1, s) with a second norm
    (weight1) or a second modulation (Modulation.scale1 / shift1); (q, scale, y, s) with the fp8 epilogue (y None unless return_norm, s None without a
    sum or with return_sum=False). The two do not combine."""
    if second_norm and quantized:
        raise InvalidOptionError("add_norm has no output layout for a second norm (weight1) with the fp8 epilogue "
                                 "(quant): the epilogue quantizes the one norm output y.")
    if quantized:
        return ("q", "scale", "y", "s")
    return ("y", "y1", "s") if second_norm else ("y", "s")


def api_index(name: str, second_norm: bool = False, quantized: bool = False) -> int:
    """Where output ``name`` is in the tuple ``add_norm`` returns (see api_outputs)."""
    names = api_outputs(second_norm, quantized)
    if name not in names:
        raise InvalidOptionError(f"add_norm(second_norm={second_norm}, quantized={quantized}) returns {names}; it "
                                 f"has no output {name!r}." + closest(str(name), names))
    return names.index(name)


def op_output_index(op: str, name: str) -> int:
    """Where output ``name`` is among the outputs of ``torch.ops.normfuse.<op>``."""
    names = _outputs_of(op)
    if name not in names:
        raise InvalidOptionError(f"{NAMESPACE}::{op} returns {names}; it has no output {name!r}."
                                 + closest(str(name), names))
    return names.index(name)


def _outputs_of(op: str) -> tuple[str, ...]:
    if op not in OP_OUTPUTS:
        raise InvalidOptionError(f"{op!r} is not a {NAMESPACE} op with named outputs; the ops are "
                                 f"{tuple(OP_OUTPUTS)}." + closest(str(op), OP_OUTPUTS))
    return OP_OUTPUTS[op]


# --------------------------------------------------------------------------------------
# Arguments, from the schemas
# --------------------------------------------------------------------------------------

@functools.cache
def _schema(op: str) -> "torch._C.FunctionSchema":
    if op not in DECLARATIONS:
        raise InvalidOptionError(f"{op!r} is not declared in normfuse/kernels/declarations.py; the ops are "
                                 f"{tuple(DECLARATIONS)}." + closest(str(op), DECLARATIONS))
    return torch._C.parse_schema(f"{NAMESPACE}::{op}{_schema_text(op)}")


@functools.cache
def op_arguments(op: str) -> tuple[str, ...]:
    """The argument names of ``torch.ops.normfuse.<op>``, in the schema's order."""
    return tuple(a.name for a in _schema(op).arguments)


@functools.cache
def op_defaults(op: str) -> dict[str, Any]:
    """The arguments of ``op`` that have a default in the schema, with it."""
    return {a.name: a.default_value for a in _schema(op).arguments if a.has_default_value()}


@functools.cache
def _trailing_defaults(op: str) -> tuple[tuple, int]:
    """(the defaults of the trailing arguments that have one, where they begin)."""
    names, defaults = op_arguments(op), op_defaults(op)
    first = len(names)
    while first > 0 and names[first - 1] in defaults:
        first -= 1
    return tuple(defaults[n] for n in names[first:]), first


def bind(op: str, inputs: tuple) -> dict[str, Any]:
    """{argument name: value} of one call of ``op`` with positional ``inputs`` (what
    setup_context gets: trailing arguments with a default may be omitted)."""
    names = op_arguments(op)
    defaults, first = _trailing_defaults(op)
    if not first <= len(inputs) <= len(names):
        raise InvalidOptionError(f"{NAMESPACE}::{op} takes {first} to {len(names)} arguments {names}; got "
                                 f"{len(inputs)}.")
    return dict(zip(names, (*inputs, *defaults[len(inputs) - first:])))


@functools.cache
def _gradient_slots(op: str) -> dict[str, int]:
    return {name: i for i, name in enumerate(op_arguments(op))}


def op_gradients(op: str, grads: dict[str, Optional[Tensor]]) -> tuple:
    """The tuple ``op``'s autograd formula returns: grads[name] at each argument's place, None for
    the arguments not in ``grads``."""
    slots = _gradient_slots(op)
    out = [None] * len(slots)
    for name, grad in grads.items():
        if name not in slots:
            raise InvalidOptionError(f"{NAMESPACE}::{op} has no argument {name!r} to return a gradient for; its "
                                     f"arguments are {tuple(slots)}." + closest(str(name), slots))
        out[slots[name]] = grad
    return tuple(out)


# --------------------------------------------------------------------------------------
# Shared by the checks (ops.py imports them)
# --------------------------------------------------------------------------------------

# Activation, weight and rounding dtypes the fused ops take (normfuse/vocabulary.py). fp64
# runs on CPU only, through the reference (gradcheck needs it).
SUPPORTED_DTYPES = KERNEL_DTYPES
CPU_ONLY_DTYPES = (torch.float64,)


def dtype_names(dtypes) -> str:
    return ", ".join(str(d) for d in dtypes)


SUPPORTED_TEXT = dtype_names(SUPPORTED_DTYPES) + " (and torch.float64 on CPU)"


def dtypes_on(device: torch.device) -> tuple:
    return SUPPORTED_DTYPES + (CPU_ONLY_DTYPES if device.type == "cpu" else ())


def describe(value) -> str:
    if isinstance(value, Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)} on {value.device}"
    if isinstance(value, torch.Generator):
        return f"a torch.Generator on {value.device}"
    return type(value).__name__


def check_operand(name: str, t, x: Tensor) -> None:
    """A tensor operand of an op (given, not None): a tensor of a dtype the ops take, on x's device."""
    if not isinstance(t, Tensor):
        raise InvalidOptionError(f"{name} must be a tensor or None; got {describe(t)}.")
    if t.dtype not in dtypes_on(x.device):
        raise UnsupportedDtypeError(f"{name} has dtype {t.dtype} on {t.device}; the fused add+norm ops take "
                                    f"{SUPPORTED_TEXT}. Cast it first, e.g. {name.split()[-1]}.to(torch.float32).")
    if t.device != x.device:
        raise InvalidOptionError(f"{name} is on {t.device} but x is on {x.device}; move them to one device.")


def _largest_pow2_divisor(n: int) -> int:
    return min(n & -n, 128)


def _check_choice(name: str, value, choices, what: str) -> None:
    if value not in choices:
        raise InvalidOptionError(f"{name}={value!r} is not one {what}; use one of {choices}."
                                 + closest(str(value), choices))


# --------------------------------------------------------------------------------------
# The grouped options of add_norm
# --------------------------------------------------------------------------------------
# eq=False: the fields hold tensors, whose == is elementwise.

@dataclasses.dataclass(frozen=True, eq=False)
class Gate:
    """A gated norm (Mamba2 / NemotronH, Qwen3-Next, Kimi-Linear): z, x's shape, multiplies by
    activation(z) in fp32 the norm input ("before": then the norm of the unrounded product) or the
    norm output ("after": y0 rounded as usual, then round(out_dtype, y0 * act(z)); out_dtype
    defaults to add_norm's out_dtype). Differentiable in z."""
    z: Tensor
    position: str = "before"
    activation: str = "silu"
    out_dtype: Optional[torch.dtype] = None

    def __post_init__(self):
        _check_choice("gate_position", self.position, GATE_POSITIONS, "the gated norm computes")
        _check_choice("gate_activation", self.activation, GATE_ACTIVATIONS, "the gated norm computes")

    def check(self, x: Tensor) -> None:
        """The checks against x (shape, dtype, device)."""
        gate = self.z
        if not isinstance(gate, Tensor):
            raise InvalidOptionError(f"gate must be a tensor of x's shape or None; got {describe(gate)}.")
        if gate.shape != x.shape:
            raise ShapeMismatchError(f"gate has shape {tuple(gate.shape)} but x has shape {tuple(x.shape)}; the gate "
                                     f"multiplies x elementwise, so it must have x's shape.")
        if gate.dtype not in dtypes_on(x.device):
            raise UnsupportedDtypeError(f"gate has dtype {gate.dtype}; the fused ops take {SUPPORTED_TEXT}. Cast it "
                                        f"first, e.g. gate.to(x.dtype).")
        if gate.device != x.device:
            raise InvalidOptionError(f"gate is on {gate.device} but x is on {x.device}; move them to one device.")
        if self.out_dtype is not None and self.out_dtype not in dtypes_on(x.device):
            raise UnsupportedDtypeError(f"gate_out_dtype={self.out_dtype} is not a dtype the fused ops round to; use "
                                        f"one of {SUPPORTED_TEXT}.")

    def kernel_args(self) -> dict[str, Any]:
        """The flat keywords of fused_add_norm (and the add_norm_fwd arguments) it stands for."""
        return {"gate": self.z, "gate_position": self.position, "gate_activation": self.activation,
                "gate_out_dtype": self.out_dtype}


@dataclasses.dataclass(frozen=True, eq=False)
class Fp8Quant:
    """The fp8 quantization epilogue: y is also written as q in ``dtype`` (torch.float8_e4m3fn or
    torch.float8_e5m2) with a scale, for an fp8 linear to read; add_norm then returns
    (q, scale, y or None, s). The exact steps are in normfuse.kernels.reference.

    scale: a static per-tensor scale (a 1-element fp32 tensor, returned as scale); None: a dynamic
    scale from the amax of each row's rounded y, or of each group of ``group`` columns (a power of
    two dividing N). scale_form: "amax/max", "max/amax" or "max*(1/amax)". amax_min, scale_min:
    lower clamps of amax and of the scale. apply: q = y / scale ("div"), y * scale ("mul") or
    y * (1 / scale) ("mul_reciprocal"). clamp: clamp to [-c, c] before the cast. scale_out:
    return the scale ("scale") or its reciprocal ("reciprocal")."""
    dtype: torch.dtype = torch.float8_e4m3fn
    scale: Optional[Tensor] = None
    group: Optional[int] = None
    scale_form: str = "amax/max"
    amax_min: Optional[float] = None
    scale_min: Optional[float] = None
    apply: str = "div"
    clamp: Optional[float] = None
    scale_out: str = "scale"

    def __post_init__(self):
        if self.dtype not in QUANT_DTYPES:
            raise UnsupportedDtypeError(f"quant_dtype={self.dtype!r} is not an fp8 dtype the epilogue writes; use one "
                                        f"of {dtype_names(QUANT_DTYPES)} (or quant_dtype=None for no quantization).")
        for name, value, choices in (("quant_scale_form", self.scale_form, QUANT_SCALE_FORMS),
                                     ("quant_apply", self.apply, QUANT_APPLY),
                                     ("quant_scale_out", self.scale_out, QUANT_SCALE_OUT)):
            _check_choice(name, value, choices, "the epilogue computes")
        for name, value in (("quant_amax_min", self.amax_min), ("quant_scale_min", self.scale_min),
                            ("quant_clamp", self.clamp)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not math.isfinite(value) or value <= 0):
                raise InvalidOptionError(f"{name}={value!r} must be a finite number > 0, or None for no clamp "
                                         f"(e.g. quant_amax_min=1e-12, quant_clamp=448.0).")
        if self.scale is not None:
            dynamic_only = [f"{name}={value!r}" for name, value, default in (
                ("quant_group", self.group, None), ("quant_scale_form", self.scale_form, "amax/max"),
                ("quant_amax_min", self.amax_min, None), ("quant_scale_min", self.scale_min, None),
                ("quant_scale_out", self.scale_out, "scale")) if value != default]
            if dynamic_only:
                raise InvalidOptionError(f"{', '.join(dynamic_only)} shape a dynamic scale, but quant_scale gives a "
                                         f"static one; drop them, or pass quant_scale=None to compute the scale from "
                                         f"each row's (or group's) amax.")
        group = self.group
        if group is not None and (isinstance(group, bool) or not isinstance(group, int) or group <= 0
                                  or group & (group - 1)):
            raise InvalidOptionError(f"quant_group={group!r} must be a power of two (e.g. 64 or 128: one scale "
                                     f"per group of that many columns), or None for one scale per row.")

    def check(self, x: Tensor) -> None:
        """The checks against x (the static scale's tensor, the group dividing N)."""
        scale = self.scale
        if scale is not None:
            if not (isinstance(scale, Tensor) and scale.numel() == 1 and scale.dtype == torch.float32):
                raise InvalidOptionError(f"quant_scale must be a static per-tensor scale, a 1-element fp32 tensor; "
                                         f"got {describe(scale)}. Pass e.g. torch.tensor([0.02], device=x.device), "
                                         f"or quant_scale=None for a dynamic scale.")
            if scale.device != x.device:
                raise InvalidOptionError(f"quant_scale is on {scale.device} but x is on {x.device}; move it to "
                                         f"x's device.")
            if scale.requires_grad and torch.is_grad_enabled():
                raise InvalidOptionError("quant_scale requires grad, but the quantization is not differentiated; "
                                         "pass quant_scale.detach().")
        n_cols = x.shape[-1]
        if self.group is not None and n_cols % self.group:
            raise ShapeMismatchError(f"quant_group={self.group} does not divide the normalized dim N={n_cols}; "
                                     f"pass a group size that divides it (e.g. {_largest_pow2_divisor(n_cols)}), or "
                                     f"quant_group=None for one scale per row.")

    def kernel_args(self) -> dict[str, Any]:
        """The flat keywords of fused_add_norm it stands for (add_norm_quant_fwd's quant_* arguments)."""
        return {"quant_dtype": self.dtype, "quant_scale": self.scale, "quant_group": self.group,
                "quant_scale_form": self.scale_form, "quant_amax_min": self.amax_min,
                "quant_scale_min": self.scale_min, "quant_apply": self.apply, "quant_clamp": self.clamp,
                "quant_scale_out": self.scale_out}


@dataclasses.dataclass(frozen=True, eq=False)
class Dropout:
    """Dropout on x (before rowscale and x1), scaled by 1 / (1 - p), p in [0, 1). The mask is
    regenerated from a seed in the backward, never stored. seed: an int or an int64 CPU tensor of
    shape () (reproducible); without one a seed is drawn from ``generator`` (a CPU
    torch.Generator; default: torch's). The reference (CPU) and Triton backends draw different
    masks from one seed."""
    p: float
    seed: Any = None
    generator: Optional[torch.Generator] = None

    def __post_init__(self):
        p, seed, generator = self.p, self.seed, self.generator
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p < 1.0:
            raise InvalidOptionError(f"dropout_p={p!r} must be a number in [0, 1) (0 disables dropout; "
                                     f"p = 1 would drop every element).")
        if generator is not None and not (isinstance(generator, torch.Generator) and generator.device.type == "cpu"):
            raise InvalidOptionError(f"generator must be a CPU torch.Generator (the seed is drawn on the CPU, so the "
                                     f"kernels need no device sync); got {describe(generator)}. Pass "
                                     f"torch.Generator().manual_seed(...) or a seed.")
        if seed is not None and generator is not None:
            raise InvalidOptionError("pass either seed (a reproducible mask) or generator (a seed drawn from it), "
                                     "not both.")
        if seed is not None and not isinstance(seed, int) and not (
                isinstance(seed, Tensor) and seed.dtype == torch.int64 and seed.dim() == 0
                and seed.device.type == "cpu"):
            raise InvalidOptionError(f"seed must be an int or an int64 CPU tensor of shape () (it is read once, "
                                     f"without a device sync); got {describe(seed)}. Pass e.g. "
                                     f"torch.tensor(1234), or seed=None to draw one.")

    def kernel_args(self) -> dict[str, Any]:
        """The flat keywords of fused_add_norm it stands for (nothing depends on x: the values
        were checked when the spec was built)."""
        return {"dropout_p": self.p, "seed": self.seed, "generator": self.generator}




# --------------------------------------------------------------------------------------
# The ops' calls: each op's arguments, grouped (declarations.py says which argument goes where)
# --------------------------------------------------------------------------------------
# Built once per op call from the flat arguments (call_of) and read, never changed, by the kernel,
# the fake, the reference and the Triton launcher. slots, not frozen: a call is built on every op
# call, and a frozen dataclass's __init__ costs a setattr per field.

_group = dataclasses.dataclass(slots=True, eq=False)


@_group
class Rows:
    """The rows the op reads and sums: s = b + residual_scale * residual, b = x after its branch modes
    (x_gate: x * x_gate first, a gated residual branch, x_gate broadcastable to x; rowscale per row,
    x1 added; dropout is its own group)."""
    x: Optional[Tensor] = None
    residual: Optional[Tensor] = None
    residual_scale: float = 1.0
    x1: Optional[Tensor] = None
    rowscale: Optional[Tensor] = None
    x_gate: Optional[Tensor] = None


@_group
class Norm:
    """The norm: kind ("rms_norm" / "layer_norm" / "l2_norm"), its parameters (w' = weight + weight_offset),
    eps, and group (statistics per group of that many columns; None: the whole row)."""
    kind: str = "rms_norm"
    weight: Optional[Tensor] = None
    bias: Optional[Tensor] = None
    eps: float = 0.0
    weight_offset: float = 0.0
    group: Optional[int] = None


def stores_mean(kind: str) -> bool:
    """Whether a norm keeps a first statistic per row beside rstd: layer_norm its row mean, l2_norm its
    row's L2 norm where that is at least eps and 0 where eps clamps it (no gradient flows through a
    clamped norm); rms_norm none (an empty tensor)."""
    return kind != "rms_norm"


@_group
class Rounding:
    """Where the graph rounded: the sum (sum_dtype, before the norm unless round_sum_first is False),
    the normalized value (norm_round_dtype: "round then multiply"; None: "multiply then round"), y."""
    sum_dtype: Optional[torch.dtype] = None
    norm_round_dtype: Optional[torch.dtype] = None
    out_dtype: Optional[torch.dtype] = None
    round_sum_first: bool = True


@_group
class Store:
    """Which optional outputs are written: the sum s (norm_add: out, always), the norm output y."""
    sum: bool = True
    y: bool = True


@_group
class SecondNorm:
    """A second norm of the same statistics with its own parameters: y1 (backward: weight only)."""
    weight: Tensor
    bias: Optional[Tensor] = None


@_group
class DropoutMask:
    """Dropout on x: p > 0, and the seed (an int64 CPU tensor of shape ()) its mask is drawn from."""
    p: float
    seed: Optional[Tensor] = None


@_group
class Modulation:
    """adaLN modulation of the norm output y (diffusion transformers): m = y * scale + shift, each a
    tensor broadcastable to x (per sample (B, 1, N), per token (B, S, N), or (N,)), or None. scale
    is the factor as the graph computed it (``1 + scale`` in DiT, Flux, Wan). Rounded to ``dtype``
    after each op (default: the promoted dtype of y, scale and shift), once with ``fused``
    (``addcmul``), then to ``out_dtype`` (Wan's ``.type_as(x)``; default: dtype). ``scale1`` and
    ``shift1``: a second modulation of the same y with the same modes, returned as y1 (SD3.5's
    AdaLayerNormZeroX modulates one norm's output twice). ``one_plus``: the scales are given without
    the 1, the factor is ``1 + scale`` rounded to scale's dtype (as the graph's add rounds it; a per-token
    scale then costs no pass of its own)."""
    scale: Optional[Tensor] = None
    shift: Optional[Tensor] = None
    dtype: Optional[torch.dtype] = None
    fused: bool = False
    out_dtype: Optional[torch.dtype] = None
    scale1: Optional[Tensor] = None
    shift1: Optional[Tensor] = None
    one_plus: bool = False

    ON_WHEN = ("scale", "shift")  # on when either is given

    @property
    def operands(self) -> tuple[Optional[Tensor], ...]:
        """(scale, shift, scale1, shift1): the tensors it reads, in the kernels' order (None: absent)."""
        return self.scale, self.shift, self.scale1, self.shift1

    @property
    def twice(self) -> bool:
        """Whether y is modulated a second time (y1)."""
        return self.scale1 is not None or self.shift1 is not None

    def second(self) -> "Modulation":
        """The second modulation as one of its own (the same modes)."""
        return Modulation(self.scale1, self.shift1, self.dtype, self.fused, self.out_dtype, one_plus=self.one_plus)

    def check(self, x: Tensor) -> None:
        """The functional API's checks against x (the op's fake checks the shapes only)."""
        if self.scale is None and self.shift is None:
            raise InvalidOptionError("Modulation(scale=None, shift=None) modulates nothing; pass a scale, a shift or "
                                     "both (or modulation=None).")
        if self.twice and ((self.scale1 is None) != (self.scale is None) or (self.shift1 is None) != (self.shift is None)):
            raise InvalidOptionError("the second modulation (scale1, shift1) takes the steps of the first: give "
                                     "scale1 with scale and shift1 with shift, or modulate y1 separately.")
        for first, second in ((self.scale, self.scale1), (self.shift, self.shift1)):
            if self.twice and first is not None and second.dtype != first.dtype:
                raise InvalidOptionError(f"the second modulation rounds as the first: scale1 and shift1 must have "
                                         f"the dtypes of scale and shift ({first.dtype}); got {second.dtype}. Cast "
                                         f"them, or modulate y1 separately.")
        ok = dtypes_on(x.device)
        for name, t in (("Modulation scale", self.scale), ("Modulation shift", self.shift),
                        ("Modulation scale1", self.scale1), ("Modulation shift1", self.shift1)):
            if t is not None:
                check_operand(name, t, x)
        for name, dtype in (("dtype", self.dtype), ("out_dtype", self.out_dtype)):
            if dtype is not None and dtype not in ok:
                raise UnsupportedDtypeError(f"Modulation {name}={dtype} is not a dtype the fused ops round to; use "
                                            f"one of {SUPPORTED_TEXT}.")

    def kernel_args(self) -> dict[str, Any]:
        """The flat keywords of fused_add_norm (and the add_norm_fwd arguments) it stands for."""
        return {"mod_scale": self.scale, "mod_shift": self.shift, "mod_dtype": self.dtype,
                "mod_fused": bool(self.fused), "mod_out_dtype": self.out_dtype, "mod1_scale": self.scale1,
                "mod1_shift": self.shift1, "mod_one_plus": bool(self.one_plus)}


@_group
class XGate:
    """The backward of a gated residual branch b = x * gate: the gate and the ungated x."""
    gate: Tensor
    x: Optional[Tensor] = None


@_group
class Grads:
    """The incoming gradients: dy (of y; norm_add: of out), dextra (of s; norm_add: of y), dy1 (of y1)."""
    dy: Tensor
    dextra: Optional[Tensor] = None
    dy1: Optional[Tensor] = None


@_group
class Saved:
    """What the forward saved: the norm input and its flat per-row (per-group) statistics."""
    inp: Tensor
    mean: Tensor
    rstd: Tensor


@_group
class GradDtypes:
    """The dtype of each input gradient (None: that input does not exist)."""
    x: torch.dtype
    residual: Optional[torch.dtype] = None
    bias: Optional[torch.dtype] = None
    x1: Optional[torch.dtype] = None
    bias1: Optional[torch.dtype] = None


@_group
class Linears:
    """The linears that read one norm output: their weights, biases (present where has_bias)."""
    weights: list
    biases: list
    has_bias: list


@_group
class QkRows:
    """One of q and k: its rows (B, S, H, D), its norm weight and bias; backward: the output's gradient,
    the rstd."""
    x: Tensor
    weight: Optional[Tensor] = None
    dout: Optional[Tensor] = None
    rstd: Optional[Tensor] = None
    bias: Optional[Tensor] = None


@_group
class Rope:
    """The rotary embedding: cos/sin tables, layout ("neox" / "gptj"), rotary_dim rotated columns."""
    cos: Tensor
    sin: Tensor
    layout: str = "neox"
    rotary_dim: int = 0


@_group
class QkNorm:
    """The q/k norm: eps, weight_offset, full_width (the norm over the whole row, not per head), kind
    ("rms_norm" or "layer_norm")."""
    eps: float = 0.0
    weight_offset: float = 0.0
    full_width: bool = False
    kind: str = "rms_norm"


@_group
class QkRounding:
    """Where qk_norm_rope rounds: n (norm_round_dtype), the norm output, the rope's steps, the output."""
    norm_round_dtype: Optional[torch.dtype] = None
    norm_out_dtype: Optional[torch.dtype] = None
    rope_dtype: Optional[torch.dtype] = None
    out_dtype: Optional[torch.dtype] = None


@_group
class AddNormCall:
    """add_norm_fwd and add_norm_quant_fwd: the optional groups are None when off."""
    rows: Rows
    norm: Norm
    rounding: Rounding
    store: Store
    second: Optional[SecondNorm] = None
    dropout: Optional[DropoutMask] = None
    gate: Optional[Gate] = None
    quant: Optional[Fp8Quant] = None
    modulation: Optional[Modulation] = None


@_group
class NormAddCall:
    """norm_add_fwd: out = round(rounding.sum_dtype, residual_scale * residual + y)."""
    rows: Rows
    norm: Norm
    rounding: Rounding
    store: Store


@_group
class BackwardCall:
    """add_norm_bwd, the backward of both orders (add_after_norm: norm_add's)."""
    grads: Grads
    saved: Saved
    norm: Norm
    dtypes: GradDtypes
    residual_scale: float = 1.0
    add_after_norm: bool = False
    rowscale: Optional[Tensor] = None
    second: Optional[SecondNorm] = None
    dropout: Optional[DropoutMask] = None
    gate: Optional[Gate] = None
    modulation: Optional[Modulation] = None
    x_gate: Optional[XGate] = None


@_group
class KeepMaskCall:
    """dropout_keep_mask: the keep mask of x's shape for p and seed (on_reference: that backend's)."""
    x: Tensor
    p: float
    seed: Tensor
    on_reference: bool = False


@_group
class NormLinearsCall:
    """norm_linears: the linears reading y, whose backward rebuilds y from inp."""
    y: Tensor
    inp: Tensor
    norm: Norm
    linears: Linears
    rounding: Rounding


@_group
class QkNormRopeCall:
    """qk_norm_rope_fwd (k None: q only)."""
    q: QkRows
    k: Optional[QkRows]
    rope: Rope
    norm: QkNorm
    rounding: QkRounding
    transpose_out: bool = False


@_group
class QkNormRopeBackwardCall:
    """qk_norm_rope_bwd (k None: q only)."""
    q: QkRows
    k: Optional[QkRows]
    rope: Rope
    norm: QkNorm


# add_norm's grouped options (a call with one of them is recorded by torch.fx with the tensors inside)
SPECS = (Gate, Fp8Quant, Dropout, Modulation)

CALLS = {cls.__name__: cls for cls in (AddNormCall, NormAddCall, BackwardCall, KeepMaskCall, NormLinearsCall,
                                       QkNormRopeCall, QkNormRopeBackwardCall)}


def _absent(value) -> bool:
    """An optional group is off when its first field is None (or a zero probability: dropout)."""
    return value is None or (type(value) in (int, float) and value == 0)


@functools.cache
def _call_plan(op: str) -> tuple:
    """(the call type, [(group field, group type or None, [(group's field, argument index)])]) of ``op``."""
    declaration = DECLARATIONS[op]
    call_type = CALLS[declaration.call]
    hints = typing.get_type_hints(call_type)
    groups: dict[str, list] = {}
    for index, arg in enumerate(declaration.args):
        group, _, field = arg.to.rpartition(".")
        groups.setdefault(group or field, []).append((field if group else None, index))
    plan = []
    for name, fields in groups.items():
        hint = hints[name]
        group_type = next((t for t in typing.get_args(hint) if t is not type(None)), hint)
        if fields[0][0] is None:  # an argument that is a field of the call itself
            plan.append((name, None, fields))
        else:
            optional = type(None) in typing.get_args(hint)
            # the arguments that say whether the group is on (any of them given): its first field, or ON_WHEN
            on_when = getattr(group_type, "ON_WHEN", (dataclasses.fields(group_type)[0].name,))
            keys = tuple(index for field, index in fields if field in on_when) if optional else ()
            plan.append((name, (group_type, keys), fields))
    return call_type, tuple(plan)


def call_of(op: str, inputs: tuple):
    """The call of ``op`` with positional ``inputs`` (trailing defaults may be omitted): its
    arguments grouped as declarations.py says, an optional group None when off."""
    call_type, plan = _call_plan(op)
    defaults, first = _trailing_defaults(op)
    if len(inputs) < first + len(defaults):
        if len(inputs) < first:
            bind(op, inputs)  # raises, naming the arguments
        inputs = (*inputs, *defaults[len(inputs) - first:])
    parts = {}
    for name, group, fields in plan:
        if group is None:
            parts[name] = inputs[fields[0][1]]
            continue
        group_type, keys = group
        if keys and all(_absent(inputs[index]) for index in keys):
            parts[name] = None
        else:
            parts[name] = group_type(**{field: inputs[index] for field, index in fields})
    return call_type(**parts)


def _check_declarations() -> None:
    """Every op's call type holds each declared argument once (run by tests/test_declarations.py)."""
    for op, declaration in DECLARATIONS.items():
        call_type, plan = _call_plan(op)
        for name, group, fields in plan:
            names = {f.name for f in dataclasses.fields(group[0] if group else call_type)}
            missing = [field for field, _ in fields if (field or name) not in names]
            if missing:
                raise TypeError(f"{op}: {declaration.call}.{name} has no field {missing}")
        if any(a.default is not REQUIRED and a.default is None and "?" not in a.type for a in declaration.args):
            raise TypeError(f"{op}: a None default on an argument that is not optional")
