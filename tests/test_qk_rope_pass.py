"""The graph pass fuses q/k norms with their rotary embedding (fusions/qk_norm_rope.py).

HF models built from configs (2 layers, no download); each layer has one q_norm and one k_norm
whose outputs go into ``apply_rotary_pos_emb``: 2L = 4 norms, fused with their RoPE in L = 2
``qk_norm_rope`` calls (q and k of one attention share cos/sin):
- qwen3:       per-head RMSNorm, the transpose after it, bf16 tables (three roundings)
- gemma3_text: (1 + w), q transposed before the norm
- olmo2:       the norm over the whole row, then the view to heads; fp32 tables, cast back
- glm4_moe:    use_qk_norm, partial rotary (half of the head rotated)
- qwen3_moe:   qwen3's attention
"""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import normfuse
from normfuse.verify.numeric import perturb_vectors
from normfuse.zoo import example_inputs, hf_model
from helpers import optimized_with_fault, plant_rope_fault

pytest.importorskip("transformers")

MODELS = {"qwen3": {}, "gemma3_text": {}, "olmo2": {}, "glm4_moe": {"use_qk_norm": True}, "qwen3_moe": {}}
ROPE = {"qwen3": "neox, rotary 16 of 16", "qwen3_moe": "neox, rotary 16 of 16", "gemma3_text": "neox, rotary 16 of 16", "olmo2": "neox, rotary 16 of 16",
        "glm4_moe": "neox, rotary 8 of 16"}


def _model(name, dtype):
    torch._dynamo.reset()
    return perturb_vectors(hf_model(name, dtype, **MODELS[name]))


def _qk_sites(rep):
    return [s for s in rep.sites if s.fqn.endswith(("q_norm", "k_norm"))]


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_every_qk_norm_is_fused_with_its_rope(name, dtype):
    model = _model(name, dtype)
    inputs = example_inputs(model)
    with torch.no_grad():
        ref = model(**inputs)[0]
        normfuse.optimize(model)
        out = model(**inputs)[0]
    rep = normfuse.report(model)
    qk = _qk_sites(rep)
    assert len(qk) == 4 and rep.counts()["rope"] == 4 and rep.counts()["fused_rope"] == 4, rep
    assert all(s.op == "qk_norm_rope" and s.rope == ROPE[name] and s.rope_reason is None for s in qk), rep
    assert len({s.call for s in qk}) == 2  # q and k of each attention in one call
    assert "+ rope" in str(rep)
    assert torch.equal(out, ref)  # the reference path rounds where eager rounds


@pytest.mark.parametrize("name", list(MODELS))
def test_check_passes_every_site_with_gradients(name):
    model = _model(name, torch.bfloat16)
    res = normfuse.check(model)  # outputs and every gradient vs fp64 (normfuse/tolerances.py), site by site
    assert res.ok, str(res)
    qk = [s for s in res.sites if s.op == "qk_norm_rope"]
    assert len(qk) == 4 and all(s.passed and s.numeric.passed for s in qk), str(res)
    # the symbolic rows stand for heads: OLMo 2's rows of all heads (k has fewer) split into heads
    # by the view, GLM's half-rotated heads, the tables' columns: every site proved by algebra
    assert all(s.symbolic.status == "proved" and s.symbolic.method.startswith("algebra") for s in qk), str(res)


@pytest.mark.parametrize("name", ["qwen3", "glm4_moe"])
def test_torch_export_graph(name):
    """An exported ATen graph spells the RoPE aten.slice / cat / unsqueeze / transpose; fuse_graph takes it."""
    model = _model(name, torch.bfloat16)
    inputs = example_inputs(model)
    gm = torch.export.export(model, (), inputs).module()
    with torch.no_grad():
        ref = gm(**inputs)[0]
        gm, rep = normfuse.fuse_graph(gm)
        out = gm(**inputs)[0]
    qk = _qk_sites(rep)
    assert len(qk) == 4 and all(s.op == "qk_norm_rope" and s.rope == ROPE[name] for s in qk), rep
    assert torch.equal(out, ref)


@pytest.mark.parametrize("name", ["qwen3", "olmo2", "glm4_moe"])
def test_triton_kernels_in_a_training_step(name, triton_cpu):
    """The Triton forward and backward (interpreted on CPU) in place of the reference: outputs
    and every gradient within normfuse/tolerances.py of fp64, each q/k call within its budget."""
    model = _model(name, torch.bfloat16)
    res = normfuse.check(model)
    assert res.ok, str(res)
    qk = [s for s in res.sites if s.op == "qk_norm_rope"]
    assert len(qk) == 4 and all(s.numeric.passed for s in qk), str(res)
    assert any(o.name.startswith("grad:") and "q_norm" in o.name for o in res.outputs)


# --------------------------------------------------------------------------- planted faults

def _faulty_copy(model, fault):
    return optimized_with_fault(model, lambda gm: plant_rope_fault(gm, fault))


# the sites of layer 0's q_norm / k_norm call (OLMo 2's q/k norms come before any residual norm)
_FIRST_CALL = {"qwen3": {"g0.s1", "g0.s2"}, "glm4_moe": {"g0.s1", "g0.s2"}, "olmo2": {"g0.s0", "g0.s1"}}


@pytest.mark.parametrize("name,fault", [("qwen3", "wrong_half"), ("qwen3", "rotated_sign"),
                                        ("qwen3", "no_bf16_round"), ("glm4_moe", "rotary_dim"),
                                        ("olmo2", "wrong_half"), ("olmo2", "rotated_sign")])
def test_planted_fault_is_refuted_at_its_site(name, fault):
    model = _model(name, torch.bfloat16)
    res = normfuse.check(model, optimized=_faulty_copy(model, fault), backward=False)
    assert not res.ok
    failing = [s.id for s in res.sites if not s.passed]
    assert failing and set(failing) <= _FIRST_CALL[name], failing  # layer 0's q_norm / k_norm call only
    assert res.first_divergence is not None and res.first_divergence.id in failing
    assert res.first_divergence.numeric.passed is False
    # faults that change the exact math are refuted (OLMo 2's rows of all heads, rotated head by
    # head; GLM's half-rotated heads); the rounding fault is caught numerically
    want = "proved" if fault == "no_bf16_round" else "refuted"
    assert res.first_divergence.symbolic.status == want, res.first_divergence.symbolic


# --------------------------------------------------------------------------- left as it was

def test_fuse_rope_false_leaves_the_rope():
    model = _model("qwen3", torch.bfloat16)
    inputs = example_inputs(model)
    with torch.no_grad():
        ref = model(**inputs)[0]
        normfuse.optimize(model, fuse_rope=False)
        out = model(**inputs)[0]
    rep = normfuse.report(model)
    qk = _qk_sites(rep)
    assert len(qk) == 4 and all(s.fused and s.op == "norm" and not s.fused_rope for s in qk), rep
    assert all(s.rope == ROPE["qwen3"] and s.rope_reason == "not fused (fuse_rope=False)" for s in qk)
    assert torch.equal(out, ref)


class _Attention(nn.Module):
    """q/k RMSNorm per head, then a RoPE: ``"neox"`` as HF writes it, ``"pairs"`` the interleaved
    form written with ``select`` (not read), ``"strided"`` Wan's stores, ``"matrix"`` Kandinsky 5's rotation
    matrices (not read), ``"none"`` no RoPE; ``leak``
    also returns the normalized q."""

    def __init__(self, rope="neox", leak=False, heads=2, dim=8, norm=nn.RMSNorm, q_scale=None):
        super().__init__()
        self.rope, self.leak, self.heads, self.dim, self.q_scale = rope, leak, heads, dim, q_scale
        self.q_norm, self.k_norm = norm(dim, eps=1e-6), norm(dim, eps=1e-6)
        with torch.no_grad():
            self.q_norm.weight.uniform_(0.5, 1.5)
            self.k_norm.weight.uniform_(0.5, 1.5)

    def _rotate(self, x, cos, sin):
        if self.rope == "neox":
            x1, x2 = x[..., : self.dim // 2], x[..., self.dim // 2:]
            return x * cos + torch.cat((-x2, x1), dim=-1) * sin
        if self.rope == "strided":  # Wan: the pairs' rotations stored into a new tensor, every other column
            x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
            out = torch.empty_like(x)
            out[..., 0::2] = x1 * cos[..., 0::2] - x2 * sin[..., 1::2]
            out[..., 1::2] = x1 * sin[..., 1::2] + x2 * cos[..., 0::2]
            return out
        if self.rope == "none":  # no rotation: the attention reads the normalized q and k
            return x
        if self.rope == "matrix":  # Kandinsky 5: a 2x2 rotation matrix times each pair
            c, s = cos[..., 0::2], sin[..., 0::2]
            table = torch.stack([c, -s, s, c], dim=-1).view(*c.shape, 2, 2)
            return (table * x.reshape(*x.shape[:-1], -1, 1, 2)).sum(-1).reshape(x.shape)
        pairs = x.unflatten(-1, (-1, 2))
        rot = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
        if self.rope == "pairs_joined":  # PRX: the rotated tokens joined with others after the RoPE
            rotated = x * cos + rot * sin
            return torch.cat([rotated[:, :, :-1], sin.expand_as(rotated)[:, :, -1:]], dim=2)
        return x * cos + rot * sin

    def forward(self, q, k, cos, sin):
        B, S = q.shape[:2]
        qn = self.q_norm(q.view(B, S, self.heads, self.dim))
        qn = (qn if self.q_scale is None else qn * self.q_scale).transpose(1, 2)
        kn = self.k_norm(k.view(B, S, self.heads, self.dim)).transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        v = k.view(B, S, self.heads, self.dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(self._rotate(qn, cos, sin), self._rotate(kn, cos, sin), v)
        if self.leak == "k":
            return out, kn
        return (out, qn) if self.leak else out


class _KLeakingStack(nn.Module):
    """Two attentions reading one cos/sin table, the second computed from the first's output;
    each also returns its normalized k, so no q has the k of its own attention to pair with."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([_Attention(leak="k") for _ in range(2)])

    def forward(self, q, k, cos, sin):
        leaked = []
        for layer in self.layers:
            out, kn = layer(q, k, cos, sin)
            leaked.append(kn)
            q = k = out.transpose(1, 2).flatten(2)
        return q, *leaked


def _toy_inputs():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 5, 16, generator=g), torch.randn(2, 5, 16, generator=g)
    angles = torch.randn(1, 5, 4, generator=g)
    emb = torch.cat((angles, angles), dim=-1)
    return q, k, emb.cos(), emb.sin()


def _optimized_toy(model, **options):
    """(eager output, optimized output, report) of a toy model optimized in place."""
    torch._dynamo.reset()
    args = _toy_inputs()
    with torch.no_grad():
        ref = model(*args)
        normfuse.optimize(model, **options)
        out = model(*args)
    return ref, out, normfuse.report(model)


@pytest.mark.parametrize("rope,leak,why", [("neox", False, None), ("pairs", False, None),
                                           ("neox", True, "the normalized q/k is read outside its RoPE")])
def test_toy_rope_recognized_or_left(rope, leak, why):
    ref, out, rep = _optimized_toy(_Attention(rope, leak))
    assert len(rep.sites) == 2 and all(s.fused for s in rep.sites), rep
    q, k = rep.sites
    if rope == "neox" and not leak:
        assert q.op == k.op == "qk_norm_rope" and q.call == k.call and q.fused_rope and k.fused_rope
    elif leak:  # q keeps its RoPE (the graph reads its normalized value too); k is fused alone with its own
        assert q.op == "norm" and not q.fused_rope and q.rope_reason == why, rep
        assert k.op == "qk_norm_rope" and k.fused_rope and k.call != q.call
    else:  # interleaved pairs are not HF's rotate_half: the norms fused alone, the RoPE left as it was
        assert q.op == k.op == "norm" and q.rope is None and k.rope is None, rep
        assert q.rope_reason.startswith("a RoPE follows this q/k norm in another layout"), rep
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


@pytest.mark.parametrize("rope,why", [
    ("strided", "a RoPE follows this q/k norm written into a tensor through indexed stores"),
    ("matrix", "a RoPE follows this q/k norm as a 2x2 rotation matrix times each pair"),
    ("pairs_joined", "a RoPE follows this q/k norm in another layout or order of steps;"),
    ("none", None),
])
def test_a_rope_in_a_form_not_read_is_kept_with_the_reason(rope, why):
    """Any rotation after a q/k norm (a sum of two products of the normalized value, one by a table,
    before the attention reads it) that the call does not read keeps the reason; a q/k norm the
    attention reads directly has none."""
    ref, out, rep = _optimized_toy(_Attention(rope))
    assert [s.op for s in rep.sites] == ["norm", "norm"] and not any(s.fused_rope for s in rep.sites), rep
    for s in rep.sites:
        assert (s.rope_reason or "").startswith(why) if why else s.rope_reason is None, rep
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["phi", "persimmon"])
def test_layer_norm_q_k_norms_fuse_with_their_rope(name):
    """Phi and Persimmon normalize q and k per head with LayerNorms (weight and bias), then rotate the
    first half of each head (partial rotary): one qk_norm_rope call per attention, q with k, the
    output the same bits, every site proved."""
    torch._dynamo.reset()
    model = hf_model(name, qk_layernorm=True)
    inputs = example_inputs(model)
    with torch.no_grad():
        ref = model(**inputs)[0]
        res = normfuse.check(model, **inputs, backward=False)
        normfuse.optimize(model)
        out = model(**inputs)[0]
    assert res.ok and all(s.symbolic.status == "proved" for s in res.sites), res
    rep = normfuse.report(model)
    qk = [s for s in rep.sites if s.fqn.endswith(("q_layernorm", "k_layernorm"))]
    assert len(qk) == 4 and all(s.op == "qk_norm_rope" and s.fused_rope for s in qk), rep
    assert len({s.call for s in qk}) == 2, rep
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


@pytest.mark.parametrize("name,overrides,norms,why", [
    # a LayerNorm per head, weight (heads, head_dim)
    ("cohere", {"use_qk_norm": True}, 4, "in another layout or order of steps"),
    # one LayerNorm module per head, split and concatenated
    ("stablelm", {"qk_layernorm": True}, 12, "over rows concatenated with other tokens' before it"),
    # a LayerNorm over all heads, cast, then the view to heads
    ("esmc", {"num_key_value_heads": 4}, 4, "in another layout or order of steps"),
])
def test_layer_norm_q_k_norms_in_other_forms_say_why_their_rope_stays(name, overrides, norms, why):
    """LayerNorm q/k norms whose RoPE the call does not read (Cohere, StableLM, ESM-C) are fused alone
    and each says why its RoPE stays."""
    torch._dynamo.reset()
    model = hf_model(name, **overrides)
    inputs = example_inputs(model)
    with torch.no_grad():
        ref = model(**inputs)[0]
        normfuse.optimize(model)
        out = model(**inputs)[0]
    rep = normfuse.report(model)
    qk = [s for s in rep.sites if ".self_attn." in s.fqn]
    assert len(qk) == norms and all(s.fused and s.op == "norm" for s in qk), rep
    assert all(s.rope_reason.startswith(f"a RoPE follows this q/k norm {why}") for s in qk), rep
    # Cohere's written-out LayerNorm reduces its rows in another order than the call (tests/zoo/expected.py)
    torch.testing.assert_close(out, ref, **({} if name == "cohere" else dict(rtol=0, atol=0)))


def test_a_layer_norm_q_k_norm_takes_its_rope():
    """nn.LayerNorm q/k norms (weight and bias) before HF's RoPE: one qk_norm_rope call, the same bits."""
    ref, out, rep = _optimized_toy(_Attention(norm=nn.LayerNorm))
    assert [s.op for s in rep.sites] == ["qk_norm_rope"] * 2 and all(s.fused_rope for s in rep.sites), rep
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


def test_a_rope_after_q_is_scaled_is_kept_with_the_reason():
    """MuseGlimmer scales q between its norm and its RoPE: q's norm is fused alone, its RoPE left as
    it was, and the report says why; k has no scale: fused with its RoPE, alone."""
    ref, out, rep = _optimized_toy(_Attention(q_scale=0.5))
    q, k = rep.sites
    why = "q/k is multiplied by 0.5 between its norm and its RoPE, a rounding the kernel does not make"
    assert q.fused and q.op == "norm" and not q.fused_rope and q.rope_reason == why, rep
    assert k.op == "qk_norm_rope" and k.fused_rope, rep
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


def test_a_q_norm_does_not_pair_with_the_next_layer_s_q_norm():
    """Every layer reads one cos/sin table: a q whose own k cannot join it is fused with its RoPE
    alone, not paired with the next layer's q (computed from this layer's output, so that call
    could not start where this one does, and the RoPE would be left out)."""
    ref, out, rep = _optimized_toy(_KLeakingStack())
    q_sites = [s for s in rep.sites if s.fqn.endswith("q_norm")]
    k_sites = [s for s in rep.sites if s.fqn.endswith("k_norm")]
    assert len(q_sites) == len(k_sites) == 2, rep
    assert all(s.op == "qk_norm_rope" and s.fused_rope for s in q_sites), rep
    assert len({s.call for s in q_sites}) == 2  # one call each
    assert all(s.op == "norm" and s.rope_reason == "the normalized q/k is read outside its RoPE" for s in k_sites)
    for got, want in zip(out, ref):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


class QKNormCrossAttention(_Attention):
    """An attention whose class is named with "norm": q and k rotated with their own tables."""

    def forward(self, q, k, q_table, k_table):
        B, S = q.shape[:2]
        qn = self.q_norm(q.view(B, S, self.heads, self.dim)).transpose(1, 2)
        kn = self.k_norm(k.view(B, S, self.heads, self.dim)).transpose(1, 2)
        v = k.view(B, S, self.heads, self.dim).transpose(1, 2)
        (qc, qs), (kc, ks) = ((c.unsqueeze(1), s.unsqueeze(1)) for c, s in (q_table, k_table))
        return F.scaled_dot_product_attention(self._rotate(qn, qc, qs), self._rotate(kn, kc, ks), v)


class _CrossStreams(nn.Module):
    """LTX-2's audio-video cross attentions: the video-to-audio one's q and the audio-to-video one's k read
    the video table, the other two the audio table."""

    def __init__(self):
        super().__init__()
        self.a2v, self.v2a = QKNormCrossAttention(), QKNormCrossAttention()

    def forward(self, q, k, cos, sin):
        video, audio = (cos, sin), (sin, cos)
        return self.a2v(q, k, video, audio), self.v2a(k, q, audio, video)


def test_q_k_norms_pair_within_one_attention_whatever_its_class_is_named():
    """Two attentions' norms that read one table are not one call: each attention's gradients would flow
    through the other's (zeros where eager has none). The norm's own module is the one that computes the
    norm only, not the one whose class name says "norm"."""
    ref, out, rep = _optimized_toy(_CrossStreams())
    assert len(rep.sites) == 4 and all(s.op == "qk_norm_rope" and s.fused_rope for s in rep.sites), rep
    for call in {s.call for s in rep.sites}:
        assert len({s.fqn.split(".")[0] for s in rep.sites if s.call == call}) == 1, rep
    for got, want in zip(out, ref):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_standalone_false_leaves_the_q_k_norms_and_their_rope():
    """q/k norms have no add next to them: with standalone=False they stay as the model wrote them."""
    ref, out, rep = _optimized_toy(_Attention(), standalone=False)
    assert len(rep.sites) == 2 and not any(s.fused for s in rep.sites), rep
    assert all(s.rope_reason == "standalone norms not rewritten (standalone=False)" for s in rep.sites), rep
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


def test_audit_prices_the_rope():
    """q and k read once and their rotated values written once: the fused forward bytes of one
    attention's call are exactly that plus the weights, the cos/sin tables and the fp32 rstd per
    norm row; its backward reads dq_out, dk_out, q, k, rstd, the weights and the tables and writes
    dq, dk and the weights' grads."""
    from normfuse.auditing import audit
    from normfuse.config import FuseConfig

    B, S = 1, 64
    priced = {}
    for fuse in (True, False):
        model = _model("qwen3", torch.bfloat16)
        rep = audit(model, **example_inputs(model, batch=B, seq=S), config=FuseConfig(fuse_rope=fuse))
        priced[fuse] = {s.site.fqn: s for s in rep.sites if s.site.fqn.endswith(("q_norm", "k_norm"))}
    cfg = model.config
    D, H, Hk = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    q_bytes, k_bytes = B * S * H * D * 2, B * S * Hk * D * 2
    weights, tables, rstd = 2 * D * 2, 2 * S * D * 2, 4 * B * S * (H + Hk)  # bf16 (D,) weights, (1, S, D) tables
    want = 2 * (q_bytes + k_bytes) + weights + tables + rstd
    want_bwd = 3 * (q_bytes + k_bytes) + 2 * weights + tables + rstd
    for layer in range(2):
        q, k = (priced[True][f"layers.{layer}.self_attn.{n}"] for n in ("q_norm", "k_norm"))
        assert q.site.op == k.site.op == "qk_norm_rope"
        assert q.site.fused_rope and k.site.fused_rope and k.site.rope_reason is None  # k's RoPE is in q's call
        assert q.fused.fwd + k.fused.fwd == want
        assert q.fused.bwd + k.fused.bwd == want_bwd
        assert q.fused.fwd_kernels + k.fused.fwd_kernels == 1
        # the RoPE's eager traffic is priced at the lead: more saved than by the norms alone
        alone = priced[False][f"layers.{layer}.self_attn.q_norm"]
        assert q.eager.fwd > alone.eager.fwd and q.eager.fwd - q.fused.fwd > alone.eager.fwd - alone.fused.fwd


class _Strided(nn.Module):
    """A normalized q read by two slices that are not a RoPE's halves (one with a step)."""

    def __init__(self):
        super().__init__()
        self.norm = nn.RMSNorm(8, eps=1e-6)

    def forward(self, q):
        qn = self.norm(q.view(2, 5, 2, 8)).transpose(1, 2)
        return qn[..., ::2] * qn[..., :4]


def test_slices_that_are_not_halves_leave_the_norm_alone():
    torch._dynamo.reset()
    model = _Strided()
    q = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(q)
        normfuse.optimize(model)
        out = model(q)
    rep = normfuse.report(model)
    assert [(s.op, s.rope) for s in rep.sites] == [("norm", None)], rep
    assert not rep.warnings and not rep.notes, rep
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


class _WanAttention(nn.Module):
    """Wan 2.x's self-attention: q/k RMSNorms over all heads, the view to heads, then the RoPE with the
    complex product written out on the pairs and stored interleaved into ``empty_like(x)``, half
    tables taken as ``cos[..., 0::2]`` / ``sin[..., 1::2]`` of (1, S, 1, D) ones; ``leak`` also returns
    the first halves of q's pairs."""

    def __init__(self, heads=2, dim=8, leak=False, cast=None):
        super().__init__()
        self.heads, self.leak, self.cast = heads, leak, cast  # cast: a dtype the stored rotation is cast to
        self.norm_q, self.norm_k = nn.RMSNorm(heads * dim, eps=1e-6), nn.RMSNorm(heads * dim, eps=1e-6)
        with torch.no_grad():
            self.norm_q.weight.uniform_(0.5, 1.5)
            self.norm_k.weight.uniform_(0.5, 1.5)

    def _rope(self, x, cos, sin):
        x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
        cos, sin = cos[..., 0::2], sin[..., 1::2]
        out = torch.empty_like(x)
        out[..., 0::2] = x1 * cos - x2 * sin
        out[..., 1::2] = x1 * sin + x2 * cos
        return (out.type_as(x) if self.cast is None else out.to(self.cast)), x1

    def forward(self, q, k, cos, sin):
        q, x1 = self._rope(self.norm_q(q).unflatten(2, (self.heads, -1)), cos, sin)
        k, _ = self._rope(self.norm_k(k).unflatten(2, (self.heads, -1)), cos, sin)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), k.transpose(1, 2))
        return (out, x1) if self.leak else out


def _wan_inputs(dtype, table_dtype, sin_dtype=None):
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, 5, 16, generator=g).to(dtype) for _ in range(2))
    angles = torch.randn(1, 5, 1, 4, generator=g, dtype=torch.float64).repeat_interleave(2, dim=-1)
    return q, k, angles.cos().to(table_dtype), angles.sin().to(sin_dtype or table_dtype)


@pytest.mark.parametrize("dtype,table_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                               (torch.bfloat16, torch.float32)])
def test_wan_stored_rope_is_fused_and_proved(dtype, table_dtype):
    torch._dynamo.reset()
    model, args = _WanAttention().to(dtype), _wan_inputs(dtype, table_dtype)
    with torch.no_grad():
        ref = model(*args)
        res = normfuse.check(model, *args, backward=False)
        normfuse.optimize(model)
        out = model(*args)
    rep = normfuse.report(model)
    assert [(s.op, s.fused_rope, s.rope) for s in rep.sites] == [("qk_norm_rope", True, "gptj, rotary 8 of 8")] * 2
    assert res.ok and [s.symbolic.status for s in res.sites] == ["proved"] * 2, res
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


@pytest.mark.parametrize("options,inputs,why", [
    (dict(leak=True), (torch.float32, torch.float32), "the normalized q/k is read outside its RoPE"),
    ({}, (torch.float32, torch.float64), "RoPE dtypes torch.float64 -> torch.float32 are not ones the kernels take"),
    # stored in bf16, then cast to fp32: the fp32 rotation rounded twice
    (dict(cast=torch.float32), (torch.bfloat16, torch.float32),
     "the rotation stored in torch.bfloat16 is cast to torch.float32: two roundings"),
    # bf16 sin: x2 * sin rounds to bf16, the sum is fp32 (cos's)
    ({}, (torch.bfloat16, torch.float32, torch.bfloat16), "the RoPE computes in torch.float32, not in the promotion"),
])
def test_wan_stored_rope_the_call_cannot_take_keeps_the_reason(options, inputs, why):
    torch._dynamo.reset()
    model, args = _WanAttention(**options).to(inputs[0]), _wan_inputs(*inputs)
    with torch.no_grad():
        ref = model(*args)
        normfuse.optimize(model)
        out = model(*args)
    q = normfuse.report(model).sites[0]
    assert q.op == "norm" and not q.fused_rope and q.rope_reason.startswith(why), q
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


# --------------------------------------------------------------------------- dynamic shapes

@pytest.mark.parametrize("name", ["qwen3", "olmo2", "gemma3_text", "glm4_moe"])
def test_a_recompile_for_another_length_fuses_the_rope_too(name):
    """A second length makes dynamo recompile with the batch and sequence sizes symbolic (as in
    generation, or any run of varied lengths): that graph's q/k norms are fused with their RoPE
    as the first graph's, and every output equals eager's."""
    model = _model(name, torch.bfloat16)
    lengths = (8, 12, 16)
    with torch.no_grad():
        refs = [model(**example_inputs(model, seq=n))[0] for n in lengths]
        normfuse.optimize(model)
        outs = [model(**example_inputs(model, seq=n))[0] for n in lengths]
    rep = normfuse.report(model)
    graphs = {s.id.split(".")[0] for s in rep.sites}
    assert len(graphs) == 2, rep  # the static first graph, then one with symbolic sizes
    qk = _qk_sites(rep)
    assert len(qk) == 8 and all(s.op == "qk_norm_rope" and s.fused_rope and s.rope == ROPE[name] for s in qk), rep
    assert all(torch.equal(out, ref) for out, ref in zip(outs, refs))


def test_export_with_a_dynamic_sequence_length():
    model = _model("qwen3", torch.bfloat16)
    inputs = example_inputs(model, seq=8)
    seq = torch.export.Dim("seq", min=2, max=64)
    gm = torch.export.export(model, (), inputs, dynamic_shapes={"input_ids": {1: seq}}).module()
    gm, rep = normfuse.fuse_graph(gm)
    qk = _qk_sites(rep)
    assert len(qk) == 4 and all(s.op == "qk_norm_rope" and s.fused_rope for s in qk), rep
    with torch.no_grad():
        for n in (8, 20):
            other = example_inputs(model, seq=n)
            assert torch.equal(gm(**other)[0], model(**other)[0])


@pytest.mark.parametrize("heads", [3, 4])
def test_the_proof_tells_a_norm_over_all_heads_from_one_per_head(heads, monkeypatch):
    """OLMo 2 normalizes q and k over all heads. Asked about a call that normalized each head
    instead, the symbolic proof refutes it, for an odd number of heads too (the rows of m heads
    are d symbolic heads, d the least prime factor of m: one head would make both the same)."""
    import normfuse.verify.graph_check as graph_check

    prove = graph_check.prove_site

    def per_head(pair, **kwargs):  # the call as a rewrite that took OLMo 2's norm per head would have made it
        options = dict(pair.call.kwargs)
        if options.get("rotary_dim") is None:
            return prove(pair, **kwargs)
        pair.call.kwargs = {**options, "norm_width": "head"}
        try:
            return prove(pair, **kwargs)
        finally:
            pair.call.kwargs = options

    torch._dynamo.reset()
    model = perturb_vectors(hf_model("olmo2", torch.float32, num_attention_heads=heads, num_key_value_heads=heads,
                                     hidden_size=16 * heads, head_dim=16))
    assert normfuse.check(model, backward=False).ok  # as rewritten: every site proved
    monkeypatch.setattr(graph_check, "prove_site", per_head)
    res = normfuse.check(model, backward=False)
    qk = [s for s in res.sites if s.op == "qk_norm_rope"]
    assert len(qk) == 4 and all(s.symbolic.status == "refuted" for s in qk), str(res)
