"""The fp8 quantization of a norm's output as reference implementations write it
(normfuse/passes/parts/quant.py reads the amax by a rule: an exact upcast commutes with abs, neg,
max and a clamp by a constant).

Spellings: the hand-written per-token quantization of issue 29 (the amax of the 16-bit y,
upcast afterwards), ``max(dim, keepdim=True)[0]`` / ``.values`` / ``torch.max``, a negated
input, the floor clamped before the upcast, vLLM's per-token reference (a 2-D view, constants
as one-element fp32 tensors, ``max`` without keepdim and the dim put back with ``[:, None]``,
a scale floor of ``1 / (qmax * 512)``, a multiply by ``1 / scale``), torchao's rowwise
reference (``|y|`` upcast then ``abs`` again, the scale computed in fp64 from a floored amax,
then rounded to fp32), and float8_e5m2. Each is written here from its description, as a
linear of a small Llama (``Fp8Llama``, tests/fp8_models.py) quantizing its input: every quantized
norm is fused with its quantization and the outputs equal eager's bit for bit on the
reference path. Spellings that compute something else keep their quantization, with the
reason.
"""


import pytest
import torch
import torch.nn as nn

import normfuse
from normfuse.passes.canonical import canonicalize, node_dtype
from normfuse.verify.sites import fused_calls
from fp8_models import Fp8Linear, Fp8Llama, optimized_copy, token_ids

pytest.importorskip("sympy")
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
F32, F64 = torch.float32, torch.float64


def _vllm(x, quant_dtype=E4M3):
    # the reference of vLLM's dynamic per-token kernel: constants as one-element fp32 tensors
    f32 = lambda v: torch.as_tensor(v, dtype=F32, device=x.device)  # noqa: E731
    rows = x.view(-1, x.shape[-1])  # (tokens, hidden)
    qmax, one, s512 = f32(torch.finfo(quant_dtype).max), f32(1.0), f32(512.0)
    token_max, _ = rows.abs().max(dim=-1)  # (tokens,)
    scales = (f32(token_max) / qmax)[:, None]  # (tokens, 1)
    scales = scales.clamp(min=one / (qmax * s512))
    inverse = f32(one / scales)
    q = (f32(rows) * inverse).clamp(-torch.finfo(quant_dtype).max, torch.finfo(quant_dtype).max).to(quant_dtype)
    return q.view(x.shape), scales.view(*x.shape[:-1], 1)


def _torchao(x, floor=1e-12):
    # torchao's float8 rowwise scaling: |x| upcast, abs again, amax; the scale 448 / amax in fp64
    magnitude = torch.abs(x).to(F32)
    amax = torch.amax(torch.abs(magnitude), dim=-1, keepdim=True).to(F64)
    scale = (448.0 / torch.clamp(amax, min=floor)).to(F32)
    q = (x.to(F32) * scale).clamp(min=-448.0, max=448.0).to(E4M3)
    return q, scale.reciprocal()


def _per_token(amax_of, dtype=E4M3):
    """The hand-written per-token quantization with its amax taken by ``amax_of(y)`` (the 16-bit
    amax, upcast afterwards), floored in fp32."""
    qmax = torch.finfo(dtype).max

    def quantize(x):
        scale = amax_of(x).float().clamp(min=1e-12) / qmax
        return (x.float() / scale).clamp(-qmax, qmax).to(dtype), scale
    return quantize


def _floored_before_upcast(x):
    # the floor clamped in the 16-bit dtype, where 1e-12 rounds to another value than in fp32
    scale = x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12).float() / 448
    return (x.float() / scale).clamp(-448, 448).to(E4M3), scale


SPELLINGS = {
    "per_token": _per_token(lambda x: x.abs().amax(dim=-1, keepdim=True)),  # issue 29's
    "max_getitem": _per_token(lambda x: x.abs().max(dim=-1, keepdim=True)[0]),
    "max_values": _per_token(lambda x: x.abs().max(dim=-1, keepdim=True).values),
    "torch_max": _per_token(lambda x: torch.max(x.abs(), dim=-1, keepdim=True)[0]),
    "neg": _per_token(lambda x: (-x).abs().amax(dim=-1, keepdim=True)),
    "floored_before_upcast": _floored_before_upcast,
    "vllm": _vllm,
    "torchao": _torchao,
    "e5m2": _per_token(lambda x: x.abs().amax(dim=-1, keepdim=True), E5M2),
}


class SpelledFp8Linear(Fp8Linear):
    """An Fp8Linear whose input is quantized by one of SPELLINGS; forward dequantizes per row."""

    def __init__(self, n_in, n_out, spelling):
        super().__init__(n_in, n_out, "row")
        self.spelling = spelling

    def quantize(self, x):
        return SPELLINGS[self.spelling](x)


def spelled_llama(spelling, dtype):
    """Fp8Llama (2 blocks: 4 quantized norms, the final norm feeding a plain head) whose qkv and
    gate-up linears quantize their input as ``spelling`` writes it."""
    model = Fp8Llama(recipe="row")
    for block in model.layers:
        for name in ("qkv", "gate_up"):
            old = getattr(block, name)
            new = SpelledFp8Linear(old.weight.shape[1], old.weight.shape[0], spelling)
            new.weight = old.weight
            setattr(block, name, new)
    return model.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("spelling", sorted(SPELLINGS))
def test_every_quantized_norm_is_fused_with_its_quantization_bit_for_bit(spelling, dtype):
    model = spelled_llama(spelling, dtype)
    with torch.no_grad():
        want = model(token_ids())
        optimized = optimized_copy(model)
        got = optimized(token_ids())
    assert torch.equal(got, want)
    rep = normfuse.report(optimized)
    quantized = [s for s in rep.sites if s.quant is not None]
    assert len(rep.sites) == 5 and len(quantized) == 4, str(rep)
    assert all(s.fused and s.fused_quant and s.quant_reason is None for s in quantized), \
        [s.quant_reason for s in quantized]
    assert (rep.counts()["quantized"], rep.counts()["fused_quant"]) == (4, 4)
    fp8 = E5M2 if spelling == "e5m2" else E4M3
    assert all(s.quant == f"{str(fp8).removeprefix('torch.')}, dynamic per row" for s in quantized)
    calls = [c for c in fused_calls(rep.graph_modules[0].graph) if c.kwargs.get("quant_dtype") is not None]
    assert len(calls) == 4 and all(c.kwargs["quant_dtype"] == fp8 for c in calls)
    # nothing of the written-out quantization is left: no fp8 cast, no amax or max of |y|
    view = canonicalize(rep.graph_modules[0].graph)
    left = [n for n, c in view.items() if c.prim == "cast" and node_dtype(n) == fp8 or c.prim in ("abs", "amax")]
    assert left == [], left


# the options each spelling is read as (the epilogue's steps: normfuse/kernels/reference.py)
OPTIONS = {
    "per_token": dict(quant_scale_form="amax/max", quant_amax_min=1e-12, quant_scale_min=None, quant_apply="div",
                      quant_clamp=448.0),
    "floored_before_upcast": dict(quant_scale_form="amax/max", quant_apply="div", quant_clamp=448.0,
                                  quant_amax_min=float(torch.tensor(1e-12, dtype=torch.bfloat16))),
    "vllm": dict(quant_scale_form="amax/max", quant_amax_min=None, quant_apply="mul_reciprocal", quant_clamp=448.0,
                 quant_scale_min=float(torch.tensor(1.0) / (torch.tensor(448.0) * torch.tensor(512.0)))),
    "torchao": dict(quant_scale_form="max/amax", quant_amax_min=1e-12, quant_scale_min=None, quant_apply="mul",
                    quant_clamp=448.0),
}


class _Quantizes(nn.Module):
    """One add -> RMSNorm whose output is quantized by ``quantize``; returns (q, scale)."""

    def __init__(self, quantize, dim=64):
        super().__init__()
        self.quantize = quantize
        self.norm = nn.RMSNorm(dim, eps=1e-6)

    def forward(self, x, h):
        return self.quantize(self.norm(x + h))


def _inputs(dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(1)
    x, h = torch.randn(2, 8, 64, generator=g).to(dtype), torch.randn(2, 8, 64, generator=g).to(dtype)
    x[0, 3] = -h[0, 3]  # a row of zeros: its scale is the floor's
    return x, h


def _run(module, dtype=torch.bfloat16):
    model = module.to(dtype)
    x, h = _inputs(dtype)
    with torch.no_grad():
        want = model(x, h)
        optimized = optimized_copy(model)
        got = optimized(x, h)
    (site,) = normfuse.report(optimized).sites
    return site, got, want, optimized


@pytest.mark.parametrize("spelling", sorted(OPTIONS))
def test_a_zero_row_gets_the_graphs_scale_and_the_options_say_how(spelling):
    site, got, want, optimized = _run(_Quantizes(SPELLINGS[spelling]))
    assert site.fused_quant, site.quant_reason
    assert all(torch.equal(a.float(), b.float()) and a.dtype == b.dtype for a, b in zip(got, want))
    assert want[1][0, 3].item() != 0  # the floor decided the zero row's scale
    (call,) = fused_calls(normfuse.report(optimized).graph_modules[0].graph)
    assert {k: call.kwargs[k] for k in OPTIONS[spelling]} == OPTIONS[spelling]


@pytest.mark.parametrize("spelling", sorted(SPELLINGS))
def test_torch_export_graphs_too(spelling):
    # ATen spellings: aten.max.dim with its unread indices, aten.unsqueeze, aten.clamp.Tensor, and the
    # constants torch.export lifts into plain attributes (read through aten.lift_fresh_copy)
    model = _Quantizes(SPELLINGS[spelling]).to(torch.bfloat16)
    x, h = _inputs()
    with torch.no_grad():
        want = model(x, h)
        gm, rep = normfuse.fuse_graph(torch.export.export(model, (x, h)).module())
        got = gm(x, h)
    (site,) = rep.sites
    assert site.fused_quant, site.quant_reason
    assert all(torch.equal(a.float(), b.float()) and a.dtype == b.dtype for a, b in zip(got, want))


@pytest.mark.parametrize("spelling", ["per_token", "max_values", "neg", "vllm", "torchao"])
def test_check_compares_and_proves_the_site(spelling):
    model = _Quantizes(SPELLINGS[spelling]).to(torch.bfloat16)
    torch._dynamo.reset()
    res = normfuse.check(model, *_inputs(), backward=False)
    assert res.ok, str(res)
    (site,) = res.sites
    assert site.passed and site.symbolic.status == "proved", site.symbolic
    dtypes = [o.dtype for o in site.numeric.outputs]
    assert dtypes.count(str(E4M3)) == 1 and dtypes.count(str(F32)) == 1  # q and its scale
    assert all(o.ulp_max == 0 and o.passed for o in site.numeric.outputs)


def test_an_fp64_scale_rounded_to_fp32_is_fp32s_division():
    # why torchao's fp64 scale is the epilogue's fp32 one: for every bf16 and fp16 amax and a
    # million fp32 ones, fp32(q / fp64(a)) (Python's q / a: a reciprocal, then a multiply),
    # fp32(fp64 q / a) and fp32(fp64(a) / q) are fp32's correctly rounded q / a and a / q
    amaxes = []
    for dtype in (torch.bfloat16, torch.float16):
        every = torch.arange(0, 2 ** 15, dtype=torch.int16).view(dtype)
        amaxes.append(every[torch.isfinite(every)].float())
    bits = torch.randint(0, 0x7F800000, (1_000_000,), generator=torch.Generator().manual_seed(0))
    amaxes.append(bits.to(torch.int32).view(F32))
    a = torch.cat(amaxes)
    same = lambda u, v: torch.equal(u.view(torch.int32), v.view(torch.int32))  # noqa: E731
    for qmax in (448.0, 57344.0):
        wide = a.to(F64)
        assert same((qmax / wide).to(F32), torch.full_like(a, qmax) / a)
        assert same((torch.tensor(qmax, dtype=F64) / wide).to(F32), torch.full_like(a, qmax) / a)
        assert same((wide / qmax).to(F32), a / qmax)


class _Refuses(nn.Module):
    """One add -> RMSNorm whose output is quantized in a way the epilogue does not compute."""

    def __init__(self, how, dim=64):
        super().__init__()
        self.how = how
        self.norm = nn.RMSNorm(dim, eps=1e-6)

    def forward(self, x, h):
        s = x + h
        y = self.norm(s)
        if self.how == "amax_of_another_tensor":  # the scale measures the norm's input
            scale = s.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12) / 448
            return (y.float() / scale).clamp(-448, 448).to(E4M3), scale
        if self.how == "amax_capped":  # vLLM's scale_ub: a cap on the amax the epilogue has not
            scale = y.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12, max=1.0) / 448
            return (y.float() / scale).clamp(-448, 448).to(E4M3), scale
        if self.how == "max_of_negated_magnitude":  # max(-|y|) = -min|y|: not an amax
            scale = (-y.abs()).amax(dim=-1, keepdim=True).float().clamp(min=1e-12) / 448
            return (y.float() / scale).clamp(-448, 448).to(E4M3), scale
        if self.how == "fp64_floor_rounds_otherwise":  # 448 / 1e-3 in fp64 -> fp32 != 448 / fp32(1e-3)
            return _torchao(y, floor=1e-3)
        if self.how == "per_tensor_max":
            scale = torch.max(y.abs()).float() / 448
            return (y.float() / scale).clamp(-448, 448).to(E4M3), scale
        raise ValueError(self.how)


@pytest.mark.parametrize("how,reason", [
    ("amax_of_another_tensor", "the amax is taken of another value than the one divided by the scale"),
    ("amax_capped", "the scale is not computed from the amax of |y|"),
    ("max_of_negated_magnitude", "is not of an abs"),
    ("fp64_floor_rounds_otherwise", "the amax is floored at 0.001 in float64"),
    ("per_tensor_max", "the scale is not computed from the amax of |y|"),
])
def test_a_spelling_that_computes_something_else_stays_with_its_reason(how, reason):
    site, got, want, _ = _run(_Refuses(how))
    assert all(torch.equal(a.float(), b.float()) for a, b in zip(got, want))
    assert site.fused and site.fused_add and not site.fused_quant
    assert site.quant is not None and reason in site.quant_reason, site.quant_reason
