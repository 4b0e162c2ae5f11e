"""The pass takes over the fp8 quantization of a norm's output (normfuse/passes/parts/quant.py).

Models: ``Fp8Llama`` (tests/fp8_models.py), whose fused qkv and gate-up linears quantize the norm
outputs they read (static per-tensor, dynamic per row in two spellings, per group of 128
and 64 columns). On CPU the fused call runs the reference, which reproduces the graph's
rounding: the model's outputs equal eager's bit for bit. ``check`` compares each call's q
and scale with the subgraph it replaced (against fp64) and proves it symbolically; a
planted wrong clamp, scale form or amax floor is caught at its site. Spellings the
epilogue does not compute keep their quantization in the graph, with the reason reported.
"""

import copy

import pytest
import torch
import torch.nn as nn

import normfuse
from normfuse.verify.sites import fused_calls
from fp8_models import FP8_RECIPES, Fp8Llama, optimized_copy, token_ids
from helpers import assert_close
from test_check import faulty_copy

pytest.importorskip("sympy")
F8 = torch.float8_e4m3fn


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("recipe", FP8_RECIPES)
def test_fp8_llama_fuses_every_quantized_norm_bit_for_bit(recipe, dtype):
    model = Fp8Llama(recipe=recipe).to(dtype)
    with torch.no_grad():
        want = model(token_ids())
        optimized = optimized_copy(model)
        got = optimized(token_ids())
    assert torch.equal(got, want)
    rep = normfuse.report(optimized)
    quantized = [s for s in rep.sites if s.quant is not None]
    assert len(rep.sites) == 5 and len(quantized) == 4  # the final norm feeds a plain head
    assert all(s.fused and s.fused_quant and s.quant_reason is None for s in quantized), str(rep)
    assert [s.fused_add for s in quantized] == [False, True, True, True]  # the first norm reads the embedding
    assert "+ fp8 quant" in str(rep)
    assert (rep.counts()["quantized"], rep.counts()["fused_quant"]) == (4, 4)
    expected = {"static": "static per-tensor scale", "row": "dynamic per row", "row_reciprocal": "dynamic per row",
                "group128": "dynamic per group of 128", "group64": "dynamic per group of 64"}[recipe]
    assert all(s.quant == f"float8_e4m3fn, {expected}" for s in quantized)
    # the rewritten graph casts nothing to fp8 itself: the calls write q
    gm = rep.graph_modules[0]
    casts = [n for n in gm.graph.nodes if isinstance(n.meta.get("example_value"), torch.Tensor)
             and n.meta["example_value"].dtype == F8 and n.op == "call_method" and n.target == "to"]
    assert casts == []
    calls = fused_calls(gm.graph)
    assert sum(c.kwargs.get("quant_dtype") == F8 for c in calls) == 4
    # y is read only by its quantization: the calls do not return it
    assert all(c.kwargs.get("return_norm") is False for c in calls if c.kwargs.get("quant_dtype"))


@pytest.mark.parametrize("recipe", ["static", "row", "row_reciprocal", "group128"])
def test_check_compares_and_proves_each_quantized_site(recipe):
    model = Fp8Llama(recipe=recipe).to(torch.bfloat16)
    torch._dynamo.reset()
    res = normfuse.check(model, token_ids(), backward=False)
    assert res.ok, str(res)
    quantized = [s for s in res.sites if any(o.dtype == str(F8) for o in s.numeric.outputs)]
    assert len(quantized) == 4
    for site in quantized:
        assert site.passed and site.symbolic.status == "proved" and site.symbolic.method.startswith("algebra")
        dtypes = [o.dtype for o in site.numeric.outputs]
        assert dtypes.count(str(F8)) == 1  # q
        assert dtypes.count(str(torch.float32)) == (0 if recipe == "static" else 1)  # the dynamic scale
        assert all(o.ulp_max == 0 and o.passed for o in site.numeric.outputs)


def _plant_quant(gm, index, fault):
    call = fused_calls(gm.graph)[index]
    kw = dict(call.kwargs)
    if fault == "clamp":
        kw["quant_clamp"] = 240.0
    elif fault == "scale_form":
        kw["quant_scale_form"] = "max/amax"
    elif fault == "amax_min":
        kw["quant_amax_min"] = 10.0
    call.kwargs = kw
    gm.recompile()


@pytest.mark.parametrize("fault", ["clamp", "scale_form", "amax_min"])
def test_a_planted_quantization_fault_is_caught_at_its_site(fault, monkeypatch):
    import test_check

    monkeypatch.setattr(test_check, "plant", _plant_quant)
    model = Fp8Llama(dim=128, recipe="row").to(torch.bfloat16)
    torch._dynamo.reset()
    res = normfuse.check(model, token_ids(), optimized=faulty_copy(model, 1, fault), backward=False)
    assert not res.ok
    failing = [s.id for s in res.sites if not s.passed]
    assert failing == ["g0.s1"], failing
    site = res.first_divergence
    assert site.id == "g0.s1" and site.symbolic.status == "refuted", site.symbolic
    assert not site.numeric.passed


class _Quantizes(nn.Module):
    """One add -> RMSNorm whose output is quantized as ``how`` says."""

    def __init__(self, how, dim=64):
        super().__init__()
        self.how = how
        self.norm = nn.RMSNorm(dim, eps=1e-6)
        self.register_buffer("s", torch.tensor(0.05))

    def forward(self, x, h):
        y = self.norm(x + h)
        if self.how == "asymmetric_clamp":
            amax = y.float().abs().amax(-1, keepdim=True)
            return (y.float() / (amax / 448.0)).clamp(-448.0, 400.0).to(F8)
        if self.how == "per_tensor":
            amax = y.float().abs().amax()
            return (y.float() / (amax / 448.0)).clamp(-448.0, 448.0).to(F8)
        if self.how == "other_qmax":
            amax = y.float().abs().amax(-1, keepdim=True)
            return (y.float() / (amax / 400.0)).clamp(-448.0, 448.0).to(F8)
        if self.how == "scaled_in_bf16":  # a 0-dim fp32 scale does not promote a bf16 y: divides in bf16
            return (y / self.s).clamp(-448.0, 448.0).to(F8)
        if self.how == "two_casts":  # q, k and v linears each quantize y their own way
            return y.float().clamp(-448.0, 448.0).to(F8), (y.float() / self.s).to(torch.float8_e5m2)
        raise ValueError(self.how)


@pytest.mark.parametrize("how,reason", [
    ("asymmetric_clamp", "not symmetric"),
    ("per_tensor", "per-tensor amax is not row-local"),
    ("other_qmax", "not by the fp8 dtype's largest value 448"),
    ("scaled_in_bf16", "scales y in torch.bfloat16"),
    ("two_casts", "cast to fp8 2 times"),
])
def test_a_quantization_the_epilogue_does_not_compute_stays_with_its_reason(how, reason):
    model = _Quantizes(how).to(torch.bfloat16)
    x, h = torch.randn(2, 8, 64, dtype=torch.bfloat16), torch.randn(2, 8, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        want = model(x, h)
        optimized = optimized_copy(model)
        got = optimized(x, h)
    for a, b in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
        assert torch.equal(a.float(), b.float())
    (site,) = normfuse.report(optimized).sites
    assert site.fused and site.fused_add and not site.fused_quant  # the norm and its add fused all the same
    assert "fp8 quantization left" in str(normfuse.report(optimized))
    assert site.quant is not None and reason in site.quant_reason, site.quant_reason


def test_fuse_quant_false_leaves_the_quantization_in_the_graph():
    model = Fp8Llama(recipe="row").to(torch.bfloat16)
    torch._dynamo.reset()
    optimized = normfuse.optimize(copy.deepcopy(model), fuse_quant=False)
    with torch.no_grad():
        assert torch.equal(optimized(token_ids()), model(token_ids()))
    sites = [s for s in normfuse.report(optimized).sites if s.quant is not None]
    assert len(sites) == 4 and not any(s.fused_quant for s in sites)
    assert all(s.quant_reason == "quantizations are not fused (fuse_quant=False)" for s in sites)


def test_a_quantization_autograd_differentiates_through_is_left_in_the_graph():
    # training through a hand-written cast: eager's gradient flows through q into the norm; the
    # epilogue's q has none, so the call must not take it over
    model = Fp8Llama(recipe="row")
    optimized = optimized_copy(model)
    out = optimized(token_ids())
    out.sum().backward()
    model(token_ids()).sum().backward()
    # the same gradients up to the order of fp32 sums (an element-wise rtol fails on the near-zero
    # elements of a weight gradient: 3e-6 apart on one of magnitude 9, one thread per worker);
    # a gradient that stopped at q would miss the norm's whole branch
    for (name, a), b in zip(optimized.named_parameters(), model.parameters()):
        assert_close(a.grad, b.grad, msg=name)
    sites = [s for s in normfuse.report(optimized).sites if s.quant is not None]
    assert len(sites) == 4 and not any(s.fused_quant for s in sites)
    assert all("differentiates through the quantization" in s.quant_reason for s in sites)


def test_torchao_float8_training_linear_is_explained():
    # torchao's float8 training linear quantizes inside one autograd.Function: nothing to take
    # over in the graph, and the report says where the quantization went
    pytest.importorskip("torchao.float8")
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    class Block(nn.Module):
        def __init__(self, dim=128):
            super().__init__()
            self.norm, self.linear = nn.RMSNorm(dim), nn.Linear(dim, dim, bias=False)

        def forward(self, x, h):
            x = x + h
            return x, self.linear(self.norm(x))

    model = Block().to(torch.bfloat16)
    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name("rowwise"))
    x, h = torch.randn(2, 8, 128, dtype=torch.bfloat16), torch.randn(2, 8, 128, dtype=torch.bfloat16)
    with torch.no_grad():
        want = model(x, h)
        optimized = optimized_copy(model)
        got = optimized(x, h)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    (site,) = normfuse.report(optimized).sites
    assert site.fused and site.fused_add and not site.fused_quant
    assert site.quant == "fp8, inside torchao's float8 linear" and "autograd.Function" in site.quant_reason


def test_a_norm_output_read_besides_its_quantization_is_returned_too():
    class Both(nn.Module):
        def __init__(self, dim=64):
            super().__init__()
            self.norm = nn.RMSNorm(dim, eps=1e-6)

        def forward(self, x, h):
            y = self.norm(x + h)
            amax = y.float().abs().amax(-1, keepdim=True)
            scale = amax / 448.0
            return (y.float() / scale).clamp(-448.0, 448.0).to(F8), scale, y * 2

    model = Both().to(torch.bfloat16)
    x, h = torch.randn(2, 8, 64, dtype=torch.bfloat16), torch.randn(2, 8, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        want = model(x, h)
        optimized = optimized_copy(model)
        got = optimized(x, h)
    assert all(torch.equal(a.float(), b.float()) for a, b in zip(got, want))
    (site,) = normfuse.report(optimized).sites
    assert site.fused_quant
    (call,) = fused_calls(normfuse.report(optimized).graph_modules[0].graph)
    assert call.kwargs["return_norm"] is True
