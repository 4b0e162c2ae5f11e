"""Nested regions: checkpointed blocks, other higher-order-op subgraphs, and the pass as an
Inductor custom post-grad pass.

Dynamo puts a checkpointed block in a nested subgraph of a higher-order op; the pass
descends into it, and the checkpoint recomputes the fused op in backward.
"""

import copy
import functools
import warnings

import pytest
import torch
import torch.nn as nn
import torch.fx.passes.shape_prop

import normfuse
from normfuse.passes.pipeline import NormFusionPass
from normfuse.zoo import ToyTransformer, example_inputs, hf_model
from tests.helpers import assert_within
from tests.loops import checkpointed_stack

IDS = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _train_step(model, ids):
    out = model(ids)
    out.square().mean().backward()
    return out, {n: p.grad for n, p in model.named_parameters()}


# optimize's options for: no cross-block pairs; the default (a checkpointed block gets the
# sum, the final norm the last block's pair); pairs into checkpointed blocks too
MODES = {"off": {"cross_block": False}, "default": {}, "cross_checkpoints": {"cross_checkpoints": True}}

# add-fed sites fused with their add: inside each block the add before norm2; by default also
# the final norm (the last block's pair), with cross_checkpoints also each block's first norm.
# A reentrant checkpoint in the owner's loop would hide a pair going in from autograd: only
# the sum goes into its blocks.
WITH_ADD = {"non_reentrant": {"off": 2, "default": 3, "cross_checkpoints": 4},
            "reentrant": {"off": 2, "default": 3, "cross_checkpoints": 3},
            "checkpoint_wrapper": {"off": 2, "default": 3, "cross_checkpoints": 4}}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("wrap", ["non_reentrant", "reentrant", "checkpoint_wrapper"])
def test_checkpointed_blocks_are_entered_and_fused(wrap, mode):
    model = checkpointed_stack(wrap)
    ref, ref64 = copy.deepcopy(model), copy.deepcopy(model).double()
    normfuse.optimize(model, **MODES[mode])
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no fallback anywhere
        out, grads = _train_step(model, IDS)
    ref_out, ref_grads = _train_step(ref, IDS)
    _, grads64 = _train_step(ref64, IDS)
    rep = normfuse.report(model)
    counts = rep.counts()
    # 2 norms per block and the final norm: all found and fused
    assert counts["sites"] == 5 and counts["fused"] == 5
    assert counts["fused_with_add"] == WITH_ADD[wrap][mode], str(rep)
    if mode != "off":
        [note] = [n for n in rep.notes if n.startswith("cross-block")]
        assert "left as it was" not in note and ("reentrant" in note) == (wrap == "reentrant"), note
    assert [r.op for r in rep.regions] == ["tag_activation_checkpoint"] * 2
    assert all(r.analyzed for r in rep.regions)
    # every wrapper's norms sit in the nested graphs (graph > 0), named by their module paths
    assert sorted(s.fqn for s in rep.sites if s.graph > 0) == [
        f"blocks.{i}.{n}" for i in range(2) for n in ("norm1", "norm2")]
    # the same adds and norms, recomputed in backward by the fused op: the forward is
    # bit-identical on CPU, gradients within the tolerance rule against fp64
    assert torch.equal(out, ref_out)
    for name, g in ref_grads.items():
        assert_within(grads[name], g, grads64[name], name)


_NO_DROPOUT = {"bert": {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0},
               "opt": {"dropout": 0.0, "attention_dropout": 0.0}}


# llama-, Gemma- (decomposed ``1 + w`` RMSNorm), OPT- (Pre-Norm LayerNorm modules) and
# BERT-style (Post-Norm) families
@pytest.mark.parametrize("family", ["llama", "gemma", "opt", "bert"])
@pytest.mark.parametrize("mode", list(MODES))
def test_hf_gradient_checkpointing(family, mode):
    no_dropout = _NO_DROPOUT.get(family, {})
    model = hf_model(family, **no_dropout)
    model.gradient_checkpointing_enable()
    model.train()  # HF checkpoints only in training mode
    inputs = example_inputs(model)
    ref, ref64 = copy.deepcopy(model), copy.deepcopy(model).double()
    normfuse.optimize(model, **MODES[mode])
    out = model(**inputs).last_hidden_state
    ref_out = ref(**inputs).last_hidden_state
    out.sum().backward()
    ref_out.sum().backward()
    ref64(**inputs).last_hidden_state.sum().backward()
    rep = normfuse.report(model)
    counts = rep.counts()
    assert len(rep.regions) == 2 and all(r.op == "tag_activation_checkpoint" for r in rep.regions)
    if family != "bert":
        # every norm of the 2 layers and the final norm, each fed by an add but the first; the
        # add inside each layer fused, by default also the last layer's add into the final
        # norm, and with cross_checkpoints the add between the layers (its pair crosses the
        # checkpointed layer as two tensors)
        assert counts["sites"] == 5 and counts["fused"] == 5
        assert counts["fused_with_add"] == {"off": 2, "default": 3, "cross_checkpoints": 4}[mode], str(rep)
    else:
        # 2 Post-Norm sites per layer, each with its add, as without checkpointing; the
        # embedding norm with its position add (a table broadcast over the batch)
        assert counts["sites"] == 5 and counts["fused"] == 5 and counts["fused_with_add"] == 5
    assert torch.equal(out, ref_out)
    for (name, p), (_, q), (_, r) in zip(model.named_parameters(), ref.named_parameters(),
                                         ref64.named_parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            assert_within(p.grad, q.grad, r.grad, name)


def test_check_verifies_sites_inside_checkpointed_regions():
    model = checkpointed_stack("non_reentrant")
    result = normfuse.check(model, IDS)
    assert result.ok, str(result)
    # every fused site, the four inside the two regions included, is compared and proved
    assert len(result.sites) == 5
    assert all(s.numeric.passed and s.numeric.outputs for s in result.sites)
    assert all(s.symbolic.status == "proved" for s in result.sites)


class CondBlock(nn.Module):
    """A norm inside ``torch.cond``: a region the pass does not enter."""

    def __init__(self, n=16):
        super().__init__()
        self.lin, self.norm = nn.Linear(n, n), nn.LayerNorm(n)

    def forward(self, x):
        def yes(x):
            return self.norm(x + self.lin(x))

        def no(x):
            return x * 2

        return torch.cond(x.sum() > 0, yes, no, (x,))


def test_region_not_entered_is_reported():
    model = normfuse.optimize(CondBlock().eval())
    x = torch.randn(2, 3, 16)
    with torch.no_grad():
        out = model(x)
    assert torch.equal(out, CondBlock.forward(model, x))
    rep = normfuse.report(model)
    skipped = rep.regions_not_analyzed
    assert skipped and all(r.op == "cond" and "not entered" in r.reason for r in skipped)
    assert "not analyzed" in str(rep)
    audit = normfuse.audit(CondBlock().eval(), x)
    assert [r.name for r in audit.regions_not_analyzed] == [r.name for r in skipped]
    assert "not analyzed" in audit.to_table()


@pytest.mark.parametrize("kind", ["rms_norm", "layer_norm"])
def test_inductor_custom_post_grad_pass(kind):
    """Plain torch.compile (Inductor) with the pass as its post-grad custom pass: the
    functionalized ATen graph (LayerNorm decomposed into var_mean) is matched too."""
    model = ToyTransformer(placement="pre", kind=kind, spelling="llama" if kind == "rms_norm" else "module",
                           hidden=32, depth=2).eval()
    fusion = NormFusionPass()
    assert fusion.uuid() == NormFusionPass().uuid()  # cacheable: same options, same key
    assert NormFusionPass(normfuse.FuseConfig(standalone=False)).uuid() != fusion.uuid()
    # a graph served from Inductor's FX-graph cache is not passed through the pass again, so
    # the report would list nothing: compile afresh
    with torch._inductor.config.patch(post_grad_custom_post_pass=fusion, fx_graph_cache=False), torch.no_grad():
        out = torch.compile(model)(IDS)
        ref = model(IDS)
        ref64 = copy.deepcopy(model).double()(IDS)
    counts = fusion.report.counts()
    assert counts["sites"] == 5 and counts["fused"] == 5 and counts["fused_with_add"] == 5, str(fusion.report)
    assert_within(out, ref, ref64)


def test_pass_on_a_bare_graph_rewrites_it_in_place():
    gm = torch.fx.symbolic_trace(ToyTransformer(placement="post", kind="layer_norm", spelling="module",
                                                hidden=32, depth=1).eval())
    torch.fx.passes.shape_prop.ShapeProp(gm).propagate(IDS)  # shapes and dtypes the matcher reads
    graph = gm.graph
    result = NormFusionPass()(graph)
    assert gm.graph is graph and result.modified
    assert sum(1 for n in graph.nodes if n.op == "call_function" and "normfuse" in str(n.target)) == 2
    with pytest.raises(TypeError, match="GraphModule"):
        NormFusionPass()(functools.partial(print))


@pytest.mark.parametrize("cross_checkpoints", [False, True])
@pytest.mark.parametrize("family", ["llama", "opt"])
def test_check_proves_hf_checkpointed_layers_with_the_pairs_between_them(family, cross_checkpoints):
    model = hf_model(family, **_NO_DROPOUT.get(family, {}))
    model.gradient_checkpointing_enable()
    model.train()
    optimized = normfuse.optimize(copy.deepcopy(model), cross_checkpoints=cross_checkpoints)
    result = normfuse.check(model, optimized=optimized, **example_inputs(model))
    assert result.ok, str(result)
    # the 5 sites, those whose add came in from the layer before included, each proved
    assert len(result.sites) == 5 and all(s.symbolic.status == "proved" for s in result.sites)
    assert sum(s.op == "add_norm" for s in result.sites) == (4 if cross_checkpoints else 3)
    assert any("equals the original bit for bit" in note for note in result.notes), result.notes


def test_checkpoints_keep_the_sum_unless_pairs_are_asked_into_them():
    """A checkpoint keeps its block's inputs for the recompute: by default the checkpointed
    layers get the sum (one tensor, as in eager), so the forward keeps no more than eager's."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from bench_memory import SavedBytes  # the meter benchmarks/bench_checkpoint.py reports with

    def saved(model, inputs):
        with SavedBytes(exclude=list(model.parameters())) as meter:
            out = model(**inputs).last_hidden_state
        out.sum().backward()
        return meter.bytes

    eager = hf_model("llama", num_hidden_layers=4)
    eager.gradient_checkpointing_enable()
    eager.train()
    inputs = example_inputs(eager, seq=32)
    default = normfuse.optimize(copy.deepcopy(eager))
    crossing = normfuse.optimize(copy.deepcopy(eager), cross_checkpoints=True)
    sizes = {name: saved(m, inputs) for name, m in [("eager", eager), ("default", default), ("crossing", crossing)]}
    one = 2 * 32 * eager.config.hidden_size * 4  # one hidden-sized fp32 activation
    assert sizes["default"] <= sizes["eager"], sizes
    # pairs into the 3 checkpointed layers after the first: one more activation kept by each
    assert sizes["crossing"] - sizes["default"] >= 3 * one, sizes
