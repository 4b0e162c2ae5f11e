"""Each ``torch.ops.normfuse`` op declared once: its arguments, in the schema's order, and its outputs.

An argument is declared with its schema type, its default, and where it goes in the grouped value
the implementations receive (``"norm.weight"``: field ``weight`` of group ``norm``; a name with no
dot is a field of the call itself). From this one table come

* the schema string each op is registered with (``schema(op)``; saved programs call the op by it,
  so the order and the names are kept as they were first published),
* the op's grouped call (``normfuse.kernels.specs.call_of(op, args)``): the kernel, the fake, the
  reference backend and the Triton launcher each take that one value, never the flat list,
* the argument names, defaults and gradient slots the autograd formulas and the rewrite read.

``tests/test_declarations.py`` walks every op and checks the registered schema, the fake, the
reference and the launcher against this table. Adding an operand: one line here, a field in its
group (``specs.py``), then the kernel, the reference and the part that reads it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["Arg", "OpDeclaration", "DECLARATIONS", "REQUIRED", "schema", "NAMESPACE"]

NAMESPACE = "normfuse"


class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED: Any = _Required()


@dataclasses.dataclass(frozen=True)
class Arg:
    """One argument of an op: its name in the schema, its schema type, where it goes in the call
    (``group.field``, or ``field`` of the call), its default (REQUIRED: none)."""
    name: str
    type: str
    to: str
    default: Any = REQUIRED

    def schema_text(self) -> str:
        text = f"{self.type} {self.name}"
        if self.default is REQUIRED:
            return text
        if isinstance(self.default, str):
            return f'{text}="{self.default}"'
        return f"{text}={self.default}"


@dataclasses.dataclass(frozen=True)
class OpDeclaration:
    """An op: its arguments, its outputs (names), the schema's return type, the module that
    implements it (imported on the op's first use), the name of its call type in specs.py, and the
    backends' functions that take that call ("module:function"; None where the op has none)."""
    name: str
    args: tuple[Arg, ...]
    outputs: tuple[str, ...]
    returns: str
    module: str
    call: str
    reference: str | None = None
    launcher: str | None = None

    @property
    def arg_names(self) -> tuple[str, ...]:
        return tuple(a.name for a in self.args)


def _args(*rows) -> tuple[Arg, ...]:
    return tuple(Arg(*row) for row in rows)


def _tensors(n: int) -> str:
    return "(" + ", ".join(["Tensor"] * n) + ")"


# The add_norm forward's arguments (add_norm_quant_fwd's begin with the same 19).
_ADD_NORM_ARGS = _args(
    ("x", "Tensor", "rows.x"),
    ("residual", "Tensor?", "rows.residual"),
    ("weight", "Tensor?", "norm.weight"),
    ("bias", "Tensor?", "norm.bias"),
    ("kind", "str", "norm.kind"),
    ("eps", "float", "norm.eps"),
    ("weight_offset", "float", "norm.weight_offset"),
    ("residual_scale", "float", "rows.residual_scale"),
    ("sum_dtype", "ScalarType", "rounding.sum_dtype"),
    ("norm_round_dtype", "ScalarType?", "rounding.norm_round_dtype"),
    ("out_dtype", "ScalarType", "rounding.out_dtype"),
    ("store_sum", "bool", "store.sum"),
)
_ADD_NORM_MODES = (
    ("round_sum_first", "bool", "rounding.round_sum_first"),
    ("x1", "Tensor?", "rows.x1"),
    ("rowscale", "Tensor?", "rows.rowscale"),
    ("weight1", "Tensor?", "second.weight"),
    ("bias1", "Tensor?", "second.bias"),
    ("dropout_p", "float", "dropout.p"),
    ("seed", "Tensor?", "dropout.seed"),
)
_ADD_NORM_DEFAULTS = (True, None, None, None, None, 0.0, None)

DECLARATIONS: dict[str, OpDeclaration] = {op.name: op for op in (
    OpDeclaration(
        "add_norm_fwd",
        _ADD_NORM_ARGS + _args(*((*row, default) for row, default in zip(_ADD_NORM_MODES, _ADD_NORM_DEFAULTS)))
        + _args(("gate", "Tensor?", "gate.z", None),
                ("gate_position", "str", "gate.position", "before"),
                ("gate_activation", "str", "gate.activation", "silu"),
                ("norm_group", "SymInt?", "norm.group", None),
                ("gate_out_dtype", "ScalarType?", "gate.out_dtype", None),
                ("mod_scale", "Tensor?", "modulation.scale", None),
                ("mod_shift", "Tensor?", "modulation.shift", None),
                ("mod_dtype", "ScalarType?", "modulation.dtype", None),
                ("mod_fused", "bool", "modulation.fused", False),
                ("mod_out_dtype", "ScalarType?", "modulation.out_dtype", None),
                ("x_gate", "Tensor?", "rows.x_gate", None),
                ("mod1_scale", "Tensor?", "modulation.scale1", None),
                ("mod1_shift", "Tensor?", "modulation.shift1", None),
                ("mod_one_plus", "bool", "modulation.one_plus", False)),
        outputs=("y", "s", "mean", "rstd", "y1"), returns=_tensors(5),
        module="normfuse.kernels.ops", call="AddNormCall",
        reference="normfuse.kernels.reference:add_norm_fwd", launcher="normfuse.kernels.triton:add_norm_fwd"),
    OpDeclaration(
        "add_norm_quant_fwd",
        _ADD_NORM_ARGS + _args(*_ADD_NORM_MODES)
        + _args(("store_y", "bool", "store.y"),
                ("quant_dtype", "ScalarType", "quant.dtype"),
                ("quant_scale", "Tensor?", "quant.scale"),
                ("quant_group", "SymInt?", "quant.group"),
                ("quant_scale_form", "str", "quant.scale_form"),
                ("quant_amax_min", "float?", "quant.amax_min"),
                ("quant_scale_min", "float?", "quant.scale_min"),
                ("quant_apply", "str", "quant.apply"),
                ("quant_clamp", "float?", "quant.clamp"),
                ("quant_scale_out", "str", "quant.scale_out")),
        # q as its bytes (uint8): ``q.view(quant_dtype)`` is q (see ops.add_norm_quant_fwd)
        outputs=("y", "s", "mean", "rstd", "y1", "q", "scale"), returns=_tensors(7),
        module="normfuse.kernels.ops", call="AddNormCall",
        reference="normfuse.kernels.reference:add_norm_quant_fwd",
        launcher="normfuse.kernels.triton:add_norm_quant_fwd"),
    OpDeclaration(
        "dropout_keep_mask",
        _args(("x", "Tensor", "x"), ("p", "float", "p"), ("seed", "Tensor", "seed"),
              ("on_reference", "bool", "on_reference", False)),
        outputs=("keep",), returns="Tensor", module="normfuse.kernels.ops", call="KeepMaskCall"),
    OpDeclaration(
        "norm_add_fwd",
        _args(("x", "Tensor", "rows.x"),
              ("residual", "Tensor", "rows.residual"),
              ("weight", "Tensor?", "norm.weight"),
              ("bias", "Tensor?", "norm.bias"),
              ("kind", "str", "norm.kind"),
              ("eps", "float", "norm.eps"),
              ("weight_offset", "float", "norm.weight_offset"),
              ("residual_scale", "float", "rows.residual_scale"),
              ("norm_round_dtype", "ScalarType?", "rounding.norm_round_dtype"),
              ("out_dtype", "ScalarType", "rounding.out_dtype"),
              # out = residual + y is norm_add's sum: rounded to add_dtype
              ("add_dtype", "ScalarType", "rounding.sum_dtype"),
              ("store_norm", "bool", "store.y")),
        outputs=("out", "y", "mean", "rstd"), returns=_tensors(4),
        module="normfuse.kernels.ops", call="NormAddCall",
        reference="normfuse.kernels.reference:norm_add_fwd", launcher="normfuse.kernels.triton:norm_add_fwd"),
    OpDeclaration(
        "add_norm_bwd",
        _args(("dy", "Tensor", "grads.dy"),
              ("dextra", "Tensor?", "grads.dextra"),
              ("inp", "Tensor", "saved.inp"),
              ("mean", "Tensor", "saved.mean"),
              ("rstd", "Tensor", "saved.rstd"),
              ("weight", "Tensor?", "norm.weight"),
              ("kind", "str", "norm.kind"),
              ("weight_offset", "float", "norm.weight_offset"),
              ("residual_scale", "float", "residual_scale"),
              ("add_after_norm", "bool", "add_after_norm"),
              ("x_dtype", "ScalarType", "dtypes.x"),
              ("residual_dtype", "ScalarType?", "dtypes.residual"),
              ("bias_dtype", "ScalarType?", "dtypes.bias"),
              ("dy1", "Tensor?", "grads.dy1", None),
              ("weight1", "Tensor?", "second.weight", None),
              ("bias1_dtype", "ScalarType?", "dtypes.bias1", None),
              ("x1_dtype", "ScalarType?", "dtypes.x1", None),
              ("rowscale", "Tensor?", "rowscale", None),
              ("dropout_p", "float", "dropout.p", 0.0),
              ("seed", "Tensor?", "dropout.seed", None),
              ("gate", "Tensor?", "gate.z", None),
              ("gate_position", "str", "gate.position", "before"),
              ("gate_activation", "str", "gate.activation", "silu"),
              ("norm_group", "SymInt?", "norm.group", None),
              ("bias", "Tensor?", "norm.bias", None),
              ("mod_scale", "Tensor?", "modulation.scale", None),
              ("mod_shift", "Tensor?", "modulation.shift", None),
              ("x_gate", "Tensor?", "x_gate.gate", None),
              ("x", "Tensor?", "x_gate.x", None),
              ("mod1_scale", "Tensor?", "modulation.scale1", None),
              ("mod1_shift", "Tensor?", "modulation.shift1", None),
              ("mod_one_plus", "bool", "modulation.one_plus", False)),
        outputs=("dx", "dresidual", "dweight", "dbias", "dx1", "dweight1", "dbias1", "dgate", "dmod_scale",
                 "dmod_shift", "dx_gate", "dmod1_scale", "dmod1_shift"), returns=_tensors(13),
        module="normfuse.kernels.ops", call="BackwardCall",
        reference="normfuse.kernels.reference:add_norm_bwd", launcher="normfuse.kernels.triton:add_norm_bwd"),
    OpDeclaration(
        "norm_linears",
        _args(("y", "Tensor", "y"),
              ("inp", "Tensor", "inp"),
              ("norm_weight", "Tensor?", "norm.weight"),
              ("norm_bias", "Tensor?", "norm.bias"),
              ("weights", "Tensor[]", "linears.weights"),
              ("biases", "Tensor[]", "linears.biases"),
              ("has_bias", "bool[]", "linears.has_bias"),
              ("kind", "str", "norm.kind"),
              ("eps", "float", "norm.eps"),
              ("weight_offset", "float", "norm.weight_offset"),
              ("sum_dtype", "ScalarType", "rounding.sum_dtype"),
              ("norm_round_dtype", "ScalarType?", "rounding.norm_round_dtype"),
              ("out_dtype", "ScalarType", "rounding.out_dtype")),
        outputs=("outputs",), returns="Tensor[]", module="normfuse.kernels.norm_linear", call="NormLinearsCall"),
    OpDeclaration(
        "qk_norm_rope_fwd",
        _args(("q", "Tensor", "q.x"),
              ("k", "Tensor?", "k.x"),
              ("q_weight", "Tensor?", "q.weight"),
              ("k_weight", "Tensor?", "k.weight"),
              ("cos", "Tensor", "rope.cos"),
              ("sin", "Tensor", "rope.sin"),
              ("eps", "float", "norm.eps"),
              ("weight_offset", "float", "norm.weight_offset"),
              ("norm_round_dtype", "ScalarType?", "rounding.norm_round_dtype"),
              ("norm_out_dtype", "ScalarType", "rounding.norm_out_dtype"),
              ("rope_dtype", "ScalarType", "rounding.rope_dtype"),
              ("out_dtype", "ScalarType", "rounding.out_dtype"),
              ("layout", "str", "rope.layout"),
              ("rotary_dim", "SymInt", "rope.rotary_dim"),
              ("full_width", "bool", "norm.full_width"),
              ("transpose_out", "bool", "transpose_out"),
              ("q_bias", "Tensor?", "q.bias", None),
              ("k_bias", "Tensor?", "k.bias", None),
              ("kind", "str", "norm.kind", "rms_norm")),
        outputs=("q_out", "k_out", "q_rstd", "k_rstd"), returns=_tensors(4),
        module="normfuse.kernels.qk_rope", call="QkNormRopeCall",
        reference="normfuse.kernels.qk_rope:qk_norm_rope_fwd_ref",
        launcher="normfuse.kernels.triton_rope:qk_norm_rope_fwd"),
    OpDeclaration(
        "qk_norm_rope_bwd",
        _args(("dq_out", "Tensor", "q.dout"),
              ("dk_out", "Tensor?", "k.dout"),
              ("q", "Tensor", "q.x"),
              ("k", "Tensor?", "k.x"),
              ("q_weight", "Tensor?", "q.weight"),
              ("k_weight", "Tensor?", "k.weight"),
              ("cos", "Tensor", "rope.cos"),
              ("sin", "Tensor", "rope.sin"),
              ("q_rstd", "Tensor", "q.rstd"),
              ("k_rstd", "Tensor?", "k.rstd"),
              ("weight_offset", "float", "norm.weight_offset"),
              ("layout", "str", "rope.layout"),
              ("rotary_dim", "SymInt", "rope.rotary_dim"),
              ("full_width", "bool", "norm.full_width"),
              ("q_bias", "Tensor?", "q.bias", None),
              ("k_bias", "Tensor?", "k.bias", None),
              ("kind", "str", "norm.kind", "rms_norm")),
        outputs=("dq", "dk", "dq_weight", "dk_weight", "dq_bias", "dk_bias"), returns=_tensors(6),
        module="normfuse.kernels.qk_rope", call="QkNormRopeBackwardCall",
        reference="normfuse.kernels.qk_rope:qk_norm_rope_bwd_ref",
        launcher="normfuse.kernels.triton_rope:qk_norm_rope_bwd"),
)}


def schema(op: str) -> str:
    """The schema string of ``op`` (without its name), as torch.library takes it."""
    declaration = DECLARATIONS[op]
    return f"({', '.join(a.schema_text() for a in declaration.args)}) -> {declaration.returns}"
