"""qk_norm_rope: per-head RMSNorm of q and k, then RoPE, in one op (normfuse/kernels/qk_rope.py).

* Reference path: the outputs equal the models' own code bit for bit, called on the same inputs: HF's
  q_norm / k_norm modules and apply_rotary_pos_emb of Qwen3, Gemma 3, GLM-4 MoE (partial rotary) and
  OLMo 2 (whole-row norm, fp32 tables), and torchtitan's nn.RMSNorm + ComplexRoPE / CosSinRoPE.
* Triton path (the kernels under the interpreter): the same outputs as the models' and the reference's,
  within the rounding budget (a row's statistics summed in another order: normfuse.tolerances).
* Gradients: held to the project's rule (normfuse.tolerances) three ways: |ours - fp64| <= factor *
  |the model's code in the working dtype - fp64| + atol, fp64 being the reference with fp64 roundings.
"""

from __future__ import annotations

import pytest
import torch

from normfuse.errors import InvalidOptionError, NormfuseError, ShapeMismatchError, UnsupportedDtypeError
from normfuse.kernels.qk_rope import qk_norm_rope, qk_norm_rope_bwd_ref, qk_norm_rope_fwd_ref, qk_norm_rope_ref
from normfuse.kernels.reference import normalize
from normfuse.tolerances import within_tolerance
from normfuse.zoo import prepare_torchvision

from kernel_cases import BF16, FP16, FP32, FP64, assert_same_bits, assert_within_rounding_budget

prepare_torchvision()
pytest.importorskip("transformers")
from transformers.models.gemma3 import modeling_gemma3 as gemma3  # noqa: E402
from transformers.models.glm4_moe import modeling_glm4_moe as glm4_moe  # noqa: E402
from transformers.models.olmo2 import modeling_olmo2 as olmo2  # noqa: E402
from transformers.models.qwen3 import modeling_qwen3 as qwen3  # noqa: E402

EPS = 1e-6
DTYPES = {"bf16": BF16, "fp16": FP16, "fp32": FP32}


@pytest.fixture(params=("reference", "triton"))
def path(request):
    """CPU tensors through the reference, or through the Triton kernels (interpreter)."""
    if request.param == "triton":
        request.getfixturevalue("triton_cpu")
    return request.param


# ---- inputs ------------------------------------------------------------------------------------

def qk(B, S, H, Hk, D, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = (torch.randn(B, S, H, D, generator=gen) * 2 + 0.3).to(dtype)
    k = (torch.randn(B, S, Hk, D, generator=gen) * 1.5 - 0.2).to(dtype)
    return q, k


def weights(n, dtype, seed=1, mean=1.0):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, generator=gen) * 0.3 + mean).to(dtype) for _ in range(2)]


def hf_tables(B, S, R, dtype, theta=10000.0):
    """cos, sin as HF's rotary embeddings compute them: (B, S, R), halves duplicated, positions
    offset per batch (as with a cache), fp32 then cast to ``dtype``."""
    inv_freq = 1.0 / theta ** (torch.arange(0, R, 2, dtype=torch.int64).float() / R)
    positions = torch.arange(S)[None, :] + 7 * torch.arange(B)[:, None]
    freqs = positions[..., None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def norm_module(cls, n, weight):
    """The model's norm module with ``weight`` itself as its weight (a leaf of the caller's run)."""
    module = cls(n, eps=EPS)
    module._parameters["weight"] = weight
    return module


# ---- the models' code, and the options that reproduce it ------------------------------------

def qwen3_like(family, q, k, wq, wk, cos, sin):
    """Qwen3 / GLM-4 MoE (use_qk_norm): per-head Llama-rounding norm, transpose, apply_rotary_pos_emb
    (GLM's rotates the first cos.shape[-1] columns)."""
    mod = {"qwen3": qwen3, "glm4_moe": glm4_moe}[family]
    cls = {"qwen3": qwen3.Qwen3RMSNorm, "glm4_moe": glm4_moe.Glm4MoeRMSNorm}[family]
    qn, kn = norm_module(cls, q.shape[-1], wq)(q), norm_module(cls, k.shape[-1], wk)(k)
    return mod.apply_rotary_pos_emb(qn.transpose(1, 2), kn.transpose(1, 2), cos, sin)


def gemma3_hf(q, k, wq, wk, cos, sin):
    """Gemma 3: q_norm on the transposed heads ((1 + w), multiplied then rounded), then RoPE."""
    qn = norm_module(gemma3.Gemma3RMSNorm, q.shape[-1], wq)(q.transpose(1, 2))
    kn = norm_module(gemma3.Gemma3RMSNorm, k.shape[-1], wk)(k.transpose(1, 2))
    return gemma3.apply_rotary_pos_emb(qn, kn, cos, sin)


def olmo2_hf(q, k, wq, wk, cos, sin):
    """OLMo 2: q_norm over the whole projection (all heads), the view, then RoPE with fp32 tables
    and a cast back to the input dtype."""
    B, S, H, D = q.shape
    qn = norm_module(olmo2.Olmo2RMSNorm, H * D, wq)(q.reshape(B, S, H * D)).view(B, S, H, D)
    kn = norm_module(olmo2.Olmo2RMSNorm, k.shape[2] * D, wk)(k.reshape(B, S, -1)).view(k.shape)
    return olmo2.apply_rotary_pos_emb(qn.transpose(1, 2), kn.transpose(1, 2), cos, sin)


def options(family, dtype):
    """qk_norm_rope's options for the family's code on activations of ``dtype`` (module docstring)."""
    if family in ("qwen3", "glm4_moe"):
        return dict(norm_round_dtype=dtype, transpose_out=True)
    if family == "gemma3":
        return dict(weight_offset=1.0, transpose_out=True)
    if family == "olmo2":
        return dict(norm_width="row", out_dtype=dtype, transpose_out=True)
    return dict(out_dtype=dtype)  # torchtitan: rope_dtype fp32 from its fp32 tables


def hf(family, q, k, wq, wk, cos, sin):
    if family == "gemma3":
        return gemma3_hf(q, k, wq, wk, cos, sin)
    if family == "olmo2":
        return olmo2_hf(q, k, wq, wk, cos, sin)
    return qwen3_like(family, q, k, wq, wk, cos, sin)


def case(family, dtype, B=2, S=5, H=4, Hk=2, D=64, wdtype=None, seed=0):
    """(q, k, wq, wk, cos, sin, R) of a family: GLM rotates half of each head (partial_rotary_factor
    0.5), OLMo 2's weights span all heads and its tables stay fp32."""
    q, k = qk(B, S, H, Hk, D, dtype, seed)
    R = D // 2 if family == "glm4_moe" else D
    if family == "olmo2":
        wq, _ = weights(H * D, wdtype or dtype, seed + 1)
        _, wk = weights(Hk * D, wdtype or dtype, seed + 1)
        cos, sin = hf_tables(B, S, R, FP32)
    else:
        wq, wk = weights(D, wdtype or dtype, seed + 1, mean=0.0 if family == "gemma3" else 1.0)
        cos, sin = hf_tables(B, S, R, dtype)
    return q, k, wq, wk, cos, sin, R


HF_FAMILIES = ("qwen3", "gemma3", "glm4_moe", "olmo2")


# ---- the reference path: bit for bit with the models ------------------------------------------

def assert_same(path, got, want, what):
    """Bit for bit on the reference path; within the rounding budget on the Triton path."""
    assert torch.isfinite(got).all(), f"{what}: not finite"
    if path == "reference":
        assert_same_bits(got, want, what)
    else:
        assert_within_rounding_budget(got, want, what)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("family", HF_FAMILIES)
def test_equals_hf(path, family, dtype):
    q, k, wq, wk, cos, sin, _ = case(family, dtype, B=1, S=3)
    with torch.no_grad():
        got = qk_norm_rope(q, k, wq, wk, cos, sin, eps=EPS, **options(family, dtype))
        want = hf(family, q, k, wq, wk, cos, sin)
    for name, g, w in zip(("q", "k"), got, want):
        assert_same(path, g, w.contiguous(), f"{family} {name}")
        assert g.is_contiguous()


@pytest.mark.parametrize("family", ("qwen3", "gemma3"))
def test_weight_dtype_other_than_the_activations(path, family):
    """A norm left in fp32 next to bf16 activations. Qwen3: weight * h.to(bf16) promotes to fp32, and
    the RoPE then runs in fp32 too (bf16 tables times fp32 y): the defaults follow eager's promotion.
    Gemma 3 multiplies in fp32 and rounds to bf16 either way."""
    q, k, wq, wk, cos, sin, _ = case(family, BF16, B=1, S=3, wdtype=FP32)
    with torch.no_grad():
        got = qk_norm_rope(q, k, wq, wk, cos, sin, eps=EPS, **options(family, BF16))
        want = hf(family, q, k, wq, wk, cos, sin)
    for name, g, w in zip(("q", "k"), got, want):
        assert g.dtype == (FP32 if family == "qwen3" else BF16)
        assert_same(path, g, w.contiguous(), name)


def titan_inputs(dtype, B=2, S=6, H=4, Hk=2, D=64, seed=0):
    from torchtitan.models.common.rope import ComplexRoPE, CosSinRoPE
    q, k = qk(B, S, H, Hk, D, dtype, seed)
    wq, wk = weights(D, dtype, seed + 1)
    cfg = dict(dim=D, max_seq_len=S + 3, theta=500000.0)
    complex_rope = ComplexRoPE(ComplexRoPE.Config(**cfg))
    cossin_rope = CosSinRoPE(CosSinRoPE.Config(**cfg))
    return q, k, wq, wk, complex_rope, cossin_rope


def titan_norm(x, w):
    return norm_module(torch.nn.RMSNorm, x.shape[-1], w)(x)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("form", ("complex", "cos_sin"))
def test_equals_torchtitan(path, form, dtype):
    """torchtitan: nn.RMSNorm on (B, S, H, D), then ComplexRoPE (view_as_complex(x.float()) * freqs_cis,
    type_as: the pair rotation in fp32, one rounding) or CosSinRoPE (rotate_half in fp32)."""
    pytest.importorskip("torchtitan")
    q, k, wq, wk, complex_rope, cossin_rope = titan_inputs(dtype, B=1, S=3)
    D, S = q.shape[-1], q.shape[1]
    with torch.no_grad():
        qn, kn = titan_norm(q, wq), titan_norm(k, wk)
        if form == "complex":
            freqs_cis = complex_rope._reshape_cache(q)                  # (1, S, 1, D / 2) complex64
            want = complex_rope.apply_rotary_emb(qn, kn, freqs_cis)
            got = qk_norm_rope(q, k, wq, wk, freqs_cis.real, freqs_cis.imag, eps=EPS, layout="gptj", rotary_dim=D,
                               out_dtype=dtype)
        else:
            cache = cossin_rope._reshape_cache(q)                       # (1, S, 1, 2 D) fp32
            want = cossin_rope.apply_rotary_emb(qn, kn, cache)
            got = qk_norm_rope(q, k, wq, wk, cache[..., :D], cache[..., D:], eps=EPS, out_dtype=dtype)
    assert got[0].shape == (1, S, 4, D)
    for name, g, w in zip(("q", "k"), got, want):
        assert_same(path, g, w, f"{form} {name}")


@pytest.mark.parametrize("dtype", (BF16, FP32), ids=("bf16", "fp32"))
@pytest.mark.parametrize("N", (96, 2048))
def test_equals_ltx_video_row_rope(path, N, dtype):
    """LTX-Video: nn.RMSNorm over the (B, S, N) row of all heads, then diffusers' interleaved RoPE of the
    whole row with fp32 (B, S, N) tables (one angle per column, no head repeats it), ``.to(x.dtype)``:
    one head of N columns, layout "gptj", the tables read as HF's 3-d ones."""
    diffusers_ltx = pytest.importorskip("diffusers.models.transformers.transformer_ltx")
    B, S = 2, 3
    gen = torch.Generator().manual_seed(N)
    q, k = (torch.randn(B, S, N, generator=gen).to(dtype) for _ in range(2))
    wq, wk = ((1 + 0.1 * torch.randn(N, generator=gen)).to(dtype) for _ in range(2))
    angles = torch.rand(B, S, N // 2, generator=gen) * 6.3
    cos, sin = (t.repeat_interleave(2, dim=-1) for t in (angles.cos(), angles.sin()))  # as LTX's rope tables
    with torch.no_grad():
        want = [diffusers_ltx.apply_rotary_emb(titan_norm(x, w), (cos, sin)) for x, w in ((q, wq), (k, wk))]
        got = qk_norm_rope(q.unflatten(-1, (1, N)), k.unflatten(-1, (1, N)), wq, wk, cos, sin, eps=EPS,
                           layout="gptj", out_dtype=dtype)
    for name, g, w in zip(("q", "k"), got, want):
        assert g.shape == (B, S, 1, N)
        assert_same(path, g.flatten(2), w, f"LTX {name}")


def wan_rope(x, cos, sin):
    """Wan 2.x's RoPE as the model writes it: the pairs' complex product stored interleaved."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[..., 0::2], sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(x)


@pytest.mark.parametrize("dtype", (BF16, FP32), ids=("bf16", "fp32"))
@pytest.mark.parametrize("H", (4, 40))
def test_equals_wan_stored_rope(path, H, dtype):
    """Wan: nn.RMSNorm over all heads (H * 128, 5120 at 14B), the view to heads, its RoPE with half
    tables read in place (every other column of (1, S, 1, D) ones, the model's dtype): norm_width
    "row", layout "gptj", rotary_dim D."""
    B, S, D = 1, 3, 128
    gen = torch.Generator().manual_seed(H)
    q, k = (torch.randn(B, S, H * D, generator=gen).to(dtype) for _ in range(2))
    wq, wk = ((1 + 0.1 * torch.randn(H * D, generator=gen)).to(dtype) for _ in range(2))
    angles = (torch.rand(1, S, 1, D // 2, generator=gen) * 6.3).repeat_interleave(2, dim=-1)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    with torch.no_grad():
        want = [wan_rope(titan_norm(x, w).unflatten(2, (H, D)), cos, sin) for x, w in ((q, wq), (k, wk))]
        got = qk_norm_rope(q.unflatten(2, (H, D)), k.unflatten(2, (H, D)), wq, wk, cos[..., 0::2], sin[..., 1::2],
                           eps=EPS, norm_width="row", layout="gptj", rotary_dim=D, out_dtype=dtype)
    for name, g, w in zip(("q", "k"), got, want):
        assert_same(path, g, w, f"Wan {name}")


# ---- pitfalls: the options matter ---------------------------------------------------------------

def test_gptj_layout_on_neox_tables_differs(path):
    """The layout is an argument, never assumed: pairing adjacent columns where the model rotates
    halves gives other numbers."""
    q, k, wq, wk, cos, sin, _ = case("qwen3", BF16, B=1, S=3)
    with torch.no_grad():
        want = hf("qwen3", q, k, wq, wk, cos, sin)[0]
        neox = qk_norm_rope(q, k, wq, wk, cos, sin, eps=EPS, norm_round_dtype=BF16, transpose_out=True)[0]
        gptj = qk_norm_rope(q, k, wq, wk, cos, sin, eps=EPS, norm_round_dtype=BF16, transpose_out=True,
                            layout="gptj")[0]
    assert_same(path, neox, want.contiguous(), "neox")
    assert (gptj != want).float().mean() > 0.5


def test_skipping_the_bf16_round_before_rope_differs(path):
    """Qwen3 rounds the norm output to bf16, and each step of RoPE: an op that normalizes and rotates
    in fp32 and rounds once (what a "fused in fp32" kernel does) differs from the model."""
    q, k, wq, wk, cos, sin, _ = case("qwen3", BF16, B=1, S=4)
    with torch.no_grad():
        want = hf("qwen3", q, k, wq, wk, cos, sin)[0]
        exact = qk_norm_rope(q, k, wq, wk, cos, sin, eps=EPS, norm_round_dtype=BF16, transpose_out=True)[0]
        fp32 = qk_norm_rope(q, k, wq, wk, cos, sin, eps=EPS, norm_round_dtype=BF16, norm_out_dtype=FP32,
                            rope_dtype=FP32, out_dtype=BF16, transpose_out=True)[0]
    assert_same(path, exact, want.contiguous(), "with the bf16 roundings")
    assert (fp32 != want).float().mean() > 0.05


@pytest.mark.parametrize("R", (32, 16), ids=("half", "quarter"))
def test_partial_rotary_passes_the_rest_through(path, R):
    """GLM-style partial rotary: the columns past R are the norm output itself, finite, and the
    rotated ones equal the model's."""
    q, k, wq, wk, cos, sin, _ = case("glm4_moe", BF16, B=1, S=3, D=64)
    cos, sin = cos[..., :R], sin[..., :R]
    with torch.no_grad():
        got = qk_norm_rope(q, k, wq, wk, cos, sin, eps=EPS, norm_round_dtype=BF16, transpose_out=True)
        want = hf("glm4_moe", q, k, wq, wk, cos, sin)
        norm = norm_module(glm4_moe.Glm4MoeRMSNorm, 64, wq)(q).transpose(1, 2)
    assert_same(path, got[0][..., R:], norm[..., R:].contiguous(), "pass-through columns")
    for name, g, w in zip(("q", "k"), got, want):
        assert_same(path, g, w.contiguous(), name)


# ---- gradients: the project's rule --------------------------------------------------------------

def qk_rule(q, k, wq, wk, cos, sin, *, eps, weight_offset=0.0, layout="neox", rotary_dim=None, norm_width="head",
            transpose_out=False, acc=FP64, round_to=None, **rounding):
    """(q_out, k_out) of the op in plain torch ops, written apart from normfuse.kernels.qk_rope:
    computed in ``acc`` with no rounding on the way (the op's rounding options, out_dtype among
    them, are ignored), the outputs rounded to ``round_to`` when one is given::

        n = x / sqrt(mean(x^2) + eps) * (w + offset)         per head (D), or per position (H * D)
        out[..., :R] = n * cos + rot(n) * sin,  out[..., R:] = n[..., R:]
        rot: neox (-n2, n1) of the halves; gptj (-n1, n0, -n3, n2, ...) of the pairs
    A table of R / 2 angles holds one per pair: neox pairs column j with j + R / 2, gptj 2i with 2i + 1.
    """
    cos, sin = cos.to(acc), sin.to(acc)
    if cos.dim() == 3:                                   # HF's (B, S, R): one table for every head
        cos, sin = cos[:, :, None], sin[:, :, None]
    R = rotary_dim or cos.shape[-1]
    if cos.shape[-1] != R:
        pair = torch.arange(R) % (R // 2) if layout == "neox" else torch.arange(R) // 2
        cos, sin = cos[..., pair], sin[..., pair]
    outs = []
    for x, w in ((q, wq), (k, wk)):
        if x is None:
            outs.append(None)
            continue
        B, S, H, D = x.shape
        rows = x.to(acc).reshape(B, S, H * D) if norm_width == "row" else x.to(acc)
        n = rows / torch.sqrt((rows * rows).mean(-1, keepdim=True) + eps)
        n = (n if w is None else n * (w.to(acc) + weight_offset)).reshape(B, S, H, D)
        a = n[..., :R]
        if layout == "neox":
            rot = torch.cat((-a[..., R // 2:], a[..., :R // 2]), dim=-1)
        else:
            rot = torch.stack((-a[..., 1::2], a[..., 0::2]), dim=-1).flatten(-2)
        out = torch.cat((a * cos + rot * sin, n[..., R:]), dim=-1)
        out = out.transpose(1, 2) if transpose_out else out
        outs.append(out if round_to is None else out.to(round_to))
    return tuple(outs)


def _run(fn, tensors, cot):
    """fn's outputs and the grads of q, k, wq, wk under sum(out * cotangent)."""
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    outs = fn(*leaves)
    loss = sum((o.double() * c).sum() for o, c in zip(outs, cot))
    return list(outs) + list(torch.autograd.grad(loss, leaves))


def check_three_way(family, dtype, B=2, S=4, H=4, Hk=2, D=64):
    q, k, wq, wk, cos, sin, R = case(family, dtype, B, S, H, Hk, D)
    opts = options(family, dtype)
    gen = torch.Generator().manual_seed(5)
    cot = [torch.randn(B, h, S, D, generator=gen, dtype=FP64) for h in (H, Hk)]
    got = _run(lambda *a: qk_norm_rope(*a, cos, sin, eps=EPS, **opts), (q, k, wq, wk), cot)
    base = _run(lambda *a: hf(family, *a, cos, sin), (q, k, wq, wk), cot)
    exact = _run(lambda *a: qk_rule(*a, cos, sin, eps=EPS, **opts), (q.double(), k.double(), wq.double(),
                                                                     wk.double()), cot)
    for what, g, b, e in zip(("q_out", "k_out", "dq", "dk", "dq_weight", "dk_weight"), got, base, exact):
        assert g.dtype == b.dtype and g.shape == b.shape, what
        ok, err, err_base, bound = within_tolerance(g, b.contiguous(), e, dtype=g.dtype)
        assert ok, f"{family} {what}: error {err:.3g} > bound {bound:.3g} (the model's {err_base:.3g})"


@pytest.mark.parametrize("dtype", (BF16, FP32), ids=("bf16", "fp32"))
@pytest.mark.parametrize("family", HF_FAMILIES)
def test_grads_vs_fp64(path, family, dtype):
    check_three_way(family, dtype, B=1, S=3)


def test_cos_and_sin_are_not_differentiated_on_the_eager_path():
    """Grads flow to q, k and the weights; a rotary table that requires grad is refused."""
    q, k, wq, wk, cos, sin, _ = case("qwen3", FP32)
    with pytest.raises(InvalidOptionError, match="cos.detach()"):
        qk_norm_rope(q, k, wq, wk, cos.requires_grad_(), sin, eps=EPS)


# ---- QK LayerNorm (CogVideoX, CogView4, Persimmon) ---------------------------------------------
# the models' own code: nn.LayerNorm per head (weight and bias) on the (B, H, S, D) heads, then
# diffusers' apply_rotary_emb (fp32 tables of (S, D), ``(x.float() * cos + rotated.float() * sin).to(x.dtype)``):
# CogVideoX's interleaved pairs (use_real_unbind_dim=-1), CogView4's halves (-2); a partial rotary
# (Persimmon: the first R of D columns rotated, rotate_half)

def layer_norms(D, dtype, seed=6):
    gen = torch.Generator().manual_seed(seed)
    norms = [torch.nn.LayerNorm(D, eps=EPS).to(dtype) for _ in range(2)]
    with torch.no_grad():
        for m in norms:
            m.weight.copy_(torch.randn(D, generator=gen) * 0.3 + 1)
            m.bias.copy_(torch.randn(D, generator=gen) * 0.5)
    return norms


def ln_case(dtype, B=2, S=5, H=4, Hk=2, D=64):
    q, k = qk(B, S, H, Hk, D, dtype)
    gen = torch.Generator().manual_seed(7)
    angles = torch.rand(S, D // 2, generator=gen) * 6.3
    return q, k, layer_norms(D, dtype), angles


def diffusers_rope(x, angles, unbind_dim, rotary_dim=None):
    """diffusers' apply_rotary_emb on (B, H, S, D), its tables as CogVideoX / CogView4 build them;
    with rotary_dim, HF's partial rotate_half written out (Persimmon's form: fp32 tables, rounded
    once) on the first rotary_dim columns and the rest concatenated back."""
    from diffusers.models.embeddings import apply_rotary_emb

    if rotary_dim is not None:  # HF's partial rotary (Persimmon), fp32 tables, rounded once
        R = rotary_dim
        c = torch.cat((angles[:, :R // 2].cos(), angles[:, :R // 2].cos()), -1)
        s_ = torch.cat((angles[:, :R // 2].sin(), angles[:, :R // 2].sin()), -1)
        a, rest = x[..., :R], x[..., R:]
        rot = torch.cat((-a[..., R // 2:], a[..., :R // 2]), dim=-1)
        return torch.cat(((a.float() * c + rot.float() * s_).to(x.dtype), rest), dim=-1)
    per_column = angles.repeat_interleave(2, -1) if unbind_dim == -1 else torch.cat((angles, angles), -1)
    return apply_rotary_emb(x, (per_column.cos(), per_column.sin()), use_real_unbind_dim=unbind_dim)


def _ln_tables(angles, unbind_dim, rotary_dim=None):
    """The op's (1, S, 1, R) tables of the same angles."""
    if rotary_dim is not None:
        a = angles[:, :rotary_dim // 2]
        per_column = torch.cat((a, a), -1)
    else:
        per_column = angles.repeat_interleave(2, -1) if unbind_dim == -1 else torch.cat((angles, angles), -1)
    return per_column.cos()[None, :, None], per_column.sin()[None, :, None]


LN_FORMS = {"cogvideox": dict(unbind_dim=-1, layout="gptj"), "cogview4": dict(unbind_dim=-2, layout="neox"),
            "partial": dict(unbind_dim=None, layout="neox", rotary_dim=32)}


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("form", LN_FORMS)
def test_equals_the_layer_norm_models(path, form, dtype):
    f = LN_FORMS[form]
    q, k, (nq, nk), angles = ln_case(dtype)
    cos, sin = _ln_tables(angles, f["unbind_dim"], f.get("rotary_dim"))
    with torch.no_grad():
        got = qk_norm_rope(q, k, nq.weight, nk.weight, cos, sin, eps=EPS, kind="layer_norm", q_bias=nq.bias,
                           k_bias=nk.bias, layout=f["layout"], rotary_dim=f.get("rotary_dim"), rope_dtype=FP32,
                           out_dtype=dtype, transpose_out=True)
        want = [diffusers_rope(n(x.transpose(1, 2)), angles, f["unbind_dim"], f.get("rotary_dim"))
                for n, x in ((nq, q), (nk, k))]
    if path == "triton":  # a row's statistics summed in another order: y may round the other way, and
        # the rotation adds two such y (up to 2 ulp of a smaller output): the rule against fp64
        exact = ln_rule(q, k, nq.weight, nk.weight, nq.bias, nk.bias, cos, sin, layout=f["layout"],
                        rotary_dim=f.get("rotary_dim"))
        for name, g, w, e in zip(("q", "k"), got, want, exact):
            ok, err, err_base, bound = within_tolerance(g, w.contiguous(), e, dtype=g.dtype)
            assert ok, f"{form} {name}: error {err:.3g} > bound {bound:.3g} (the model's {err_base:.3g})"
        return
    for name, g, w in zip(("q", "k"), got, want):
        assert_same_bits(g, w.contiguous(), f"{form} {name}")


def ln_rule(q, k, wq, wk, bq, bk, cos, sin, *, layout, rotary_dim=None, acc=FP64):
    """The QK-LayerNorm + RoPE in plain fp64 ops, written apart from the op: n = (x - mean) /
    sqrt(var + eps) * w + b per head, then n * cos + rot(n) * sin on the first rotary_dim columns
    ((1, S, 1, R) tables), the rest as they are; (B, H, S, D) outputs."""
    cos, sin = cos.to(acc), sin.to(acc)
    outs = []
    for x, w, b in ((q, wq, bq), (k, wk, bk)):
        x = x.to(acc)
        c = x - x.mean(-1, keepdim=True)
        n = c / torch.sqrt((c * c).mean(-1, keepdim=True) + EPS) * w.to(acc) + b.to(acc)
        R = rotary_dim or n.shape[-1]
        a = n[..., :R]
        if layout == "neox":
            rot = torch.cat((-a[..., R // 2:], a[..., :R // 2]), dim=-1)
        else:
            rot = torch.stack((-a[..., 1::2], a[..., 0::2]), dim=-1).flatten(-2)
        outs.append(torch.cat((a * cos + rot * sin, n[..., R:]), dim=-1).transpose(1, 2))
    return tuple(outs)


@pytest.mark.parametrize("dtype", (BF16, FP32), ids=("bf16", "fp32"))
@pytest.mark.parametrize("form", ("cogvideox", "cogview4"))
def test_layer_norm_grads_vs_fp64(path, form, dtype):
    """dq, dk, the weights' and the biases' gradients within the rule against fp64, the models' own
    code in the working dtype the baseline."""
    f = LN_FORMS[form]
    q, k, (nq, nk), angles = ln_case(dtype, B=1, S=3)
    cos, sin = _ln_tables(angles, f["unbind_dim"])
    gen = torch.Generator().manual_seed(5)
    cot = [torch.randn(1, h, 3, 64, generator=gen, dtype=FP64) for h in (4, 2)]
    params = [t.detach() for t in (nq.weight, nk.weight, nq.bias, nk.bias)]
    got = _run(lambda q, k, wq, wk, bq, bk: qk_norm_rope(q, k, wq, wk, cos, sin, eps=EPS, kind="layer_norm",
                                                          q_bias=bq, k_bias=bk, layout=f["layout"], rope_dtype=FP32,
                                                          out_dtype=dtype, transpose_out=True),
               (q, k, *params), cot)

    def model(q, k, wq, wk, bq, bk):
        return [diffusers_rope(torch.nn.functional.layer_norm(x.transpose(1, 2), (64,), w, b, EPS), angles,
                               f["unbind_dim"]) for x, w, b in ((q, wq, bq), (k, wk, bk))]
    base = _run(model, (q, k, *params), cot)
    exact = _run(lambda *a: ln_rule(*a, cos, sin, layout=f["layout"]), [t.double() for t in (q, k, *params)], cot)
    names = ("q_out", "k_out", "dq", "dk", "dq_weight", "dk_weight", "dq_bias", "dk_bias")
    for what, g, b, e in zip(names, got, base, exact):
        assert g.dtype == b.dtype and g.shape == b.shape, what
        ok, err, err_base, bound = within_tolerance(g, b.contiguous(), e, dtype=g.dtype)
        assert ok, f"{form} {what}: error {err:.3g} > bound {bound:.3g} (the model's {err_base:.3g})"


@pytest.mark.usefixtures("triton_cpu")
@pytest.mark.parametrize("dtype", (BF16, FP16, FP32), ids=("bf16", "fp16", "fp32"))
@pytest.mark.parametrize("norm_width,D,R", [("head", 64, 64), ("head", 64, 16), ("row", 64, 32), ("head", 96, 96),
                                            ("head", 96, 40)])
def test_layer_norm_kernels_match_the_reference(norm_width, D, R, dtype):
    """The Triton kernels (interpreter) against the reference: outputs within the rounding budget,
    gradients of q, k, the weights and the biases within fp32 summation order (per-head and whole-row
    LayerNorms, full and partial rotary, pass-through blocks of 48 = 32 + 16 columns; tiles with
    masked-off lanes, which the centring must leave out: D = 96 rotated whole (halves of 48 in tiles of
    64), and R = 40 (a pass-through of 56 = 32 + 24 in blocks of 32))."""
    from normfuse.kernels import triton_rope
    from normfuse.kernels.specs import QkNorm, QkNormRopeBackwardCall, QkNormRopeCall, QkRounding, QkRows, Rope

    q, k, _, angles = ln_case(dtype, B=2, S=3, D=D)
    wq, bq, wk, bk = (weights(x.shape[2] * D if norm_width == "row" else D, dtype, seed=seed, mean=mean)[0]
                      for x in (q, k) for seed, mean in ((2, 1.0), (3, 0.0)))
    a = angles[:, :R // 2]
    cos, sin = (t[None, :, None] for t in (torch.cat((a, a), -1).cos(), torch.cat((a, a), -1).sin()))
    rope = Rope(cos, sin, "neox", R)
    norm = QkNorm(EPS, 0.0, norm_width == "row", "layer_norm")
    rounding = QkRounding(None, dtype, FP32, dtype)
    call = QkNormRopeCall(QkRows(q, wq, bias=bq), QkRows(k, wk, bias=bk), rope, norm, rounding, False)
    with torch.no_grad():
        got, want = triton_rope.qk_norm_rope_fwd(call), qk_norm_rope_fwd_ref(call)
    for name, g, w in zip(("q_out", "k_out", "q_rstd", "k_rstd"), got, want):
        assert_within_rounding_budget(g, w, name)
    gen = torch.Generator().manual_seed(9)
    dq, dk = (torch.randn(x.shape, generator=gen).to(dtype) for x in (q, k))
    back = QkNormRopeBackwardCall(QkRows(q, wq, dq, want[2], bq), QkRows(k, wk, dk, want[3], bk), rope, norm)
    got, want = triton_rope.qk_norm_rope_bwd(back), qk_norm_rope_bwd_ref(back)
    for name, g, w in zip(("dq", "dk", "dq_weight", "dk_weight", "dq_bias", "dk_bias"), got, want):
        tol = 1e-4 if dtype == FP32 else 2e-2
        assert torch.allclose(g.float(), w.float(), rtol=tol, atol=tol), \
            f"{name}: {(g.float() - w.float()).abs().max():.3g}"


# ---- bad input -----------------------------------------------------------------------------------

def _bad(**change):
    q, k = qk(2, 3, 4, 2, 64, BF16)
    (wq, wk), (cos, sin) = weights(64, BF16), hf_tables(2, 3, 64, BF16)
    args = dict(q=q, k=k, q_weight=wq, k_weight=wk, cos=cos, sin=sin, eps=EPS)
    args.update(change)
    return args


@pytest.mark.parametrize("change,error,words", [
    (dict(q=torch.zeros(2, 3, 256)), ShapeMismatchError, "(batch, seq, heads, head_dim)"),
    (dict(k=torch.zeros(2, 3, 2, 32, dtype=BF16)), ShapeMismatchError, "(B, S, Hk, D) = (2, 3, Hk, 64)"),
    (dict(q_weight=torch.ones(32)), ShapeMismatchError, "must have shape (64,)"),
    (dict(q_weight=torch.ones(64), norm_width="row"), ShapeMismatchError, "heads * head_dim = 256"),
    (dict(rotary_dim=33), ShapeMismatchError, "must be even"),
    (dict(rotary_dim=128), ShapeMismatchError, "head_dim = 64"),
    (dict(cos=torch.ones(2, 4, 64), sin=torch.ones(2, 4, 64)), ShapeMismatchError, "broadcast to (B, S, 1, R)"),
    (dict(cos=torch.ones(2, 3, 64), sin=torch.ones(2, 3, 32)), ShapeMismatchError, "must match"),
    (dict(q=torch.zeros(2, 3, 4, 64, dtype=torch.int32)), UnsupportedDtypeError, "q.to(torch.bfloat16)"),
    (dict(k_weight=torch.ones(64, dtype=torch.int8)), UnsupportedDtypeError, "k_weight"),
    (dict(layout="neo-x"), InvalidOptionError, "Did you mean 'neox'?"),
    (dict(norm_width="heads"), InvalidOptionError, "Did you mean 'head'?"),
    (dict(eps=-1.0), InvalidOptionError, "eps=-1.0"),
    (dict(rope_dtype=torch.int8), UnsupportedDtypeError, "rope_dtype"),
    (dict(cos=None), InvalidOptionError, "cos must be a tensor"),
    (dict(kind="layernorm"), InvalidOptionError, "Did you mean 'layer_norm'?"),
    (dict(q_bias=torch.zeros(64)), InvalidOptionError, "pass kind=\"layer_norm\""),
    (dict(kind="layer_norm", k_bias=torch.zeros(32)), ShapeMismatchError, "k_bias has shape (32,)"),
])
def test_bad_arguments(change, error, words):
    with pytest.raises(error) as info:
        qk_norm_rope(**_bad(**change))
    assert isinstance(info.value, NormfuseError) and words in str(info.value)


# ---- ops: opcheck, compile -------------------------------------------------------------------------

def _op_samples():
    q, k = (t.requires_grad_() for t in qk(2, 3, 4, 2, 64, BF16))
    wq, wk = (w.requires_grad_() for w in weights(64, FP32))
    cos, sin = (t.unsqueeze(2) for t in hf_tables(2, 3, 32, BF16))
    yield "fwd", (q, k, wq, wk, cos, sin, EPS, 0.0, BF16, FP32, FP32, BF16, "neox", 32, False, True)
    yield "fwd_q_only", (q, None, None, None, cos[..., :16], sin[..., :16], EPS, 1.0, None, BF16, BF16, BF16, "gptj",
                         32, False, False)
    w_row = weights(4 * 64, BF16)[0].requires_grad_()
    yield "fwd_row", (q, None, w_row, None, cos[:1], sin[:1], EPS, 0.0, None, BF16, FP32, BF16, "neox", 32, True,
                      False)
    dq, dk = qk(2, 3, 4, 2, 64, BF16, seed=3)
    rstd_q, rstd_k = torch.rand(24) + 0.5, torch.rand(12) + 0.5
    yield "bwd", (dq.transpose(1, 2).contiguous().transpose(1, 2), dk, q.detach(), k.detach(), wq.detach(),
                  wk.detach(), cos, sin, rstd_q, rstd_k, 0.0, "neox", 32, False)
    bq, bk = (b.requires_grad_() for b in weights(64, FP32, seed=4, mean=0.0))
    yield "fwd_layer", (q, k, wq, wk, cos, sin, EPS, 0.0, None, BF16, FP32, BF16, "gptj", 32, False, True, bq, bk,
                        "layer_norm")
    yield "bwd_layer", (dq, dk, q.detach(), k.detach(), wq.detach(), wk.detach(), cos, sin, rstd_q, rstd_k, 0.0,
                        "gptj", 32, False, bq.detach(), bk.detach(), "layer_norm")


@pytest.mark.parametrize("name,args", list(_op_samples()), ids=lambda v: v if isinstance(v, str) else "")
def test_opcheck(path, name, args):
    op = torch.ops.normfuse.qk_norm_rope_bwd if name.startswith("bwd") else torch.ops.normfuse.qk_norm_rope_fwd
    torch.library.opcheck(op.default, args)


@pytest.mark.usefixtures("fresh_dynamo")
def test_compile_fullgraph_matches_eager():
    """Traced calls keep one custom op; forward and grads equal the eager path's."""
    q, k, wq, wk, cos, sin, _ = case("qwen3", BF16)

    def attn_inputs(q, k, wq, wk):
        qo, ko = qk_norm_rope(q, k, wq, wk, cos, sin, eps=EPS, norm_round_dtype=BF16, transpose_out=True)
        return qo.float().square().sum() + ko.float().sin().sum()

    runs = []
    for fn in (attn_inputs, torch.compile(attn_inputs, fullgraph=True, backend="aot_eager")):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, wq, wk)]
        loss = fn(*leaves)
        loss.backward()
        runs.append([loss] + [t.grad for t in leaves])
    for eager, compiled in zip(*runs):
        assert torch.equal(eager, compiled)


# ---- the Triton kernels against the reference ----------------------------------------------------
# Grid pruned to run in about a minute under the interpreter: one batch of 3 positions, GQA (4 query
# heads, 2 key heads); head_dim 64, 128, 256 with R = D, D / 2, D / 4 in both layouts and all dtypes.

def _tables(S, R, dtype, seed=4):
    gen = torch.Generator().manual_seed(seed)
    angles = torch.rand(1, S, R, generator=gen) * 6.3
    return angles.cos().to(dtype), angles.sin().to(dtype)


@pytest.mark.usefixtures("triton_cpu")
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("layout", ("neox", "gptj"))
@pytest.mark.parametrize("D,R", [(64, 64), (128, 64), (256, 64)], ids=("D64-R64", "D128-R64", "D256-R64"))
def test_triton_forward_equals_reference(D, R, layout, dtype):
    q, k = qk(1, 3, 4, 2, D, dtype)
    wq, wk = weights(D, dtype)
    cos, sin = _tables(3, R, dtype)
    opts = dict(eps=EPS, norm_round_dtype=dtype if dtype != FP32 else None, layout=layout, transpose_out=D == 128)
    got = qk_norm_rope(q, k, wq, wk, cos, sin, **opts)
    want = qk_norm_rope_ref(q, k, wq, wk, cos, sin, **opts)
    for name, g, w in zip(("q", "k"), got, want):
        assert_within_rounding_budget(g, w, f"{name}")
        assert torch.isfinite(g).all(), name
    if R < D:  # the pass-through columns: the norm output itself (no NaN, no garbage)
        y = normalize(q, wq, None, "rms_norm", EPS, 0.0, opts["norm_round_dtype"], dtype)[0]
        y = y.transpose(1, 2) if opts["transpose_out"] else y
        assert_within_rounding_budget(got[0][..., R:], y[..., R:].contiguous(), "pass-through")


@pytest.mark.usefixtures("triton_cpu")
@pytest.mark.parametrize("layout,R", [("neox", 32), ("gptj", 64)])
def test_triton_whole_row_norm(layout, R):
    """OLMo 2's norm over all heads of a position, with partial rotary and the GPT-J pairing too."""
    q, k = qk(1, 3, 4, 2, 64, BF16)
    wq, wk = weights(4 * 64, BF16)[0], weights(2 * 64, BF16)[1]
    cos, sin = _tables(3, R, FP32)
    opts = dict(eps=EPS, norm_width="row", layout=layout, out_dtype=BF16)
    for g, w in zip(qk_norm_rope(q, k, wq, wk, cos, sin, **opts), qk_norm_rope_ref(q, k, wq, wk, cos, sin, **opts)):
        assert_within_rounding_budget(g, w, layout)


@pytest.mark.usefixtures("triton_cpu")
def test_triton_strided_inputs_and_tables():
    """q and k as views of one fused qkv projection (rows strided), cos/sin as the real and imaginary
    parts of a complex table (columns strided by 2): the kernel reads them in place."""
    B, S, H, Hk, D = 1, 3, 4, 2, 64
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(B, S, (H + 2 * Hk) * D, generator=gen).to(BF16)
    q, k = qkv[..., :H * D].view(B, S, H, D), qkv[..., H * D:(H + Hk) * D].view(B, S, Hk, D)
    freqs_cis = torch.polar(torch.ones(S, D // 2), torch.rand(S, D // 2, generator=gen) * 6).view(1, S, 1, D // 2)
    wq, wk = weights(D, BF16)
    opts = dict(eps=EPS, layout="gptj", rotary_dim=D, out_dtype=BF16)
    got = qk_norm_rope(q, k, wq, wk, freqs_cis.real, freqs_cis.imag, **opts)
    want = qk_norm_rope_ref(q.contiguous(), k.contiguous(), wq, wk, freqs_cis.real.contiguous(),
                            freqs_cis.imag.contiguous(), **opts)
    for g, w in zip(got, want):
        assert_within_rounding_budget(g, w)


def test_q_alone_and_no_weights(path):
    q, k, wq, wk, cos, sin, _ = case("qwen3", BF16, B=1, S=3)
    with torch.no_grad():
        q_out, k_out = qk_norm_rope(q, None, None, None, cos, sin, eps=EPS)
        want = qk_norm_rope_ref(q, None, None, None, cos, sin, eps=EPS)[0]
        pair = qk_norm_rope(q, k, None, None, cos, sin, eps=EPS)[0]
    assert k_out is None and q_out.shape == q.shape
    assert_same(path, q_out, want, "q alone")
    assert torch.equal(q_out, pair)


def _grads_three_way(q, k, wq, wk, cos, sin, opts, dtype, seed=5):
    """Grads of the op (this path) against the formula in fp64 (qk_rule), with that formula composed
    in fp32 and rounded to the op's output dtype as the baseline."""
    gen = torch.Generator().manual_seed(seed)
    shape = (lambda x: x.transpose(1, 2).shape) if opts.get("transpose_out") else (lambda x: x.shape)
    cot = [torch.randn(shape(x), generator=gen, dtype=FP64) for x in (q, k)]
    got = _run(lambda *a: qk_norm_rope(*a, cos, sin, **opts), (q, k, wq, wk), cot)
    base = _run(lambda *a: qk_rule(*a, cos, sin, **dict(opts, acc=FP32, round_to=dtype)), (q, k, wq, wk), cot)
    exact = _run(lambda *a: qk_rule(*a, cos, sin, **opts), tuple(t.double() for t in (q, k, wq, wk)), cot)
    for what, g, b, e in zip(("q_out", "k_out", "dq", "dk", "dq_weight", "dk_weight"), got, base, exact):
        assert g.dtype == b.dtype, what
        ok, err, err_base, bound = within_tolerance(g, b, e, dtype=g.dtype)
        assert ok, f"{what}: error {err:.3g} > bound {bound:.3g} (reference's {err_base:.3g})"


@pytest.mark.parametrize("layout,D,R,table", [("gptj", 64, 64, "half"), ("neox", 256, 64, "full"),
                                              ("gptj", 128, 64, "full")])
def test_grads_layouts_and_partial_rotary(path, layout, D, R, table):
    """The transposed rotation in the backward: both pairings, half tables, R = D / 4 and D / 2."""
    q, k = qk(1, 3, 4, 2, D, BF16)
    wq, wk = weights(D, FP32)
    cos, sin = _tables(3, R // 2 if table == "half" else R, FP32)
    opts = dict(eps=EPS, layout=layout, rotary_dim=R, out_dtype=BF16, transpose_out=layout == "neox")
    _grads_three_way(q, k, wq, wk, cos, sin, opts, BF16)


def test_q_and_k_of_other_norm_dtypes(path):
    """q's weight in fp32 and k's in bf16 with Qwen3's rounding: the norm outputs (and so the RoPE
    dtypes) differ between q and k, which then run as two calls, each as the model computes it."""
    q, k, _, _, cos, sin, _ = case("qwen3", BF16, B=1, S=3)
    wq, wk = weights(64, FP32)[0], weights(64, BF16)[1]
    with torch.no_grad():
        got = qk_norm_rope(q, k, wq, wk, cos, sin, eps=EPS, norm_round_dtype=BF16, transpose_out=True)
        want = hf("qwen3", q, k, wq, wk, cos, sin)
    assert got[0].dtype == FP32 and got[1].dtype == BF16
    for name, g, w in zip(("q", "k"), got, want):
        assert_same(path, g, w.contiguous(), name)


def test_no_positions(path):
    """An empty sequence: empty outputs, and zero weight grads."""
    q, k = qk(2, 0, 4, 2, 64, BF16)
    wq, wk = (w.requires_grad_() for w in weights(64, BF16))
    cos, sin = hf_tables(2, 0, 64, BF16)
    q_out, k_out = qk_norm_rope(q, k, wq, wk, cos, sin, eps=EPS, transpose_out=True)
    assert q_out.shape == (2, 4, 0, 64) and k_out.shape == (2, 2, 0, 64)
    (q_out.float().sum() + k_out.float().sum()).backward()
    assert torch.equal(wq.grad, torch.zeros_like(wq)) and torch.equal(wk.grad, torch.zeros_like(wk))


def test_static_compile_report_toy(tmp_path):
    """The kernels compile for sm90 (the interpreter accepts code the compiler rejects, e.g. a constexpr
    branch returning early), without spills, the forward reading q and writing q_out once per element
    (benchmarks/bench_static_rope.py --toy: both layouts, head and row norms, forward and backward, and
    a LayerNorm's each way)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton")
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_static_rope.py"
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "NORMFUSE_TRITON_CPU")}
    proc = subprocess.run([sys.executable, str(script), "--toy", "--out", str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "static_rope.json").read_text())
    verdict = report["verdict"]
    assert verdict["kernels_compiled"] == 10 and verdict["no_spills"], verdict
    assert verdict["forward_reads_q_once_writes_once"], verdict
    assert all(0 < r["regs"] <= 255 for r in report["rows"])
