"""add_norm's modulation epilogue (diffusion transformers' adaLN: ``norm(s) * (1 + scale) + shift``).

* Forward: bit-equal to the blocks' own eager ops, spelled as diffusers spells them, in fp32, bf16
  and fp16: DiT/Flux (LayerNorm without affine, then the 16-bit product and sum, each rounded),
  ``addcmul`` (one rounding), Wan (``(norm(x.float()) * (1 + scale) + shift).type_as(x)``: fp32
  steps, rounded once), scale only, shift only; scale and shift per sample ((B, 1, N): one value per
  sample and column, read through a broadcast) or per token ((B, S, N)); with the residual add.
* Backward: dx, dresidual, dscale, dshift (summed over the tokens a per-sample value covers) and the
  norm's parameters against eager autograd, held to the tolerance rule against the same ops in fp64.
* The op: opcheck with the modulation arguments; a bad scale shape or a combination not taken
  raises, naming the fix.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import normfuse
from normfuse.errors import InvalidOptionError, ShapeMismatchError
from normfuse.kernels import Modulation
from normfuse.kernels.add_norm import add_norm
from normfuse.tolerances import within_tolerance

BF16, FP16, FP32, FP64 = torch.bfloat16, torch.float16, torch.float32, torch.float64
B, S, N = 2, 5, 48


def _tensors(dtype, per_token=False, scale_dtype=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x, r = (torch.randn(B, S, N, generator=gen).to(dtype) for _ in range(2))
    shape = (B, S, N) if per_token else (B, 1, N)
    scale, shift = ((torch.randn(*shape, generator=gen) * 0.5).to(scale_dtype or dtype) for _ in range(2))
    w, b = (torch.randn(N, generator=gen).to(dtype) for _ in range(2))
    return dict(x=x, r=r, scale=scale, shift=shift, w=w, b=b)


# ---- the blocks as diffusers writes them, and the add_norm call that stands for each ------------

def eager(form, t, kind="layer_norm"):
    """(modulated output, sum): the block's own ops."""
    s = t["x"] + t["r"]
    norm = (lambda v: F.layer_norm(v, (N,), None, None, 1e-6)) if kind == "layer_norm" else \
        (lambda v: F.rms_norm(v, (N,), t["w"], 1e-6))
    if form == "dit":          # norm(x) * (1 + scale[:, None]) + shift[:, None]
        out = norm(s) * (1 + t["scale"]) + t["shift"]
    elif form == "scale_first":  # (1 + scale) * n + shift
        out = (1 + t["scale"]) * norm(s) + t["shift"]
    elif form == "addcmul":    # torch.addcmul(shift, n, 1 + scale): one rounding
        out = torch.addcmul(t["shift"], norm(s), 1 + t["scale"])
    elif form == "wan":        # (norm(x.float()) * (1 + scale) + shift).type_as(x), scale and shift in fp32
        out = (norm(s.float()) * (1 + t["scale"]) + t["shift"]).type_as(s)
    elif form == "scale_only":  # x-transformers' adaptive norms
        out = norm(s) * (1 + t["scale"])
    else:                      # "shift_only"
        out = norm(s) + t["shift"]
    return out, s


def ours(form, t, kind="layer_norm"):
    scale = None if form == "shift_only" else 1 + t["scale"]
    shift = None if form == "scale_only" else t["shift"]
    weight = None if kind == "layer_norm" else t["w"]
    x, r = t["x"], t["r"]
    if form == "wan":
        # the norm of the fp32 sum (x.float()), the modulation's steps in fp32, one rounding to x's dtype
        mod = Modulation(scale, shift, out_dtype=x.dtype)
        return add_norm(x, r, weight, None, kind=kind, eps=1e-6, out_dtype=FP32, modulation=mod)
    mod = Modulation(scale, shift, fused=form == "addcmul")
    return add_norm(x, r, weight, None, kind=kind, eps=1e-6, modulation=mod)


FORMS = ("dit", "scale_first", "addcmul", "wan", "scale_only", "shift_only")


@pytest.mark.parametrize("per_token", (False, True), ids=("per_sample", "per_token"))
@pytest.mark.parametrize("kind", ("layer_norm", "rms_norm"))
@pytest.mark.parametrize("dtype", (FP32, BF16, FP16), ids=("fp32", "bf16", "fp16"))
@pytest.mark.parametrize("form", FORMS)
def test_forward_equals_the_blocks_ops(form, dtype, kind, per_token):
    t = _tensors(dtype, per_token, scale_dtype=FP32 if form == "wan" else None)
    got, got_s = ours(form, t, kind)
    want, want_s = eager(form, t, kind)
    assert got.dtype == want.dtype and torch.equal(got, want), (got - want).abs().max()
    assert torch.equal(got_s, want_s)


def test_the_custom_op_computes_the_same():
    """The op itself (what rewritten graphs call), and through torch.compile."""
    t = _tensors(BF16)
    want, _ = eager("dit", t)
    y, s, _, _, _ = torch.ops.normfuse.add_norm_fwd(
        t["x"], t["r"], None, None, "layer_norm", 1e-6, 0.0, 1.0, BF16, None, BF16, True, True, None, None, None,
        None, 0.0, None, None, "before", "silu", None, None, 1 + t["scale"], t["shift"], None, False, None)
    assert torch.equal(y, want)
    compiled = torch.compile(lambda a: ours("dit", a), backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(t)[0], want)


def _assert_within(got, want, exact, what: str = "") -> None:
    """got has want's (eager's) dtype and shape and is within the project's rule against want and the
    fp64 ``exact`` (normfuse.tolerances)."""
    assert got.dtype == want.dtype and got.shape == want.shape, what
    ok, err, err_base, bound = within_tolerance(got.detach(), want.detach(), exact.detach(), dtype=got.dtype)
    assert ok, f"{what}error {err:.3g} > bound {bound:.3g} (eager's {err_base:.3g})"


def _assert_grads_within(got: dict, base: dict, exact: dict) -> None:
    """Each gradient of ``got`` (by input name) within the rule against eager's and the fp64 one."""
    for name in got:
        _assert_within(got[name], base[name], exact[name], f"d{name}: ")


def _grads(fn, t, names, cot):
    leaves = {k: v.detach().clone().requires_grad_(k in names) for k, v in t.items()}
    out, s = fn(leaves)
    loss = (out.double() * cot[0]).sum() + (s.double() * cot[1]).sum()
    return dict(zip(names, torch.autograd.grad(loss, [leaves[k] for k in names])))


@pytest.mark.parametrize("per_token", (False, True), ids=("per_sample", "per_token"))
@pytest.mark.parametrize("kind", ("layer_norm", "rms_norm"))
@pytest.mark.parametrize("dtype", (FP32, BF16), ids=("fp32", "bf16"))
@pytest.mark.parametrize("form", ("dit", "addcmul", "wan", "scale_only", "shift_only"))
def test_gradients_vs_fp64(form, dtype, kind, per_token):
    t = _tensors(dtype, per_token, scale_dtype=FP32 if form == "wan" else None, seed=3)
    gen = torch.Generator().manual_seed(9)
    cot = [torch.randn(B, S, N, generator=gen, dtype=FP64) for _ in range(2)]
    names = ["x", "r"] + (["scale"] if form != "shift_only" else []) + (["shift"] if form != "scale_only" else []) \
        + (["w"] if kind == "rms_norm" else [])
    got = _grads(lambda a: ours(form, a, kind), t, names, cot)
    base = _grads(lambda a: eager(form, a, kind), t, names, cot)
    exact = _grads(lambda a: eager(form, a, kind), {k: v.double() for k, v in t.items()}, names, cot)
    _assert_grads_within(got, base, exact)


def test_fp64_gradcheck():
    t = {k: v.double() for k, v in _tensors(FP64).items()}

    def fn(x, r, scale, shift, w):
        return add_norm(x, r, w, None, kind="rms_norm", eps=1e-6, modulation=Modulation(scale, shift))

    args = tuple(t[k].requires_grad_() for k in ("x", "r", "scale", "shift", "w"))
    assert torch.autograd.gradcheck(fn, args)


def test_opcheck():
    t = {k: v.requires_grad_() for k, v in _tensors(FP32).items()}
    args = (t["x"], t["r"], t["w"], None, "rms_norm", 1e-6, 0.0, 1.0, FP32, None, FP32, True, True, None, None,
            None, None, 0.0, None, None, "before", "silu", None, None, t["scale"], t["shift"], None, False, None)
    torch.library.opcheck(torch.ops.normfuse.add_norm_fwd.default, args)


@pytest.mark.parametrize("kwargs,error,words", [
    (dict(modulation=Modulation(torch.ones(B, 2, N), None)), ShapeMismatchError, "must broadcast to x's shape"),
    (dict(modulation=Modulation(None, None)), InvalidOptionError, "modulates nothing"),
    (dict(modulation=Modulation(torch.ones(B, 1, N)), weight1=torch.ones(N)), InvalidOptionError,
     "cannot be combined"),
])
def test_bad_arguments(kwargs, error, words):
    x = torch.randn(B, S, N)
    with pytest.raises(error, match=words):
        add_norm(x, x, None, None, kind="layer_norm", eps=1e-6, **kwargs)


def test_exported_names():
    assert normfuse.Modulation is Modulation


# ---- the gated residual branch: s = residual + gate * x ------------------------------------------

def dit_block(t, per_token=False):
    """Flux's/DiT's block tail: hidden + gate.unsqueeze(1) * attn_out, norm2, modulation."""
    s = t["r"] + t["gate"] * t["x"]
    n = F.layer_norm(s, (N,), None, None, 1e-6)
    return n * (1 + t["scale"]) + t["shift"], s


def dit_ours(t):
    return add_norm(t["x"], t["r"], None, None, kind="layer_norm", eps=1e-6, x_gate=t["gate"],
                    modulation=Modulation(1 + t["scale"], t["shift"]))


def _gated(dtype, per_token=False, seed=0):
    t = _tensors(dtype, per_token, seed=seed)
    gen = torch.Generator().manual_seed(seed + 100)
    t["gate"] = torch.randn(*t["scale"].shape, generator=gen).to(dtype)
    return t


BACKENDS = pytest.mark.parametrize("backend", ("reference", "triton"))


def _on(backend, request, monkeypatch=None):
    """Run the ops on ``backend``: the Triton kernels under the interpreter (with ``monkeypatch``: the
    kernels take the whole call, ``_kernels_take_it_all``), or the reference."""
    if backend == "triton":
        request.getfixturevalue("triton_cpu")
        if monkeypatch is not None:
            _kernels_take_it_all(monkeypatch)


@BACKENDS
@pytest.mark.parametrize("kind", ("layer_norm", "rms_norm"))
@pytest.mark.parametrize("form", FORMS)
def test_each_form_on_each_backend_bf16(form, kind, backend, request):
    """The Triton path (the add and the norm in the kernels, the modulation around them) gives the
    block's bits as the reference does."""
    _on(backend, request)
    t = _tensors(BF16, per_token=form == "dit")
    (got, got_s), (want, want_s) = ours(form, t, kind), eager(form, t, kind)
    assert torch.equal(got, want) and torch.equal(got_s, want_s)


@BACKENDS
@pytest.mark.parametrize("per_token", (False, True), ids=("per_sample", "per_token"))
@pytest.mark.parametrize("dtype", (FP32, BF16, FP16), ids=("fp32", "bf16", "fp16"))
def test_gated_branch_and_modulation_equal_the_block(dtype, per_token, backend, request):
    """Bit-equal on the reference; the Triton kernels' fp32 reductions run in another order than
    eager's, so there each output is held to the tolerance rule against the block in fp64."""
    _on(backend, request)
    t = _gated(dtype, per_token)
    got, want = dit_ours(t), dit_block(t)
    if backend == "reference":
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        return
    exact = dit_block({k: v.double() for k, v in t.items()})
    for a, b, e in zip(got, want, exact):
        _assert_within(a, b, e)


@BACKENDS
@pytest.mark.parametrize("per_token", (False, True), ids=("per_sample", "per_token"))
@pytest.mark.parametrize("dtype", (FP32, BF16), ids=("fp32", "bf16"))
def test_gated_branch_gradients_vs_fp64(dtype, per_token, backend, request):
    _on(backend, request)
    t = _gated(dtype, per_token, seed=5)
    gen = torch.Generator().manual_seed(11)
    cot = [torch.randn(B, S, N, generator=gen, dtype=FP64) for _ in range(2)]
    names = ["x", "r", "gate", "scale", "shift"]
    got = _grads(dit_ours, t, names, cot)
    base = _grads(dit_block, t, names, cot)
    exact = _grads(dit_block, {k: v.double() for k, v in t.items()}, names, cot)
    _assert_grads_within(got, base, exact)


def test_gated_branch_without_a_stored_sum():
    """return_sum=False: the backward rebuilds the norm input from x, the gate and the residual."""
    t = _gated(FP32, seed=2)
    leaves = {k: v.clone().requires_grad_() for k, v in t.items()}
    y, s = add_norm(leaves["x"], leaves["r"], None, None, kind="layer_norm", eps=1e-6, x_gate=leaves["gate"],
                    return_sum=False)
    assert s is None
    y.sum().backward()
    ref = {k: v.clone().requires_grad_() for k, v in t.items()}
    F.layer_norm(ref["r"] + ref["gate"] * ref["x"], (N,), None, None, 1e-6).sum().backward()
    for name in ("x", "r", "gate"):
        torch.testing.assert_close(leaves[name].grad, ref[name].grad)


def test_gated_branch_gradcheck():
    t = {k: v.double() for k, v in _gated(FP64).items()}

    def fn(x, r, gate, scale, shift):
        return add_norm(x, r, None, None, kind="layer_norm", eps=1e-6, x_gate=gate,
                        modulation=Modulation(scale, shift))

    assert torch.autograd.gradcheck(fn, tuple(t[k].requires_grad_() for k in ("x", "r", "gate", "scale", "shift")))


def test_gated_branch_opcheck():
    t = {k: v.requires_grad_() for k, v in _gated(FP32).items()}
    args = (t["x"], t["r"], None, None, "layer_norm", 1e-6, 0.0, 1.0, FP32, None, FP32, True, True, None, None,
            None, None, 0.0, None, None, "before", "silu", None, None, t["scale"], t["shift"], None, False, None,
            t["gate"])
    torch.library.opcheck(torch.ops.normfuse.add_norm_fwd.default, args)


@pytest.mark.parametrize("kwargs,error,words", [
    (dict(x_gate=torch.ones(B, 2, N)), ShapeMismatchError, "must broadcast to x's shape"),
    (dict(x_gate=torch.ones(B, 1, N), rowscale=torch.ones(B, S)), InvalidOptionError, "cannot be combined"),
    (dict(x_gate=torch.ones(B, 1, N), x1=torch.ones(B, S, N, dtype=torch.bfloat16)), InvalidOptionError,
     "x1 must have the product's dtype"),
    (dict(x_gate=torch.ones(B, 1, N, dtype=torch.int32)), normfuse.errors.UnsupportedDtypeError, "Cast it first"),
])
def test_gated_branch_bad_arguments(kwargs, error, words):
    x = torch.randn(B, S, N)
    with pytest.raises(error, match=words):
        add_norm(x, x, None, None, kind="layer_norm", eps=1e-6, **kwargs)


def two_gated_branches(t):
    """SD3.5's dual-attention block: the first attention's gated branch summed with the stream, then the
    second's, then norm2 and its modulation."""
    s = (t["r"] + t["gate"] * t["x"]) + t["gate2"] * t["x2"]
    return F.layer_norm(s, (N,), None, None, 1e-6) * (1 + t["scale"]) + t["shift"], s


def two_gated_branches_ours(t):
    """The call gates x, adds the stream as x1, then adds the second gated branch, formed before it, as its
    residual: ``(gate * x + x1) + residual``, each step rounded where the block rounds."""
    return add_norm(t["x"], t["gate2"] * t["x2"], None, None, kind="layer_norm", eps=1e-6, x_gate=t["gate"],
                    x1=t["r"], modulation=Modulation(1 + t["scale"], t["shift"]))


def _two_gated(dtype, per_token=False, seed=0):
    t = _gated(dtype, per_token, seed)
    gen = torch.Generator().manual_seed(seed + 200)
    t["x2"] = torch.randn(B, S, N, generator=gen).to(dtype)
    t["gate2"] = torch.randn(*t["gate"].shape, generator=gen).to(dtype)
    return t


@BACKENDS
@pytest.mark.parametrize("per_token", (False, True), ids=("per_sample", "per_token"))
@pytest.mark.parametrize("dtype", (FP32, BF16), ids=("fp32", "bf16"))
def test_a_gated_branch_with_a_second_branch(dtype, per_token, backend, request, monkeypatch):
    """x_gate with x1: the sum ``round(round(gate * x) + x1)`` then the residual, as the block's two adds
    (bit-equal on the reference; the Triton kernels take all of it, their reductions held to the rule);
    gradients within the rule against fp64."""
    _on(backend, request, monkeypatch)
    t = _two_gated(dtype, per_token)
    got, want = two_gated_branches_ours(t), two_gated_branches(t)
    exact = two_gated_branches({k: v.double() for k, v in t.items()})
    assert torch.equal(got[1], want[1])
    for a, b, e in zip(got, want, exact):
        if backend == "reference":
            assert torch.equal(a, b)
        _assert_within(a, b, e)
    gen = torch.Generator().manual_seed(11)
    cot = [torch.randn(B, S, N, generator=gen, dtype=FP64) for _ in range(2)]
    names = ["x", "r", "gate", "x2", "gate2", "scale", "shift"]
    _assert_grads_within(_grads(two_gated_branches_ours, t, names, cot), _grads(two_gated_branches, t, names, cot),
                         _grads(two_gated_branches, {k: v.double() for k, v in t.items()}, names, cot))


# ---- the modulation as the kernels' epilogue (Triton) ---------------------------------------------

def _kernels_take_it_all(monkeypatch):
    """Fail the test where a gated branch or a modulation runs around the kernels."""
    from normfuse.kernels import triton as kernels

    part = kernels._kernel_part

    def strict(call):
        got = part(call)
        if got is not None:
            pytest.fail("the gated branch or the modulation ran around the kernels")
        return got
    monkeypatch.setattr(kernels, "_kernel_part", strict)


@pytest.mark.parametrize("per_token", (False, True), ids=("per_sample", "per_token"))
@pytest.mark.parametrize("dtype", (FP32, BF16, FP16), ids=("fp32", "bf16", "fp16"))
@pytest.mark.parametrize("form", FORMS)
def test_the_kernels_modulate_in_their_epilogue(form, dtype, per_token, triton_cpu, monkeypatch):
    """Without a gated branch the Triton kernels modulate y as they store it (no pass around them):
    within the rule against the block in fp64, and bf16 bit-equal to the block."""
    _kernels_take_it_all(monkeypatch)
    t = _tensors(dtype, per_token, scale_dtype=FP32 if form == "wan" else None, seed=1)
    got, want = ours(form, t, "rms_norm"), eager(form, t, "rms_norm")
    if dtype == BF16:
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    exact = eager(form, {k: v.double() for k, v in t.items()}, "rms_norm")
    for a, b, e in zip(got, want, exact):
        _assert_within(a, b, e)


def test_the_kernels_read_chunks_of_the_embedding_in_place(triton_cpu, monkeypatch):
    """scale and shift as DiT takes them, ``emb.chunk(6, dim=-1)`` pieces viewed per sample: the kernels
    read them through their strides (no copy), per token as well, and a looped (wide) row too."""
    from normfuse.kernels.triton import broadcast_operand

    _kernels_take_it_all(monkeypatch)
    gen = torch.Generator().manual_seed(2)
    for n in (N, 20000):
        x, r = (torch.randn(B, S, n, generator=gen).to(BF16) for _ in range(2))
        emb = torch.randn(B, 6 * n, generator=gen).to(BF16)
        shift, scale = (c[:, None] for c in emb.chunk(6, dim=-1)[:2])
        assert broadcast_operand(scale, x)[1:] == (6 * n, S, 0)  # (outer stride, period, inner stride)
        got = add_norm(x, r, None, None, kind="layer_norm", eps=1e-6, modulation=Modulation(1 + scale, shift))[0]
        n_ = F.layer_norm(x + r, (n,), None, None, 1e-6)
        assert torch.equal(got, n_ * (1 + scale) + shift)


@pytest.mark.parametrize("form", ("dit", "addcmul", "wan", "scale_only", "shift_only"))
def test_gradients_through_the_kernels_epilogue(form, triton_cpu):
    t = _tensors(BF16, True, scale_dtype=FP32 if form == "wan" else None, seed=3)
    gen = torch.Generator().manual_seed(9)
    cot = [torch.randn(B, S, N, generator=gen, dtype=FP64) for _ in range(2)]
    names = ["x", "r", "w"] + (["scale"] if form != "shift_only" else []) + (["shift"] if form != "scale_only" else [])
    got = _grads(lambda a: ours(form, a, "rms_norm"), t, names, cot)
    base = _grads(lambda a: eager(form, a, "rms_norm"), t, names, cot)
    exact = _grads(lambda a: eager(form, a, "rms_norm"), {k: v.double() for k, v in t.items()}, names, cot)
    _assert_grads_within(got, base, exact)


def test_the_kernels_take_the_gated_branch_and_the_modulation(triton_cpu, monkeypatch):
    """DiT's block tail with its gate, scale and shift as ``emb.chunk(6)`` pieces: the kernels read the
    gate as their prologue and modulate as their epilogue, nothing runs around them; bf16 bit-equal
    to the block, a wide (looped) row too."""
    _kernels_take_it_all(monkeypatch)
    gen = torch.Generator().manual_seed(4)
    for n in (N, 20000):
        x, r = (torch.randn(B, S, n, generator=gen).to(BF16) for _ in range(2))
        shift, scale, gate = (c[:, None] for c in torch.randn(B, 6 * n, generator=gen).to(BF16).chunk(6, dim=-1)[:3])
        y, s = add_norm(x, r, None, None, kind="layer_norm", eps=1e-6, x_gate=gate,
                        modulation=Modulation(1 + scale, shift))
        want_s = r + gate * x
        assert torch.equal(s, want_s)
        assert torch.equal(y, F.layer_norm(want_s, (n,), None, None, 1e-6) * (1 + scale) + shift)


# ---- two modulations of one norm (SD3.5's AdaLayerNormZeroX): y and y1 -------------------------

def sd35_block(t):
    """(y, y1, s): one norm without affine, its output modulated twice (attention and the second attention)."""
    s = t["x"] + t["r"]
    n = F.layer_norm(s, s.shape[-1:], None, None, 1e-6)
    return n * (1 + t["scale"]) + t["shift"], n * (1 + t["scale1"]) + t["shift1"], s


def sd35_ours(t):
    mod = Modulation(1 + t["scale"], t["shift"], scale1=1 + t["scale1"], shift1=t["shift1"])
    return add_norm(t["x"], t["r"], None, None, kind="layer_norm", eps=1e-6, modulation=mod)


def _twice(dtype, per_token=False, seed=0, n=N):
    gen = torch.Generator().manual_seed(seed)
    x, r = (torch.randn(B, S, n, generator=gen).to(dtype) for _ in range(2))
    shape = (B, S, n) if per_token else (B, 1, n)
    return dict(x=x, r=r, **{k: (torch.randn(*shape, generator=gen) * 0.5).to(dtype)
                             for k in ("scale", "shift", "scale1", "shift1")})


@BACKENDS
@pytest.mark.parametrize("per_token", (False, True), ids=("per_sample", "per_token"))
@pytest.mark.parametrize("dtype", (FP32, BF16, FP16), ids=("fp32", "bf16", "fp16"))
def test_two_modulations_of_one_norm(dtype, per_token, backend, request, monkeypatch):
    """y and y1 of one call: bit-equal to the block on the reference path and in 16 bits on the
    kernels (which modulate both in their epilogue, nothing around them), within the rule in fp32."""
    _on(backend, request, monkeypatch)
    t = _twice(dtype, per_token)
    got, want = sd35_ours(t), sd35_block(t)
    exact = sd35_block({k: v.double() for k, v in t.items()})
    for a, b, e in zip(got, want, exact):
        assert a.dtype == b.dtype and a.shape == b.shape
        if backend == "reference" or dtype != FP32:
            assert torch.equal(a, b), (a - b).abs().max()
        _assert_within(a, b, e)


def test_two_modulations_on_a_looped_row(triton_cpu, monkeypatch):
    _kernels_take_it_all(monkeypatch)
    t = _twice(BF16, seed=5, n=20000)
    assert all(torch.equal(a, b) for a, b in zip(sd35_ours(t), sd35_block(t)))


@BACKENDS
@pytest.mark.parametrize("dtype", (FP32, BF16), ids=("fp32", "bf16"))
def test_two_modulations_gradients_vs_fp64(dtype, backend, request):
    _on(backend, request)
    t = _twice(dtype, per_token=False, seed=3)
    gen = torch.Generator().manual_seed(9)
    cot = [torch.randn(B, S, N, generator=gen, dtype=FP64) for _ in range(3)]
    names = ["x", "r", "scale", "shift", "scale1", "shift1"]

    def grads(fn, values):
        leaves = {k: v.detach().clone().requires_grad_() for k, v in values.items()}
        loss = sum((o.double() * c).sum() for o, c in zip(fn(leaves), cot))
        return dict(zip(names, torch.autograd.grad(loss, [leaves[k] for k in names])))
    got, base = grads(sd35_ours, t), grads(sd35_block, t)
    exact = grads(sd35_block, {k: v.double() for k, v in t.items()})
    _assert_grads_within(got, base, exact)


def test_two_modulations_opcheck():
    t = {k: v.requires_grad_() for k, v in _twice(FP32).items()}
    args = (t["x"], t["r"], None, None, "layer_norm", 1e-6, 0.0, 1.0, FP32, None, FP32, True, True, None, None,
            None, None, 0.0, None, None, "before", "silu", None, None, t["scale"], t["shift"], None, False, None,
            None, t["scale1"], t["shift1"])
    torch.library.opcheck(torch.ops.normfuse.add_norm_fwd.default, args)


def test_two_modulations_around_the_kernels(triton_cpu):
    """A second scale whose leading dims do not collapse into two strides (a permuted table over
    (B, T, S)): both modulations run around the kernels, the same bits as the block in bf16."""
    gen = torch.Generator().manual_seed(6)
    x, r = (torch.randn(B, 3, S, N, generator=gen).to(BF16) for _ in range(2))
    t = dict(x=x, r=r, scale=torch.randn(B, 1, 1, N, generator=gen).to(BF16),
             shift=torch.randn(B, 1, 1, N, generator=gen).to(BF16),
             scale1=torch.randn(S, 3, B, N, generator=gen).to(BF16).permute(2, 1, 0, 3),
             shift1=torch.randn(B, 1, 1, N, generator=gen).to(BF16))
    from normfuse.kernels.triton import broadcast_operand
    assert broadcast_operand(1 + t["scale1"], x) is None  # (so the modulations run around the kernels)
    assert all(torch.equal(a, b) for a, b in zip(sd35_ours(t), sd35_block(t)))


@pytest.mark.parametrize("mod,error,words", [
    (Modulation(torch.ones(B, 1, N), None, scale1=torch.ones(B, 2, N)), ShapeMismatchError, "must broadcast"),
    (Modulation(torch.ones(B, 1, N), torch.ones(B, 1, N), scale1=torch.ones(B, 1, N)), InvalidOptionError,
     "takes the steps of the first"),
    (Modulation(torch.ones(B, 1, N), None, scale1=torch.ones(B, 1, N, dtype=BF16)), InvalidOptionError,
     "must have the dtypes of scale and shift"),
])
def test_two_modulations_bad_arguments(mod, error, words):
    x = torch.randn(B, S, N)
    with pytest.raises(error, match=words):
        add_norm(x, x, None, None, kind="layer_norm", eps=1e-6, modulation=mod)


# ---- the factor 1 + scale computed in the call (one_plus): no pass of its own for a per-token scale ----

def ours_one_plus(form, t):
    x, r = t["x"], t["r"]
    if form == "wan":
        mod = Modulation(t["scale"], t["shift"], out_dtype=x.dtype, one_plus=True)
        return add_norm(x, r, None, None, kind="layer_norm", eps=1e-6, out_dtype=FP32, modulation=mod)
    mod = Modulation(t["scale"], t["shift"], fused=form == "addcmul", one_plus=True)
    return add_norm(x, r, None, None, kind="layer_norm", eps=1e-6, modulation=mod)


@BACKENDS
@pytest.mark.parametrize("per_token", (False, True), ids=("per_sample", "per_token"))
@pytest.mark.parametrize("dtype", (FP32, BF16, FP16), ids=("fp32", "bf16", "fp16"))
@pytest.mark.parametrize("form", ("dit", "addcmul", "wan"))
def test_the_factor_one_plus_scale_in_the_call(form, dtype, per_token, backend, request, monkeypatch):
    """Modulation(scale, shift, one_plus=True) is the block's ``n * (1 + scale) + shift`` with the add
    rounded to scale's dtype as the graph's: bit-equal on the reference path and in 16 bits on the
    kernels (which compute it in their epilogue), within the rule in fp32; gradients of the raw scale."""
    _on(backend, request, monkeypatch)
    t = _tensors(dtype, per_token, scale_dtype=FP32 if form == "wan" else None, seed=4)
    (got, got_s), (want, want_s) = ours_one_plus(form, t), eager(form, t)
    exact = eager(form, {k: v.double() for k, v in t.items()})[0]
    assert got.dtype == want.dtype and torch.equal(got_s, want_s)
    if backend == "reference" or dtype != FP32:
        assert torch.equal(got, want), (got - want).abs().max()
    _assert_within(got, want, exact)
    if dtype == BF16 and per_token:
        gen = torch.Generator().manual_seed(9)
        cot = [torch.randn(B, S, N, generator=gen, dtype=FP64) for _ in range(2)]
        names = ["x", "r", "scale", "shift"]
        g_ours = _grads(lambda a: ours_one_plus(form, a), t, names, cot)
        g_eager = _grads(lambda a: eager(form, a), t, names, cot)
        g_exact = _grads(lambda a: eager(form, a), {k: v.double() for k, v in t.items()}, names, cot)
        _assert_grads_within(g_ours, g_eager, g_exact)


@BACKENDS
@pytest.mark.parametrize("dtype,scale_dtype", [(FP32, BF16), (BF16, FP16)], ids=("fp32_x_bf16_scale", "bf16_x_fp16_scale"))
def test_the_factor_rounds_to_the_scale_s_dtype(dtype, scale_dtype, backend, request, monkeypatch):
    """1 + scale rounds to the scale's dtype (as the graph's add), not to the product's (fp32 here):
    bit-equal to the block on both paths."""
    _on(backend, request, monkeypatch)
    t = _tensors(dtype, per_token=True, scale_dtype=scale_dtype, seed=8)
    t["scale"] = t["scale"] * 64  # factors far from 1: their rounding to the scale's dtype shows
    (got, _), (want, _) = ours_one_plus("dit", t), eager("dit", t)
    assert got.dtype == want.dtype == torch.float32
    close = dict(rtol=1e-5, atol=1e-5)  # the kernels sum the statistics in another order: a few fp32 ulps
    if backend == "reference":
        assert torch.equal(got, want), (got - want).abs().max()
    else:
        torch.testing.assert_close(got, want, **close)
    n = F.layer_norm(t["x"] + t["r"], (N,), None, None, 1e-6)  # a factor kept in fp32 is farther than that
    kept = n * (1 + t["scale"].float()) + t["shift"]
    assert not torch.allclose(kept, want, **close)


@BACKENDS
@pytest.mark.parametrize("dtype", (BF16, FP16), ids=("bf16", "fp16"))
@pytest.mark.parametrize("affine", (False, True), ids=("no_affine", "affine"))
def test_a_norm_in_fp32_rounded_before_its_modulation(affine, dtype, backend, request, monkeypatch):
    """Diffusers' FP32LayerNorm in a 16-bit model, then the modulation (AuraFlow, EasyAnimate):
    ``F.layer_norm(x.float(), ...).to(x.dtype) * (1 + scale) + shift``. The call's norm in fp32
    (out_dtype fp32), y rounded to the modulation's 16-bit dtype before the product: bit-equal to the
    block on the reference path and the kernels (a y kept in fp32 into the product fails either)."""
    _on(backend, request, monkeypatch)
    t = _tensors(dtype, per_token=False, seed=11)
    w, b = (t["w"], t["b"]) if affine else (None, None)
    s = t["x"] + t["r"]
    n = F.layer_norm(s.float(), (N,), None if w is None else w.float(), None if b is None else b.float(), 1e-6)
    want = n.to(dtype) * (1 + t["scale"]) + t["shift"]
    mod = Modulation(1 + t["scale"], t["shift"], dtype=dtype)
    got, got_s = add_norm(t["x"], t["r"], w, b, kind="layer_norm", eps=1e-6, out_dtype=FP32, modulation=mod)
    assert got.dtype == want.dtype == dtype and torch.equal(got_s, s)
    assert torch.equal(got, want), (got - want).abs().max()
    # y kept in fp32 into the product (the product then rounded as the block's): another value
    assert not torch.equal((n * (1 + t["scale"]).float()).to(dtype) + t["shift"], want)


# ---- the chain's backward inside the kernels' backward -------------------------------------------
# The kernels' backward takes the modulation's and the gated branch's gradients too: dscale, dshift and
# dx_gate per row where the operand has a row per row of x, else summed per run of rows a program
# covers (its rows lie in one run). 3 x 14 rows over 4 interpreted "SMs": 16 programs of 3 rows would
# straddle the samples, so they take 2 (14 = 7 x 2), and a partial row sums two rows of one sample.

CHAIN_B, CHAIN_S = 3, 14


def _kernels_take_the_backward(kernels, monkeypatch):
    """Fail the test where the chain's backward runs around the kernels."""
    def around(call):
        pytest.fail("the modulation's or the gated branch's backward ran around the kernels")
    monkeypatch.setattr(kernels, "_add_norm_bwd_around_kernels", around)


def _chain_tensors(dtype, layout, n=N, seed=0, scale_dtype=None):
    """x, r, gate, scale, shift, w, b as a diffusion block reads them: per sample as ``emb.chunk(6)``
    pieces (strided views), per token, per column, or per frame of a video's (B, F, S, N) tokens."""
    gen = torch.Generator().manual_seed(seed)
    lead = (CHAIN_B, 2, 7) if layout == "per_frame" else (CHAIN_B, CHAIN_S)
    x, r = (torch.randn(*lead, n, generator=gen).to(dtype) for _ in range(2))
    t = dict(x=x, r=r, w=torch.randn(n, generator=gen).to(dtype), b=torch.randn(n, generator=gen).to(dtype))
    if layout == "per_sample":
        emb = (torch.randn(CHAIN_B, 6 * n, generator=gen) * 0.5).to(scale_dtype or dtype)
        t["shift"], t["scale"], t["gate"] = (c[:, None] for c in emb.chunk(6, dim=-1)[:3])
    else:
        shape = {"per_token": (*lead, n), "per_column": (n,), "per_frame": (CHAIN_B, 2, 1, n)}[layout]
        t["shift"], t["scale"], t["gate"] = ((torch.randn(*shape, generator=gen) * 0.5).to(scale_dtype or dtype)
                                             for _ in range(3))
    t["gate"] = t["gate"].to(dtype)
    return t


def chain_block(form, t, kind="layer_norm"):
    """(modulated output, sum): the block's gate, add, norm and modulation as its own ops."""
    s = t["r"] + t["gate"] * t["x"]
    n_ = s.shape[-1]
    norm = (lambda v: F.layer_norm(v, (n_,), t["w"].to(v.dtype), t["b"].to(v.dtype), 1e-6)) \
        if kind == "layer_norm" else (lambda v: F.rms_norm(v, (n_,), t["w"].to(v.dtype), 1e-6))
    if form in ("dit", "one_plus"):
        return norm(s) * (1 + t["scale"]) + t["shift"], s
    if form == "addcmul":
        return torch.addcmul(t["shift"], norm(s), 1 + t["scale"]), s
    if form == "wan":
        return (norm(s.float()) * (1 + t["scale"]) + t["shift"]).type_as(s), s
    if form == "scale_only":
        return norm(s) * (1 + t["scale"]), s
    return norm(s) + t["shift"], s


def chain_ours(form, t, kind="layer_norm"):
    scale = None if form == "shift_only" else t["scale"] if form == "one_plus" else 1 + t["scale"]
    shift = None if form == "scale_only" else t["shift"]
    mod = Modulation(scale, shift, fused=form == "addcmul", one_plus=form == "one_plus",
                     out_dtype=t["x"].dtype if form == "wan" else None)
    return add_norm(t["x"], t["r"], t["w"], t["b"] if kind == "layer_norm" else None, kind=kind, eps=1e-6,
                    x_gate=t["gate"], modulation=mod, out_dtype=FP32 if form == "wan" else None)


def _chain_grads_within(form, t, kind="layer_norm"):
    gen = torch.Generator().manual_seed(9)
    cot = [torch.randn(t["x"].shape, generator=gen, dtype=FP64) for _ in range(2)]
    names = ["x", "r", "gate", "w"] + (["b"] if kind == "layer_norm" else []) \
        + (["scale"] if form != "shift_only" else []) + (["shift"] if form != "scale_only" else [])
    got = _grads(lambda a: chain_ours(form, a, kind), t, names, cot)
    base = _grads(lambda a: chain_block(form, a, kind), t, names, cot)
    exact = _grads(lambda a: chain_block(form, a, kind), {k: v.double() for k, v in t.items()}, names, cot)
    _assert_grads_within(got, base, exact)


@pytest.mark.parametrize("layout", ("per_sample", "per_token", "per_column", "per_frame"))
@pytest.mark.parametrize("form", ("dit", "one_plus", "addcmul", "wan", "scale_only", "shift_only"))
def test_the_kernels_backward_takes_the_chain(form, layout, triton_cpu, monkeypatch):
    """bf16, LayerNorm with weight and bias: every gradient (x, the residual, the gate, the scale, the
    shift, the norm's parameters) within the rule against the block's ops in fp64, nothing around."""
    from normfuse.kernels import triton as kernels

    _kernels_take_the_backward(kernels, monkeypatch)
    _chain_grads_within(form, _chain_tensors(BF16, layout, seed=2, scale_dtype=FP32 if form == "wan" else None))


@pytest.mark.parametrize("kind", ("layer_norm", "rms_norm"))
@pytest.mark.parametrize("dtype", (FP32, FP16), ids=("fp32", "fp16"))
def test_the_kernels_backward_takes_the_chain_in_each_dtype(dtype, kind, triton_cpu, monkeypatch):
    from normfuse.kernels import triton as kernels

    _kernels_take_the_backward(kernels, monkeypatch)
    _chain_grads_within("dit", _chain_tensors(dtype, "per_sample", seed=4), kind)


@pytest.mark.parametrize("layout", ("per_sample", "per_token"))
def test_the_kernels_backward_takes_the_chain_on_a_looped_row(layout, triton_cpu, monkeypatch):
    """Rows of three backward blocks (20000 bf16 columns): each block's part of a run's sum is added into
    the program's partial row, each block of a per-token gradient stored."""
    from normfuse.kernels import triton as kernels

    _kernels_take_the_backward(kernels, monkeypatch)
    t = _chain_tensors(BF16, layout, n=20000, seed=6)
    block, _, looped = kernels._blocking(20000, 2, backward=True)
    assert looped and 20000 > 2 * block
    _chain_grads_within("dit", t)


def test_a_table_shared_across_the_batch_keeps_its_backward_around_the_kernels(triton_cpu, monkeypatch):
    """A (1, S, N) scale (one row per token, the same for every sample) has neither a row per row of x
    nor one per run: its gradient is a sum across the batch, which the torch ops around the kernels take."""
    from normfuse.kernels import triton as kernels

    calls = []
    around = kernels._add_norm_bwd_around_kernels
    monkeypatch.setattr(kernels, "_add_norm_bwd_around_kernels", lambda call: calls.append(1) or around(call))
    t = _chain_tensors(BF16, "per_sample", seed=8)
    gen = torch.Generator().manual_seed(1)
    t["scale"] = (torch.randn(1, CHAIN_S, N, generator=gen) * 0.5).to(BF16)
    _chain_grads_within("dit", t)
    assert calls


def test_runs_with_no_small_divisor_take_a_divisor_above(triton_cpu, monkeypatch):
    """4 samples of 22 tokens over 16 interpreted programs: 6 rows a program would straddle samples, and
    22's divisors under 6 (2) would make 44 programs; the programs take 11 rows (half a sample) each."""
    from normfuse.kernels import triton as kernels

    assert kernels._rows_dividing(22, 6, 88, 4) == 11
    assert kernels._rows_dividing(4097, 8, 4097, 132) == 17      # 17 x 241: 241 programs
    assert kernels._rows_dividing(4099, 8, 4099, 132) == 1       # a prime: one row a program
    assert kernels._rows_dividing(4608, 9, 4608, 132) == 9       # Flux-dev's 4096 + 512 tokens: as planned
    _kernels_take_the_backward(kernels, monkeypatch)
    seen = []
    launch = kernels._adaln_launch
    monkeypatch.setattr(kernels, "_adaln_launch", lambda call, layouts, n_rows, n_cols, programs, alloc:
                        seen.append(programs) or launch(call, layouts, n_rows, n_cols, programs, alloc))
    gen = torch.Generator().manual_seed(12)
    x, r = (torch.randn(4, 22, N, generator=gen).to(BF16) for _ in range(2))
    shift, scale, gate = (c[:, None] for c in (torch.randn(4, 6 * N, generator=gen) * 0.5).to(BF16).chunk(6, -1)[:3])
    t = dict(x=x, r=r, w=torch.randn(N, generator=gen).to(BF16), b=torch.randn(N, generator=gen).to(BF16),
             scale=scale, shift=shift, gate=gate)
    _chain_grads_within("dit", t)
    assert seen == [8]
