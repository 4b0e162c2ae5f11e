"""Code bases written differently from transformers: module lists with holes, x-transformers.

x-transformers (lucidrains) keeps ``None`` in its module lists where a variant has no module
(``layer_integrators``, a block's norms without a post-branch norm) and writes its norms
without affine parameters (``nn.LayerNorm(d, elementwise_affine=False)`` then ``* gamma``).
Preparation reads such lists without failing, and leaves them as they were with a reason.
"""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import normfuse
from normfuse.passes.blocks import block_lists
from normfuse.passes.prenorm_model import final_norm_like

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


class _Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        return x + self.fc(self.norm(x))


class _Holes(nn.Module):
    """A stack with a list of ``None`` next to its blocks, and a block list with a hole."""

    def __init__(self, d=16, depth=3):
        super().__init__()
        self.blocks = nn.ModuleList([_Block(d) for _ in range(depth)])
        self.integrators = nn.ModuleList([None] * depth)
        self.mixed = nn.ModuleList([_Block(d), None, _Block(d)])
        self.norm = nn.LayerNorm(d)

    def forward(self, x):
        for block, integrate in zip(self.blocks, self.integrators):
            x = block(x)
            if integrate is not None:
                x = integrate(x)
        return self.norm(x)


def test_block_lists_skip_lists_holding_none():
    assert block_lists(_Holes()) == ["blocks"]


@pytest.mark.parametrize("options", [{}, {"prenorm": True}])
def test_prepare_takes_none_entries(options):
    torch.manual_seed(0)
    model = _Holes().eval()
    x = torch.randn(2, 5, 16)
    ref = model(x)
    done = normfuse.prepare(copy.deepcopy(model), **options)
    assert not any("failed" in note for note in done.notes), done.notes
    normfuse.optimize(model, **options)
    assert torch.equal(model(x), ref)
    assert not any("failed" in note for note in normfuse.report(model).notes)


def test_final_norm_like_a_norm_without_affine():
    final = final_norm_like(nn.LayerNorm(24, elementwise_affine=False))
    assert isinstance(final, nn.LayerNorm) and final.normalized_shape == (24,) and final.weight is None
    final = final_norm_like(nn.RMSNorm(24, elementwise_affine=False, eps=1e-6))
    assert isinstance(final, nn.RMSNorm) and final.normalized_shape == (24,) and final.eps == 1e-6


def _x_transformer(**layers):
    xt = pytest.importorskip("x_transformers")
    torch.manual_seed(0)
    kind = layers.pop("kind", "Decoder")
    attn = getattr(xt, kind)(dim=32, depth=2, heads=2, **layers)
    return xt.TransformerWrapper(num_tokens=64, max_seq_len=16, attn_layers=attn).eval()


@pytest.mark.parametrize("options", [{}, {"prenorm": True}])
def test_x_transformers_prepare_does_not_fail(options):
    model = _x_transformer()
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    ref = model(ids)
    normfuse.optimize(model, **options)
    assert torch.equal(model(ids), ref)
    notes = normfuse.report(model).notes
    assert not any("prepare: failed" in note for note in notes), notes
    assert any("cross-block: attn_layers.layers: left as it was" in note for note in notes), notes


class _AffineFree(nn.Module):
    """``nn.LayerNorm(d, elementwise_affine=False)`` then its weight (x-transformers' LayerNorm,
    ``unit_offset``: ``gamma + 1.0``), reading a residual add."""

    def __init__(self, d=32, offset=0.0):
        super().__init__()
        self.ln = nn.LayerNorm(d, elementwise_affine=False)
        self.gamma = nn.Parameter(1 - offset + 0.1 * torch.randn(d))
        self.offset = offset

    def forward(self, x, r):
        h = x + r
        return self.ln(h) * (self.gamma + self.offset), h


@pytest.mark.parametrize("dtype,gamma_dtype,offset", [(torch.float32, torch.float32, 1.0),
                                                      (torch.bfloat16, torch.bfloat16, 0.0),
                                                      (torch.bfloat16, torch.float32, 0.0)])
def test_weight_after_an_affine_free_norm_is_folded(dtype, gamma_dtype, offset):
    torch.manual_seed(0)
    model = _AffineFree(offset=offset).eval().to(dtype)
    model.gamma.data = model.gamma.data.to(gamma_dtype)
    x, r = torch.randn(2, 5, 32, dtype=dtype), torch.randn(2, 5, 32, dtype=dtype)
    ref = model(x, r)
    normfuse.optimize(model)
    out = model(x, r)
    [site] = normfuse.report(model).sites
    assert site.fused and site.fused_add and site.form == "module"
    assert site.weight_offset == offset
    # the call returns what the multiply returned: n rounded to the input dtype, then times gamma
    assert site.out_dtype == str(torch.promote_types(dtype, gamma_dtype))
    assert site.norm_round_dtype == (str(dtype) if dtype != torch.float32 else None)
    assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])


def test_x_transformers_layer_norm_weight_folded_and_proved():
    model = _x_transformer()
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    result = normfuse.check(model, ids)
    assert result.ok, result
    assert [s.symbolic.status for s in result.sites] == ["proved"] * 5
    optimized = normfuse.optimize(copy.deepcopy(model))
    optimized(ids)
    assert all(s.fused and s.weight_offset == 1.0 for s in normfuse.report(optimized).sites)


# --------------------------------------------------------------------------- F.normalize norms

@pytest.mark.parametrize("variant", ["use_rmsnorm", "use_scalenorm", "use_simple_rmsnorm"])
def test_x_transformers_normalize_norms_are_fused_and_proved(variant):
    """x-transformers' RMSNorm, ScaleNorm and SimpleRMSNorm are ``F.normalize(x, dim=-1) * dim ** 0.5``
    (times g): the l2_norm call (eps clamps the row's L2 norm) with the residual add, outputs equal
    to eager, gradients within the rule, every site proved."""
    model = _x_transformer(**{variant: True})
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    result = normfuse.check(model, ids)
    assert result.ok, result
    assert [s.symbolic.status for s in result.sites] == ["proved"] * 5, result
    optimized = normfuse.optimize(copy.deepcopy(model))
    with torch.no_grad():
        assert torch.equal(optimized(ids), model(ids))
    sites = normfuse.report(optimized).sites
    assert len(sites) == 5 and all(s.kind == "l2_norm" and s.fused and s.fused_add for s in sites), sites


def _as_rms_norm(gm):
    """The first l2_norm call turned into an rms_norm one: eps added to the mean square instead of
    clamping the L2 norm (the fault a rewrite reading F.normalize as a plain RMSNorm makes)."""
    from normfuse.verify.sites import fused_calls

    call = next(n for n in fused_calls(gm.graph) if n.kwargs.get("kind") == "l2_norm")
    call.kwargs = {**call.kwargs, "kind": "rms_norm"}
    gm.recompile()


def test_normalize_read_as_a_plain_rms_norm_is_refuted_at_its_site():
    from helpers import optimized_with_fault

    model = _x_transformer(use_rmsnorm=True)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    res = normfuse.check(model, ids, optimized=optimized_with_fault(model, _as_rms_norm), backward=False)
    refuted = [s.id for s in res.sites if s.symbolic.status == "refuted"]
    assert not res.ok and refuted == [res.sites[0].id], [(s.id, s.symbolic) for s in res.sites]


@pytest.mark.parametrize("variant", ["use_dynamic_tanh", "use_derf"])
def test_elementwise_norm_replacements_are_listed_not_fused(variant):
    """DynamicTanh (``tanh(alpha * x) * w + b``) and Derf (``erf(alpha * x + s) * w + b``) replace
    the norm in some models: no row statistic, so no site; the report lists them with the reason,
    and the model runs as it was."""
    model = _x_transformer(**{variant: True})
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    optimized = normfuse.optimize(copy.deepcopy(model))
    with torch.no_grad():
        assert torch.equal(optimized(ids), model(ids))
    rep = normfuse.report(optimized)
    assert not rep.sites, rep
    [note] = [n for n in rep.notes if "elementwise norm replacement" in n]
    assert note.startswith("5 elementwise norm replacement(s)") and "attn_layers.final_norm" in note, note
    assert "one elementwise pass, which Inductor fuses" in note, note


def test_a_tanh_gelu_is_not_an_elementwise_norm():
    """GELU's tanh approximation multiplies by constants, not by a learned scalar and a weight."""
    class _Mlp(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.fc = nn.LayerNorm(16), nn.Linear(16, 16)

        def forward(self, x, r):
            return self.fc(F.gelu(self.norm(x + r), approximate="tanh"))

    model = _Mlp().eval()
    x, r = torch.randn(2, 3, 16), torch.randn(2, 3, 16)
    normfuse.optimize(model)
    model(x, r)
    rep = normfuse.report(model)
    assert not any("elementwise norm" in n for n in rep.notes) and rep.sites[0].fused_add, rep
