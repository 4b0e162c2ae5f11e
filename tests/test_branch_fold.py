"""What the kernel takes over from a residual add's branch, and two norms of one value in one call.

- x + attn + mlp (GPT-J, GPT-NeoX, Phi, Cohere, Falcon): the second add is the kernel's x1;
- timm's drop_path in training: the per-sample scale is the kernel's rowscale;
- training-mode dropout of the branch (BERT, ViT): drawn in the kernel, checked given its mask;
- two norms of the same value (GPT-NeoX's parallel blocks): one call, one read of the sum.
"""

import copy

import pytest
import torch

import normfuse
from normfuse.verify.graph_check import check_graph_sites
from normfuse.zoo import ToyTransformer, example_inputs, hf_model
from tests.helpers import assert_close, assert_within

pytest.importorskip("transformers")


def _zoo(name):
    from tests.zoo.models import zoo_models
    return zoo_models()[name].build()


def _optimized_counts(model, *args, **kwargs):
    torch._dynamo.reset()
    normfuse.optimize(model, **kwargs.pop("options", {}))
    with torch.no_grad():
        out = model(*args, **kwargs)
    return out, normfuse.report(model)


# --------------------------------------------------------------------------- x1 and two norms

# family -> (fused sites, fused calls, sites with x1): two layers and the final norm
PARALLEL = {
    "hf:gpt_neox": (5, 3, 2),   # two norms of one value per layer (one call), h = mlp + attn + h
    "hf:gptj": (3, 3, 2),       # one norm per layer, h = attn + mlp + h
    "hf:phi": (3, 3, 2),
    "hf:cohere": (3, 3, 2),     # h = (h + attn) + mlp
    "hf:falcon": (3, 3, 2),     # mlp += attn (in place), then dropout_add
}


@pytest.mark.parametrize("name", list(PARALLEL))
def test_parallel_blocks_fold_the_second_branch(name):
    model, args, kwargs = _zoo(name)
    with torch.no_grad():
        ref = model(*args, **kwargs).last_hidden_state
    out, rep = _optimized_counts(model, *args, **kwargs)
    c = rep.counts()
    fused, calls, x1 = PARALLEL[name]
    assert (c["fused"], c["fused_calls"], c["fused_x1"]) == (fused, calls, x1), str(rep)
    # the same adds in the same order (Cohere's written-out LayerNorm reduces its rows in
    # another order than the kernel: equal up to that)
    assert_close(out.last_hidden_state, ref)


def test_two_norms_of_one_value_share_a_call_and_are_proved():
    model, args, kwargs = _zoo("hf:gpt_neox")
    result = normfuse.check(model, *args, **kwargs)
    assert result.ok, str(result)
    assert len(result.sites) == 5 and all(s.symbolic.status == "proved" for s in result.sites)
    rep = result.report
    calls = {}
    for s in rep.sites:
        calls.setdefault(s.call, []).append(s.fqn)
    assert sorted(calls.values()) == [
        ["final_layer_norm"],
        ["layers.0.input_layernorm", "layers.0.post_attention_layernorm"],
        ["layers.1.input_layernorm", "layers.1.post_attention_layernorm"]]
    assert "one kernel with" in str(rep)


def test_audit_counts_one_kernel_for_two_norms():
    model, args, kwargs = _zoo("hf:gpt_neox")
    paired = normfuse.audit(model, *args, **kwargs)
    apart = normfuse.audit(model, *args, config=normfuse.FuseConfig(pair_norms=False), **kwargs)
    kernels = sum(s.fused.fwd_kernels for s in paired.sites if s.would_fuse)
    assert kernels == 3 == paired.summary()["fused_calls"]
    assert paired.summary()["fused_x1"] == 2
    assert sum(s.fused.fwd_kernels for s in apart.sites if s.would_fuse) == 5
    # one read of the sum serves both norms: fewer bytes than two kernels reading it
    assert paired.totals()["fused"]["fwd"] < apart.totals()["fused"]["fwd"]


def test_toy_parallel_block_training_matches_eager():
    torch.manual_seed(0)
    model = ToyTransformer(placement="parallel", kind="rms_norm", spelling="llama")
    ids = torch.randint(0, 64, (2, 8))
    ref, ref64 = copy.deepcopy(model), copy.deepcopy(model).double()
    normfuse.optimize(model)
    grads = []
    for m in (model, ref, ref64):
        m(ids).sum().backward()
        grads.append({n: p.grad for n, p in m.named_parameters()})
    c = normfuse.report(model).counts()
    assert c["fused_calls"] == 3 and c["fused_x1"] == 2
    for name, g in grads[1].items():
        assert_within(grads[0][name], g, grads[2][name], name)


# --------------------------------------------------------------------------- training: drop_path, dropout

def _vit(drop_path=0.2, proj_drop=0.1):
    normfuse.zoo.prepare_torchvision()
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    return timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=2,
                             drop_path_rate=drop_path, proj_drop_rate=proj_drop)


IMAGES = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))


def test_vit_training_folds_drop_path_and_dropout():
    model = _vit().train()
    result = normfuse.check(model, IMAGES)
    c = result.report.counts()
    # block 0: attn's dropout and mlp's dropout; block 1 (drop_path 0.2): both drop paths
    assert (c["fused_with_add"], c["fused_dropout"], c["fused_rowscale"]) == (5, 2, 2), str(result.report)
    assert all(s.passed and s.symbolic.status == "proved" for s in result.sites), str(result)
    given = [s.id for s in result.sites if s.numeric.given_mask]
    assert given == ["g0.s1", "g0.s2"]
    assert "equal given the mask" in str(result)


def test_vit_eval_folds_nothing_random():
    model = _vit().eval()
    ref = model(IMAGES)
    out, rep = _optimized_counts(model, IMAGES)
    c = rep.counts()
    assert (c["fused_dropout"], c["fused_rowscale"], c["fused_with_add"]) == (0, 0, 5)
    assert torch.equal(out, ref)


def test_folded_dropout_follows_torch_seed_and_trains():
    model = _vit(drop_path=0.0).train()
    normfuse.optimize(model)
    outs = []
    for _ in range(2):
        torch.manual_seed(3)
        outs.append(model(IMAGES))
    torch.manual_seed(4)
    other = model(IMAGES)
    assert torch.equal(outs[0], outs[1]) and not torch.equal(outs[0], other)
    outs[0].square().mean().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad)
    assert normfuse.report(model).counts()["fused_dropout"] == 4  # attn and mlp dropout, both blocks


def test_bert_training_dropout_checked_given_the_mask():
    model = hf_model("bert").train()
    inputs = example_inputs(model)
    result = normfuse.check(model, **inputs)
    assert result.report.counts()["fused_dropout"] == 4
    # the embedding norm has no branch; each of the 4 Post-Norm sites drew its dropout
    assert [s.numeric.given_mask for s in result.sites] == [False, True, True, True, True]
    assert all(s.passed and s.symbolic.status == "proved" for s in result.sites), str(result)


def test_options_turn_each_fold_off():
    model = _vit().train()
    _, rep = _optimized_counts(model, IMAGES, options=dict(fuse_dropout=False))
    assert (rep.counts()["fused_dropout"], rep.counts()["fused_rowscale"]) == (0, 2)
    model = _vit().train()
    _, rep = _optimized_counts(model, IMAGES, options=dict(fuse_branch=False))
    assert (rep.counts()["fused_dropout"], rep.counts()["fused_rowscale"]) == (0, 0)
    model, args, kwargs = _zoo("hf:gpt_neox")
    _, rep = _optimized_counts(model, *args, options=dict(pair_norms=False, fuse_branch=False), **kwargs)
    c = rep.counts()
    assert (c["fused"], c["fused_calls"], c["fused_x1"]) == (5, 5, 0)


# --------------------------------------------------------------------------- the checker catches a wrong fold

def _captured(model, *args, **kwargs):
    gms = []

    def capture(gm, example_inputs):
        gms.append((gm, example_inputs))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(model, backend=capture)(*args, **kwargs)
    assert len(gms) == 1
    return gms[0]


def _site_checks_after(model, tamper, *args, **kwargs):
    gm, inputs = _captured(model, *args, **kwargs)
    original = normfuse.passes.graph.copy_graph_module(gm)
    rewritten, rep = normfuse.fuse_graph(gm)
    calls = [n for n in rewritten.graph.nodes if normfuse.passes.record.is_fused_call(n)]
    changed = tamper(calls)
    rewritten.recompile()
    checks, _ = check_graph_sites(original, list(inputs), rewritten, rep.sites)
    return checks, changed


def test_checker_refutes_a_call_that_drops_the_second_branch():
    torch.manual_seed(0)
    model = ToyTransformer(placement="parallel", kind="layer_norm").eval()

    def drop_x1(calls):
        call = next(c for c in calls if "x1" in c.kwargs)
        call.kwargs = {k: v for k, v in call.kwargs.items() if k != "x1"}
        return call

    checks, _ = _site_checks_after(model, drop_x1, torch.randint(0, 64, (2, 8)))
    bad = [c for c in checks if not c.passed]
    assert bad and all(c.symbolic.status == "refuted" for c in bad)
    assert all(not c.numeric.passed for c in bad)


def test_checker_fails_a_call_with_another_dropout_rate():
    model = hf_model("bert").train()

    def other_rate(calls):
        call = next(c for c in calls if c.kwargs.get("dropout_p"))
        call.kwargs = {**call.kwargs, "dropout_p": 0.3}
        return call

    checks, _ = _site_checks_after(model, other_rate, **example_inputs(model))
    assert sum(not c.passed for c in checks) == 1
    bad = next(c for c in checks if not c.passed)
    assert bad.numeric.given_mask and bad.symbolic.status == "refuted"


# --------------------------------------------------------------------------- checkpointing with dropout

def _step(model, inputs, seed=5):
    torch.manual_seed(seed)
    out = model(**inputs).last_hidden_state
    out.square().sum().backward()
    return out, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("fuse_dropout", [True, False])
def test_checkpointed_dropout_recomputes_the_same_mask(fuse_dropout):
    """Regions run eagerly recompute with the forward's random numbers: with and without
    checkpointing, the same seed gives the same output and the same gradients."""
    base = hf_model("bert").train()
    inputs = example_inputs(base)
    plain, ckpt = copy.deepcopy(base), copy.deepcopy(base)
    ckpt.gradient_checkpointing_enable()
    for m in (plain, ckpt):
        torch._dynamo.reset()
        normfuse.optimize(m, fuse_dropout=fuse_dropout)
    out, grads = _step(plain, inputs)
    out_ck, grads_ck = _step(ckpt, inputs)
    assert normfuse.report(ckpt).counts()["fused_dropout"] == (4 if fuse_dropout else 0)
    assert torch.equal(out, out_ck)
    for name, g in grads.items():
        assert torch.equal(g, grads_ck[name]), name
    if not fuse_dropout:  # eager's own dropout: the same numbers as the unoptimized model
        ref_out, ref_grads = _step(copy.deepcopy(base), inputs)
        assert torch.equal(out, ref_out)
        for name, g in ref_grads.items():
            assert_close(grads[name], g)


def test_audit_prices_an_fp32_residual_stream():
    model = hf_model("llama", torch.bfloat16)
    inputs = example_inputs(model)
    plain = normfuse.audit(model, **inputs).totals()["fused"]
    wide = normfuse.audit(model, config=normfuse.FuseConfig(residual_dtype=torch.float32), **inputs).totals()["fused"]
    # the add_norm sites write their bf16 sums and read their residuals in fp32: more bytes, no kernel
    assert wide["fwd"] > plain["fwd"] and wide["bwd"] > plain["bwd"]
    assert wide["fwd_kernels"] == plain["fwd_kernels"]


def test_inductor_post_grad_graphs_pair_norms_and_fold_x1():
    """As Inductor's custom post-grad pass: the ATen graph's decomposed norms are paired and the
    three-operand sum folded, calling the custom op itself."""
    torch.manual_seed(0)
    fusion = normfuse.NormFusionPass()
    model = ToyTransformer(placement="parallel").eval()
    ids = torch.randint(0, 64, (2, 8))
    torch._dynamo.reset()
    with torch.no_grad():
        ref = model(ids)
        with torch._inductor.config.patch(post_grad_custom_post_pass=fusion, fx_graph_cache=False):
            out = torch.compile(model)(ids)
    c = fusion.report.counts()
    assert (c["fused"], c["fused_calls"], c["fused_x1"], c["fused_with_add"]) == (5, 3, 2, 5), str(fusion.report)
    assert_close(out, ref)


def test_dropout_on_dtensor_rows_stays_eager(monkeypatch):
    """On DTensors each rank would draw its mask from its local row index (the same pattern on
    every rank): the branch's dropout is left to eager there."""
    import normfuse.kernels.sharding as sharding
    monkeypatch.setattr(sharding, "is_dtensor", lambda value: True)
    torch.manual_seed(0)
    model = ToyTransformer(dropout=0.2).train()
    torch._dynamo.reset()
    normfuse.optimize(model)
    model(torch.randint(0, 64, (2, 8)))
    c = normfuse.report(model).counts()
    assert (c["fused_with_add"], c["fused_dropout"]) == (5, 0)


def test_filter_fn_keeps_an_excluded_norm_out_of_its_pair():
    torch.manual_seed(0)
    model = ToyTransformer(placement="parallel").eval()
    ids = torch.randint(0, 64, (2, 8))
    ref = model(ids)
    out, rep = _optimized_counts(model, ids, options=dict(filter_fn=lambda site: site.fqn != "blocks.1.norm2"))
    excluded = next(s for s in rep.sites if s.fqn == "blocks.1.norm2")
    assert not excluded.fused and excluded.reason == "excluded by filter_fn"
    c = rep.counts()
    assert (c["fused"], c["fused_calls"]) == (4, 3)  # block 1's first norm is a call of its own
    assert_close(out, ref)
