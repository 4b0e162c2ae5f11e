"""FuseConfig(residual_dtype=torch.float32): the residual stream of a bf16 model kept in fp32."""

from __future__ import annotations

import copy

import pytest
import torch

import normfuse
from normfuse.errors import InvalidOptionError
from normfuse.kernels.add_norm import add_norm
from normfuse.passes.record import fused_op_name
from normfuse.zoo import ToyTransformer, example_inputs, hf_model

from helpers import assert_close

BF16, FP32 = torch.bfloat16, torch.float32


def _stream_kernel_case(seed=0):
    """HF Llama's site with an fp32 stream: bf16 branch, fp32 residual, fp32 sum, bf16 output."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(6, 1000, generator=g).to(BF16).requires_grad_()
    r = (torch.randn(6, 1000, generator=g) * 4).requires_grad_()
    w = (1 + 0.1 * torch.randn(1000, generator=g)).to(BF16).requires_grad_()
    return x, r, w


def _run(x, r, w):
    y, s = add_norm(x, r, w, kind="rms_norm", eps=1e-6, sum_dtype=FP32, norm_round_dtype=BF16, out_dtype=BF16)
    g = torch.Generator().manual_seed(1)
    (y.float() * torch.randn(y.shape, generator=g)).sum().backward(retain_graph=True)
    (s * torch.randn(s.shape, generator=g)).sum().backward()
    grads = [t.grad.clone() for t in (x, r, w)]
    for t in (x, r, w):
        t.grad = None
    return y.detach(), s.detach(), grads


def test_kernels_take_an_fp32_sum_with_bf16_output(triton_cpu, monkeypatch):
    """The Triton kernels (interpreted) compute what the reference computes for a wide stream."""
    x, r, w = _stream_kernel_case()
    y_t, s_t, grads_t = _run(x, r, w)
    monkeypatch.delenv("NORMFUSE_TRITON_CPU")
    y_r, s_r, grads_r = _run(x, r, w)
    assert y_t.dtype == BF16 and s_t.dtype == FP32
    assert torch.equal(s_t, s_r)  # one fp32 add of the same operands
    assert torch.equal(s_r, x.detach().float() + r.detach())
    # the row reduction order may differ: at most one bf16 ulp apart
    assert (y_t.float() - y_r.float()).abs().max() <= 2 ** -7 * y_r.float().abs().max()
    for a, b in zip(grads_t, grads_r):
        assert a.dtype == b.dtype
        assert_close(a, b)


def _fused_calls(model):
    return [n for gm in normfuse.report(model).graph_modules for n in gm.graph.nodes if fused_op_name(n)]


def test_hf_llama_stream_in_fp32():
    """2-layer bf16 llama: the 4 stream sums are fp32, the first norm (embeddings) and the
    last hidden state stays bf16, and the checker holds the outputs to the usual rule, by design."""
    torch._dynamo.reset()
    model = hf_model("llama", BF16).eval()
    inputs = example_inputs(model)
    opt = normfuse.optimize(copy.deepcopy(model), residual_dtype=FP32)
    out = opt(**inputs).last_hidden_state
    assert out.dtype == BF16
    rep = normfuse.report(opt)
    assert [s.residual_dtype for s in rep.sites] == [None] + ["torch.float32"] * 4
    calls = _fused_calls(opt)
    assert [c.kwargs["sum_dtype"] for c in calls if fused_op_name(c) == "add_norm"] == [FP32] * 4
    assert all(c.kwargs["out_dtype"] == BF16 for c in calls)
    res = normfuse.check(model, optimized=opt, **inputs)
    assert res.by_design and res.ok, res
    assert any("by design" in note for note in res.notes)


def test_deep_bf16_model_is_more_accurate_with_an_fp32_stream():
    """16 blocks, bf16: the fp32 stream's logits are closer to fp64 than eager's."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = ToyTransformer(hidden=64, depth=16, kind="rms_norm", spelling="llama").to(BF16).eval()
    ids = torch.randint(0, 64, (2, 16))
    opt = normfuse.optimize(copy.deepcopy(model), residual_dtype=FP32)
    res = normfuse.check(model, ids, optimized=opt, backward=False)
    assert res.ok and res.by_design
    logits = next(o for o in res.outputs if o.name == "output")
    assert logits.max_abs < logits.err_original


def test_without_the_option_nothing_widens():
    torch._dynamo.reset()
    opt = normfuse.optimize(hf_model("llama", BF16).eval())
    opt(**example_inputs(opt))
    assert all(s.residual_dtype is None for s in normfuse.report(opt).sites)


@pytest.mark.parametrize("bad", [torch.float16, torch.float64, "fp32", 32])
def test_bad_residual_dtype(bad):
    with pytest.raises(InvalidOptionError, match="residual_dtype=torch.float32"):
        normfuse.optimize(ToyTransformer(), residual_dtype=bad)


# gpt_neox: layer 1's parallel add_norm and the final one write the wide sum; layer 1's second
# norm of that sum reads it rounded back. gemma2: the 4 pre-norm adds (the sandwich norms'
# adds are those same adds, folded into the pre-norms' kernels)
@pytest.mark.parametrize("name, widened", [("gpt2", 5), ("gpt_neox", 3), ("gemma2", 4)])
def test_other_stream_shapes(name, widened):
    """Learned-position LayerNorm (gpt2), parallel blocks whose sum two norms read (gpt_neox),
    sandwich norms with norm_add (gemma2): every model runs, keeps its output dtype and passes
    the checker; a reader that cannot take the wide sum gets it rounded back."""
    torch._dynamo.reset()
    model = hf_model(name, BF16).eval()
    inputs = example_inputs(model)
    opt = normfuse.optimize(copy.deepcopy(model), residual_dtype=FP32)
    res = normfuse.check(model, optimized=opt, **inputs)
    assert sum(s.residual_dtype is not None for s in normfuse.report(opt).sites) == widened
    assert res.ok and res.by_design, res
