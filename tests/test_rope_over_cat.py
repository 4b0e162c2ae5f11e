"""A RoPE over a concatenation of normalized pieces (passes/rope_over_cat.py).

Flux's double-stream blocks normalize the text and the image q and k with norms of their own,
concatenate them along the positions and rotate the whole. The rotation is per position, so the
pass gives each piece its own RoPE with its rows of the tables: each q/k norm is then one
qk_norm_rope call with its piece's RoPE, the cat moved after the calls (the same bits).
"""

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import eager_and_optimized

import normfuse
from normfuse.verify.sites import fused_calls

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


class _JointAttention(nn.Module):
    """Two token streams (text, image), each with its own q/k RMSNorms, concatenated along the
    positions before one RoPE (HF's rotate_half on 4-d (1, S, 1, D) tables), then attention;
    ``leak`` also returns the normalized q before its RoPE."""

    def __init__(self, heads=2, dim=8, rope=True, leak=False):
        super().__init__()
        self.heads, self.dim, self.rope, self.leak = heads, dim, rope, leak
        self.norms = nn.ModuleDict({name: nn.RMSNorm(dim, eps=1e-6) for name in ("q", "k", "added_q", "added_k")})
        with torch.no_grad():
            for norm in self.norms.values():
                norm.weight.uniform_(0.5, 1.5)

    def _rotate(self, x, cos, sin):
        x1, x2 = x[..., : self.dim // 2], x[..., self.dim // 2:]
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin

    def forward(self, text, image, cos, sin):
        def heads(t):
            return t.unflatten(-1, (self.heads, self.dim))
        q = normalized = torch.cat([self.norms["added_q"](heads(text)), self.norms["q"](heads(image))], dim=1)
        k = torch.cat([self.norms["added_k"](heads(text)), self.norms["k"](heads(image))], dim=1)
        if self.rope:
            q, k = self._rotate(q, cos, sin), self._rotate(k, cos, sin)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), k.transpose(1, 2))
        return (out, normalized) if self.leak else out


def _inputs(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    text, image = torch.randn(2, 3, 16, generator=g), torch.randn(2, 5, 16, generator=g)
    angles = torch.randn(1, 8, 1, 4, generator=g)
    emb = torch.cat((angles, angles), dim=-1)
    return [t.to(dtype) for t in (text, image, emb.cos(), emb.sin())]


def _optimized(model, dtype=torch.float32):
    args = _inputs(dtype)
    model = model.to(dtype)
    return eager_and_optimized(model, *args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_piece_takes_its_rope(dtype):
    ref, out, rep = _optimized(_JointAttention(), dtype)
    assert len(rep.sites) == 4 and all(s.op == "qk_norm_rope" and s.fused_rope for s in rep.sites), rep
    assert len({s.call for s in rep.sites}) == 2, rep  # text q with text k, image q with image k
    assert torch.equal(out, ref)


def test_each_piece_is_proved_and_the_gradients_hold():
    model = _JointAttention()
    res = normfuse.check(model, *_inputs())
    assert res.ok, res
    assert [s.symbolic.status for s in res.sites] == ["proved"] * 4, res


def test_no_rope_no_split():
    """No rotation after the cat: it stays, the norms are fused alone, with no RoPE reason."""
    ref, out, rep = _optimized(_JointAttention(rope=False))
    assert all(s.op == "norm" and not s.fused_rope and s.rope_reason is None for s in rep.sites), rep
    assert torch.equal(out, ref)


def test_a_cat_read_besides_its_rope_stays_whole_with_the_reason():
    """The normalized q's cat is read besides its RoPE: q's RoPE stays whole (its norms fused alone,
    with the reason); k's cat is read by its RoPE only and is split, each k norm with its RoPE."""
    ref, out, rep = _optimized(_JointAttention(leak=True))
    by_name = {s.fqn.rsplit(".", 1)[-1]: s for s in rep.sites}
    for name in ("added_q", "q"):
        assert by_name[name].op == "norm", rep
        assert by_name[name].rope_reason.startswith("a RoPE follows this q/k norm over rows concatenated"), rep
    assert all(by_name[name].op == "qk_norm_rope" and by_name[name].fused_rope for name in ("added_k", "k")), rep
    assert all(torch.equal(got, want) for got, want in zip(out, ref))


def _shifted_tables(gm):
    """The first call reads its tables one position later than its piece (a wrong slice)."""
    call = next(n for n in fused_calls(gm.graph) if n.kwargs.get("rotary_dim") is not None)
    kw = dict(call.kwargs)
    for role in ("cos", "sin"):
        piece = kw[role]
        table, index = piece.args
        rows = index[1]
        with gm.graph.inserting_after(piece):
            shifted = gm.graph.call_function(piece.target,
                                             (table, (index[0], slice(rows.start + 1, rows.stop + 1))))
        shifted.meta = dict(piece.meta)
        kw[role] = shifted
    call.kwargs = kw
    gm.recompile()


def test_a_call_reading_another_piece_s_rows_is_caught_at_its_site():
    from helpers import optimized_with_fault

    model = _JointAttention()
    args = _inputs()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = normfuse.check(model, *args, backward=False, optimized=optimized_with_fault(model, _shifted_tables))
    assert not res.ok
    failing = [s for s in res.sites if not s.passed]
    assert failing and all(s.numeric.passed is False for s in failing), failing
    assert len({s.number for s in failing}) == 2, failing  # the one call: its q and k sites


@pytest.mark.zoo
def test_flux_double_stream_blocks_fuse_every_q_k_rope():
    """Flux's double-stream attention (text and image q/k norms, one RoPE over their cat): every
    q/k norm of the model fused with its RoPE, every site proved, output equal to eager."""
    from tests.zoo.diffusion import build

    model, kwargs = build("flux")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = normfuse.check(model, **kwargs, backward=False)
    assert res.ok and [s.symbolic.status for s in res.sites] == ["proved"] * len(res.sites), res
    qk = [s for s in res.report.sites if s.fqn.rsplit(".", 1)[-1].startswith(("norm_q", "norm_k", "norm_added"))]
    assert len(qk) == 6 and all(s.fused_rope for s in qk), res.report
