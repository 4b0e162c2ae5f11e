"""The graph pass on HF models built from their configs (2 layers, no download).

Expected counts come from the architecture (L = 2 layers):
- llama:    2L + 1 = 5 RMSNorms (decomposed LlamaRMSNorm). layer 0's input norm reads the
            embeddings (standalone); the other 2L are fed by a residual add that continues
            the stream (pre), the last being the final norm.
- gemma2:   4 norms per layer + final = 9. input and pre-feedforward norms are pre (layer 0's
            input norm standalone), post-attention / post-feedforward norms sit inside the
            branch and their output feeds the add that the next norm reads (sandwich).
            Gemma's (1 + w) offset is read off the graph.
- t5:       encoder 2 per layer + final, decoder 3 per layer + final = 5 + 7 = 12; the first
            norm of each stack reads the embeddings (standalone), the rest are pre.
- bert:     embedding LayerNorm (tok + pos + type) + 2 per layer, Post-Norm = 1 + 4.
- gpt2:     ln_1, ln_2 per layer + ln_f = 5, all pre; ln_1 of layer 0 reads wte + wpe, a sum
            that continues the stream.
- gpt_neox: parallel residual: ln_1 and ln_2 both read x (4 parallel) + final norm (pre); the
            two norms of a layer are one call, so layer 1's pair and the final norm take the add
            (h = mlp + attn + h, the second branch folded in: x1).
"""

import pytest
import torch

import normfuse
from normfuse.tolerances import within_tolerance
from normfuse.zoo import example_inputs, hf_model
from helpers import assert_close

pytest.importorskip("transformers")

EXPECTED = {
    "llama": dict(sites=5, placements={"standalone": 1, "pre": 4}, input_is_add=4, fused_add=4, kind="rms_norm"),
    "gemma2": dict(sites=9, placements={"standalone": 1, "pre": 4, "sandwich": 4}, input_is_add=4, fused_add=4,
                   kind="rms_norm"),
    "t5": dict(sites=12, placements={"standalone": 2, "pre": 10}, input_is_add=10, fused_add=10, kind="rms_norm"),
    "bert": dict(sites=5, placements={"embedding": 1, "post": 4}, input_is_add=5, fused_add=5, kind="layer_norm"),
    "gpt2": dict(sites=5, placements={"pre": 5}, input_is_add=5, fused_add=5, kind="layer_norm"),
    "gpt_neox": dict(sites=5, placements={"parallel": 4, "pre": 1}, input_is_add=3, fused_add=3,
                     kind="layer_norm"),
}


def _first_tensor(out):
    return out[0] if isinstance(out, (tuple, list)) else out.last_hidden_state


def _check_report(rep, want):
    c = rep.counts()
    assert c["sites"] == want["sites"], rep
    assert c["by_placement"] == want["placements"], rep
    assert c["input_is_add"] == want["input_is_add"], rep
    assert c["fused"] == want["sites"], [s.reason for s in rep.unfused]
    assert c["fused_with_add"] == want["fused_add"], rep
    assert c["by_kind"] == {want["kind"]: want["sites"]}
    assert all(s.fqn and s.source for s in rep.sites)


@pytest.mark.parametrize("name", list(EXPECTED))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hf_forward(name, dtype):
    torch._dynamo.reset()
    model = hf_model(name, dtype)
    ref64 = hf_model(name, torch.float64)
    inputs = example_inputs(model)
    keys = list(model.state_dict())
    with torch.no_grad():
        ref = _first_tensor(model(**inputs))
        exact = _first_tensor(ref64(**inputs))
        normfuse.optimize(model)
        out = _first_tensor(model(**inputs))
    _check_report(normfuse.report(model), EXPECTED[name])
    assert list(model.state_dict()) == keys
    ok, err, base, bound = within_tolerance(out, ref, exact, dtype)
    assert ok, (err, base, bound)
    if name == "gemma2":
        assert all(s.weight_offset == 1.0 for s in normfuse.report(model).sites)


@pytest.mark.parametrize("name", ["llama", "bert", "gemma2", "t5"])
def test_hf_backward(name):
    """Gradients of every parameter match eager (fp32)."""
    torch._dynamo.reset()
    no_dropout = dict(dropout_rate=0.0, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                      attention_dropout=0.0, hidden_dropout=0.0)  # both runs must see the same function
    model = hf_model(name, torch.float32, **no_dropout).train()
    twin = hf_model(name, torch.float32, **no_dropout).train()
    inputs = example_inputs(model)
    normfuse.optimize(model)
    _first_tensor(model(**inputs)).square().mean().backward()
    _first_tensor(twin(**inputs)).square().mean().backward()
    assert len(normfuse.report(model).fused) == EXPECTED[name]["sites"]
    for (pname, p), q in zip(model.named_parameters(), twin.parameters()):
        if q.grad is None:
            assert p.grad is None, pname
            continue
        assert_close(p.grad, q.grad, pname)


@pytest.mark.parametrize("name", list(EXPECTED))
def test_export_aten_graph_same_sites(name):
    """torch.export's ATen graph gives the same sites as dynamo's torch-level graph."""
    model = hf_model(name, torch.bfloat16)
    inputs = example_inputs(model)
    gm = torch.export.export(model, (), inputs, strict=False).module()
    with torch.no_grad():
        ref = _first_tensor(model(**inputs))
    gm, rep = normfuse.fuse_graph(gm)
    _check_report(rep, EXPECTED[name])
    assert all(s.form in ("aten",) or s.form.startswith("decomposed") for s in rep.sites)
    with torch.no_grad():
        out = _first_tensor(gm(**inputs))
    assert torch.equal(out, ref)  # CPU reference path: same rounding, same reduction order


def test_inductor_backend_on_llama():
    torch._dynamo.reset()
    model = hf_model("llama", torch.float32)
    inputs = example_inputs(model)
    with torch.no_grad():
        ref = _first_tensor(model(**inputs))
        out = _first_tensor(torch.compile(model, backend="normfuse_inductor")(**inputs))
    _check_report(normfuse.report(model), EXPECTED["llama"])   # the pass ran before Inductor and fused
    assert_close(out, ref)


@pytest.mark.parametrize("name", ["llama", "bert"])
def test_aot_graphs(name):
    """AOTAutograd's functionalized ATen graphs: inference graphs fuse every site; in a training
    forward graph LayerNorm's mean/rstd are outputs saved for the backward, so those sites are
    left with that reason (the decomposed RMSNorm keeps its saved intermediates alive)."""
    from torch._dynamo.backends.common import aot_autograd

    reports = []

    def fuse(gm, example_inputs):
        gm, rep = normfuse.fuse_graph(gm)
        reports.append(rep)
        return gm

    model = hf_model(name, torch.bfloat16)
    inputs = example_inputs(model)
    torch._dynamo.reset()
    with torch.no_grad():
        ref = _first_tensor(model(**inputs))
        out = _first_tensor(torch.compile(model, backend=aot_autograd(fw_compiler=fuse))(**inputs))
    assert len(reports[0].fused) == EXPECTED[name]["sites"]
    assert torch.equal(out, ref)
    torch._dynamo.reset()
    reports.clear()
    compiled = torch.compile(model, backend=aot_autograd(fw_compiler=fuse, bw_compiler=lambda gm, ex: gm))
    _first_tensor(compiled(**inputs)).float().sum().backward()
    train = reports[0]
    if name == "llama":
        assert len(train.fused) == EXPECTED[name]["sites"]
    else:
        assert len(train.sites) == EXPECTED[name]["sites"] and not train.fused
        assert all("saved statistics" in s.reason for s in train.sites), [s.reason for s in train.sites]
