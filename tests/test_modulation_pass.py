"""The pass takes a diffusion transformer's block tail into one call (parts/modulation.py,
parts/gated_residual.py): the gated residual branch ``h + gate * f(h)``, the add, the norm and the
adaLN modulation ``y * (1 + scale) + shift``, in every spelling the blocks write.

Per spelling: the call takes it (the report says so), the output equals the block's eager ops
bit for bit on the reference path (fp32 and bf16), the gradients are held to the tolerance rule
against fp64, and ``normfuse.check`` proves the site. Planted faults (scale and shift swapped, the
raw scale read where the graph has ``1 + scale``, the gate on the stream instead of the branch,
Wan's fp32 composition rounded per op) are refuted at their site. A modulation the call cannot
take keeps a reason.
"""

from __future__ import annotations

import operator

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import eager_and_optimized, optimized_with_fault

import normfuse
from normfuse.tolerances import within_tolerance
from normfuse.verify.sites import fused_calls

B, S, C = 2, 6, 32
FORMS = ("dit", "scale_first", "addcmul", "wan", "scale_only", "shift_only", "weight_after")


class Block(nn.Module):
    """A DiT block's second half: h = h + gate * attn(h); then norm2, modulated as ``form`` writes it."""

    def __init__(self, form: str, gated: bool = True, dtype=torch.float32):
        super().__init__()
        self.form, self.gated = form, gated
        self.attn = nn.Linear(C, C, dtype=dtype)
        self.ada = nn.Linear(C, 3 * C, dtype=dtype)
        self.norm2 = nn.LayerNorm(C, elementwise_affine=False, eps=1e-6, dtype=dtype)
        self.gamma = nn.Parameter(torch.randn(C, dtype=dtype))
        self.ff = nn.Linear(C, C, dtype=dtype)

    def forward(self, h, emb):
        gate, scale, shift = self.ada(F.silu(emb)).chunk(3, dim=1)
        branch = self.attn(h)
        h = h + (gate.unsqueeze(1) * branch if self.gated else branch)
        form = self.form
        if form == "wan":
            n = self.norm2(h.float())
            m = (n * (1 + scale[:, None].float()) + shift[:, None].float()).type_as(h)
        else:
            n = self.norm2(h)
            if form == "dit":
                m = n * (1 + scale[:, None]) + shift[:, None]
            elif form == "scale_first":
                m = (1 + scale[:, None]) * n + shift[:, None]
            elif form == "addcmul":
                m = torch.addcmul(shift[:, None], n, 1 + scale[:, None])
            elif form == "scale_only":
                m = n * (1 + scale[:, None])
            elif form == "shift_only":
                m = n + shift[:, None]
            else:  # "weight_after": a norm without affine, then its weight (x-transformers' LayerNorm)
                m = n * self.gamma
        return self.ff(m), h


def _inputs(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, S, C, generator=g).to(dtype), torch.randn(B, C, generator=g).to(dtype)


def _model(form, dtype=torch.float32, gated=True):
    torch.manual_seed(0)
    return Block(form, gated, dtype).eval()


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=("fp32", "bf16"))
@pytest.mark.parametrize("form", FORMS)
def test_each_spelling_is_taken_and_equals_eager(form, dtype):
    model = _model(form, dtype)
    h, emb = _inputs(dtype)
    with torch.no_grad():
        want = model(h, emb)
        opt = normfuse.optimize(model)
        got = opt(h, emb)
    site = next(s for s in normfuse.report(opt).sites if "norm2" in (s.fqn or ""))
    assert site.fused and site.fused_add and site.fused_gated_residual, site
    # a weight after a norm without affine is the norm's own (the finder reads it as its weight,
    # rounded where the graph rounds: find.py); every other form is the modulation's
    assert site.fused_modulation == (form != "weight_after"), site
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("form", ("dit", "wan", "addcmul"))
def test_gradients_within_the_rule(form):
    dtype = torch.bfloat16
    model = _model(form, dtype)
    h, emb = _inputs(dtype, seed=3)
    exact = _model(form, torch.float64)
    exact.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    g = torch.Generator().manual_seed(5)
    cots = [torch.randn(B, S, C, generator=g, dtype=torch.float64) for _ in range(2)]

    def grads(m, x, e):
        x, e = x.clone().requires_grad_(), e.clone().requires_grad_()
        out = m(x, e)
        sum((o.double() * c).sum() for o, c in zip(out, cots)).backward()
        return {"h": x.grad, "emb": e.grad, **{n: p.grad for n, p in m.named_parameters()}}

    base = grads(model, h, emb)
    want = grads(exact, h.double(), emb.double())
    opt = normfuse.optimize(_model(form, dtype))
    got = grads(opt, h, emb)
    assert normfuse.report(opt).counts()["fused_modulation"] == 1
    for name, g_base in base.items():
        if g_base is None:
            continue
        ok, err, err_base, bound = within_tolerance(got[name], g_base, want[name], dtype=g_base.dtype)
        assert ok, f"d{name}: error {err:.3g} > bound {bound:.3g} (eager's {err_base:.3g})"


@pytest.mark.parametrize("form", FORMS)
def test_check_proves_the_site(form):
    model = _model(form)
    res = normfuse.check(model, *_inputs(torch.float32), backward=False)
    assert res.ok, res
    site = next(s for s in res.sites if "norm2" in s.id or "norm2" in str(s))
    assert site.symbolic.status == "proved", site.symbolic


# --------------------------------------------------------------------------- planted faults

def _plant(gm, fault):
    call = next(n for n in fused_calls(gm.graph) if n.kwargs.get("mod_scale") is not None
                or n.kwargs.get("mod_shift") is not None)
    kw = dict(call.kwargs)
    if fault == "scale_shift_swapped":
        kw["mod_scale"], kw["mod_shift"] = kw["mod_shift"], kw["mod_scale"]
    elif fault == "raw_scale":      # the call multiplies by scale[:, None] where the graph has 1 + scale[:, None]
        assert kw["mod_one_plus"]   # (the call computes the graph's 1 + scale itself)
        kw["mod_one_plus"] = False
    elif fault == "gate_on_stream":  # the gate multiplies the residual instead of the branch
        x, residual = call.args[:2]
        call.args = (residual, x, *call.args[2:])
    elif fault == "wan_rounded_per_op":  # Wan's fp32 steps rounded to bf16 after each op
        assert kw["mod_dtype"] == torch.float32
        kw["mod_dtype"] = torch.bfloat16
    else:
        raise ValueError(fault)
    call.kwargs = kw
    gm.recompile()


@pytest.mark.parametrize("form,fault,status", [("dit", "scale_shift_swapped", "refuted"),
                                               ("dit", "raw_scale", "refuted"),
                                               ("dit", "gate_on_stream", "refuted"),
                                               ("wan", "wan_rounded_per_op", "proved")])
def test_planted_fault_is_refuted_at_its_site(form, fault, status):
    dtype = torch.bfloat16 if form == "wan" else torch.float32
    model = _model(form, dtype)
    optimized = optimized_with_fault(model, lambda gm: _plant(gm, fault))
    res = normfuse.check(model, *_inputs(dtype), optimized=optimized, backward=False)
    assert not res.ok
    failing = [s for s in res.sites if not s.passed]
    assert [s.id for s in failing] == [res.first_divergence.id]
    assert "norm2" in str(res.first_divergence)
    # a change of the exact math is refuted; a rounding fault is caught numerically, its math proved
    assert res.first_divergence.symbolic.status == status, res.first_divergence.symbolic
    assert res.first_divergence.numeric.passed is False


# --------------------------------------------------------------------------- left as it was, with a reason

def test_fuse_modulation_false_leaves_the_chain():
    model = _model("dit")
    opt = normfuse.optimize(model, fuse_modulation=False)
    with torch.no_grad():
        opt(*_inputs(torch.float32))
    site = next(s for s in normfuse.report(opt).sites if "norm2" in (s.fqn or ""))
    assert site.fused and not site.fused_modulation and not site.fused_gated_residual
    assert site.modulation_reason == "modulations are not fused (fuse_modulation=False)"
    assert site.gated_residual_reason == "gated residual branches are not fused (fuse_modulation=False)"


class ReadTwice(nn.Module):
    """The norm's output modulated by several readers (SD3.5's AdaLayerNormZeroX: two, for its attention
    and its second attention); ``steps``: per reader, whether it adds a shift."""

    def __init__(self, steps=(True, True), mixed=False):
        super().__init__()
        self.norm, self.steps, self.mixed = nn.LayerNorm(C, elementwise_affine=False), steps, mixed

    def forward(self, h, scale):
        n = self.norm(h)
        if self.mixed:  # 1 + scale beside 2 + scale: the call takes both factors as the graph computed them
            return tuple(n * (k + 1 + scale[:, None]) + k * scale[:, None] for k in range(len(self.steps)))
        return tuple(n * (1 + (k + 1) * scale[:, None]) + (k * scale[:, None] if shifted else 0)
                     for k, shifted in enumerate(self.steps))


class PerSegment(nn.Module):
    """HunyuanVideo I2V's token_replace: the first frame's tokens modulated with their own scale and
    shift, the others with the block's, then concatenated."""

    def __init__(self, first=3):
        super().__init__()
        self.norm, self.first = nn.LayerNorm(C, elementwise_affine=False), first

    def forward(self, h, scale):
        n = self.norm(h)
        zero = n[:, :self.first] * (1 + scale[:, None]) + scale[:, None]
        rest = n[:, self.first:] * (2 + scale[:, None]) - scale[:, None]
        return torch.cat([zero, rest], dim=1)


@pytest.mark.parametrize("mixed", [False, True], ids=("one_plus", "mixed_factors"))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_two_modulations_of_one_norm_are_its_call_s_y_and_y1(dtype, mixed):
    """SD3.5's two modulations of one norm's output: one call returns both (y and y1), the same bits,
    the site proved; the call's second modulation reading the first's shift is refuted at its site."""
    from normfuse.verify.sites import fused_calls

    model, (h, emb) = ReadTwice(mixed=mixed), _inputs(dtype)
    with torch.no_grad():
        want = model(h, emb)
        res = normfuse.check(model, h, emb, backward=False)

        def first_shift_twice(gm):
            call = next(iter(fused_calls(gm.graph)))
            call.kwargs = {**call.kwargs, "mod1_shift": call.kwargs["mod_shift"]}
            gm.recompile()
        faulty = normfuse.check(model, h, emb, backward=False, optimized=optimized_with_fault(model, first_shift_twice))
        opt = normfuse.optimize(model)
        got = opt(h, emb)
    site = normfuse.report(opt).sites[0]
    assert site.fused and site.fused_modulation and site.modulation.endswith("2 times"), site
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert res.ok and [s.symbolic.status for s in res.sites] == ["proved"], res
    assert not faulty.ok and [s.symbolic.status for s in faulty.sites] == ["refuted"], faulty


@pytest.mark.parametrize("model,why", [
    (ReadTwice((True, True, True)), "the norm's output is modulated 3 times: the call returns two"),
    (ReadTwice((True, False)), "the norm's output is modulated twice with different steps"),
])
def test_a_norm_modulated_more_than_once_otherwise_is_fused_without_the_modulations_with_the_reason(model, why):
    h, emb = _inputs(torch.float32)
    with torch.no_grad():
        want = model(h, emb)
        opt = normfuse.optimize(model)
        got = opt(h, emb)
    site = normfuse.report(opt).sites[0]
    assert site.fused and site.modulation and not site.fused_modulation, site
    assert site.modulation_reason.startswith(why), site.modulation_reason
    for a, b in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
        assert torch.equal(a, b)


def test_a_norm_modulated_per_segment_is_split_per_segment():
    """HunyuanVideo I2V's token_replace: the norm is split per slice of its rows (passes/norm_over_slices.py),
    each slice's norm takes the modulation that slice has (the second's ``- scale`` stays a subtraction
    after its call); the same bits."""
    h, emb = _inputs(torch.float32)
    model = PerSegment()
    with torch.no_grad():
        want = model(h, emb)
        opt = normfuse.optimize(model)
        got = opt(h, emb)
    sites = normfuse.report(opt).sites
    assert len(sites) == 2 and all(s.fused and s.fused_modulation for s in sites), sites
    assert torch.equal(got, want)


class ScaleFromTheSum(nn.Module):
    """A factor computed from the sum the call makes: the call cannot read it before it computes it."""

    def __init__(self):
        super().__init__()
        self.norm, self.lin = nn.LayerNorm(C, elementwise_affine=False), nn.Linear(C, C)

    def forward(self, h):
        h = h + self.lin(h)
        n = self.norm(h)
        return n * (1 + h.mean(-1, keepdim=True)), h


def test_a_factor_computed_from_the_sum_keeps_the_modulation_in_the_graph():
    model = ScaleFromTheSum().eval()
    h, _ = _inputs(torch.float32)
    with torch.no_grad():
        want = model(h)
        opt = normfuse.optimize(model)
        got = opt(h)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    site = normfuse.report(opt).sites[0]
    assert site.fused and site.fused_add and site.modulation and not site.fused_modulation, site
    assert site.modulation_reason.startswith("the modulation's scale and shift: operand"), site.modulation_reason


def _mochi_norm(x, scale, eps=1e-6):
    """Mochi's modulated RMSNorm: the statistics and the scale in fp32, then a cast to x's dtype."""
    dtype = x.dtype
    x = x.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return (x * scale).to(dtype)


class MochiBlock(nn.Module):
    """Mochi's block tail: ``h + norm2(attn, tanh(gate))`` (the gate is the norm's scale), then norm3 of
    that sum. The add reads the modulated output through its cast to its own dtype."""

    def __init__(self):
        super().__init__()
        self.attn, self.ff = nn.Linear(C, C), nn.Linear(C, C)

    def forward(self, h, emb):
        h = h + _mochi_norm(self.attn(h), torch.tanh(emb).unsqueeze(1))
        n = _mochi_norm(h, 1 + emb.unsqueeze(1).to(torch.float32))
        return h + _mochi_norm(self.ff(n), torch.tanh(2 * emb).unsqueeze(1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_modulated_output_read_through_a_cast_to_its_own_dtype(dtype):
    """The next call reads the first call's y where the graph has the value before the no-op cast
    (the pass failed its lint and left the graph as it was)."""
    torch.manual_seed(0)
    model, (h, emb) = MochiBlock().to(dtype).eval(), _inputs(dtype)
    with torch.no_grad():
        want = model(h, emb)
        opt = normfuse.optimize(model)
        got = opt(h, emb)
    rep = normfuse.report(opt)
    assert torch.equal(got, want)
    assert [(s.op, s.fused_modulation) for s in rep.sites] == [("norm", True), ("add_norm", True), ("norm", True)], rep


class PerTokenFactor(nn.Module):
    """Wan 2.2 TI2V / LTX: a scale and shift per token, the factor ``1 + scale`` a (B, S, C) add of its own."""

    def __init__(self):
        super().__init__()
        self.norm, self.emb = nn.LayerNorm(C, elementwise_affine=False), nn.Linear(C, 2 * C)

    def forward(self, h):
        scale, shift = self.emb(h).chunk(2, dim=-1)
        return self.norm(h) * (1 + scale) + shift


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_call_computes_the_factor_one_plus_scale(dtype):
    """The per-token ``1 + scale`` is computed in the call (mod_one_plus): no add of the activation's
    size is left, the same bits, the site proved."""
    from normfuse.verify.sites import fused_calls

    torch.manual_seed(0)
    model, (h, _) = PerTokenFactor().to(dtype).eval(), _inputs(dtype)
    with torch.no_grad():
        want = model(h)
        res = normfuse.check(model, h, backward=False)
        opt = normfuse.optimize(model)
        got = opt(h)
    rep = normfuse.report(opt)
    assert torch.equal(got, want)
    assert rep.sites[0].fused_modulation and rep.sites[0].modulation.startswith("y * (1 + scale) + shift"), rep
    graph = rep.graph_modules[0].graph
    assert [c.kwargs["mod_one_plus"] for c in fused_calls(graph)] == [True]
    assert not [n for n in graph.nodes if n.op == "call_function" and n.target in (operator.add, torch.add)]
    assert res.ok and [s.symbolic.status for s in res.sites] == ["proved"], res


class FP32NormBlock(nn.Module):
    """Diffusers' FP32LayerNorm in a 16-bit model, then the modulation: ``F.layer_norm(x.float(), ...)
    .to(x.dtype)`` modulated by a scale and shift in ``mod_dtype`` (the model's, or fp32 as a temb kept
    in fp32 gives); ``back_up``: the rounded y cast back to fp32 before the product."""

    def __init__(self, mod_dtype=None, back_up=False, affine=True):
        super().__init__()
        self.proj, self.emb = nn.Linear(16, 16), nn.Linear(8, 32)
        self.norm = nn.LayerNorm(16, eps=1e-6, elementwise_affine=affine)
        if affine:
            with torch.no_grad():
                self.norm.weight.uniform_(0.5, 1.5)
                self.norm.bias.uniform_(-0.5, 0.5)
        self.mod_dtype, self.back_up = mod_dtype, back_up

    def forward(self, x, t):
        scale, shift = self.emb(t).chunk(2, dim=-1)
        if self.mod_dtype is not None:
            scale, shift = scale.to(self.mod_dtype), shift.to(self.mod_dtype)
        h = x + self.proj(x)
        w, b = (None, None) if self.norm.weight is None else (self.norm.weight.float(), self.norm.bias.float())
        y = F.layer_norm(h.float(), (16,), w, b, 1e-6).to(x.dtype)
        if self.back_up:
            y = y.float()
        return y * (1 + scale[:, None]) + shift[:, None]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", ["model_dtype", "no_affine", "fp32_scale", "back_up"])
def test_a_norm_in_fp32_rounded_before_its_modulation(case, dtype):
    """The call rounds y to the modulation's dtype before the product: taken where that is the dtype y
    was rounded to (the scale in the model's dtype), with the reason where the product is wider
    (a scale kept in fp32, y cast back up after its rounding); the output the same bits either way."""
    model = FP32NormBlock(mod_dtype=torch.float32 if case == "fp32_scale" else None, back_up=case == "back_up",
                          affine=case != "no_affine").to(dtype)
    g = torch.Generator().manual_seed(0)
    x, t = torch.randn(2, 5, 16, generator=g).to(dtype), torch.randn(2, 8, generator=g).to(dtype)
    with torch.no_grad():
        want = model(x, t)
        optimized = normfuse.optimize(model)
        got = optimized(x, t)
    site = normfuse.report(optimized).sites[0]
    assert torch.equal(got, want), (got.float() - want.float()).abs().max()
    if case in ("model_dtype", "no_affine"):
        assert site.fused and site.fused_modulation, site
    elif case == "fp32_scale":
        assert site.fused and not site.fused_modulation and "rounded to" in site.modulation_reason, site
    else:
        assert site.fused and not site.fused_modulation, site


class ViewedToFrames(nn.Module):
    """Kandinsky 5's output layer: the last residual add on (B, N, C), its sum viewed to (B, T, H, W, C),
    normalized and modulated there, the scale and shift (B, 1, 1, 1, C) after ``[:, None, None]`` (or one
    value per column: ``per_column``)."""

    def __init__(self, per_column=False, d=16):
        super().__init__()
        self.per_column = per_column
        self.proj, self.mod = nn.Linear(d, d), nn.Linear(d, 2 * d)
        self.norm, self.out = nn.LayerNorm(d, elementwise_affine=False), nn.Linear(d, 4)
        self.table = nn.Parameter(torch.randn(2, d))

    def forward(self, x, t):
        x = x + self.proj(x)
        x = x.reshape(x.shape[0], 2, 4, 4, x.shape[-1])
        if self.per_column:
            scale, shift = self.table
        else:
            scale, shift = (v[:, None, None, None] for v in self.mod(t).chunk(2, dim=-1))
        return self.out(self.norm(x) * (1 + scale) + shift)


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("per_column", [False, True])
def test_a_modulation_after_a_view_of_the_sum(per_column, batch):
    """The call computes in the add's shape (B, N, C) and y is viewed to (B, T, H, W, C) after it: a
    scale of (B, 1, 1, 1, C) broadcasts against the view only, and stays outside the call with the reason
    (the optimized model ran into the op's shape check before); one value per column is taken."""
    torch.manual_seed(0)
    model = ViewedToFrames(per_column).eval()
    x, t = torch.randn(batch, 32, 16), torch.randn(batch, 16)
    want, got, rep = eager_and_optimized(model, x, t)
    site = rep.sites[0]
    assert torch.equal(got, want)
    assert site.fused and site.fused_add, site
    if per_column:
        assert site.fused_modulation, site
    else:
        assert not site.fused_modulation and "viewed to (" in site.modulation_reason, site


class LearnedModulation(nn.Module):
    """A norm without affine followed by learned parameters of one value per column, as a block may hold
    them: ``shape`` (C,), (1, 1, C) or (1, 1, 1, C) (the last widens y to 4 dims), ``form`` the steps."""

    def __init__(self, shape, form, d=16, dtype=torch.float32):
        super().__init__()
        self.form = form
        self.proj, self.out = nn.Linear(d, d, dtype=dtype), nn.Linear(d, 4, dtype=dtype)
        self.norm = nn.LayerNorm(d, elementwise_affine=False, dtype=dtype)
        self.scale = nn.Parameter(torch.randn(*shape, dtype=dtype))
        self.shift = nn.Parameter(torch.randn(*shape, dtype=dtype))

    def forward(self, x):
        x = x + self.proj(x)
        n = self.norm(x)
        if self.form == "one_plus":
            y = n * (1 + self.scale) + self.shift
        elif self.form == "scale_shift":
            y = n * self.scale + self.shift
        else:  # "shift"
            y = n + self.shift
        return self.out(y)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=("fp32", "bf16"))
@pytest.mark.parametrize("form", ("one_plus", "scale_shift", "shift"))
@pytest.mark.parametrize("shape", ((16,), (1, 1, 16), (1, 1, 1, 16)), ids=("C", "11C", "111C"))
def test_learned_parameters_after_a_norm_without_affine(shape, form, dtype):
    """The op takes a weight and a bias of shape (C,) only: a (1, 1, C) parameter is the modulation's
    per-column operand, a (1, 1, 1, C) one (y widened) stays in the graph (the optimized model ran into
    the op's shape check with both before). After a norm call, ``+ bias`` is not the op's bias: eager's
    layer_norm with a bias rounds its affine step otherwise than a separate add (fp32 differed by 1 ulp)."""
    torch.manual_seed(0)
    model = LearnedModulation(shape, form, dtype=dtype).eval()
    x = torch.randn(2, 8, 16).to(dtype)
    want, got, rep = eager_and_optimized(model, x)
    site = rep.sites[0]
    assert site.fused and site.fused_add, site
    assert torch.equal(got, want)
    if len(shape) < 4:  # the scale is the norm's weight or the modulation's factor; the shift the modulation's
        assert site.fused_modulation, site
    res = normfuse.check(LearnedModulation(shape, form), torch.randn(2, 8, 16))
    assert res.ok, res
    assert all(s.symbolic.status == "proved" for s in res.sites), res


class ScaleFromAnotherNorm(nn.Module):
    """One norm's scale is computed from another norm's output, and its own add comes first: its call would
    move the scale's projection up before its add, above the other norm's call that makes what it reads."""

    def __init__(self, d=16):
        super().__init__()
        self.f, self.g, self.proj, self.out = (nn.Linear(d, d) for _ in range(4))
        self.norm_a, self.norm_b = nn.LayerNorm(d), nn.LayerNorm(d, elementwise_affine=False)

    def forward(self, x, z):
        sum_b = x + self.f(x)
        sum_a = z + self.g(z)
        scale = self.proj(self.norm_a(sum_a))
        return self.out(self.norm_b(sum_b) * (1 + scale)), sum_a


def test_an_operand_read_from_an_earlier_call_s_output_is_not_moved_above_that_call():
    """Every value a call replaces is made where the call goes: a later call moves no reader of it above
    that (the pass failed its lint stage and left the graph unchanged before); this call goes where its
    output is first read instead."""
    torch.manual_seed(0)
    model = ScaleFromAnotherNorm().eval()
    x, z = torch.randn(2, 8, 16), torch.randn(2, 8, 16)
    want, got, rep = eager_and_optimized(model, x, z)
    assert all(s.fused and s.fused_add for s in rep.sites) and rep.counts()["fused_modulation"] == 1, rep
    assert all(torch.equal(a, b) for a, b in zip(got, want))


class TwoGatedBranches(nn.Module):
    """SD3.5's dual-attention block (``"sd35"``: the first attention's gated branch added to the stream, then
    the second's, then norm2 and its modulation), and ``"control"``: a block's gated branch added, then a
    control hint scaled by a number (WanVACE's, without Wan's fp32 composition), then the next norm."""

    def __init__(self, form, dtype=torch.float32, d=C):
        super().__init__()
        self.form = form
        self.attn, self.attn2, self.ff = (nn.Linear(d, d, dtype=dtype) for _ in range(3))
        self.ada = nn.Linear(d, 4 * d, dtype=dtype)
        self.norm2 = nn.LayerNorm(d, elementwise_affine=False, eps=1e-6, dtype=dtype)

    def forward(self, h, emb):
        gate, gate2, scale, shift = (c.unsqueeze(1) for c in self.ada(F.silu(emb)).chunk(4, dim=1))
        first, second = self.attn(h), self.attn2(h)  # (SD3.5's attn2 reads norm1's second output, not the sum)
        h = h + gate * first
        h = h + (gate2 * second if self.form == "sd35" else second * 0.5)
        return self.ff(self.norm2(h) * (1 + scale) + shift), h


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=("fp32", "bf16"))
@pytest.mark.parametrize("form", ("sd35", "control"))
def test_a_gated_branch_added_before_another_branch(form, dtype):
    """``(h + gate * a) + b``: the call gates a, adds h as its second branch (x1), then b as its residual,
    as the two adds round (SD3.5's second gate: the gated branch was left to eager with the reason that
    the call took a second branch)."""
    torch.manual_seed(0)
    model = TwoGatedBranches(form, dtype).eval()
    h, emb = _inputs(dtype)
    want, got, rep = eager_and_optimized(model, h, emb)
    site = rep.sites[0]
    assert site.fused_add and site.fused_x1 and site.fused_gated_residual and site.fused_modulation, site
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    res = normfuse.check(TwoGatedBranches(form), *_inputs(torch.float32))
    assert res.ok, res
    assert res.sites[0].symbolic.status == "proved", res.sites[0]



class WanControlHint(nn.Module):
    """WanVACE: a Wan block's sum formed in fp32 and rounded by a cast, then a control hint added."""

    def __init__(self, d=C):
        super().__init__()
        self.ffn, self.ada, self.out = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.norm1 = nn.LayerNorm(d, elementwise_affine=False, eps=1e-6)

    def forward(self, h, emb, hint):
        gate = self.ada(emb).unsqueeze(1)
        h = (h.float() + self.ffn(h).float() * gate).type_as(h)
        h = h + hint * 0.5
        return self.out(self.norm1(h)), h


def test_a_gated_branch_in_a_sum_rounded_by_a_cast_keeps_the_reason():
    torch.manual_seed(0)
    model = WanControlHint().eval()
    h, emb = _inputs(torch.float32)
    hint = torch.randn(B, S, C)
    want, got, rep = eager_and_optimized(model, h, emb, hint)
    site = rep.sites[0]
    assert site.fused_add and not site.fused_gated_residual, site
    assert site.gated_residual_reason.startswith("the gated branch is in a sum rounded by a cast"), site
    assert all(torch.equal(a, b) for a, b in zip(got, want))


class ModulatedPerFrame(nn.Module):
    """SANA-WM: the norm's output viewed to (B, frames, tokens, C), then modulated with a scale per frame."""

    def __init__(self, d=16, frames=2):
        super().__init__()
        self.frames = frames
        self.proj, self.mod, self.out = nn.Linear(d, d), nn.Linear(d, 2 * d * frames), nn.Linear(d, d)
        self.norm = nn.LayerNorm(d, elementwise_affine=False, eps=1e-6)

    def forward(self, x, t):
        b, n, d = x.shape
        x = x + self.proj(x)
        scale, shift = self.mod(t).view(b, self.frames, 1, 2 * d).chunk(2, dim=-1)
        y = self.norm(x).reshape(b, self.frames, -1, d) * (1 + scale) + shift
        return self.out(y.reshape(b, n, d))


def test_a_modulation_after_a_view_of_the_norm_s_output_keeps_the_reason():
    torch.manual_seed(0)
    model = ModulatedPerFrame().eval()
    x, t = torch.randn(2, 8, 16), torch.randn(2, 16)
    want, got, rep = eager_and_optimized(model, x, t)
    site = rep.sites[0]
    assert site.fused_add and site.modulation and not site.fused_modulation, site
    assert site.modulation_reason.startswith("the norm's output is viewed to (2, 2, 4, 16) before its modulation")
    assert torch.equal(got, want)


def test_two_branches_under_autocast_keep_the_stream_s_dtype():
    """Under autocast the stream stays fp32 while ``gate * attn`` is bf16: the inner sum rounds to fp32, not
    the product's dtype, so the gate stays outside the call with the reason, and the call still takes the
    inner sum as its second branch (a refused gate once left x and x1 both the stream: (h + h) + b)."""
    torch.manual_seed(0)
    model = TwoGatedBranches("sd35").eval()
    h, emb = _inputs(torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want, got, rep = eager_and_optimized(model, h, emb)
    site = rep.sites[0]
    assert site.fused_x1 and not site.fused_gated_residual, site
    assert site.gated_residual_reason == "the gated product and the value it is first added to differ in dtype"
    assert all(torch.equal(a, b) for a, b in zip(got, want))


class ScaledNormThenBranch(nn.Module):
    """Z-Image's gate on a norm's output (``h + tanh(g) * norm2(a)``: the product is norm2's call's y,
    scaled in its epilogue), then another branch added before the next norm."""

    def __init__(self, second_gated, d=C):
        super().__init__()
        self.second_gated = second_gated
        self.attn, self.attn2, self.ff = (nn.Linear(d, d) for _ in range(3))
        self.ada = nn.Linear(d, 2 * d)
        self.norm_a2, self.norm_ff = nn.RMSNorm(d, eps=1e-6), nn.RMSNorm(d, eps=1e-6)

    def forward(self, h, emb):
        g1, g2 = (c.unsqueeze(1) for c in self.ada(F.silu(emb)).chunk(2, dim=1))
        a, b = self.attn(h), self.attn2(h)
        h = h + torch.tanh(g1) * self.norm_a2(a)
        h = h + (g2 * b if self.second_gated else b)
        return self.ff(self.norm_ff(h)), h


@pytest.mark.parametrize("second_gated", [True, False])
def test_a_branch_another_call_scales_is_not_folded(second_gated):
    """The inner sum's operand is another call's output: the next call does not fold it as its second branch
    (the pass failed its lint stage and left the whole graph unchanged); both norms fused, the same bits."""
    torch.manual_seed(0)
    model = ScaledNormThenBranch(second_gated).eval()
    h, emb = _inputs(torch.float32)
    want, got, rep = eager_and_optimized(model, h, emb)
    assert all(s.fused for s in rep.sites) and rep.sites[1].fused_add and not rep.warnings, rep
    assert rep.sites[1].fused_gated_residual == second_gated, rep
    assert all(torch.equal(a, b) for a, b in zip(got, want))
