"""The token + position embedding add that broadcasts, ``(B, S, C) + (S, C)``, folded into the first
norm's call: the kernel reads the table's rows again every S rows (no copy to x's shape), and the
table's gradient is summed over the batch.

* The op: a table of shape (S, C) or (1, S, C) on the reference and on the Triton kernels (under the
  interpreter), forward equal to eager's ops, gradients within the tolerance rule against fp64; a
  residual that broadcasts otherwise ((B, 1, C)) is refused with the fix.
* The pass: a model with learned absolute positions (a hand-written GPT-style embedding, HF GPT-2
  from its config) fuses the first norm with that add; the output equals eager's and ``check``
  proves the site.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import normfuse
from normfuse.errors import ShapeMismatchError
from normfuse.kernels.add_norm import add_norm
from normfuse.tolerances import within_tolerance

B, S, C = 3, 16, 32


def _tensors(dtype, table_shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, S, C, generator=g).to(dtype)
    pos = torch.randn(*table_shape, generator=g).to(dtype)
    w, b = (torch.randn(C, generator=g).to(dtype) for _ in range(2))
    return x, pos, w, b


def _eager(x, pos, w, b):
    s = x + pos
    return F.layer_norm(s, (C,), w, b, 1e-5), s


@pytest.mark.parametrize("backend", ("reference", "triton"))
@pytest.mark.parametrize("table", ((S, C), (1, S, C)), ids=("SC", "1SC"))
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=("fp32", "bf16"))
def test_the_op_reads_the_table_every_s_rows(dtype, table, backend, request):
    if backend == "triton":
        request.getfixturevalue("triton_cpu")
    x, pos, w, b = _tensors(dtype, table)
    leaves = [t.clone().requires_grad_() for t in (x, pos, w, b)]
    y, s = add_norm(*leaves, kind="layer_norm", eps=1e-5)
    want_y, want_s = _eager(x, pos, w, b)
    assert s.shape == want_s.shape and torch.equal(s, want_s)
    if backend == "reference":
        assert torch.equal(y, want_y)
    g = torch.Generator().manual_seed(1)
    cots = [torch.randn(B, S, C, generator=g, dtype=torch.float64) for _ in range(2)]
    (y.double() * cots[0] + s.double() * cots[1]).sum().backward()
    base = [t.clone().requires_grad_() for t in (x, pos, w, b)]
    exact = [t.double().requires_grad_() for t in (x, pos, w, b)]
    for ts in (base, exact):
        yy, ss = _eager(*ts)
        (yy.double() * cots[0] + ss.double() * cots[1]).sum().backward()
    for name, got, eager, ref in zip(("x", "pos", "w", "b"), leaves, base, exact):
        assert got.grad.shape == eager.grad.shape, name
        ok, err, err_base, bound = within_tolerance(got.grad, eager.grad, ref.grad, dtype=got.grad.dtype)
        assert ok, f"d{name}: error {err:.3g} > bound {bound:.3g} (eager's {err_base:.3g})"


def test_a_residual_broadcast_over_the_tokens_is_refused_with_the_fix():
    x, pos, w, b = _tensors(torch.float32, (B, 1, C))
    with pytest.raises(ShapeMismatchError, match="over x's leading dims only"):
        add_norm(x, pos, w, b, kind="layer_norm", eps=1e-5)


class LearnedPositions(nn.Module):
    """GPT-style embeddings: tokens + learned positions, then a Pre-Norm block."""

    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(64, C), nn.Embedding(S, C)
        self.ln_1, self.mlp, self.ln_f = nn.LayerNorm(C), nn.Linear(C, C), nn.LayerNorm(C)

    def forward(self, ids):
        h = self.wte(ids) + self.wpe(torch.arange(ids.shape[1]))
        h = h + self.mlp(self.ln_1(h))
        return self.ln_f(h)


def test_the_first_norm_takes_the_position_add():
    torch.manual_seed(0)
    model = LearnedPositions().eval()
    ids = torch.randint(0, 64, (B, S))
    with torch.no_grad():
        want = model(ids)
        opt = normfuse.optimize(model)
        got = opt(ids)
    assert torch.equal(got, want)
    first = next(s for s in normfuse.report(opt).sites if s.fqn == "ln_1")
    assert first.fused and first.fused_add, first
    res = normfuse.check(model, ids)
    assert res.ok and all(s.symbolic.status == "proved" for s in res.sites), res


def test_gpt2_fuses_its_embedding_add():
    transformers = pytest.importorskip("transformers")
    config = transformers.AutoConfig.for_model("gpt2", n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    ids = torch.randint(0, 64, (2, 12))
    with torch.no_grad():
        want = model(ids).logits
        opt = normfuse.optimize(model)
        got = opt(ids).logits
    assert torch.equal(got, want)
    first = next(s for s in normfuse.report(opt).sites if s.fqn.endswith("h.0.ln_1"))
    assert first.fused and first.fused_add, first
