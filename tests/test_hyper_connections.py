"""Hyper-connections: N residual streams (B, S, N, D), collapsed into each block's input by a
weighted sum over the stream dim, ``(pre.unsqueeze(-1) * streams).sum(dim=2)``, which feeds the
block's norm (DeepSeek-V4's mHC, HY-V4, GLM-5-Next in transformers).

That collapse is an add of N weighted terms: the kernels add two or three operands of one
shape, so the norm is fused alone and its site says why (before, the site was standalone with
no reason). Fusing the collapse into the kernel's read is the next step.
"""

import copy

import pytest
import torch
import torch.nn as nn

import normfuse

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

STREAM_REASON = "weighted sum of 4 residual streams"


class _HyperBlock(nn.Module):
    """One sub-layer on N streams: collapse (weights from the streams), norm, branch, expand."""

    def __init__(self, dim, streams):
        super().__init__()
        self.pre = nn.Linear(streams * dim, streams)
        self.post = nn.Parameter(torch.randn(streams) * 0.1)
        self.norm = nn.RMSNorm(dim, eps=1e-6)
        self.branch = nn.Linear(dim, dim)

    def forward(self, streams):  # (B, S, N, D)
        b, s, n, d = streams.shape
        pre = torch.sigmoid(self.pre(streams.reshape(b, s, n * d)))  # (B, S, N)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=2)  # (B, S, D)
        out = self.branch(self.norm(collapsed))
        return streams + self.post[:, None] * out.unsqueeze(-2)


class _HyperModel(nn.Module):
    def __init__(self, dim=32, streams=4, depth=2):
        super().__init__()
        torch.manual_seed(0)
        self.streams = streams
        self.embed = nn.Embedding(64, dim)
        self.blocks = nn.ModuleList(_HyperBlock(dim, streams) for _ in range(depth))
        self.final = _HyperBlock(dim, streams)

    def forward(self, ids):
        x = self.embed(ids).unsqueeze(-2).expand(-1, -1, self.streams, -1)
        for block in self.blocks:
            x = block(x)
        return self.final(x)


IDS = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))


def test_a_collapse_of_streams_feeding_a_norm_says_why_it_stays_outside():
    model = _HyperModel().eval()
    optimized = normfuse.optimize(copy.deepcopy(model))
    with torch.no_grad():
        assert torch.equal(optimized(IDS), model(IDS))
    rep = normfuse.report(optimized)
    assert (len(rep.sites), len(rep.fused)) == (3, 3)
    for site in rep.sites:
        assert site.input_is_add and not site.fused_add, str(rep)
        assert STREAM_REASON in site.add_reason, site.add_reason
    assert normfuse.check(model, IDS).ok


# transformers' hyper-connection families at small configs: (norm sites, add-fed sites whose
# input is the stream collapse, norm modules that run outside the captured graph)
HF_FAMILIES = {
    # q/k/kv norms and the unweighted norms over the flattened streams; the compressor's kv_norm
    # runs in a frame dynamo skips (listed as not captured)
    "deepseek_v4": (16, 5, {"layers.0.self_attn.compressor.kv_norm", "layers.1.self_attn.compressor.kv_norm"}),
    # its 5 HYV4UnweightedRMSNorm return rstd(x) alone, which multiplies linear(x): sites listed
    # with that reason (not fused)
    "hy_v4": (16, 5, set()),
    # its final norm reads the streams' head collapse through another spelling: standalone
    "glm5_next_text": (11, 4, set()),
}
MOE = dict(num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
           n_shared_experts=1, first_k_dense_replace=1)
MLA = dict(q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, qk_head_dim=32,
           o_lora_rank=32, index_topk=8, index_head_dim=16, index_n_heads=2, num_key_value_heads=4)


@pytest.mark.parametrize("model_type", list(HF_FAMILIES))
def test_hf_hyper_connection_families(model_type):
    transformers = pytest.importorskip("transformers")
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if model_type not in CONFIG_MAPPING_NAMES:
        pytest.skip(f"transformers {transformers.__version__} has no {model_type}")
    from normfuse.zoo import example_inputs, hf_model

    sites, collapsed, eager = HF_FAMILIES[model_type]
    model = hf_model(model_type, pad_token_id=0, **MOE, **MLA)
    inputs = example_inputs(model)
    optimized = normfuse.optimize(copy.deepcopy(model))
    with torch.no_grad():
        assert torch.equal(optimized(**inputs)[0], model(**inputs)[0])
    rep = normfuse.report(optimized)
    rstd_alone = [s for s in rep.sites if not s.fused and "rstd" in (s.reason or "")]
    assert (len(rep.sites), len(rep.fused)) == (sites, sites - len(rep.unfused)), str(rep)
    assert len(rep.unfused) == len(rstd_alone) == (5 if model_type == "hy_v4" else 0), str(rep)
    assert set(rep.uncaptured) == eager
    assert sum(STREAM_REASON in (s.add_reason or "") for s in rep.sites) == collapsed, str(rep)
    # every add-fed norm fused without its add says why
    assert all(s.add_reason for s in rep.sites if s.input_is_add and not s.fused_add), str(rep)


def test_x_transformers_residual_streams_say_why():
    """x-transformers' ``num_residual_streams``: each branch reads an einsum over the streams."""
    x_transformers = pytest.importorskip("x_transformers")
    torch.manual_seed(0)
    layers = x_transformers.Decoder(dim=32, depth=2, heads=2, num_residual_streams=4)
    model = x_transformers.TransformerWrapper(num_tokens=64, max_seq_len=16, attn_layers=layers).eval()
    optimized = normfuse.optimize(copy.deepcopy(model))
    with torch.no_grad():
        assert torch.equal(optimized(IDS), model(IDS))
    rep = normfuse.report(optimized)
    branch_norms = [s for s in rep.sites if s.fqn.endswith(".0.0.ln")]  # each branch's pre-norm
    assert len(branch_norms) == 4, str(rep)
    for site in branch_norms:
        assert site.input_is_add and "einsum" in site.add_reason and STREAM_REASON in site.add_reason, str(rep)
