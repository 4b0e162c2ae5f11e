"""recompute_norm_output: the linears after a fused norm recompute its output in backward."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import normfuse
from normfuse.errors import InvalidOptionError, ShapeMismatchError
from normfuse.kernels.add_norm import add_norm
from normfuse.kernels.norm_linear import norm_linears, norm_linears_op
from normfuse.zoo import example_inputs, hf_model

BF16, FP32 = torch.bfloat16, torch.float32
MODES = dict(kind="rms_norm", eps=1e-6, norm_round_dtype=BF16, out_dtype=BF16)  # HF Llama's bf16 site


def _modes(dtype):
    return dict(MODES, norm_round_dtype=dtype, out_dtype=dtype)


def _tensors(dtype=BF16, seed=0):
    g = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype).requires_grad_()

    x, r = randn(2, 5, 64), randn(2, 5, 64)
    w = (1 + 0.1 * torch.randn(64, generator=g)).to(dtype).requires_grad_()
    weights = [randn(64, 64, scale=0.1), randn(16, 64, scale=0.1), randn(16, 64, scale=0.1)]
    biases = [None, randn(16), None]
    return x, r, w, weights, biases


def _step(x, r, w, weights, biases, recompute: bool):
    """Site + linears, forward and backward; returns outputs, grads and the bytes saved for backward."""
    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    params = {p.untyped_storage().data_ptr() for p in (w, *weights, *(b for b in biases if b is not None))}
    with torch.autograd.graph.saved_tensors_hooks(
            lambda t: t if t.untyped_storage().data_ptr() in params else pack(t), lambda t: t):
        y, s = add_norm(x, r, w, sum_dtype=x.dtype, **_modes(x.dtype))
        if recompute:
            outs = norm_linears(y, s, w, None, weights, biases, sum_dtype=x.dtype, **_modes(x.dtype))
        else:
            outs = [F.linear(y, W, b) for W, b in zip(weights, biases)]
    g = torch.Generator().manual_seed(1)
    loss = sum((o.float() * torch.randn(o.shape, generator=g)).sum() for o in outs) + (s.float() ** 2).sum()
    leaves = [x, r, w, *weights, biases[1]]
    grads = torch.autograd.grad(loss, leaves)
    return [o.detach() for o in outs], grads, sum(saved.values())


@pytest.mark.parametrize("dtype", [BF16, FP32])
def test_same_numbers_less_memory(dtype):
    """Outputs and every gradient bit for bit those of the plain linears; y no longer saved."""
    tensors = _tensors(dtype)
    outs_a, grads_a, bytes_a = _step(*tensors, recompute=False)
    outs_b, grads_b, bytes_b = _step(*tensors, recompute=True)
    for a, b in zip(outs_a, outs_b):
        assert torch.equal(a, b)
    for a, b in zip(grads_a, grads_b):
        assert torch.equal(a, b)
    y_bytes = 2 * 5 * 64 * dtype.itemsize
    assert bytes_a - bytes_b == y_bytes


def test_triton_recompute(triton_cpu):
    """Under the Triton interpreter the recompute runs the site's Triton kernel: same y, same grads."""
    tensors = _tensors()
    outs_a, grads_a, _ = _step(*tensors, recompute=False)
    outs_b, grads_b, _ = _step(*tensors, recompute=True)
    for a, b in zip([*outs_a, *grads_a], [*outs_b, *grads_b]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [BF16, FP32])
def test_opcheck(dtype):
    x, r, w, weights, biases = _tensors(dtype)
    y, s = add_norm(x.detach(), r.detach(), w.detach(), sum_dtype=dtype, **_modes(dtype))
    y.requires_grad_()
    present = [b for b in biases if b is not None]
    torch.library.opcheck(norm_linears_op, (y, s, w, None, weights, present, [b is not None for b in biases],
                                            "rms_norm", 1e-6, 0.0, dtype, dtype, dtype))


def test_fullgraph_compile():
    x, r, w, weights, biases = _tensors()

    def fn(x, r):
        y, s = add_norm(x, r, w, sum_dtype=BF16, **MODES)
        return norm_linears(y, s, w, None, weights, biases, sum_dtype=BF16, **MODES)

    torch._dynamo.reset()
    outs = torch.compile(fn, fullgraph=True, backend="aot_eager")(x, r)
    sum(o.float().sum() for o in outs).backward()
    expected = fn(x.detach(), r.detach())
    for a, b in zip(outs, expected):
        assert torch.equal(a.detach(), b)
    assert x.grad is not None and weights[1].grad is not None and biases[1].grad is not None


def test_hf_llama_counts_and_check():
    """2-layer llama: q/k/v read input_layernorm, gate/up post_attention_layernorm; the final norm
    is the model's output (no linear reads it). The checker holds the rewrite to the usual rule."""
    torch._dynamo.reset()
    model = hf_model("llama", BF16).eval()
    inputs = example_inputs(model)
    opt = normfuse.optimize(copy.deepcopy(model), recompute_norm_output=True)
    res = normfuse.check(model, optimized=opt, **inputs)
    assert [s.recomputed_linears for s in normfuse.report(opt).sites] == [3, 2, 3, 2, 0]
    assert res.ok and not res.by_design, res
    calls = [n for gm in normfuse.report(opt).graph_modules for n in gm.graph.nodes if n.target is norm_linears]
    assert len(calls) == 4


def test_with_an_fp32_residual_stream():
    """Both options: the recomputed norm reads the fp32 sum while its weight stays bf16."""
    torch._dynamo.reset()
    model = hf_model("llama", BF16).eval()
    inputs = example_inputs(model)
    opt = normfuse.optimize(copy.deepcopy(model), recompute_norm_output=True, residual_dtype=FP32)
    res = normfuse.check(model, optimized=opt, **inputs)
    sites = normfuse.report(opt).sites
    assert [(s.recomputed_linears, s.residual_dtype) for s in sites] == [
        (3, None), (2, "torch.float32"), (3, "torch.float32"), (2, "torch.float32"), (0, "torch.float32")]
    assert res.ok and res.by_design, res


class _NormThenMixedUse(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.RMSNorm(32, eps=1e-6)
        self.q = nn.Linear(32, 32)
        self.k = nn.Linear(32, 32)

    def forward(self, x, r):
        s = x + r
        y = self.norm(s)
        return s + self.q(y), self.k(y) * y  # y is read by a multiply too


def test_left_alone_when_not_only_linears_read_the_norm():
    torch._dynamo.reset()
    model = normfuse.optimize(_NormThenMixedUse(), recompute_norm_output=True)
    model(torch.randn(3, 32), torch.randn(3, 32))
    (site,) = normfuse.report(model).sites
    assert site.fused and site.recomputed_linears == 0


def test_bad_input():
    x, r, w, weights, biases = _tensors()
    y, s = add_norm(x, r, w, sum_dtype=BF16, **MODES)
    with pytest.raises(ShapeMismatchError, match=r"weights\[1\] has shape \(16, 63\)"):
        norm_linears(y, s, w, None, [weights[0], weights[1][:, :63]], [None, None], sum_dtype=BF16, **MODES)
    with pytest.raises(InvalidOptionError, match="one bias"):
        norm_linears(y, s, w, None, weights, [None], sum_dtype=BF16, **MODES)
    with pytest.raises(InvalidOptionError, match="recompute_norm_output must be True or False"):
        normfuse.optimize(_NormThenMixedUse(), recompute_norm_output="yes")
