"""Defects found by running normfuse on public models it had not seen, one test (or more) each.

Each test builds the smallest model that shows the defect: a shrunk HF model built from
its config (no download) or a hand-written module with the same pattern.
"""

import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import normfuse
from normfuse.verify.structure import check_structure
from normfuse.tolerances import within_tolerance
from helpers import assert_close


def _declare_torchvision_ops():
    """transformers imports torchvision when it is installed; the registry's torchvision
    wheel is a CUDA build whose fake registrations need its ``nms`` schemas declared."""
    if not hasattr(torch.ops.torchvision, "nms"):
        lib = torch.library.Library("torchvision", "DEF")
        lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        _declare_torchvision_ops.lib = lib  # keep the library (and its schemas) alive


_declare_torchvision_ops()


def _counts(model):
    return normfuse.report(model).counts()


def _optimized_close(model, *args):
    """Optimize ``model`` in place; its output is within the tolerance rule of eager's, vs fp64."""
    ref64 = copy.deepcopy(model).double()
    with torch.no_grad():
        ref = model(*args)
        want = ref64(*(a.double() if a.is_floating_point() else a for a in args))
        normfuse.optimize(model)
        out = model(*args)
    ok, err, err_eager, bound = within_tolerance(out, ref, want)
    assert ok, (err, err_eager, bound)


# --------------------------------------------------------------------------- 1. x - mean computed twice

class TwiceSubtractedLayerNorm(nn.Module):
    """Cohere's LayerNorm: ``x - mean`` written twice, weight multiplied in fp32, cast last."""

    def __init__(self, n, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(n))
        self.eps = eps

    def forward(self, h):
        dtype = h.dtype
        h = h.to(torch.float32)
        mean = h.mean(-1, keepdim=True)
        variance = (h - mean).pow(2).mean(-1, keepdim=True)
        h = (h - mean) * torch.rsqrt(variance + self.eps)
        return (self.weight.to(torch.float32) * h).to(dtype)


class PreNormStack(nn.Module):
    """Pre-Norm blocks ``x + W(norm(x))`` and a final norm: depth + 1 norms, depth adds."""

    def __init__(self, norm, n=32, depth=2):
        super().__init__()
        self.norms = nn.ModuleList([norm(n) for _ in range(depth)])
        self.linears = nn.ModuleList([nn.Linear(n, n) for _ in range(depth)])
        self.final = norm(n)

    def forward(self, x):
        for norm, linear in zip(self.norms, self.linears):
            x = x + linear(norm(x))
        return self.final(x)


def test_duplicated_subexpressions_count_once_hand_written():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = PreNormStack(TwiceSubtractedLayerNorm).eval()
    _optimized_close(model, torch.randn(2, 5, 32))
    c = _counts(model)
    assert (c["sites"], c["fused"], c["fused_with_add"]) == (3, 3, 2), normfuse.report(model)
    assert c["by_kind"] == {"layer_norm": 3}


def test_duplicated_subexpressions_cohere():
    from normfuse.zoo import example_inputs, hf_model

    torch._dynamo.reset()
    model = hf_model("cohere")  # 2 parallel blocks: 2 input norms + final = 3 norms, 2 adds
    result = normfuse.check(model, **example_inputs(model))
    assert result.ok, result
    sites = result.report.sites
    assert (len(sites), sum(s.fused for s in sites), sum(bool(s.fused_add) for s in sites)) == (3, 3, 2), result
    assert [s.symbolic.status for s in result.sites] == ["proved"] * 3, result


def test_common_subexpressions_not_merged_across_a_write():
    from normfuse.passes.canonical import canonicalize, common_subexpressions

    def f(x):
        a = x + 1
        x.add_(1)
        b = x + 1
        return a * b, (x - 2) * (x - 2)

    gm = torch.fx.symbolic_trace(f)
    rep = common_subexpressions(gm.graph, canonicalize(gm.graph))
    assert not any(n.name.startswith("add") for n in rep), rep  # x + 1 before and after add_ differ
    gm = torch.fx.symbolic_trace(lambda x: (x - 2) * (x - 2))
    rep = common_subexpressions(gm.graph, canonicalize(gm.graph))
    assert [(k.name, v.name) for k, v in rep.items()] == [("sub_1", "sub")]


# --------------------------------------------------------------------------- 2. symbolic hidden sizes

class BrokenBlock(nn.Module):
    """A block with a graph break: each call is its own frame, so a second width recompiles
    it with dynamic shapes (the last dim becomes a SymInt)."""

    def __init__(self, n=None):
        super().__init__()
        self.norm = nn.LayerNorm(n) if n else None
        self.fc = nn.Linear(n, n) if n else None

    def forward(self, x):
        torch._dynamo.graph_break()
        if self.norm is None:  # no parameter pins the width: the last dim stays symbolic
            return F.layer_norm(x + torch.tanh(x), x.shape[-1:])
        return self.norm(x + self.fc(x))


class Pyramid(nn.Module):
    """One block class at widths 32, 48, 64, as in a vision pyramid."""

    def __init__(self, with_params):
        super().__init__()
        widths = (32, 48, 64)
        self.blocks = nn.ModuleList([BrokenBlock(n if with_params else None) for n in widths])
        self.ups = nn.ModuleList([nn.Linear(a, b) for a, b in zip(widths, widths[1:])])

    def forward(self, x):
        for i, block in enumerate(self.blocks):
            x = block(x)
            if i < len(self.ups):
                x = self.ups[i](x)
        return x


@pytest.mark.parametrize("with_params", [True, False], ids=["width_pinned_by_params", "symbolic_width"])
def test_symbolic_hidden_size_fuses(with_params):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Pyramid(with_params).eval()
    _optimized_close(model, torch.randn(2, 5, 32))
    rep = normfuse.report(model)
    # the block at 32 is static; at 48 it recompiles with a dynamic last dim; at 64 the
    # parameter-free block reuses that graph, the other one compiles for its own parameters
    widths = (32, 48, 64) if with_params else (32, 48)
    assert [(s.hidden_size, s.fused, s.op, s.reason) for s in rep.sites] == [
        (n, True, "add_norm", None) for n in widths], rep


# --------------------------------------------------------------------------- 4. check pairs torch.nn.Transformer*

def _encoder():
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()


@pytest.mark.parametrize("which", ["encoder", "transformer"])
def test_check_verifies_every_site_of_torch_transformers(which):
    torch._dynamo.reset()
    torch.manual_seed(0)
    if which == "encoder":  # 2 Post-Norm layers, 2 norms each
        model, args, fused = _encoder(), (torch.randn(2, 5, 32),), 4
    else:  # 2 + 2 layers: 4 + 6 norms, and the encoder's and the decoder's final norms
        model = nn.Transformer(32, 4, 2, 2, 64, dropout=0.0, batch_first=True).eval()
        args, fused = (torch.randn(2, 5, 32), torch.randn(2, 4, 32)), 12
    result = normfuse.check(model, *args)
    assert len(result.report.fused) == fused, result.report
    assert result.ok and result.unverified == 0, result
    assert [s.symbolic.status for s in result.sites] == ["proved"] * fused, result
    assert all(s.numeric.passed for s in result.sites), result


def test_check_headline_names_unverified_sites(monkeypatch):
    import normfuse.verify.check as check_module

    torch._dynamo.reset()
    torch.manual_seed(0)
    monkeypatch.setattr(check_module, "record_graphs", lambda *args, **kwargs: [])  # no original graph to pair with
    result = normfuse.check(_encoder(), torch.randn(2, 5, 32))
    headline = str(result).splitlines()[0]
    assert result.unverified == 4 and result.summary()["sites_unverified"] == 4
    assert "4 of 4 fused sites not verified: dynamo captured no graph of the original model" in headline, headline


# --------------------------------------------------------------------------- 3. check on models caching tensors

class CachedBiasBlock(nn.Module):
    """The attention-bias cache of timm's EfficientFormer / LeViT: in eval mode the block keeps
    ``table[idx]`` (a tensor with autograd history) in a dict attribute after its first call."""

    def __init__(self, n=32):
        super().__init__()
        self.bias_table = nn.Parameter(torch.randn(2 * n))
        self.register_buffer("bias_idx", torch.arange(n), persistent=False)
        self.fc = nn.Linear(n, n)
        self.norm = nn.LayerNorm(n)
        self.bias_cache = {}

    def attention_bias(self, device):
        if self.training:
            return self.bias_table[self.bias_idx]
        key = str(device)
        if key not in self.bias_cache:
            self.bias_cache[key] = self.bias_table[self.bias_idx]
        return self.bias_cache[key]

    def forward(self, x):
        h = x + self.attention_bias(x.device)
        return self.norm(h + self.fc(h))


@pytest.mark.parametrize("called_before", [True, False], ids=["cache_filled", "cache_empty"])
def test_check_on_a_model_caching_tensors(called_before):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = CachedBiasBlock().eval()
    x = torch.randn(2, 5, 32)
    if called_before:
        model(x)  # the cache now holds a tensor with autograd history
    result = normfuse.check(model, x)
    assert result.ok, result
    assert [(s.op, s.symbolic.status) for s in result.sites] == [("add_norm", "proved")], result
    grads = {o.name for o in result.outputs}
    # the copies hold the cached tensor detached: no gradient reaches the table through it
    assert ("grad:bias_table" in grads) is not called_before, grads
    assert any("autograd history" in n for n in result.notes) is called_before, result.notes


# --------------------------------------------------------------------------- 5. audit on meta, tensors built in forward

class ListIndexBlock(nn.Module):
    """Indexes with a Python list in forward (as Falcon's attention does): on the meta device
    that list becomes a real meta tensor, which fake-tensor tracing refuses."""

    def __init__(self, n=32):
        super().__init__()
        self.fc = nn.Linear(n, 2 * n)
        self.norm = nn.LayerNorm(n)
        self.n = n

    def forward(self, x):
        h = self.fc(x).view(*x.shape[:-1], 2, self.n)[..., [-1], :].squeeze(-2)
        return self.norm(x + h)


def test_audit_meta_falls_back_for_tensors_built_in_forward():
    torch._dynamo.reset()
    with torch.device("meta"):
        model = ListIndexBlock().eval()
        x = torch.randn(2, 5, 32)
    rep = normfuse.audit(model, x)
    from normfuse.auditing import CAPTURE_PATHS
    assert rep.summary()["capture"] == CAPTURE_PATHS[1]
    assert [(s.site.op, s.would_fuse) for s in rep.sites] == [("add_norm", True)]
    assert "fallback" in rep.warnings[0] and "captured by" in rep.to_table()
    torch._dynamo.reset()
    assert normfuse.audit(ListIndexBlock().eval(), torch.randn(2, 5, 32)).summary()["capture"] == CAPTURE_PATHS[0]


def test_audit_cli_falcon_on_meta(capsys):
    import json

    from normfuse.cli import main

    torch._dynamo.reset()
    assert main(["audit", "hf:falcon", "--layers", "2", "--seq", "64", "--format", "json"]) == 0
    from normfuse.auditing import CAPTURE_PATHS
    rep = json.loads(capsys.readouterr().out)
    assert rep["summary"]["capture"] == CAPTURE_PATHS[1]
    # falcon's default config: parallel attention, one input norm per layer, + ln_f
    assert (rep["summary"]["sites"], rep["summary"]["fused"]) == (3, 3)


# --------------------------------------------------------------------------- 6. Post -> Pre on encoder-decoder

def _small_bart():
    """BART as a user builds it from its config (use_cache on: the decoder returns its keys
    and values, read from inside each self-attention branch)."""
    from transformers import AutoConfig, AutoModel

    config = AutoConfig.for_model("bart", d_model=64, encoder_layers=2, decoder_layers=2,
                                  encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
                                  decoder_ffn_dim=128, vocab_size=128, dropout=0.0)
    torch.manual_seed(0)
    return AutoModel.from_config(config).eval()


def _bart_inputs():
    g = torch.Generator().manual_seed(0)
    return dict(input_ids=torch.randint(0, 128, (2, 8), generator=g),
                decoder_input_ids=torch.randint(0, 128, (2, 6), generator=g))


def test_prenorm_converts_every_stream_of_an_encoder_decoder():
    """Both streams converted, and the result is the Pre-Norm BART written by hand: each norm on its
    sublayer's input (x + F_k(norm_k(x))), the decoder's cross-attention reading the encoder's
    final norm, the embedding norms kept."""
    from normfuse.passes import prenorm

    torch._dynamo.reset()
    model = _small_bart()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():   # initialized to 1 and 0: every norm the same, one moved wrongly unseen
        for name, p in model.named_parameters():
            if "layer_norm" in name and "embedding" not in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3 + (1.0 if name.endswith("weight") else 0.0))
    post = copy.deepcopy(model)
    embedded = {}   # the embedding norms' outputs (not blocks: the conversion keeps them)
    for part in ("encoder", "decoder"):
        getattr(post, part).layernorm_embedding.register_forward_hook(
            lambda module, args, out, part=part: embedded.__setitem__(part, out))
    with torch.no_grad():
        post_out = post(**_bart_inputs()).last_hidden_state
    normfuse.optimize(model, prenorm=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no stream is left Post-Norm
        with torch.no_grad():
            out = model(**_bart_inputs()).last_hidden_state
    rep = normfuse.report(model)
    converted = [s.fqn for s in rep.sites if s.converted]
    assert len(converted) == 10 and sum(f.startswith("decoder.") for f in converted) == 6, rep
    assert sorted(prenorm.final_norms(model)) == ["decoder.normfuse_final_norm", "encoder.normfuse_final_norm"]
    ok, why = check_structure(rep.graph_modules)
    assert ok and why.count("adds only") == 2, why
    with torch.no_grad():                                        # (B, S, d_model) throughout
        h = embedded["encoder"]
        for layer in model.encoder.layers:
            h = h + layer.self_attn(layer.self_attn_layer_norm(h))[0]
            h = h + layer.fc2(layer.activation_fn(layer.fc1(layer.final_layer_norm(h))))
        memory = model.encoder.normfuse_final_norm(h)
        h = embedded["decoder"]
        for layer in model.decoder.layers:                       # self_attn is causal without a mask
            h = h + layer.self_attn(layer.self_attn_layer_norm(h))[0]
            h = h + layer.encoder_attn(layer.encoder_attn_layer_norm(h), key_value_states=memory)[0]
            h = h + layer.fc2(layer.activation_fn(layer.fc1(layer.final_layer_norm(h))))
        want = model.decoder.normfuse_final_norm(h)
    assert_close(out, want)
    assert (post_out - want).abs().max() > 0.5   # the conversion changed the function, as it should


def test_prenorm_stream_left_unconverted_warns_and_gets_no_final_norm():
    from normfuse.passes import prenorm

    torch._dynamo.reset()
    keep_decoder = lambda site: not (site.fqn or "").startswith("decoder.")  # noqa: E731
    model = normfuse.optimize(_small_bart(), prenorm=True, filter_fn=keep_decoder)
    with pytest.warns(RuntimeWarning, match=r"stream starting at decoder\.layers\.0\.self_attn_layer_norm .*"
                                            r"excluded by filter_fn"):
        with torch.no_grad():
            model(**_bart_inputs())
    assert list(prenorm.final_norms(model)) == ["encoder.normfuse_final_norm"]
    assert not any(k.startswith("decoder.normfuse_final_norm") for k in model.state_dict())


def test_prenorm_on_a_pre_norm_model_adds_no_parameter():
    from normfuse.zoo import ToyTransformer

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = ToyTransformer(placement="pre").eval()
    keys = list(model.state_dict())
    normfuse.optimize(model, prenorm=True)
    with torch.no_grad():
        model(torch.randint(0, 64, (2, 8)))
    assert list(model.state_dict()) == keys
    # a freshly optimized twin (its final norm still pending) loads that state_dict strictly
    twin = normfuse.optimize(ToyTransformer(placement="pre").eval(), prenorm=True)
    twin.load_state_dict(model.state_dict())


# --------------------------------------------------------------------------- 7. equal shapes are no broadcast

class PosEmbed(nn.Module):
    """``norm(x + pos_embed)`` at batch 1: both (1, tokens, n). Its graph break makes the second
    width recompile with a dynamic last dim, which the add with ``pos_embed`` pins again: the
    shapes are equal, one of them through a symbol the capture fixed."""

    def __init__(self, n, tokens=17):
        super().__init__()
        self.pos_embed = nn.Parameter(0.02 * torch.randn(1, tokens, n))
        self.norm = nn.LayerNorm(n)

    def forward(self, x):
        torch._dynamo.graph_break()
        return self.norm(x + self.pos_embed)


class TwoWidths(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.up, self.b = PosEmbed(32), nn.Linear(32, 48), PosEmbed(48)

    def forward(self, x):
        return self.b(self.up(self.a(x)))


def test_equal_shapes_are_not_a_broadcast():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = TwoWidths().eval()
    _optimized_close(model, torch.randn(1, 17, 32))
    rep = normfuse.report(model)
    assert [(s.hidden_size, s.op, s.fused_add, s.add_reason) for s in rep.sites] == [
        (32, "add_norm", True, None), (48, "add_norm", True, None)], rep


# --------------------------------------------------------------------------- 8. every add left outside has a reason

class PatchEmbedViT(nn.Module):
    """A ViT without class token: ``patch_norm(patches) + pos_embed`` feeds the first block."""

    def __init__(self, n=32, img=16, patch=4, depth=2):
        super().__init__()
        self.patch_embed = nn.Conv2d(3, n, patch, patch)
        self.patch_norm = nn.LayerNorm(n)
        self.pos_embed = nn.Parameter(0.02 * torch.randn(1, (img // patch) ** 2, n))
        self.norms = nn.ModuleList([nn.LayerNorm(n) for _ in range(depth)])
        self.mlps = nn.ModuleList([nn.Linear(n, n) for _ in range(depth)])
        self.norm = nn.LayerNorm(n)

    def forward(self, images):
        x = self.patch_norm(self.patch_embed(images).flatten(2).transpose(1, 2))  # (B, tokens, n)
        x = x + self.pos_embed
        for norm, mlp in zip(self.norms, self.mlps):
            x = x + mlp(norm(x))
        return self.norm(x)


@pytest.mark.parametrize("batch", [1, 2])
def test_every_add_left_outside_a_kernel_has_a_reason(batch):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = PatchEmbedViT().eval()
    _optimized_close(model, torch.randn(batch, 3, 16, 16))
    sites = {s.fqn: s for s in normfuse.report(model).sites}
    patch_norm, first = sites["patch_norm"], sites["norms.0"]
    assert patch_norm.output_feeds_add and (patch_norm.op, patch_norm.fused_add) == ("norm", False)
    # (1, 16, 32) + (1, 16, 32), and (2, 16, 32) + (1, 16, 32) (the table broadcast over the batch):
    # the next norm folds the add
    assert "folded into the kernel of the norm that reads its sum" in patch_norm.add_reason
    assert (first.op, first.fused_add) == ("add_norm", True)
    unexplained = [s.fqn for s in sites.values()
                   if (s.input_is_add or s.output_feeds_add) and not s.fused_add and not s.add_reason]
    assert not unexplained, sites


# --------------------------------------------------------------------------- 9. check on MoE models: grouped mm in fp64

GROUPED_MM_LAYOUTS = {  # (mat_a, mat_b, offs): what torch._grouped_mm takes; the kernel wants 16-byte strides
    "2d x 3d": ((10, 4), (3, 4, 8), [2, 5, 8]),     # tokens sorted by expert (MoE forward)
    "3d x 2d": ((3, 6, 4), (4, 12), [4, 8, 12]),
    "2d x 2d": ((6, 12), (12, 8), [4, 8, 12]),      # a weight gradient: one product per group
    "3d x 3d": ((3, 6, 4), (3, 4, 8), None),
}


@pytest.mark.parametrize("layout", list(GROUPED_MM_LAYOUTS))
def test_fp64_mode_computes_grouped_mm(layout):
    from normfuse.verify.numeric import Fp64Mode

    shape_a, shape_b, ends = GROUPED_MM_LAYOUTS[layout]
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(shape_a, generator=g), torch.randn(shape_b, generator=g)
    offs = None if ends is None else torch.tensor(ends, dtype=torch.int32)
    want = torch._grouped_mm(a, b, offs=offs)
    with Fp64Mode():
        got = F.grouped_mm(a.double(), b.double(), offs=offs)
    assert got.dtype == torch.float64 and got.shape == want.shape
    if layout == "2d x 3d":  # rows past offs[-1]: left unwritten by the kernel, zeros in fp64
        want, got, rest = want[:8], got[:8], got[8:]
        assert rest.eq(0).all()
    assert_close(want, got.float())


def test_check_on_a_mixture_of_experts_model():
    """transformers' MoE experts call torch._grouped_mm, which has no fp64 kernel: the fp64
    reference computes it group by group, forward and backward, and check passes."""
    from normfuse.verify.numeric import perturb_vectors
    from normfuse.zoo import hf_model

    torch._dynamo.reset()
    model = perturb_vectors(hf_model("mixtral", num_local_experts=4, num_experts_per_tok=2))
    res = normfuse.check(model)
    assert res.ok, str(res)
    assert len(res.sites) == 5 and all(s.symbolic.status == "proved" for s in res.sites)
    expert_grads = [o for o in res.outputs if o.name.startswith("grad:") and ".experts." in o.name]
    assert expert_grads and all(o.passed for o in expert_grads)


# --------------------------------------------------------------------------- 10. check on XGLM: scalars made from finfo

class MaskedBlock(nn.Module):
    """XGLM's attention clamps its scores with ``torch.full((), finfo(dtype).min)``: no dtype given,
    so the tensor takes the default dtype while the value is the scores' dtype's minimum."""

    def __init__(self, n=32):
        super().__init__()
        self.score = nn.Linear(n, n)
        self.norm = nn.LayerNorm(n)
        self.final = nn.LayerNorm(n)

    def forward(self, x):
        scores = self.score(self.norm(x))
        scores = torch.max(scores, torch.full((), torch.finfo(scores.dtype).min))
        return self.final(x + scores)


def test_check_on_scalars_made_from_the_dtype_minimum():
    torch._dynamo.reset()
    torch.manual_seed(0)
    res = normfuse.check(MaskedBlock().eval(), torch.randn(2, 8, 32))
    assert res.ok, str(res)
    assert len(res.sites) == 2 and all(s.symbolic.status == "proved" for s in res.sites)
    assert torch.get_default_dtype() == torch.float32  # the fp64 reference run put the default back


# --------------------------------------------------------------------------- 11. an operand computed inside the site

class LayerNorm1P(nn.LayerNorm):
    """Nemotron's LayerNorm1P: the weight is stored minus 1; ``weight + 1`` is computed when the
    norm is called, after the residual add the site starts with."""

    def forward(self, x):
        return F.layer_norm(x, self.normalized_shape, self.weight + 1, self.bias, self.eps)


class InPlaceWeightNorm(nn.LayerNorm):
    """The weight copied and then written in place after the add: the copy cannot move up
    before the add without reading the weight before the write."""

    def forward(self, x):
        weight = self.weight.clone()
        weight.mul_(2)
        return F.layer_norm(x, self.normalized_shape, weight, self.bias, self.eps)


def _optimized_stack(norm):
    """(model, input, eager output, optimized model, its output, normfuse's warnings)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = PreNormStack(norm).eval()
    x = torch.randn(2, 8, 32)
    with torch.no_grad():
        want = model(x)
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            optimized = normfuse.optimize(copy.deepcopy(model))
            got = optimized(x)
    return model, x, want, optimized, got, [str(w.message) for w in record if "normfuse" in str(w.message)]


def test_operands_computed_after_the_add_move_up():
    model, x, want, optimized, got, warned = _optimized_stack(LayerNorm1P)
    assert not warned  # no "rewrite failed, running eager" warning
    assert torch.equal(got, want)
    c = _counts(optimized)
    assert (c["sites"], c["fused"], c["fused_with_add"]) == (3, 3, 2), c
    torch._dynamo.reset()
    res = normfuse.check(model, x, backward=False)
    assert res.ok and len(res.sites) == 3, str(res)
    assert all(o.mismatch == 0 for o in res.outputs)


def test_an_operand_written_in_place_does_not_move_up():
    _, _, want, optimized, got, warned = _optimized_stack(InPlaceWeightNorm)
    assert torch.equal(got, want)  # the model is never broken: those sites stay as they were
    assert _counts(optimized)["fused_with_add"] == 0
    # each such site is left with its reason; the rest of the graph is still rewritten
    assert not [w for w in warned if "left this graph unchanged" in w]
    late = [s for s in normfuse.report(optimized).sites if s.reason and "cannot move before it" in s.reason]
    assert late and all(not s.fused for s in late)
