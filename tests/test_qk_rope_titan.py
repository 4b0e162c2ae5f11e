"""The graph pass fuses torchtitan's q/k norms with their rotary embedding (fusions/qk_norm_rope.py).

torchtitan's Qwen3 (``Qwen3Model.Config`` with ``_build_qwen3_layers``, shrunk to 2 layers of dim 64,
4 heads, 2 kv heads, head_dim 16), its attention ``GQAttention`` with ``qk_norm``, and each of its two
RoPE formats (``torchtitan/models/common/rope.py``):
- CosSinRoPE:  ``q.float() * cos + rotate_half(q.float()) * sin`` in fp32, cos / sin slices of a
               (1 | B, S, 1, 2D) cache, ``.type_as(q)``: layout "neox"
- ComplexRoPE: ``view_as_real(view_as_complex(q.float().reshape(..., D/2, 2)) * freqs_cis).flatten(3)``,
               ``.type_as(q)``: layout "gptj", the half tables freqs_cis.real / .imag
No transpose before the RoPE (the inner attention transposes). Each layer's q_norm and k_norm are
fused with their RoPE in one ``qk_norm_rope`` call: 4 norms, 2 calls.
"""

import pytest
import torch
import torch.nn as nn

import normfuse
from normfuse.verify.numeric import perturb_vectors
from normfuse.verify.sites import fused_calls

from helpers import optimized_with_fault

pytest.importorskip("torchtitan")

DIM, HEADS, KV_HEADS, HEAD_DIM, VOCAB, SEQ, BATCH = 64, 4, 2, 16, 128, 8, 2
ROPE = {"cossin": "neox, rotary 16 of 16", "complex": "gptj, rotary 16 of 16"}


class CausalSDPA(nn.Module):
    """torchtitan's inner attention contract, computed with causal SDPA: (B, L, N, H) in and out
    (FlexAttention has no CPU backward)."""

    def forward(self, q, k, v, *, attention_masks=None, scale=None, enable_gqa=False, **kwargs):
        out = nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, scale=scale,
            enable_gqa=enable_gqa)
        return out.transpose(1, 2)


def _titan_qwen3(rope: str, dtype: torch.dtype) -> nn.Module:
    """torchtitan's Qwen3 with the given RoPE format. The parameters in ``dtype``, the RoPE caches as
    torchtitan computes them (fp32 cos/sin, complex64 freqs_cis): ``Module.to(dtype)`` would also
    cast the caches (and drop freqs_cis's imaginary part)."""
    from torchtitan.models.common import ComplexRoPE, CosSinRoPE, Embedding, Linear
    from torchtitan.models.qwen3 import Qwen3Model, _build_qwen3_layers, _qwen3_norm

    torch._dynamo.reset()
    rope_config = (CosSinRoPE if rope == "cossin" else ComplexRoPE).Config(dim=HEAD_DIM, max_seq_len=32, theta=1e6)
    config = Qwen3Model.Config(
        vocab_size=VOCAB, dim=DIM, norm=_qwen3_norm(DIM), enable_weight_tying=False,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM,
                                        param_init={"weight": nn.init.normal_}),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB,
                              param_init={"weight": lambda w: nn.init.normal_(w, 0.0, 0.1)}),
        layers=_build_qwen3_layers(n_layers=2, dim=DIM, n_heads=HEADS, n_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                                   hidden_dim=128, attn_backend="flex", rope=rope_config))
    torch.manual_seed(0)
    model = config.build()
    model.init_states()
    for block in model.layers.values():
        block.attention.inner_attention = CausalSDPA()
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.to(dtype)
    return perturb_vectors(model).eval()


def _tokens():
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))


def _qk_sites(sites):
    return [s for s in sites if s.fqn.endswith(("q_norm", "k_norm"))]


@pytest.mark.parametrize("rope", list(ROPE))
@pytest.mark.parametrize("dtype,positions", [(torch.bfloat16, False), (torch.float32, False),
                                             (torch.bfloat16, True)])
def test_every_qk_norm_is_fused_with_its_rope(rope, dtype, positions):
    """positions given: the cache gathered per sample, (B, S, 1, .) tables instead of (1, S, 1, .)."""
    model = _titan_qwen3(rope, dtype)
    ids = _tokens()
    kwargs = {"positions": torch.arange(SEQ).flip(0).expand(BATCH, SEQ)} if positions else {}
    with torch.no_grad():
        ref = model(ids, **kwargs)
        normfuse.optimize(model)
        out = model(ids, **kwargs)
    rep = normfuse.report(model)
    qk = _qk_sites(rep.sites)
    assert len(qk) == 4 and rep.counts()["rope"] == 4 and rep.counts()["fused_rope"] == 4, rep
    assert all(s.op == "qk_norm_rope" and s.rope == ROPE[rope] and s.rope_reason is None for s in qk), rep
    assert len({s.call for s in qk}) == 2  # q and k of each attention in one call
    assert torch.equal(out, ref)  # the reference path rounds where eager rounds


@pytest.mark.parametrize("rope", list(ROPE))
def test_a_recompile_for_another_length_fuses_the_rope_too(rope):
    """Lengths 8, 12, 16: dynamo recompiles once with a symbolic sequence length; that graph's q/k
    norms are fused with their RoPE too (the cache sliced to a symbolic length)."""
    model = _titan_qwen3(rope, torch.bfloat16)
    ids = [torch.randint(0, VOCAB, (BATCH, n), generator=torch.Generator().manual_seed(n)) for n in (8, 12, 16)]
    with torch.no_grad():
        refs = [model(x) for x in ids]
        normfuse.optimize(model)
        outs = [model(x) for x in ids]
    rep = normfuse.report(model)
    assert len({s.id.split(".")[0] for s in rep.sites}) == 2, rep
    qk = _qk_sites(rep.sites)
    assert len(qk) == 8 and all(s.op == "qk_norm_rope" and s.rope == ROPE[rope] and s.fused_rope for s in qk), rep
    assert all(torch.equal(out, ref) for out, ref in zip(outs, refs))


@pytest.mark.parametrize("rope", list(ROPE))
def test_positions_of_one_sample(rope):
    """One sample with positions: torchtitan indexes its cache, ``cache[positions.squeeze(0)]``, after
    the norms; the call reads the table from there, moved up with it (pure primitives)."""
    model = _titan_qwen3(rope, torch.bfloat16)
    ids, positions = _tokens()[:1], torch.arange(SEQ).flip(0)[None]
    with torch.no_grad():
        ref = model(ids, positions=positions)
        normfuse.optimize(model)
        out = model(ids, positions=positions)
    qk = _qk_sites(normfuse.report(model).sites)
    assert len(qk) == 4 and all(s.op == "qk_norm_rope" and s.fused_rope for s in qk), qk
    assert torch.equal(out, ref)


@pytest.mark.parametrize("rope", list(ROPE))
def test_check_passes_every_site_with_gradients(rope):
    model = _titan_qwen3(rope, torch.bfloat16)
    res = normfuse.check(model, _tokens())  # outputs and every gradient vs fp64, site by site
    assert res.ok, str(res)
    qk = [s for s in res.sites if s.op == "qk_norm_rope"]
    assert len(qk) == 4 and all(s.passed and s.numeric.passed for s in qk), str(res)
    assert any(o.name.startswith("grad:") and "q_norm" in o.name for o in res.outputs)
    # the complex form as (real, imaginary) pairs of the rows: freqs_cis's parts are the call's cos/sin
    assert all(s.symbolic.status == "proved" and s.symbolic.method.startswith("algebra") for s in qk), str(res)


@pytest.mark.parametrize("rope", list(ROPE))
def test_torch_export_graph(rope):
    """An exported ATen graph spells the casts aten._to_copy, the slices aten.slice, the complex
    steps aten.view_as_complex / mul / view_as_real and the flatten as a view; fuse_graph takes it."""
    model = _titan_qwen3(rope, torch.bfloat16)
    ids = _tokens()
    gm = torch.export.export(model, (ids,)).module()
    with torch.no_grad():
        ref = gm(ids)
        gm, rep = normfuse.fuse_graph(gm)
        out = gm(ids)
    qk = _qk_sites(rep.sites)
    assert len(qk) == 4 and all(s.op == "qk_norm_rope" and s.rope == ROPE[rope] for s in qk), rep
    assert len({s.call for s in qk}) == 2
    assert torch.equal(out, ref)


# --------------------------------------------------------------------------- planted faults

def _plant(gm, fault):
    """Edit the first qk_norm_rope call of a rewritten graph the way a buggy rewrite would."""
    call = next(n for n in fused_calls(gm.graph) if n.kwargs.get("rotary_dim") is not None)
    kw = dict(call.kwargs)
    if fault == "other_layout":    # rotate_half's partners for adjacent pairs, or the reverse
        kw["layout"] = "gptj" if kw["layout"] == "neox" else "neox"
    elif fault == "rotated_sign":  # sin for cos (complex form: freqs_cis.imag for .real)
        kw["cos"], kw["sin"] = kw["sin"], kw["cos"]
    elif fault == "bf16_rope":     # the products and the sum rounded to bf16 (eager computes them in fp32)
        assert kw["rope_dtype"] == torch.float32
        kw["rope_dtype"] = torch.bfloat16
    else:
        raise ValueError(fault)
    call.kwargs = kw
    gm.recompile()


@pytest.mark.parametrize("rope,fault", [("cossin", "other_layout"), ("cossin", "rotated_sign"),
                                        ("complex", "other_layout"), ("complex", "rotated_sign")])
def test_planted_fault_is_refuted_at_its_site(rope, fault):
    model = _titan_qwen3(rope, torch.bfloat16)
    res = normfuse.check(model, _tokens(), optimized=optimized_with_fault(model, lambda gm: _plant(gm, fault)),
                         backward=False)
    assert not res.ok
    failing = [s.id for s in res.sites if not s.passed]
    assert failing and set(failing) <= {"g0.s1", "g0.s2"}, failing  # layer 0's q_norm / k_norm call only
    assert res.first_divergence is not None and res.first_divergence.id in failing
    assert res.first_divergence.numeric.passed is False
    assert res.first_divergence.symbolic.status == "refuted", res.first_divergence.symbolic


# --------------------------------------------------------------------------- left as it was

class _Attention(nn.Module):
    """q/k RMSNorm per head on (B, S, H, D), then torchtitan's own RoPE module; ``leak``: also
    returns the normalized q."""

    def __init__(self, rope: str, leak: bool = False):
        super().__init__()
        from torchtitan.models.common import ComplexRoPE, CosSinRoPE

        self.leak = leak
        self.q_norm, self.k_norm = nn.RMSNorm(HEAD_DIM, eps=1e-6), nn.RMSNorm(HEAD_DIM, eps=1e-6)
        config = (CosSinRoPE if rope == "cossin" else ComplexRoPE).Config(dim=HEAD_DIM, max_seq_len=SEQ)
        self.rope = config.build()
        with torch.no_grad():
            self.q_norm.weight.uniform_(0.5, 1.5)
            self.k_norm.weight.uniform_(0.5, 1.5)

    def forward(self, q, k):
        qn, kn = self.q_norm(q), self.k_norm(k)
        rq, rk = self.rope(qn, kn)
        return (rq, rk, qn) if self.leak else (rq, rk)


@pytest.mark.parametrize("rope", list(ROPE))
def test_a_q_read_outside_its_rope_keeps_it(rope):
    """The normalized q is also returned: q's norm is fused alone and its RoPE stays, with the
    reason; k is fused with its own RoPE."""
    torch._dynamo.reset()
    model = _Attention(rope, leak=True)
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(BATCH, SEQ, h, HEAD_DIM, generator=g).to(torch.bfloat16) for h in (HEADS, KV_HEADS))
    with torch.no_grad():
        for p in model.parameters():  # the RoPE cache stays as torchtitan computes it
            p.data = p.data.to(torch.bfloat16)
    with torch.no_grad():
        ref = model(q, k)
        normfuse.optimize(model)
        out = model(q, k)
    rep = normfuse.report(model)
    assert len(rep.sites) == 2 and all(s.fused for s in rep.sites), rep
    qs, ks = rep.sites
    assert qs.op == "norm" and not qs.fused_rope and qs.rope_reason == "the normalized q/k is read outside its RoPE"
    assert ks.op == "qk_norm_rope" and ks.fused_rope and ks.rope == ROPE[rope], rep
    for got, want in zip(out, ref):
        assert torch.equal(got, want)


# --------------------------------------------------------------------------- GPT-J's pairs written out

class _PairsAttention(nn.Module):
    """q/k RMSNorm per head on (B, S, H, D), then GPT-J's interleaved RoPE written out, with full
    tables (each angle repeated for its pair) in q's dtype; ``leak``: also returns the normalized q."""

    def __init__(self, leak: bool = False):
        super().__init__()
        self.leak = leak
        angles = torch.randn(1, SEQ, 1, HEAD_DIM // 2, generator=torch.Generator().manual_seed(1))
        self.register_buffer("angles", angles.repeat_interleave(2, dim=-1))
        self.q_norm, self.k_norm = nn.RMSNorm(HEAD_DIM, eps=1e-6), nn.RMSNorm(HEAD_DIM, eps=1e-6)
        with torch.no_grad():
            self.q_norm.weight.uniform_(0.5, 1.5)
            self.k_norm.weight.uniform_(0.5, 1.5)

    @staticmethod
    def _rotate(x, cos, sin):
        x1, x2 = x[..., ::2], x[..., 1::2]
        return x * cos + torch.stack((-x2, x1), dim=-1).flatten(-2) * sin

    def forward(self, q, k):
        cos, sin = self.angles.cos().to(q.dtype), self.angles.sin().to(q.dtype)
        qn, kn = self.q_norm(q), self.k_norm(k)
        out = (self._rotate(qn, cos, sin), self._rotate(kn, cos, sin))
        return (*out, qn) if self.leak else out


def _pairs_inputs(dtype):
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(BATCH, SEQ, h, HEAD_DIM, generator=g).to(dtype) for h in (HEADS, KV_HEADS))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("leak", [False, True])
def test_gptj_pairs_written_out(dtype, leak):
    torch._dynamo.reset()
    model = _PairsAttention(leak)
    model.q_norm.to(dtype), model.k_norm.to(dtype)
    args = _pairs_inputs(dtype)
    with torch.no_grad():
        ref = model(*args)
        normfuse.optimize(model)
        out = model(*args)
    rep = normfuse.report(model)
    assert len(rep.sites) == 2 and all(s.fused for s in rep.sites), rep
    qs, ks = rep.sites
    assert ks.op == "qk_norm_rope" and ks.fused_rope and ks.rope == "gptj, rotary 16 of 16", rep
    if leak:  # q keeps its RoPE, k is fused alone with its own
        assert qs.op == "norm" and qs.rope_reason == "the normalized q/k is read outside its RoPE", rep
    else:
        assert qs.op == "qk_norm_rope" and qs.call == ks.call and qs.rope == ks.rope, rep
    for got, want in zip(out, ref):
        assert torch.equal(got, want)  # bf16: eager's three roundings


def test_gptj_pairs_check_and_export():
    model = _PairsAttention()
    model.q_norm.to(torch.bfloat16), model.k_norm.to(torch.bfloat16)
    args = _pairs_inputs(torch.bfloat16)
    torch._dynamo.reset()
    res = normfuse.check(model, *args)
    assert res.ok, str(res)
    qk = [s for s in res.sites if s.op == "qk_norm_rope"]
    assert len(qk) == 2 and all(s.numeric.passed and s.symbolic.status == "proved" for s in qk), str(res)
    gm = torch.export.export(model, args).module()
    with torch.no_grad():
        ref = gm(*args)
        gm, rep = normfuse.fuse_graph(gm)
        out = gm(*args)
    assert [(s.op, s.rope) for s in rep.sites] == [("qk_norm_rope", "gptj, rotary 16 of 16")] * 2, rep
    for got, want in zip(out, ref):
        assert torch.equal(got, want)


@pytest.mark.parametrize("rope", list(ROPE))
def test_triton_kernels_in_a_training_step(rope, triton_cpu):
    """The Triton forward and backward (interpreted on CPU) reading the tables as the rewrite gives
    them: CosSinRoPE's slices of its cache, freqs_cis.real / .imag (a column stride of 2)."""
    model = _titan_qwen3(rope, torch.bfloat16)
    res = normfuse.check(model, _tokens())
    assert res.ok, str(res)
    qk = [s for s in res.sites if s.op == "qk_norm_rope"]
    assert len(qk) == 4 and all(s.numeric.passed for s in qk), str(res)
    assert any(o.name.startswith("grad:") and "k_norm" in o.name for o in res.outputs)


class _DowncastAttention(_PairsAttention):
    """An fp32 norm whose output is rounded to bf16 before GPT-J's RoPE: two roundings of the
    normalized value (fp32, then bf16), where the kernel rounds once."""

    def forward(self, q, k):
        cos, sin = self.angles.cos().bfloat16(), self.angles.sin().bfloat16()
        qn, kn = self.q_norm(q).bfloat16(), self.k_norm(k).bfloat16()
        return self._rotate(qn, cos, sin), self._rotate(kn, cos, sin)


def test_a_cast_that_rounds_before_the_rope_keeps_it():
    torch._dynamo.reset()
    model = _DowncastAttention()
    args = _pairs_inputs(torch.float32)
    with torch.no_grad():
        ref = model(*args)
        normfuse.optimize(model)
        out = model(*args)
    rep = normfuse.report(model)
    assert len(rep.sites) == 2 and all(s.fused and s.op == "norm" and not s.fused_rope for s in rep.sites), rep
    assert all(s.rope_reason == "q/k is cast from torch.float32 to torch.bfloat16 before its RoPE, a rounding the "
                                "kernel does not make" for s in rep.sites), rep
    for got, want in zip(out, ref):
        assert torch.equal(got, want)


class _CastLeakAttention(_PairsAttention):
    """GPT-J's RoPE on the normalized q itself, and an upcast of q read elsewhere."""

    def forward(self, q, k):
        cos, sin = self.angles.cos().to(q.dtype), self.angles.sin().to(q.dtype)
        qn, kn = self.q_norm(q), self.k_norm(k)
        return self._rotate(qn, cos, sin), self._rotate(kn, cos, sin), qn.float().sum()


def test_an_upcast_read_elsewhere_is_not_the_rope_s():
    torch._dynamo.reset()
    model = _CastLeakAttention()
    model.q_norm.to(torch.bfloat16), model.k_norm.to(torch.bfloat16)
    args = _pairs_inputs(torch.bfloat16)
    with torch.no_grad():
        ref = model(*args)
        normfuse.optimize(model)
        out = model(*args)
    qs, ks = normfuse.report(model).sites
    assert qs.op == "norm" and qs.rope_reason == "the normalized q/k is read outside its RoPE", qs
    assert ks.op == "qk_norm_rope" and ks.rope == "gptj, rotary 16 of 16", ks
    for got, want in zip(out, ref):
        assert torch.equal(got, want)


def test_audit_prices_the_tables_each_form_reads():
    """CosSinRoPE's call reads cos and sin, two fp32 (1, S, 1, D) slices of its cache; ComplexRoPE's
    reads freqs_cis once, a complex64 (1, S, 1, D / 2) table (its real and imaginary parts): the
    fused bytes of the q site differ by one fp32 (S, D) table each way, every other byte alike."""
    from normfuse.auditing import audit

    priced = {}
    for rope in ROPE:
        rep = audit(_titan_qwen3(rope, torch.bfloat16), _tokens())
        priced[rope] = {s.site.fqn: s for s in rep.sites if s.site.fqn.endswith(("q_norm", "k_norm"))}
    table = SEQ * HEAD_DIM * 4
    for fqn, cossin in priced["cossin"].items():
        complex_ = priced["complex"][fqn]
        assert cossin.site.op == complex_.site.op == "qk_norm_rope"
        extra = table if fqn.endswith("q_norm") else 0  # the tables are priced at the q site, the call's lead
        assert cossin.fused.fwd - complex_.fused.fwd == extra, fqn
        assert cossin.fused.bwd - complex_.fused.bwd == extra, fqn
