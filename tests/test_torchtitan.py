"""torchtitan's own llama and its own parallelize flow (FSDP2, activation checkpointing, per-block
compile), 2 CPU processes on gloo.

Built as torchtitan builds it: ``Llama3Model.Config`` (a ``ModuleDict`` of blocks, the final norm
sharded with the output head), then ``parallelize_llama``. Three things differ from a GPU run,
each only to run on CPU: the inner attention is causal SDPA (FlexAttention has no CPU backward),
the device mesh is a CPU one, and FSDP reduces with SUM (gloo has no PREMUL_SUM; torchtitan turns
FSDP's division off and scales the loss itself, as here).
"""

import pytest
import torch

import normfuse
from normfuse.tolerances import within_tolerance

from helpers import WORLD, run_on_ranks

pytest.importorskip("torchtitan")

BATCH, SEQ, DEPTH, DIM, HEADS, VOCAB, STEPS, LR = 4, 16, 4, 64, 4, 128, 2, 0.05
NORMS = [f"layers.{i}.{n}" for i in range(DEPTH) for n in ("attention_norm", "ffn_norm")] + ["norm"]


class CausalSDPA(torch.nn.Module):
    """torchtitan's inner attention contract, computed with causal SDPA: (B, L, N, H) in and out."""

    def forward(self, q, k, v, *, attention_masks=None, scale=None, enable_gqa=False, **kwargs):
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, scale=scale,
            enable_gqa=enable_gqa)
        return out.transpose(1, 2)


def build(dtype=torch.float32):
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm, compute_ffn_hidden_dim
    from torchtitan.models.llama3 import Llama3Model, _build_llama3_layers

    norm_init = {"weight": lambda w: torch.nn.init.normal_(w, 1.0, 0.2)}  # away from 1: their gradients matter
    config = Llama3Model.Config(
        dim=DIM, vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM,
                                        param_init={"weight": torch.nn.init.normal_}),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=norm_init),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB,
                              param_init={"weight": lambda w: torch.nn.init.normal_(w, 0.0, 0.1)}),
        layers=_build_llama3_layers(
            n_layers=DEPTH, dim=DIM, n_heads=HEADS, hidden_dim=compute_ffn_hidden_dim(DIM, multiple_of=64),
            rope=ComplexRoPE.Config(dim=DIM // HEADS, max_seq_len=SEQ, theta=500000, scaling="llama"),
            attn_backend="flex"))
    for layer in config.layers:
        layer.attention_norm.param_init = layer.ffn_norm.param_init = norm_init
    torch.manual_seed(0)
    model = config.build()
    model.init_states()
    for block in model.layers.values():
        block.attention.inner_attention = CausalSDPA()
    return model.to(dtype)


def batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randn(BATCH, SEQ, VOCAB, generator=g))
            for _ in range(STEPS)]


def train(model, shard=slice(None), gather=lambda g: g):
    """STEPS of SGD on a loss summed over this rank's rows and divided by the whole batch's size
    (so the ranks' gradients sum to the whole batch's); each step's gradients by name."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    history = []
    for ids, target in batches():
        opt.zero_grad()
        positions = torch.arange(SEQ).expand(ids[shard].shape[0], SEQ)
        out = model(ids[shard], positions=positions)
        loss = (out.double() - target[shard].double()).square().sum() / target.numel()
        loss.backward()
        history.append({n.replace("_checkpoint_wrapped_module.", ""): gather(p.grad).detach().float().clone()
                        for n, p in model.named_parameters()})
        opt.step()
    return history


VARIANTS = {
    "fsdp": dict(),
    "fsdp_full_ac": dict(ac=True),
    "fsdp_full_ac_cross_checkpoints": dict(ac=True, cross_checkpoints=True),
    "per_block_compile": dict(compile=True),
}


def _rank(rank, names):
    import tempfile

    import torchtitan.distributed.parallel_dims as parallel_dims
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed.activation_checkpoint import FullAC
    from torchtitan.models.llama3 import parallelize_llama


    parallel_dims.device_type = "cpu"  # torchtitan assumes an accelerator when it finds none
    results = {}
    for name in names:
        v = VARIANTS[name]
        torch._dynamo.reset()
        model = build()
        if v.get("compile"):  # the pairs first, so that per-block graphs hold the add between blocks
            normfuse.prepare(model)
        parallelism = ParallelismConfig(data_parallel_shard_degree=WORLD, spmd_backend="partial_dtensor")
        parallelize_llama(model, parallel_dims=ParallelDims.from_config(parallelism, WORLD),
                          training=TrainingConfig(mixed_precision_param="float32"), parallelism=parallelism,
                          compile_config=CompileConfig(enable=bool(v.get("compile")), backend="normfuse"),
                          ac_config=FullAC.Config() if v.get("ac") else None, dump_folder=tempfile.mkdtemp())
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
        if not v.get("compile"):
            normfuse.optimize(model, cross_checkpoints=v.get("cross_checkpoints", False))
        shard = slice(rank * BATCH // WORLD, (rank + 1) * BATCH // WORLD)
        grads = train(model, shard, gather=lambda g: g.full_tensor())
        rep = normfuse.report(model)
        results[name] = {"grads": grads, "warnings": list(rep.warnings), "uncaptured": list(rep.uncaptured),
                         "text": str(rep), "sites": [(s.fqn, s.fused, s.fused_add) for s in rep.sites]}
    return results


@pytest.fixture(scope="module")
def results():
    return run_on_ranks(_rank, list(VARIANTS))


@pytest.fixture(scope="module")
def references():
    return train(build()), train(build(torch.float64))


@pytest.mark.parametrize("name", list(VARIANTS))
def test_torchtitan_flow(name, results, references):
    v = VARIANTS[name]
    eager, exact = references
    for rank, res in enumerate(r[name] for r in results):
        assert not res["warnings"], res["text"]
        sites = res["sites"]
        if v.get("compile"):
            # torchtitan compiles the blocks only: the final norm runs eagerly (reported as such)
            assert [s[0] for s in sites] == NORMS[:-1] and res["uncaptured"] == ["norm"], res["text"]
            assert "not captured: norm" in res["text"]
        else:
            assert [s[0] for s in sites] == NORMS and not res["uncaptured"], res["text"]
        assert all(s[1] for s in sites), res["text"]
        with_add = [s[0] for s in sites if s[2]]
        if v.get("ac") and not v.get("cross_checkpoints"):  # checkpointed blocks keep the sum (documented)
            assert with_add == [f"layers.{i}.ffn_norm" for i in range(DEPTH)] + ["norm"], res["text"]
        else:
            assert with_add == [n for n in NORMS[1:] if n in [s[0] for s in sites]], res["text"]
        for step, grads in enumerate(res["grads"]):
            assert grads.keys() == eager[step].keys()
            for pname, grad in grads.items():
                ok, err, base, bound = within_tolerance(grad, eager[step][pname], exact[step][pname], torch.float32)
                assert ok, (name, rank, step, pname, err, base, bound)
