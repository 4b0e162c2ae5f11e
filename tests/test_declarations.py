"""Each op declared once (normfuse/kernels/declarations.py), and everything that takes its arguments
checked against that declaration: the schema it is registered with, the call type its arguments are
grouped into, the function registered as its kernel, its fake, the reference backend's and the
Triton launcher's functions (each takes the one call), and the grouping itself on real calls."""

from __future__ import annotations

import dataclasses
import importlib
import inspect

import pytest
import torch

import normfuse
import normfuse.kernels.triton
from normfuse.kernels import library, specs
from normfuse.kernels.declarations import DECLARATIONS, REQUIRED, schema

OPS = list(DECLARATIONS)


def _function(path: str):
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


def _takes_the_call(fn, call: str) -> bool:
    parameters = list(inspect.signature(fn).parameters.values())
    annotation = parameters[0].annotation if len(parameters) == 1 else None
    return getattr(annotation, "__name__", annotation) == call


@pytest.mark.parametrize("op", OPS)
def test_the_registered_schema_is_the_declared_one(op):
    normfuse.kernels.library.declare()
    registered = getattr(torch.ops.normfuse, op).default._schema
    declared = torch._C.parse_schema(f"normfuse::{op}{schema(op)}")
    assert str(registered) == str(declared)
    assert tuple(a.name for a in registered.arguments) == DECLARATIONS[op].arg_names
    assert len(registered.returns) == len(DECLARATIONS[op].outputs)


@pytest.mark.parametrize("op", OPS)
def test_the_call_type_holds_every_argument_once(op):
    declaration = DECLARATIONS[op]
    call_type = specs.CALLS[declaration.call]
    places = [a.to for a in declaration.args]
    assert len(set(places)) == len(places), f"{op}: two arguments go to one field"
    hints = {f.name: f.type for f in dataclasses.fields(call_type)}
    groups = {place.split(".")[0] for place in places}
    assert groups <= set(hints), f"{op}: {declaration.call} has no field for {groups - set(hints)}"
    specs._check_declarations()
    # an argument with a default is left out of a call that ends before it: the call still builds
    required = [a for a in declaration.args if a.default is REQUIRED]
    assert declaration.args[:len(required)] == tuple(required), f"{op}: a required argument after a default"


@pytest.mark.parametrize("op", OPS)
def test_kernel_fake_reference_and_launcher_take_the_call(op):
    declaration = DECLARATIONS[op]
    importlib.import_module(declaration.module)
    assert _takes_the_call(library.KERNELS[op], declaration.call)
    assert _takes_the_call(library.FAKES[op], declaration.call)
    for path in (declaration.reference, declaration.launcher):
        if path is not None:
            if path.startswith("normfuse.kernels.triton") and normfuse.kernels.triton.triton is None:
                continue
            assert _takes_the_call(_function(path), declaration.call), path


def test_a_call_groups_the_flat_arguments_as_declared():
    x, r, w, z = (torch.randn(3, 8) for _ in range(4))
    seed = torch.tensor(5)
    args = (x, r, w[0], None, "rms_norm", 1e-6, 1.0, 0.5, torch.float32, torch.bfloat16, torch.float32, True, False,
            None, None, None, None, 0.1, seed, z, "after", "sigmoid", 4, torch.bfloat16)
    call = specs.call_of("add_norm_fwd", args)
    assert call.rows.x is x and call.rows.residual is r and call.rows.residual_scale == 0.5
    assert call.norm.weight is args[2] and call.norm.kind == "rms_norm" and call.norm.eps == 1e-6
    assert call.norm.weight_offset == 1.0 and call.norm.group == 4
    assert (call.rounding.sum_dtype, call.rounding.norm_round_dtype, call.rounding.out_dtype) == (
        torch.float32, torch.bfloat16, torch.float32)
    assert call.rounding.round_sum_first is False and call.store.sum is True
    assert call.second is None and call.quant is None
    assert call.dropout.p == 0.1 and call.dropout.seed is seed
    assert call.gate.z is z and (call.gate.position, call.gate.activation, call.gate.out_dtype) == (
        "after", "sigmoid", torch.bfloat16)
    # trailing defaults may be left out: the optional groups are then off
    short = specs.call_of("add_norm_fwd", args[:12])
    assert short.gate is None and short.dropout is None and short.second is None
    assert short.rounding.round_sum_first is True and short.norm.group is None


def test_the_backward_call_groups_as_declared():
    dy, inp, w1 = torch.randn(2, 4), torch.randn(2, 4), torch.randn(4)
    mean, rstd = torch.zeros(0), torch.ones(2)
    call = specs.call_of("add_norm_bwd", (dy, None, inp, mean, rstd, None, "rms_norm", 0.0, 2.0, True, torch.float16,
                                          torch.bfloat16, None, dy, w1))
    assert call.grads.dy is dy and call.grads.dy1 is dy and call.saved.inp is inp and call.saved.rstd is rstd
    assert call.residual_scale == 2.0 and call.add_after_norm is True
    assert (call.dtypes.x, call.dtypes.residual) == (torch.float16, torch.bfloat16)
    assert call.second.weight is w1 and call.dropout is None and call.gate is None


def test_an_undeclared_op_is_named():
    with pytest.raises(normfuse.errors.InvalidOptionError, match="add_norm_fwd"):
        specs.op_arguments("add_norm_fw")
