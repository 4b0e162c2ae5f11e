"""Exact semantics, op registration, tracing and errors of the fused add+norm ops."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import normfuse
from normfuse.errors import InvalidOptionError, ShapeMismatchError, UnsupportedDtypeError
from normfuse.kernels import add_norm as K
from normfuse.tolerances import within_tolerance
from kernel_cases import (BF16, FP16, FP32, FP64, Case, assert_rounded_as_rule, assert_same_bits,
                          assert_within_rounding_budget, check_case)


@pytest.fixture(params=["reference", "triton"])
def path(request):
    """Which implementation CPU tensors run: the reference, or the Triton kernels (interpreter)."""
    if request.param == "triton":
        request.getfixturevalue("triton_cpu")
    return request.param


def test_triton_path_is_taken(triton_cpu, monkeypatch):
    from normfuse.kernels import triton as triton_backend
    calls = []
    for name in ("_launch_fwd", "add_norm_bwd"):
        real = getattr(triton_backend, name)
        monkeypatch.setattr(triton_backend, name,
                            lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k))
    x = randn(4, 64, dtype=BF16).requires_grad_()
    y, s = normfuse.add_rms_norm(x, x, None)
    y.float().sum().backward()
    normfuse.rms_norm_add(x.detach(), x.detach(), None)
    assert calls == ["_launch_fwd", "add_norm_bwd", "_launch_fwd"]


def randn(*shape, dtype=FP32, seed=0, std=1.0, mean=0.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * std + mean).to(dtype)


def assert_matches(a, b, path, narrow=None):
    """Bit for bit on the reference path (eager's own kernels). On the Triton path the row
    reduction order differs: bf16/fp16 within the rounding budget (1 ulp, on at most 1% of the
    elements), fp32 to a few ulp; ``narrow``: the dtype an fp32 output was rounded to on the way
    (Llama's n), whose rounding a reduction order may flip on at most 1% of the elements."""
    if path == "reference":
        assert_same_bits(a, b, "bit for bit")
    elif narrow is not None:
        assert_rounded_as_rule(a, b.double(), "within the rounding budget", carried=(b.double(), narrow))
    else:
        assert_within_rounding_budget(a, b, "within the rounding budget")


# ---- default modes are eager's functions --------------------------------------------

@pytest.mark.parametrize("dtype,wdtype", [(BF16, BF16), (BF16, FP32), (FP16, FP16), (FP32, FP32)])
def test_default_modes_equal_eager(path, dtype, wdtype):
    x, r = randn(8, 2, 1000, dtype=dtype), randn(8, 2, 1000, dtype=dtype, seed=1)
    w, b = randn(1000, dtype=wdtype, seed=2, mean=1), randn(1000, dtype=wdtype, seed=3, std=0.1)
    y, s = normfuse.add_rms_norm(x, r, w, eps=1e-6)
    assert torch.equal(s, x + r)
    assert_matches(y, F.rms_norm(x + r, (1000,), w, 1e-6), path)
    y, s = normfuse.add_layer_norm(x, r, w, b, eps=1e-5)
    assert torch.equal(s, x + r)
    assert_matches(y, F.layer_norm(x + r, (1000,), w, b, 1e-5), path)
    out, y = normfuse.layer_norm_add(x, r, w, b, return_norm=True)
    assert_matches(y, F.layer_norm(x, (1000,), w, b, 1e-5), path)
    assert torch.equal(out, r + y)
    out, none = normfuse.rms_norm_add(x, r, w, residual_scale=0.5)
    assert none is None
    assert_matches(out, r * 0.5 + F.rms_norm(x, (1000,), w, 1e-6), path)


def test_plain_norm_returns_no_sum(path):
    x, w = randn(4, 64, dtype=BF16), randn(64, dtype=BF16)
    y, s = normfuse.add_norm(x, None, w, kind="rms_norm", eps=1e-6)
    assert s is None
    assert_matches(y, F.rms_norm(x, (64,), w, 1e-6), path)
    y, s = normfuse.add_rms_norm(x, randn(4, 64, dtype=BF16), w, return_sum=False)
    assert s is None and y.dtype == BF16


# ---- HF Llama and Gemma, bit for bit --------------------------------------------------

def test_llama_mode_equals_hf_llama_rms_norm(path):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    norm = LlamaRMSNorm(2048, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(randn(2048, seed=5, std=0.5, mean=1.0))
    norm = norm.to(BF16)
    x, r = randn(16, 2048, dtype=BF16, seed=6), randn(16, 2048, dtype=BF16, seed=7, std=3)
    with torch.no_grad():
        expect = norm(x + r)
    y, s = normfuse.add_rms_norm(x, r, norm.weight.detach(), eps=1e-6, norm_round_dtype=BF16)
    assert y.dtype == expect.dtype == BF16
    assert torch.equal(s, x + r)
    assert_matches(y, expect, path)


def test_llama_mode_fp32_weight_keeps_hf_dtype(path):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    norm = LlamaRMSNorm(512, eps=1e-6)            # fp32 weight, bf16 activations (autocast-style)
    with torch.no_grad():
        norm.weight.copy_(randn(512, seed=5, std=0.5, mean=1.0))
    x, r = randn(16, 512, dtype=BF16, seed=6), randn(16, 512, dtype=BF16, seed=7)
    with torch.no_grad():
        expect = norm(x + r)
    y, _ = normfuse.add_rms_norm(x, r, norm.weight.detach(), eps=1e-6, norm_round_dtype=BF16)
    assert y.dtype == expect.dtype == FP32
    assert_matches(y, expect, path, narrow=BF16)


def test_gemma_offset_equals_hf_gemma_rms_norm(path):
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    norm = GemmaRMSNorm(2048, eps=1e-6)
    with torch.no_grad():                          # initialised to zeros: randomize
        norm.weight.copy_(randn(2048, seed=8, std=0.3))
    norm = norm.to(BF16)
    x, r = randn(16, 2048, dtype=BF16, seed=9), randn(16, 2048, dtype=BF16, seed=10, std=3)
    with torch.no_grad():
        expect = norm(x + r)
    y, _ = normfuse.add_rms_norm(x, r, norm.weight.detach(), eps=1e-6, weight_offset=1.0)
    assert y.dtype == BF16
    assert_matches(y, expect, path)


def test_rounding_modes_differ():
    """The two rounding modes are different functions (otherwise the option is moot)."""
    x, r, w = randn(64, 512, dtype=BF16), randn(64, 512, dtype=BF16, seed=1), randn(512, dtype=BF16, seed=2)
    y1, _ = normfuse.add_rms_norm(x, r, w)
    y2, _ = normfuse.add_rms_norm(x, r, w, norm_round_dtype=BF16)
    assert not torch.equal(y1, y2)


# ---- round_sum_first=False: normalize the unrounded sum, return the rounded one -------

@pytest.mark.parametrize("kind", ["rms_norm", "layer_norm"])
@pytest.mark.parametrize("n", [1000, 40000])     # 40000 bf16 columns: the looped forward kernel
def test_unrounded_sum_mode(path, kind, n):
    """flash-attn's layer_norm_fn(x, w, b, residual=r, prenorm=True): s is x + r rounded to bf16,
    y normalizes the fp32 sum x + 0.5 r (r scaled in its own dtype first)."""
    x, r = randn(2, n, dtype=BF16), randn(2, n, dtype=BF16, seed=1, std=4.0)
    w, b = randn(n, seed=2, mean=1.0), randn(n, seed=3)
    bias = b if kind == "layer_norm" else None
    y, s = normfuse.add_norm(x, r, w, bias, kind=kind, eps=1e-5, residual_scale=0.5, round_sum_first=False)
    r_scaled = r * 0.5
    assert torch.equal(s, x + r_scaled)
    u = x.float() + r_scaled.float()
    expect = (F.layer_norm(u, (n,), w, bias, 1e-5) if kind == "layer_norm" else F.rms_norm(u, (n,), w, 1e-5))
    # the fp32 statistics are reduced in another order than F.layer_norm's (on both paths: the
    # reference does not call it for an fp32 norm input with a bf16 output): the rounding budget
    assert_within_rounding_budget(y, expect.to(BF16), "y")
    rounded, _ = normfuse.add_norm(x, r, w, bias, kind=kind, eps=1e-5, residual_scale=0.5)
    assert not torch.equal(y, rounded)       # the two modes are different functions


@pytest.mark.parametrize("op_path", ["eager", "op"])
def test_unrounded_sum_mode_gradients(path, op_path):
    """Gradients of round_sum_first=False under the project's rule against fp64, through the eager
    CPU path and through the custom op (a direct op call takes the op's autograd)."""
    leaves = [randn(3, 200, dtype=BF16, seed=4).requires_grad_(), randn(3, 200, dtype=BF16, seed=5).requires_grad_(),
              randn(200, seed=6, mean=1.0).requires_grad_(), randn(200, seed=7).requires_grad_()]
    cotangents = randn(3, 200, seed=8), randn(3, 200, seed=9)

    def grads(fn, tensors):
        y, s = fn(*tensors)
        loss = (y.double() * cotangents[0].double()).sum() + (s.double() * cotangents[1].double()).sum()
        return torch.autograd.grad(loss, tensors)

    def candidate(x, r, w, b):
        if op_path == "eager":
            return normfuse.add_layer_norm(x, r, w, b, round_sum_first=False)
        y, s, *_ = torch.ops.normfuse.add_norm_fwd(x, r, w, b, "layer_norm", 1e-5, 0.0, 1.0, BF16, None, BF16, True,
                                                  False)
        return y, s

    def unfused(x, r, w, b):                  # the same function in plain autograd (bf16 storage)
        return F.layer_norm(x.float() + r.float(), (200,), w, b, 1e-5).to(BF16), x + r

    got = grads(candidate, leaves)
    base = grads(unfused, leaves)
    exact = grads(lambda x, r, w, b: (F.layer_norm(x + r, (200,), w, b, 1e-5), x + r),
                  [t.detach().double().requires_grad_() for t in leaves])
    for name, g, e, r in zip(("dx", "dresidual", "dweight", "dbias"), got, base, exact):
        ok, err_c, err_e, bound = within_tolerance(g, e, r, dtype=g.dtype)   # dweight, dbias: fp32
        assert ok, f"{name}: err {err_c:.3g} > bound {bound:.3g} (unfused err {err_e:.3g})"


def test_residual_scale_rounds_in_residual_dtype():
    x, r = randn(4, 256, dtype=BF16), randn(4, 256, dtype=BF16, seed=1)
    _, s = normfuse.add_rms_norm(x, r, None, residual_scale=0.3)
    assert torch.equal(s, x + r * 0.3)
    _, s = normfuse.add_rms_norm(x, r, None, sum_dtype=FP32)
    assert s.dtype == FP32 and torch.equal(s, x.float() + r.float())


# ---- opcheck, gradcheck, compile -------------------------------------------------------

def _op_samples():
    x, r = randn(3, 40, dtype=BF16), randn(3, 40, dtype=BF16, seed=1)
    w, b = randn(40, dtype=FP32, seed=2), randn(40, dtype=FP32, seed=3)
    for t in (x, r, w, b):
        t.requires_grad_()
    yield "add_norm_fwd", (x, r, w, b, "layer_norm", 1e-5, 0.0, 1.0, BF16, None, BF16, True)
    yield "add_norm_fwd", (x, r, w, None, "rms_norm", 1e-6, 1.0, 0.5, FP32, BF16, FP32, False)
    yield "add_norm_fwd", (x, None, None, None, "rms_norm", 1e-6, 0.0, 1.0, BF16, None, BF16, False)
    yield "add_norm_fwd", (x, r, w, b, "layer_norm", 1e-5, 0.0, 0.5, BF16, None, BF16, True, False)
    yield "add_norm_fwd", (x, r, w, None, "rms_norm", 1e-6, 0.0, 1.0, BF16, BF16, FP32, False, False)
    yield "norm_add_fwd", (x, r, w, b, "layer_norm", 1e-5, 0.0, 2.0, None, BF16, FP32, True)
    yield "norm_add_fwd", (x, r, w, None, "rms_norm", 1e-6, 0.0, 1.0, BF16, FP32, FP32, False)
    w = w.detach()   # the backward op has no autograd formula of its own (no double backward)
    dy, s = randn(3, 40, dtype=BF16, seed=4), randn(3, 40, dtype=BF16, seed=5)
    stats = randn(3, seed=6), randn(3, seed=7).abs() + 0.5
    yield "add_norm_bwd", (dy, dy, s, *stats, w, "layer_norm", 0.0, 0.5, False, BF16, BF16, FP32)
    yield "add_norm_bwd", (dy, None, s, stats[0][:0], stats[1], None, "rms_norm", 1.0, 1.0, True, BF16, BF16,
                           None)


@pytest.mark.parametrize("name,args", list(_op_samples()), ids=lambda v: v if isinstance(v, str) else "")
def test_opcheck(path, name, args):
    torch.library.opcheck(getattr(torch.ops.normfuse, name), args)


GRADCHECK_CASES = [
    dict(kind="layer_norm", bias=True),
    dict(kind="rms_norm", weight_offset=1.0, residual_scale=0.5),
    dict(kind="rms_norm", norm_round_dtype=FP64),
    dict(kind="layer_norm", residual=False),
    dict(kind="rms_norm", weight=False, return_sum=False),
    dict(kind="layer_norm", op="norm_add", bias=True, residual_scale=2.0, return_norm=True),
    dict(kind="rms_norm", op="norm_add", weight_offset=1.0),
]


@pytest.mark.parametrize("cfg", GRADCHECK_CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_gradcheck_fp64(cfg):
    cfg = dict(cfg)
    op = cfg.pop("op", "add_norm")
    has_res, has_w, has_b = cfg.pop("residual", True), cfg.pop("weight", True), cfg.pop("bias", False)
    x = randn(3, 9, dtype=FP64).requires_grad_()
    r = randn(3, 9, dtype=FP64, seed=1).requires_grad_() if has_res or op == "norm_add" else None
    w = randn(9, dtype=FP64, seed=2).requires_grad_() if has_w else None
    b = randn(9, dtype=FP64, seed=3).requires_grad_() if has_b else None
    fn = K.norm_add if op == "norm_add" else K.add_norm

    def f(x, r, w, b):
        return tuple(t for t in fn(x, r, w, b, eps=1e-5, **cfg) if t is not None)

    assert torch.autograd.gradcheck(f, (x, r, w, b))


def _check_compiled_block(backend):
    """torch.compile(fullgraph=True) of the functional API: no graph break, same numbers."""
    torch._dynamo.reset()

    def block(x, r, w, b):
        y, s = normfuse.add_layer_norm(x, r, w, b)
        out, _ = normfuse.rms_norm_add(y, s, w, norm_round_dtype=BF16)
        y2, _ = normfuse.add_norm(out, None, w, kind="rms_norm", eps=1e-6, weight_offset=1.0)
        return y2

    x, r = randn(4, 96, dtype=BF16).requires_grad_(), randn(4, 96, dtype=BF16, seed=1).requires_grad_()
    w, b = randn(96, seed=2).requires_grad_(), randn(96, seed=3).requires_grad_()
    expect = block(x, r, w, b)
    grads = torch.autograd.grad(expect.float().sum(), (x, r, w, b))
    compiled = torch.compile(block, backend=backend, fullgraph=True)
    got = compiled(x, r, w, b)
    assert torch.equal(got, expect)
    for g_got, g_exp in zip(torch.autograd.grad(got.float().sum(), (x, r, w, b)), grads):
        torch.testing.assert_close(g_got, g_exp)


def test_compile_fullgraph(path):
    _check_compiled_block("aot_eager")


def test_compile_inductor():
    _check_compiled_block("inductor")


@pytest.mark.slow
def test_compile_inductor_triton(triton_cpu):
    _check_compiled_block("inductor")


# ---- hypothesis -------------------------------------------------------------------------

@st.composite
def cases(draw, max_n=300):
    dtype = draw(st.sampled_from([BF16, FP16, FP32]))
    op = draw(st.sampled_from(["add_norm", "norm_add"]))
    round_first = draw(st.booleans())
    kind = draw(st.sampled_from(["rms_norm", "layer_norm"]))
    # N=1 layer norm is degenerate (y = bias, dx = 0): eager's fused LayerNorm backward,
    # which the CPU path shares, leaves roundoff of eps*rstd there where a written-out
    # norm gets exactly 0, so that pairing is not held to the rule.
    return Case(kind=kind, n=draw(st.integers(1 if kind == "rms_norm" else 2, max_n)),
                rows=draw(st.integers(0, 6)), dtype=dtype, wdtype=draw(st.sampled_from([dtype, FP32, None])),
                residual=draw(st.booleans()) or op == "norm_add", bias=draw(st.booleans()),
                offset=draw(st.sampled_from([0.0, 1.0])), scale=draw(st.sampled_from([1.0, 0.5, 3.0])),
                round_first=round_first, op=op, return_extra=draw(st.booleans()),
                sum_dtype=None if op == "norm_add" else draw(st.sampled_from([None, FP32])),
                rdtype=draw(st.sampled_from([None, None, FP32, BF16])))


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases())
def test_hypothesis_reference_vs_fp64(case):
    check_case(case)


# The interpreter costs ~50 ms a case, so the Triton path gets a shorter run here.
@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(case=cases())
def test_hypothesis_triton_vs_fp64(triton_cpu, case):
    check_case(case)


@pytest.mark.slow
@settings(max_examples=3000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases(max_n=5000))
def test_hypothesis_reference_vs_fp64_long(case):
    check_case(case)


# ---- non-finite values, strides, shapes ---------------------------------------------

@pytest.mark.parametrize("kind", ["rms_norm", "layer_norm"])
def test_nan_inf_propagate_as_in_eager(path, kind):
    x, r = randn(4, 64, dtype=BF16), randn(4, 64, dtype=BF16, seed=1)
    x[0, 3], x[1, 5], r[2, 7] = float("nan"), float("inf"), float("-inf")
    w = randn(64, dtype=BF16, seed=2)
    y, s = K.add_norm(x, r, w, kind=kind, eps=1e-5)
    expect = (F.layer_norm(x + r, (64,), w, None, 1e-5) if kind == "layer_norm"
              else F.rms_norm(x + r, (64,), w, 1e-5))
    assert torch.equal(s.isnan(), (x + r).isnan()) and torch.equal(s.isinf(), (x + r).isinf())
    assert torch.equal(y.isnan(), expect.isnan()) and torch.equal(y.isinf(), expect.isinf())
    finite = expect.isfinite()
    assert finite.any()
    assert_matches(y[finite], expect[finite], path)


def test_strided_rows_and_noncontiguous_last_dim(path):
    big_x, big_r = randn(6, 300, dtype=BF16), randn(6, 300, dtype=BF16, seed=1)
    x, r = big_x[:, 10:138], big_r[:, :128]             # row stride 300, last dim contiguous
    w = randn(128, dtype=BF16, seed=2)
    y, s = normfuse.add_rms_norm(x, r, w)
    y_c, s_c = normfuse.add_rms_norm(x.contiguous(), r.contiguous(), w)
    assert torch.equal(y, y_c) and torch.equal(s, s_c)
    xt = randn(128, 6, dtype=BF16).t()                   # last dim strided: copied once
    y, s = normfuse.add_layer_norm(xt, r, w, None)
    y_c, s_c = normfuse.add_layer_norm(xt.contiguous(), r.contiguous(), w, None)
    assert torch.equal(y, y_c) and torch.equal(s, s_c)
    x3 = randn(2, 3, 256, dtype=FP32)[:, :, :128]        # 3-D, leading dims collapsible
    y, _ = normfuse.add_rms_norm(x3, x3, None)
    assert torch.equal(y, normfuse.add_rms_norm(x3.contiguous(), x3.contiguous(), None)[0])
    assert y.is_contiguous() and y.shape == (2, 3, 128)


def test_zero_rows(path):
    x = torch.empty(0, 7, dtype=BF16, requires_grad=True)
    y, s = normfuse.add_layer_norm(x, x, torch.ones(7, dtype=BF16), None)
    assert y.shape == s.shape == (0, 7)
    y.sum().backward()
    assert x.grad.shape == (0, 7)


def test_grad_only_through_requested_inputs():
    x = randn(4, 32, dtype=BF16).requires_grad_()
    r, w = randn(4, 32, dtype=BF16, seed=1), randn(32, dtype=BF16, seed=2)
    y, _ = normfuse.add_rms_norm(x, r, w, return_sum=False)
    (gx,) = torch.autograd.grad(y.float().sum(), x)
    xe = x.detach().clone().requires_grad_()
    (ge,) = torch.autograd.grad(F.rms_norm(xe + r, (32,), w, 1e-6).float().sum(), xe)
    x64 = x.detach().double().requires_grad_()
    (g64,) = torch.autograd.grad(F.rms_norm(x64 + r.double(), (32,), w.double(), 1e-6).sum(), x64)
    ok, err, err_eager, bound = within_tolerance(gx, ge, g64)
    assert ok, f"dx error {err:.3g} > bound {bound:.3g} (eager's {err_eager:.3g})"


# ---- errors -----------------------------------------------------------------------------

def test_errors_name_the_problem():
    x, w = randn(2, 8, dtype=BF16), randn(8, dtype=BF16)
    with pytest.raises(UnsupportedDtypeError, match=r"torch.int32.*float32"):
        normfuse.add_rms_norm(x.int(), None, None)
    with pytest.raises(UnsupportedDtypeError, match=r"complex64"):
        normfuse.add_rms_norm(x, torch.zeros(2, 8, dtype=torch.complex64), None)
    with pytest.raises(UnsupportedDtypeError, match=r"weight has dtype torch.int32.*Cast it"):
        normfuse.add_rms_norm(x, x, w.int())
    with pytest.raises(UnsupportedDtypeError, match=r"out_dtype=torch.int8"):
        normfuse.add_rms_norm(x, x, w, out_dtype=torch.int8)
    with pytest.raises(ShapeMismatchError, match=r"\(2, 7\).*\(2, 8\)"):
        normfuse.add_rms_norm(x, x[:, :7], w)
    with pytest.raises(ShapeMismatchError, match=r"\(4,\).*\(2, 8\).*\(8,\)"):
        normfuse.add_layer_norm(x, x, w[:4], None)
    with pytest.raises(ShapeMismatchError, match=r"bias has shape \(8, 1\)"):
        normfuse.add_layer_norm(x, x, w, w[:, None])
    with pytest.raises(InvalidOptionError, match=r"Did you mean 'rms_norm'"):
        normfuse.add_norm(x, x, w, kind="rmsnorm", eps=1e-6)
    with pytest.raises(InvalidOptionError, match=r"eps"):
        normfuse.add_norm(x, x, w, kind="rms_norm", eps=-1.0)
    with pytest.raises(InvalidOptionError, match=r"residual"):
        normfuse.norm_add(x, None, w, kind="rms_norm", eps=1e-6)
    with pytest.raises(ShapeMismatchError, match=r"last dim"):
        normfuse.add_rms_norm(x[:, :0], None, None)
    with pytest.raises(UnsupportedDtypeError, match=r"float64"):   # the op itself validates too
        torch.ops.normfuse.add_norm_fwd(x.int(), None, None, None, "rms_norm", 1e-6, 0.0, 1.0, BF16, None,
                                        BF16, False)


def test_fp64_runs_on_cpu():
    x = randn(3, 16, dtype=FP64)
    y, s = normfuse.add_layer_norm(x, x, None, None)
    assert y.dtype == s.dtype == FP64
    torch.testing.assert_close(y, F.layer_norm(2 * x, (16,), eps=1e-5))


# ---- lean import --------------------------------------------------------------------

def test_import_is_lean():
    code = ("import sys, torch, normfuse\n"
            "assert not torch.cuda.is_initialized()\n"
            "assert 'triton' not in sys.modules, 'import normfuse imported triton'\n"
            "import normfuse.kernels.add_norm\n"
            "normfuse.add_rms_norm\n"
            "assert not torch.cuda.is_initialized()\n")
    env = {k: v for k, v in os.environ.items() if k != "NORMFUSE_TRITON_CPU"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)
