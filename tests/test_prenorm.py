"""Post-Norm -> Pre-Norm conversion: counts, final norms, numbers, structure, training."""

from __future__ import annotations

import copy
import io
import operator

import pytest
import torch
import torch.nn as nn

import normfuse
from normfuse.vocabulary import FINAL_NORM_NAME
from normfuse.verify.structure import check_structure
from normfuse.passes import prenorm
from normfuse.passes.record import fused_op_name
from normfuse.zoo import ToyTransformer
from helpers import assert_close


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _ids(vocab=64, batch=2, seq=8, seed=0):
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _toy(placement="post", seed=0, **kw):
    torch.manual_seed(seed)
    return ToyTransformer(placement=placement, depth=2, **kw).eval()


def _converted(model, *args, **kwargs):
    normfuse.optimize(model, prenorm=True)
    out = model(*args, **kwargs)
    return out, normfuse.report(model)


def _pre_twin(post: ToyTransformer, kind="layer_norm", spelling="module") -> ToyTransformer:
    """The hand-written Pre-Norm model the conversion promises: each block's norms as its
    pre-norms, the registered final norm as its final norm."""
    c = post.config
    pre = ToyTransformer(vocab=c["vocab"], hidden=c["hidden"], heads=c["heads"], depth=c["depth"], placement="pre",
                         kind=kind, spelling=spelling, embed_norm=c["embed_norm"], final_norm=True).eval()
    state = {k: v for k, v in post.state_dict().items() if not k.startswith(FINAL_NORM_NAME)}
    for k, v in post.state_dict().items():
        if k.startswith(FINAL_NORM_NAME):
            state["final_norm." + k.split(".", 1)[1]] = v
    pre.load_state_dict(state)
    return pre


# --------------------------------------------------------------------------- hand-written Post-Norm models

@pytest.mark.parametrize("kind,spelling", [("layer_norm", "module"), ("layer_norm", "manual"),
                                           ("rms_norm", "module"), ("rms_norm", "llama")])
def test_toy_post_equals_hand_written_pre(kind, spelling):
    post = _toy(kind=kind, spelling=spelling)
    ids = _ids()
    original = post(ids)
    out, rep = _converted(post, ids)
    c = rep.counts()
    assert c["converted"] == 4  # 2 blocks x 2 sublayers
    converted = [s for s in rep.sites if s.converted]
    assert {s.placement for s in converted} == {"pre"}
    assert sorted(s.fqn for s in converted) == ["blocks.0.norm1", "blocks.0.norm2", "blocks.1.norm1",
                                                "blocks.1.norm2"]
    assert list(prenorm.final_norms(post)) == ["normfuse_final_norm"]
    final = prenorm.final_norms(post)["normfuse_final_norm"]
    assert isinstance(final, nn.LayerNorm if kind == "layer_norm" else nn.RMSNorm)
    assert torch.equal(final.weight, torch.ones(32))
    # the function changed by design ...
    assert (out - original).abs().max() > 1e-2
    # ... into exactly the hand-written Pre-Norm model with the mapped weights
    expected = _pre_twin(post, kind, spelling)(ids)
    assert_close(out, expected)
    ok, why = check_structure(rep.graph_modules)
    assert ok, why
    assert "4 converted blocks" in why and "4 adds only" in why


def test_converted_sites_fuse_with_the_previous_add():
    post = _toy()
    _, rep = _converted(post, _ids())
    by_fqn = {s.fqn: s for s in rep.sites}
    assert all(by_fqn[f].fused for f in by_fqn)
    # every pre-norm after the first reads the previous block's sum: one kernel with that add
    for fqn in ("blocks.0.norm2", "blocks.1.norm1", "blocks.1.norm2", "normfuse_final_norm"):
        assert by_fqn[fqn].fused_add and by_fqn[fqn].op == "add_norm", fqn
    assert not by_fqn["normfuse_final_norm"].converted


def test_deepnorm_drops_alpha():
    post = _toy("deepnorm", alpha=1.7)
    ids = _ids()
    out, rep = _converted(post, ids)
    assert rep.counts()["converted"] == 4
    assert any("DeepNorm residual scale [1.7] dropped" in n for n in rep.notes)
    assert_close(out, _pre_twin(post)(ids))
    assert check_structure(rep.graph_modules)[0]


def test_embedding_norm_stays_and_existing_final_norm_is_used():
    post = _toy(embed_norm=True, final_norm=True)
    ids = _ids()
    out, rep = _converted(post, ids)
    sites = {s.fqn: s for s in rep.sites}
    assert sites["embed_norm"].placement == "embedding" and not sites["embed_norm"].converted
    assert rep.counts()["converted"] == 4
    # the stream already ends in the model's final norm: no new norm in the graph
    assert "normfuse_final_norm" not in sites
    assert any("already ends in a norm" in n for n in rep.notes)
    expected = _pre_twin(post)
    expected.final_norm.load_state_dict(post.final_norm.state_dict())
    assert_close(out, expected(ids))


def test_pre_norm_model_is_left_alone():
    pre = _toy("pre")
    ids = _ids()
    original = pre(ids)
    out, rep = _converted(pre, ids)
    assert rep.counts()["converted"] == 0
    assert any("no Post-Norm block" in n for n in rep.notes)
    assert_close(out, original)
    assert check_structure(rep.graph_modules) == (False, "no converted Pre-Norm stream in these graphs")


class _SharedBranch(nn.Module):
    """Post-Norm whose branch value also escapes to the output: the branch cannot be isolated."""

    def __init__(self, n=16):
        super().__init__()
        self.f1, self.f2 = nn.Linear(n, n), nn.Linear(n, n)
        self.n1, self.n2 = nn.LayerNorm(n), nn.LayerNorm(n)

    def forward(self, x):
        h = self.f1(x)
        y = self.n1(x + h)
        return self.n2(y + self.f2(y)), h


def test_unidentifiable_branch_is_refused_with_a_reason():
    model = _SharedBranch().eval()
    x = torch.randn(2, 4, 16)
    expected = model(x)
    normfuse.optimize(model, prenorm=True)
    with pytest.warns(RuntimeWarning, match="left as it was: n1: .* from inside the branch"), torch.no_grad():
        out = model(x)
    rep = normfuse.report(model)
    assert rep.counts()["converted"] == 0
    assert any("left as it was" in w and "reads" in w and "from inside the branch" in w for w in rep.warnings)
    assert_close(out[0], expected[0])


def test_structure_check_catches_a_non_add_on_the_stream():
    post = _toy()
    _, rep = _converted(post, _ids())
    gm = rep.graph_modules[0]
    # put a scale on the stream between two blocks
    call = next(n for n in gm.graph.nodes if fused_op_name(n) == "add_norm"
                and n.meta.get("nn_module_stack") and "blocks.1.norm1" in str(list(n.meta["nn_module_stack"].values())[-1]))
    stream = next(a for a in call.args[:2] if a.target is operator.getitem)
    with gm.graph.inserting_after(stream):
        scaled = gm.graph.call_function(torch.mul, (stream, 0.5))
    call.replace_input_with(stream, scaled)
    ok, why = check_structure([gm])
    assert not ok
    assert "interrupted at" in why and f" {scaled.name} " in why.split("(neither")[1]


def test_fuse_graph_registers_the_final_norm_on_the_graph_module():
    post = _toy()
    ids = _ids()
    gms = []

    def capture(gm, example_inputs):
        gms.append(gm)
        return gm.forward

    torch.compile(post, backend=capture)(ids)
    gm = gms[0]
    _, rep = normfuse.fuse_graph(gm, prenorm=True)
    assert rep.counts()["converted"] == 4
    assert isinstance(gm.get_submodule("normfuse_final_norm"), nn.LayerNorm)
    assert check_structure([gm])[0]


# --------------------------------------------------------------------------- training and state

def test_converted_model_trains_and_round_trips_state_dict():
    post = _toy("post", seed=3)
    model = normfuse.optimize(copy.deepcopy(post).train(), prenorm=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)  # built before the first call
    ids = _ids(seed=1)
    final = prenorm.final_norms(model)["normfuse_final_norm"]
    assert any(p is final.weight for g in opt.param_groups for p in g["params"])
    for _ in range(2):
        loss = model(ids).logsumexp(-1).mean()
        opt.zero_grad()
        loss.backward()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
        assert final.weight.grad is not None and final.weight.grad.abs().sum() > 0
        opt.step()
    assert not torch.equal(final.weight, torch.ones_like(final.weight))  # the final norm trained
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    twin = normfuse.optimize(copy.deepcopy(post).train(), prenorm=True)
    buf.seek(0)
    twin.load_state_dict(torch.load(buf))  # strict: same keys before its first call
    model.eval(), twin.eval()
    assert_close(twin(ids), model(ids))
    # optimize again changes nothing
    keys = list(model.state_dict())
    before = model(ids)
    assert normfuse.optimize(model, prenorm=True) is model
    assert list(model.state_dict()) == keys
    assert_close(model(ids), before)


# --------------------------------------------------------------------------- HF Post-Norm models

def test_bert_prenorm_equals_a_hand_built_pre_norm_bert():
    """The converted BERT computes what a Pre-Norm BERT written by hand computes: each block's
    LayerNorms moved to their sublayer's input (x + F_k(norm_k(x))), the embedding norm kept, the
    stream ending in the new final norm; and that is not what the Post-Norm original computes."""
    pytest.importorskip("transformers")
    from normfuse.zoo import example_inputs, hf_model

    torch._dynamo.reset()
    model = hf_model("bert").eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.encoder.named_parameters():
            if name.endswith(("dense.weight", "query.weight", "key.weight", "value.weight")):
                p.mul_(20)   # initialized so small that Post- and Pre-Norm give about the same rows
            elif "LayerNorm" in name:   # initialized to 1 and 0: every norm the same, a swap unseen
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3 + (1.0 if name.endswith("weight") else 0.0))
    inputs = example_inputs(model)
    with torch.no_grad():
        post = model(**inputs).last_hidden_state
    normfuse.optimize(model, prenorm=True)
    with torch.no_grad():
        out = model(**inputs).last_hidden_state
        h = model.embeddings(input_ids=inputs["input_ids"])
        for layer in model.encoder.layer:                      # (B, S, hidden) throughout
            attention = layer.attention
            h = h + attention.output.dense(attention.self(attention.output.LayerNorm(h))[0])
            h = h + layer.output.dense(layer.intermediate(layer.output.LayerNorm(h)))
        want = getattr(model.encoder, FINAL_NORM_NAME)(h)
    assert normfuse.report(model).counts()["converted"] == 2 * len(model.encoder.layer)
    assert_close(out, want)
    assert (post - want).abs().max() > 0.5     # the conversion changed the function, as it should


@pytest.mark.parametrize("model_type,converted,finals", [
    ("bert", 4, ["encoder.normfuse_final_norm"]),
    ("bart", 10, ["encoder.normfuse_final_norm", "decoder.normfuse_final_norm"]),
])
def test_hf_post_norm_models(model_type, converted, finals):
    pytest.importorskip("transformers")
    from normfuse.zoo import example_inputs, hf_model

    model = hf_model(model_type).train()
    inputs = example_inputs(model)
    reference = copy.deepcopy(model)
    normfuse.optimize(model, prenorm=True)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    out = model(**inputs).last_hidden_state
    rep = normfuse.report(model)
    c = rep.counts()
    assert c["converted"] == converted
    assert c["by_placement"]["embedding"] == (2 if model_type == "bart" else 1)
    assert sorted(prenorm.final_norms(model)) == sorted(finals)
    assert sorted(s.fqn for s in rep.sites if s.fqn and s.fqn.endswith(FINAL_NORM_NAME)) == sorted(finals)
    assert all(s.placement == "pre" for s in rep.sites if s.converted)
    ok, why = check_structure(rep.graph_modules)
    assert ok, why
    assert why.count("adds only") == len(finals)
    assert torch.isfinite(out).all()
    loss = out.pow(2).mean() + out[..., 0].mean()
    opt.zero_grad()
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert len(grads) > 10 and all(torch.isfinite(g).all() for g in grads)
    for fqn in finals:
        assert model.get_submodule(fqn).weight.grad is not None
    opt.step()
    # state_dict round trip into a freshly converted twin
    twin = normfuse.optimize(reference, prenorm=True)
    missing, unexpected = twin.load_state_dict(model.state_dict())
    assert not missing and not unexpected
    model.eval(), twin.eval()
    torch._dynamo.reset()
    with torch.no_grad():
        assert_close(twin(**inputs).last_hidden_state, model(**inputs).last_hidden_state)


def test_check_knows_the_conversion_is_by_design():
    post = _toy()
    converted = normfuse.optimize(copy.deepcopy(post), prenorm=True)
    res = normfuse.check(post, _ids(), optimized=converted)
    assert res.by_design is True
    assert res.structure_ok is True
    assert any("4 adds only" in n for n in res.notes)
