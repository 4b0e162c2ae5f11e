"""The pass takes a gated norm's gate and grouped statistics into its call (normfuse/passes/parts/gate.py,
the groups in find.py): HF Mamba2 (gate before the norm, one group and two), NemotronH (gate
before, groups of 64), Qwen3-Next (gate after), a Kimi-style sigmoid gate after an fp32 norm.
Outputs equal eager's bit for bit on the reference path; ``check`` proves each gated site; a
gate the kernel would round differently stays in the graph.
"""

import copy

import pytest
import torch
import torch.nn as nn

import normfuse
from normfuse.verify.sites import fused_calls
from normfuse.zoo import example_inputs, hf_model

pytest.importorskip("transformers")
pytest.importorskip("sympy")

MAMBA2 = dict(state_size=8, num_heads=8, head_dim=16)
NEMOTRON_H = dict(hidden_size=64, mamba_num_heads=8, mamba_head_dim=16, n_groups=2, ssm_state_size=8)

# (family, config overrides, gated sites, where the gate goes, columns per group of the gated norms)
MODELS = [
    ("mamba2", dict(MAMBA2, n_groups=1), 2, "before", None),
    ("mamba2", dict(MAMBA2, n_groups=2), 2, "before", 64),
    ("nemotron_h", NEMOTRON_H, 1, "before", 64),
    ("qwen3_next", {}, 2, "after", None),
]


def _output(out):
    return out.last_hidden_state if getattr(out, "last_hidden_state", None) is not None else out.logits


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("family,overrides,gated,position,group", MODELS,
                         ids=["mamba2", "mamba2-groups", "nemotron_h", "qwen3_next"])
def test_hf_gated_norms_fuse_with_their_gate_bit_for_bit(family, overrides, gated, position, group, dtype):
    torch._dynamo.reset()
    model = hf_model(family, dtype=dtype, **overrides)
    inputs = example_inputs(model)
    with torch.no_grad():
        want = _output(model(**inputs))
        optimized = normfuse.optimize(copy.deepcopy(model))
        got = _output(optimized(**inputs))
    assert torch.equal(got, want)
    rep = normfuse.report(optimized)
    sites = [s for s in rep.sites if s.gate is not None]
    assert len(sites) == gated and (rep.counts()["gated"], rep.counts()["fused_gate"]) == (gated, gated)
    assert all(s.fused and s.fused_gate and s.gate == f"silu(z) {position} the norm" for s in sites), str(rep)
    assert all(s.norm_group == group for s in sites)
    assert "+ gate" in str(rep)
    calls = [c for c in fused_calls(rep.graph_modules[0].graph) if c.kwargs.get("gate") is not None]
    assert len(calls) == gated and all(c.kwargs["gate_position"] == position for c in calls)
    assert all(c.kwargs.get("norm_group") == group for c in calls)


# Qwen3-Next forward only: its fp64 backward through the chunked delta rule takes minutes on CPU
@pytest.mark.parametrize("family,overrides,backward", [("mamba2", dict(MAMBA2, n_groups=2), True),
                                                        ("qwen3_next", {}, False)])
def test_check_proves_the_gated_sites(family, overrides, backward):
    torch._dynamo.reset()
    model = hf_model(family, dtype=torch.bfloat16, **overrides)
    res = normfuse.check(model, backward=backward, **example_inputs(model))
    assert res.ok, str(res)
    assert all(s.passed and s.symbolic.status == "proved" and s.symbolic.method.startswith("algebra")
               for s in res.sites)
    assert sum(s.fused_gate for s in res.report.sites) == 2


class _KimiGated(nn.Module):
    """Kimi-Linear's gated norm: the weight multiplied in fp32, a sigmoid gate, then the cast."""

    def __init__(self, dim=64, gate_dtype=torch.float32):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(dim) * 0.2 + 1)
        self.gate_dtype = gate_dtype

    def forward(self, x, z):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        y = self.weight.float() * h
        return (y * torch.sigmoid(z.to(self.gate_dtype))).to(x.dtype)


def test_a_sigmoid_gate_after_an_fp32_norm():
    model = _KimiGated()
    x, z = torch.randn(2, 8, 64, dtype=torch.bfloat16), torch.randn(2, 8, 64, dtype=torch.bfloat16)
    torch._dynamo.reset()
    optimized = normfuse.optimize(copy.deepcopy(model).to(torch.bfloat16))
    model = model.to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(optimized(x, z), model(x, z))
    (site,) = normfuse.report(optimized).sites
    assert site.fused and site.fused_gate and site.gate == "sigmoid(z) after the norm"
    (call,) = fused_calls(normfuse.report(optimized).graph_modules[0].graph)
    assert (call.kwargs["out_dtype"], call.kwargs["gate_out_dtype"]) == (torch.float32, torch.bfloat16)


def test_a_gate_activated_in_16_bits_stays_in_the_graph():
    # sigmoid(z) in bf16 rounds before the product: the kernel's fp32 activation would not
    model = _KimiGated(gate_dtype=torch.bfloat16).to(torch.bfloat16)
    x, z = torch.randn(2, 8, 64, dtype=torch.bfloat16), torch.randn(2, 8, 64, dtype=torch.bfloat16)
    torch._dynamo.reset()
    optimized = normfuse.optimize(copy.deepcopy(model))
    with torch.no_grad():
        assert torch.equal(optimized(x, z), model(x, z))
    (site,) = normfuse.report(optimized).sites
    assert site.fused and site.gate is None and not site.fused_gate


def test_fuse_gate_false_leaves_the_gate():
    torch._dynamo.reset()
    model = hf_model("qwen3_next")
    inputs = example_inputs(model)
    optimized = normfuse.optimize(copy.deepcopy(model), fuse_gate=False)
    with torch.no_grad():
        assert torch.equal(_output(optimized(**inputs)), _output(model(**inputs)))
    rep = normfuse.report(optimized)
    assert rep.counts()["gated"] == 2 and rep.counts()["fused_gate"] == 0
    gated = [s for s in rep.sites if s.gate is not None]
    assert all(s.gate_reason == "gates are not fused (fuse_gate=False)" for s in gated), [s.gate_reason for s in gated]


def test_training_through_a_gated_norm_keeps_the_gradients():
    torch._dynamo.reset()
    model = hf_model("mamba2", **dict(MAMBA2, n_groups=2))
    inputs = example_inputs(model)
    optimized = normfuse.optimize(copy.deepcopy(model))
    _output(optimized(**inputs)).float().pow(2).mean().backward()
    _output(model(**inputs)).float().pow(2).mean().backward()
    from helpers import assert_close
    for (name, a), b in zip(optimized.named_parameters(), model.parameters()):
        if b.grad is not None:
            assert_close(a.grad, b.grad, msg=name)
    assert normfuse.report(optimized).counts()["fused_gate"] == 2
