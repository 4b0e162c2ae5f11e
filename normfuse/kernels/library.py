"""The ``torch.ops.normfuse.*`` operators declared before their implementations are imported.

A program normfuse rewrote names its ops: ``torch.export.save`` writes
``torch.ops.normfuse.add_norm_fwd.default``, an AOTInductor package calls ``normfuse::add_norm_fwd``
through the C++ dispatcher. Loading either needs the op to exist: the export deserializer gives up on
a name that ``torch.ops.normfuse`` lacks, and AOTInductor's loader looks the schema up in C++ when the
package loads ("Could not find schema for normfuse::add_norm_fwd"), where no Python namespace hook is
asked. The implementations live in ``ops.py`` and ``norm_linear.py``, which import Triton (~0.3 s);
``import normfuse`` must not. So each op is declared here with its schema (a ``custom_op`` whose
kernel and fake import the module implementing it on first use, then call the op again), and that
module registers its functions on the same op with ``implement``: one registration, which loaded
programs and the C++ handles keep, whatever was imported first.

``import normfuse`` calls ``declare`` (right after torch's import when normfuse comes first).
"""

from __future__ import annotations

import importlib
from typing import Callable

import torch

__all__ = ["SCHEMAS", "declare", "implement"]

NAMESPACE = "normfuse"

# op -> (its schema as torch.library.infer_schema writes it for the implementing function, that module).
# implement() checks the function against it: changing an op's signature means changing it here too.
SCHEMAS: dict[str, tuple[str, str]] = {
    "add_norm_fwd": (
        "(Tensor x, Tensor? residual, Tensor? weight, Tensor? bias, str kind, float eps, float weight_offset, "
        "float residual_scale, ScalarType sum_dtype, ScalarType? norm_round_dtype, ScalarType out_dtype, "
        "bool store_sum, bool round_sum_first=True, Tensor? x1=None, Tensor? rowscale=None, Tensor? weight1=None, "
        "Tensor? bias1=None, float dropout_p=0.0, Tensor? seed=None, Tensor? gate=None, "
        "str gate_position=\"before\", str gate_activation=\"silu\", SymInt? norm_group=None, "
        "ScalarType? gate_out_dtype=None) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
        "normfuse.kernels.ops"),
    "add_norm_quant_fwd": (
        "(Tensor x, Tensor? residual, Tensor? weight, Tensor? bias, str kind, float eps, float weight_offset, "
        "float residual_scale, ScalarType sum_dtype, ScalarType? norm_round_dtype, ScalarType out_dtype, "
        "bool store_sum, bool round_sum_first, Tensor? x1, Tensor? rowscale, Tensor? weight1, Tensor? bias1, "
        "float dropout_p, Tensor? seed, bool store_y, ScalarType quant_dtype, Tensor? quant_scale, "
        "SymInt? quant_group, str quant_scale_form, float? quant_amax_min, float? quant_scale_min, "
        "str quant_apply, float? quant_clamp, str quant_scale_out) "
        "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
        "normfuse.kernels.ops"),
    "dropout_keep_mask": (
        "(Tensor x, float p, Tensor seed, bool on_reference=False) -> Tensor",
        "normfuse.kernels.ops"),
    "norm_add_fwd": (
        "(Tensor x, Tensor residual, Tensor? weight, Tensor? bias, str kind, float eps, float weight_offset, "
        "float residual_scale, ScalarType? norm_round_dtype, ScalarType out_dtype, ScalarType add_dtype, "
        "bool store_norm) -> (Tensor, Tensor, Tensor, Tensor)",
        "normfuse.kernels.ops"),
    "add_norm_bwd": (
        "(Tensor dy, Tensor? dextra, Tensor inp, Tensor mean, Tensor rstd, Tensor? weight, str kind, "
        "float weight_offset, float residual_scale, bool add_after_norm, ScalarType x_dtype, "
        "ScalarType? residual_dtype, ScalarType? bias_dtype, Tensor? dy1=None, Tensor? weight1=None, "
        "ScalarType? bias1_dtype=None, ScalarType? x1_dtype=None, Tensor? rowscale=None, float dropout_p=0.0, "
        "Tensor? seed=None, Tensor? gate=None, str gate_position=\"before\", str gate_activation=\"silu\", "
        "SymInt? norm_group=None, Tensor? bias=None) "
        "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
        "normfuse.kernels.ops"),
    "norm_linears": (
        "(Tensor y, Tensor inp, Tensor? norm_weight, Tensor? norm_bias, Tensor[] weights, Tensor[] biases, "
        "bool[] has_bias, str kind, float eps, float weight_offset, ScalarType sum_dtype, "
        "ScalarType? norm_round_dtype, ScalarType out_dtype) -> Tensor[]",
        "normfuse.kernels.norm_linear"),
    "qk_norm_rope_fwd": (
        "(Tensor q, Tensor? k, Tensor? q_weight, Tensor? k_weight, Tensor cos, Tensor sin, float eps, "
        "float weight_offset, ScalarType? norm_round_dtype, ScalarType norm_out_dtype, ScalarType rope_dtype, "
        "ScalarType out_dtype, str layout, SymInt rotary_dim, bool full_width, bool transpose_out) "
        "-> (Tensor, Tensor, Tensor, Tensor)",
        "normfuse.kernels.qk_rope"),
    "qk_norm_rope_bwd": (
        "(Tensor dq_out, Tensor? dk_out, Tensor q, Tensor? k, Tensor? q_weight, Tensor? k_weight, Tensor cos, "
        "Tensor sin, Tensor q_rstd, Tensor? k_rstd, float weight_offset, str layout, SymInt rotary_dim, "
        "bool full_width) -> (Tensor, Tensor, Tensor, Tensor)",
        "normfuse.kernels.qk_rope"),
}

_DECLARED: dict[str, "torch._library.custom_ops.CustomOpDef"] = {}
_IMPLEMENTED: set[str] = set()


def _implemented(name: str) -> None:
    """Import the module that implements ``name`` (once); raise when it did not."""
    if name not in _IMPLEMENTED:
        importlib.import_module(SCHEMAS[name][1])
    if name not in _IMPLEMENTED:  # else calling the op again would come back here
        raise RuntimeError(f"importing {SCHEMAS[name][1]} did not implement {NAMESPACE}::{name}; it must register "
                           f"the function with normfuse.kernels.library.implement({name!r}).")


def _on_first_use(name: str) -> tuple[Callable, Callable]:
    """The kernel and fake an op has until its module is imported: import it, then call the op
    again, which now runs what the module registered (its kernel, its fake, its autograd: the
    autograd formula is read after the kernel ran, so the first call is differentiable too)."""
    def kernel(*args, **kwargs):
        _implemented(name)
        return getattr(getattr(torch.ops, NAMESPACE), name).default(*args, **kwargs)

    def fake(*args, **kwargs):
        _implemented(name)
        return getattr(getattr(torch.ops, NAMESPACE), name).default(*args, **kwargs)

    kernel.__name__ = fake.__name__ = name
    return kernel, fake


def declare() -> None:
    """Declare every ``torch.ops.normfuse`` op (idempotent; about 4 ms per op in torch's custom_op, no import
    beyond torch)."""
    for name, (schema, _) in SCHEMAS.items():
        if name in _DECLARED:
            continue
        kernel, fake = _on_first_use(name)
        op = torch.library.custom_op(f"{NAMESPACE}::{name}", kernel, mutates_args=(), schema=schema)
        op.register_fake(fake)
        _DECLARED[name] = op


def implement(name: str) -> Callable:
    """Decorator for the function that implements op ``name``: registers it as the op's kernel and
    returns the op (a ``CustomOpDef``: ``.register_fake``, ``.register_autograd`` as with
    ``torch.library.custom_op``)."""
    def register(fn: Callable):
        declare()
        expected = SCHEMAS[name][0]
        got = torch.library.infer_schema(fn, mutates_args=())
        if got != expected:
            raise TypeError(f"{fn.__module__}.{fn.__name__} does not match the schema declared for "
                            f"{NAMESPACE}::{name} in normfuse/kernels/library.py (saved programs call the op by "
                            f"that schema).\n  declared: {expected}\n  function: {got}\nChange SCHEMAS[{name!r}] "
                            f"together with the function.")
        op = _DECLARED[name]
        op.register_kernel(None)(fn)
        _IMPLEMENTED.add(name)
        return op

    return register
