"""Channel norms: ``permute -> layer_norm -> permute`` over NCHW activations.

Vision models normalize over channels by permuting to channels-last, calling LayerNorm on
the last dim and permuting back (timm's ``LayerNorm2d``, ConvNeXt blocks, CoAtNet's
channels-first transformer blocks, ``F.layer_norm(x.permute(0, 2, 3, 1), ...)``). The add
before such a norm moves through the permute: ``ln(permute(a + b))`` becomes
``add_norm(permute(a), permute(b))``, the sum handed back permuted where the graph still
reads it. channels_last operands are read as contiguous rows, NCHW operands with the
channels strided (the channel-norm kernels). The models below are hand-written copies of those spellings (timm is not a dependency).
"""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import normfuse
from normfuse.tolerances import within_tolerance

class LayerNorm2d(nn.LayerNorm):
    """timm's LayerNorm2d: LayerNorm over the channels of an NCHW tensor."""

    def forward(self, x):
        x = x.permute(0, 2, 3, 1)
        x = F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        return x.permute(0, 3, 1, 2)


class CoAtBlock(nn.Module):
    """CoAtNet's channels-first transformer block: ``x + attn(norm1(x))``, ``x + mlp(norm2(x))``
    with LayerNorm2d and 1x1 convolutions."""

    def __init__(self, c):
        super().__init__()
        self.norm1, self.norm2 = LayerNorm2d(c), LayerNorm2d(c)
        self.qkv, self.proj = nn.Conv2d(c, 3 * c, 1), nn.Conv2d(c, c, 1)
        self.fc1, self.fc2 = nn.Conv2d(c, 2 * c, 1), nn.Conv2d(2 * c, c, 1)

    def attn(self, x):
        b, c, h, w = x.shape
        q, k, v = (t.transpose(1, 2) for t in self.qkv(x).flatten(2).chunk(3, dim=1))  # (B, HW, C)
        a = F.scaled_dot_product_attention(q, k, v)
        return self.proj(a.transpose(1, 2).reshape(b, c, h, w))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class CoAtNet(nn.Module):
    """stem, 2 blocks, final LayerNorm2d: 5 norms, 4 of them read a residual sum."""

    def __init__(self, c=16, depth=2):
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.blocks = nn.Sequential(*[CoAtBlock(c) for _ in range(depth)])
        self.norm = LayerNorm2d(c)

    def forward(self, x):
        return self.norm(self.blocks(self.stem(x)))


class ConvNeXtBlock(nn.Module):
    """``x + drop_path(gamma * mlp(norm(dwconv(x).permute(0, 2, 3, 1)))).permute(0, 3, 1, 2)``:
    the norm reads the depthwise conv, no add."""

    def __init__(self, c):
        super().__init__()
        self.dw = nn.Conv2d(c, c, 7, padding=3, groups=c)
        self.norm = nn.LayerNorm(c, eps=1e-6)
        self.fc1, self.fc2 = nn.Linear(c, 4 * c), nn.Linear(4 * c, c)
        self.gamma = nn.Parameter(0.5 * torch.ones(c))

    def forward(self, x):
        shortcut = x
        x = self.norm(self.dw(x).permute(0, 2, 3, 1))
        x = self.gamma * self.fc2(F.gelu(self.fc1(x)))
        return shortcut + x.permute(0, 3, 1, 2)


class ConvNeXt(nn.Module):
    """2 blocks, then the downsample's LayerNorm2d reads the last block's sum."""

    def __init__(self, c=16, depth=2):
        super().__init__()
        self.stem = nn.Conv2d(3, c, 4, stride=4)
        self.blocks = nn.Sequential(*[ConvNeXtBlock(c) for _ in range(depth)])
        self.down_norm = LayerNorm2d(c, eps=1e-6)
        self.down = nn.Conv2d(c, 2 * c, 2, stride=2)

    def forward(self, x):
        return self.down(self.down_norm(self.blocks(self.stem(x))))


class FunctionalChannelNorm(nn.Module):
    """``F.layer_norm(h.permute(0, 2, 3, 1), ...).permute(0, 3, 1, 2)``; the sum h is read again."""

    def __init__(self, c=16):
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1)
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(c))
        self.bias = nn.Parameter(0.1 * torch.randn(c))

    def forward(self, x):
        h = x + self.conv(x)
        y = F.layer_norm(h.permute(0, 2, 3, 1), (h.shape[1],), self.weight, self.bias, 1e-6).permute(0, 3, 1, 2)
        return h + y


# model, input shape, norms, norms that read a residual sum (fused with it on channels_last)
MODELS = {
    "coatnet": (CoAtNet, (2, 3, 8, 8), 5, 4),
    "convnext": (ConvNeXt, (2, 3, 32, 32), 3, 1),
    "functional": (FunctionalChannelNorm, (2, 16, 8, 8), 1, 1),
}


def _build(name, channels_last):
    cls, shape, *_ = MODELS[name]
    torch.manual_seed(0)
    model, x = cls().eval(), torch.randn(*shape)
    if channels_last:
        model, x = model.to(memory_format=torch.channels_last), x.to(memory_format=torch.channels_last)
    return model, x


def _forward_backward(model, x):
    x = x.detach().clone().requires_grad_(True)
    out = model(x)
    torch.manual_seed(1)
    out.backward(torch.randn_like(out))
    return out.detach(), [x.grad, *(p.grad for p in model.parameters())]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_channels_last_sums_fuse_through_the_permute(name):
    """Counts, placement, bit-identical fp32 output, gradients within the tolerance rule."""
    _, _, norms, with_add = MODELS[name]
    model, x = _build(name, channels_last=True)
    ref64 = copy.deepcopy(model).double()
    eager = copy.deepcopy(model)
    want, want_grads = _forward_backward(ref64, x.double())
    ref, ref_grads = _forward_backward(eager, x)
    normfuse.optimize(model)
    out, grads = _forward_backward(model, x)

    report = normfuse.report(model)
    counts = report.counts()
    assert (counts["sites"], counts["fused"], counts["fused_with_add"]) == (norms, norms, with_add)
    add_sites = [s for s in report.sites if s.op == "add_norm"]
    assert len(add_sites) == with_add and all(s.placement == "pre" for s in add_sites)
    assert all(s.add_reason is None for s in report.sites)
    assert torch.equal(out, ref)
    for got, base, exact in zip(grads, ref_grads, want_grads):
        ok, err, err_eager, bound = within_tolerance(got, base, exact.float())
        assert ok, (err, err_eager, bound)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_contiguous_nchw_fuses_with_the_strided_kernels(name):
    """On NCHW-contiguous tensors the permuted channel dim has stride H*W: the channel-norm kernels
    read it in place (tests/test_strided_norms.py), so the add fuses there too, outputs bit-equal."""
    _, _, norms, with_add = MODELS[name]
    model, x = _build(name, channels_last=False)
    with torch.no_grad():
        ref = model(x)
        normfuse.optimize(model)
        out = model(x)
    report = normfuse.report(model)
    counts = report.counts()
    assert (counts["sites"], counts["fused"], counts["fused_with_add"], counts["input_is_add"]) == (
        norms, norms, with_add, with_add)
    assert all(s.add_reason is None for s in report.sites)
    assert torch.equal(out, ref)


def test_check_proves_every_channel_site():
    model, x = _build("coatnet", channels_last=True)
    res = normfuse.check(model, x)
    assert res.ok, str(res)
    assert [s.op for s in res.sites] == ["norm", "add_norm", "add_norm", "add_norm", "add_norm"]
    assert all(s.passed and s.symbolic.status == "proved" for s in res.sites), str(res)


def test_the_sum_is_handed_back_in_its_layout():
    """The sum the graph reads again comes out of the kernel channels-last and goes back NCHW."""
    model, x = _build("functional", channels_last=True)
    normfuse.optimize(model)
    with torch.no_grad():
        model(x)
    (gm,) = normfuse.report(model).graph_modules
    permutes = [n for n in gm.graph.nodes if n.op == "call_method" and n.target == "permute"]
    # x and residual in, the sum back out, and the model's own permute after the norm
    assert [tuple(n.args[1:]) for n in permutes] == [(0, 2, 3, 1), (0, 2, 3, 1), (0, 3, 1, 2), (0, 3, 1, 2)]


def test_bf16_channels_last_within_the_rounding_budget():
    model, x = _build("coatnet", channels_last=True)
    model, x = model.to(torch.bfloat16), x.to(torch.bfloat16)
    ref64 = copy.deepcopy(model).double()
    with torch.no_grad():
        ref = model(x)
        want = ref64(x.double())
        normfuse.optimize(model)
        out = model(x)
    assert normfuse.report(model).counts()["fused_with_add"] == 4
    ok, err, err_eager, bound = within_tolerance(out, ref, want)
    assert ok, (err, err_eager, bound)


def test_export_graph_fuses_through_aten_permute():
    """A torch.export ATen graph spells the permute ``aten.permute.default``; fuse_graph takes it."""
    model, x = _build("functional", channels_last=True)
    ep = torch.export.export(model, (x,))
    gm = ep.module()
    with torch.no_grad():
        ref = gm(x)
    _, report = normfuse.fuse_graph(gm)
    assert report.counts()["fused_with_add"] == 1
    with torch.no_grad():
        assert torch.equal(gm(x), ref)
