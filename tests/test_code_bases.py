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
