"""No silent site: an add next to a norm is fused with it, or the report says why.

Two forms real models write between a residual add and the next norm: a pair of inverse
permutes (vitdet: a block ends NCHW, the next begins NHWC) cancel and the add is fused; a view
that moves the normalized dim (a per-head norm of ``(a + b).view(..., heads, head_dim)``) keeps
the add outside the kernel, with the reason.
"""

import copy

import pytest
import torch
import torch.nn as nn

import normfuse


class _PermutePair(nn.Module):
    """vitdet's block boundary: (x + mlp(norm(x))).permute(0, 3, 1, 2), then .permute(0, 2, 3, 1)."""

    def __init__(self, c=16):
        super().__init__()
        self.norm1, self.norm2, self.mlp = nn.LayerNorm(c), nn.LayerNorm(c), nn.Linear(c, c)

    def forward(self, x):                      # (B, H, W, C)
        y = (x + self.mlp(self.norm1(x))).permute(0, 3, 1, 2)   # (B, C, H, W)
        return self.norm2(y.permute(0, 2, 3, 1))


class _SplitView(nn.Module):
    """A k-norm over ``(proj(x) + x).view(..., heads, head_dim)``."""

    def __init__(self, n=64, heads=4):
        super().__init__()
        self.heads, self.proj, self.norm = heads, nn.Linear(n, n), nn.RMSNorm(n // heads, eps=1e-6)

    def forward(self, x):
        return self.norm((self.proj(x) + x).view(*x.shape[:-1], self.heads, -1))


def _optimized_report(model, x):
    want = model(x)
    optimized = normfuse.optimize(copy.deepcopy(model))
    assert torch.equal(optimized(x), want)
    return normfuse.report(optimized)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inverse_permutes_between_the_add_and_the_norm_cancel(dtype):
    torch.manual_seed(0)
    rep = _optimized_report(_PermutePair().to(dtype), torch.randn(2, 4, 4, 16).to(dtype))
    [first, second] = rep.sites
    assert second.fqn == "norm2" and second.input_is_add and second.fused_add and second.op == "add_norm", str(rep)


def test_permutes_that_do_not_cancel_keep_their_reason():
    class Turned(_PermutePair):
        def forward(self, x):                  # (B, C, C, C): a permute of the rows, not undone
            y = (x + self.mlp(self.norm1(x))).permute(0, 2, 1, 3)
            return self.norm2(y.permute(0, 2, 3, 1))

    torch.manual_seed(0)
    rep = _optimized_report(Turned(), torch.randn(2, 16, 16, 16))
    second = rep.sites[1]
    assert second.input_is_add and (second.fused_add or second.add_reason), str(rep)


def test_an_add_behind_a_view_that_moves_the_rows_is_named_with_its_reason():
    torch.manual_seed(0)
    rep = _optimized_report(_SplitView(), torch.randn(2, 8, 64))
    [site] = rep.sites
    assert site.fused and site.input_is_add and not site.fused_add, str(rep)
    assert "a view that moves the normalized dim ((2, 8, 64) -> (2, 8, 4, 16))" in site.add_reason


def test_a_view_without_an_add_behind_it_says_nothing():
    class QNorm(_SplitView):
        def forward(self, x):
            return self.norm(self.proj(x).view(*x.shape[:-1], self.heads, -1))

    torch.manual_seed(0)
    [site] = _optimized_report(QNorm(), torch.randn(2, 8, 64)).sites
    assert site.fused and not site.input_is_add and site.add_reason is None
