"""Parity with the fused add+norm test suites of flash-attn, Liger-Kernel and vLLM.

Each suite's parameter grid, reference and tolerance rule, written here in our own
words, with each peer kernel call replaced by the normfuse call that computes the same
thing; both CPU paths (the reference, and the Triton kernels under the interpreter).

* flash-attn ``tests/ops/triton/test_layer_norm.py``: three-way rule
  ``max|ours - ref| <= 2 * max|same-precision reference - ref| + atol`` for every output
  and gradient. Their upcast reference is fp32; here it is fp64, a more exact anchor.
* Liger-Kernel ``test/transformers/test_rms_norm.py``, ``test_fused_add_rms_norm.py``:
  ``allclose(ours, reference module in the same dtype, atol, rtol)`` for outputs and grads.
* vLLM ``tests/kernels/core/test_layernorm.py``: ``assert_close`` against the layer's
  native PyTorch forward (inference only).

The default run takes a CI-sized subset of each grid; ``pytest -m parity`` runs the rest.
Not mirrored here: flash-attn's ``test_layer_norm_linear`` (128 cases of ``layer_norm_linear_fn``,
the norm's output recomputed for the linear after it in backward); normfuse's counterpart,
``recompute_norm_output``, is tested in test_norm_linear.py.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

import normfuse
from normfuse.kernels import dropout_keep_mask

from kernel_cases import assert_same_bits, assert_within_rounding_budget

BF16, FP16, FP32, FP64 = torch.bfloat16, torch.float16, torch.float32, torch.float64


PATHS = ("reference", "triton")


def use_path(request, path):
    """Run CPU tensors through the reference, or through the Triton kernels (interpreter)."""
    if path == "triton":
        request.getfixturevalue("triton_cpu")


def _name(value) -> str:
    return str(value).replace("torch.", "") if isinstance(value, torch.dtype) else str(value)


def grid(cases, default, triton_default=None):
    """pytest params (path, *case) for both paths. The cases in ``default`` (reference path) and
    ``triton_default`` (Triton path; default: the same) run by default, the rest with -m parity.
    The interpreter runs a row of a program in ~10 ms, so the Triton path's default cases are small."""
    params = []
    for path in PATHS:
        chosen = default if path == "reference" or triton_default is None else triton_default
        for case in cases:
            params.append(pytest.param(path, *case, marks=() if case in chosen else pytest.mark.parity,
                                       id="-".join(_name(v) for v in (path, *case))))
    return params


def _leaves(*tensors):
    return [None if t is None else t.detach().clone().requires_grad_() for t in tensors]


# ---- flash-attn ---------------------------------------------------------------------------

FLASH_HIDDEN = (192, 2048, 2560, 3000, 4096)
FLASH_DTYPES = ((FP16, FP16), (FP16, FP32), (FP32, FP32), (BF16, BF16), (BF16, FP32))  # (input, residual)
FLASH_WEIGHT = (FP32, FP16, BF16)
FLASH_BATCH, FLASH_SEQLEN = 8, 512
FLASH_CASES = list(itertools.product(FLASH_HIDDEN, FLASH_DTYPES, FLASH_WEIGHT, (True, False),   # has_residual
                                     ("layer_norm", "rms_norm"), (True, False)))                # prenorm
FLASH_DEFAULT = {
    # 16-bit activations with fp32 parameters: LayerNorm's weight/bias gradients must be reduced in
    # fp32 (eager's CPU LayerNorm backward reduced them 6-50x over this rule)
    (192, (FP16, FP16), FP32, True, "layer_norm", False),
    (192, (BF16, FP32), FP32, True, "layer_norm", True),
    (192, (BF16, BF16), FP32, False, "layer_norm", True),
    (192, (FP32, FP32), FP32, True, "rms_norm", True),
    (192, (BF16, BF16), BF16, True, "rms_norm", False),
    (192, (FP16, FP32), FP16, False, "layer_norm", True),
}


def _flash_unfused(x, residual, weight, bias, kind, eps, upcast):
    """flash-attn's reference: the sum rounded to x's dtype; LayerNorm in the weight's dtype, RMSNorm in
    x's dtype up to the weight multiply; the output in x's dtype. ``upcast`` runs it all in fp64 (and
    leaves the output unrounded). Returns (out, the residual stream after the add)."""
    out_dtype = x.dtype
    if upcast:
        x, residual, weight, bias = (None if t is None else t.to(FP64) for t in (x, residual, weight, bias))
    if residual is not None:
        x = (x + residual).to(x.dtype)
    if kind == "layer_norm":
        out = F.layer_norm(x.to(weight.dtype), x.shape[-1:], weight, bias, eps)
    else:
        out = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * weight
        out = out if bias is None else out + bias
    return (out if upcast else out.to(out_dtype)), x


def _flash_rule(name, ours, same_precision, ref, atol):
    """max|ours - ref| <= 2 max|same_precision - ref| + atol (NaNs of the same-precision run ignored)."""
    keep = ~same_precision.isnan()
    err = (ours.double() - ref.double()).abs().max().item()
    base = (same_precision.double()[keep] - ref.double()[keep]).abs().max().item()
    assert err <= 2 * base + atol, f"{name}: error {err:.3g} > 2 * {base:.3g} + {atol:g}"


@pytest.mark.parametrize("path,hidden,dtypes,weight_dtype,has_residual,kind,prenorm",
                         grid(FLASH_CASES, FLASH_DEFAULT, triton_default=set()))
def test_flash_attn_layer_norm(request, path, hidden, dtypes, weight_dtype, has_residual, kind, prenorm):
    use_path(request, path)
    input_dtype, residual_dtype = dtypes
    bf16 = BF16 in (input_dtype, residual_dtype, weight_dtype)
    atol = 5e-2 if bf16 else 1e-2 if FP16 in (input_dtype, residual_dtype, weight_dtype) else 1e-4
    torch.manual_seed(0)
    shape = (FLASH_BATCH, FLASH_SEQLEN, hidden)
    x = torch.randn(shape, dtype=input_dtype)
    residual = torch.randn(shape, dtype=residual_dtype) if has_residual else None
    weight = torch.randn(hidden, dtype=weight_dtype)
    bias = torch.randn(hidden, dtype=weight_dtype) if kind == "layer_norm" else None
    grad = torch.randn(shape, dtype=input_dtype) / FLASH_BATCH

    def ours(x, residual, weight, bias):
        # flash-attn's kernel normalizes the fp32 sum and stores it rounded: round_sum_first=False
        out, stream = normfuse.add_norm(x, residual, weight, bias, kind=kind, eps=1e-6, out_dtype=input_dtype,
                                        return_sum=prenorm, round_sum_first=False)
        # a plain norm returns no sum: its residual stream is its input (flash-attn returns x, cast)
        return out, (x.to(residual_dtype) if prenorm and stream is None else stream)

    runs = []
    for fn in (ours, lambda *t: _flash_unfused(*t, kind, 1e-6, False), lambda *t: _flash_unfused(*t, kind, 1e-6, True)):
        leaves = _leaves(x, residual, weight, bias)
        out, stream = fn(*leaves)
        loss = out
        if prenorm:
            # as flash-attn: the reference's stream goes through the sigmoid in the residual dtype
            gate = stream.to(residual_dtype).to(stream.dtype) if stream.dtype == FP64 else stream
            loss = out * torch.sigmoid(gate)
        loss.backward(grad.to(loss.dtype))
        runs.append((out, stream, *[None if t is None else t.grad for t in leaves]))
    (out, stream, *_), _, _ = runs
    assert out.dtype == input_dtype
    if prenorm:
        assert stream.dtype == residual_dtype
    names = ("out", "residual_out", "dx", "dresidual", "dweight", "dbias")
    for name, o, p, r in zip(names, *runs):
        if o is not None and (name != "residual_out" or prenorm):
            _flash_rule(name, o, p, r, atol)


# flash-attn's grid of its kernel's modes (has_weight1, has_x1, has_rowscale, dropout_p), with
# normfuse's sum modes as one more axis: round_sum_first=False is flash-attn's own kernel (the fp32
# sum normalized), True rounds each step as an unfused graph does. Prenorm with a residual
# throughout. The token grid is smaller than flash-attn's batch 8 x seqlen 512 (the interpreter
# runs each row of a program in turn: ~1 s a case here), the dropout rate 0.37 (theirs: 0.27).
FLASH_MODE_ROWS = (2, 16)
FLASH_MODE_CASES = list(itertools.product((192, 3000), FLASH_DTYPES, ("layer_norm", "rms_norm"),
                                          (False, True), (False, True), (False, True), (0.0, 0.37),   # weight1, x1,
                                          (False, True)))                          # rowscale, dropout_p, round first
FLASH_MODE_TRITON_DEFAULT = {
    (192, (BF16, FP32), "layer_norm", True, True, True, 0.37, False),
    (192, (FP16, FP16), "rms_norm", True, False, False, 0.0, True),
    (192, (FP32, FP32), "layer_norm", False, True, False, 0.37, True),
    (192, (BF16, BF16), "rms_norm", False, False, True, 0.37, False),
}
FLASH_MODE_DEFAULT = FLASH_MODE_TRITON_DEFAULT | {(3000, (BF16, BF16), "layer_norm", True, True, True, 0.37, True)}


def _flash_branch(x, x1, rowscale, keep, dropout_p):
    """The branch before the residual add, in x's dtype (flash-attn's reference: dropout by the
    kernel's own mask, the row scale, the second branch)."""
    if keep is not None:
        x = x.masked_fill(~keep, 0.0) / (1.0 - dropout_p)
    if rowscale is not None:
        x = x * rowscale[..., None]
    return x if x1 is None else x + x1


@pytest.mark.parametrize("path,hidden,dtypes,kind,has_weight1,has_x1,has_rowscale,dropout_p,round_sum_first",
                         grid(FLASH_MODE_CASES, FLASH_MODE_DEFAULT, FLASH_MODE_TRITON_DEFAULT))
def test_flash_attn_layer_norm_modes(request, path, hidden, dtypes, kind, has_weight1, has_x1, has_rowscale,
                                     dropout_p, round_sum_first):
    use_path(request, path)
    input_dtype, residual_dtype = dtypes
    atol = 5e-2 if BF16 in dtypes else 1e-2 if FP16 in dtypes else 1e-4
    torch.manual_seed(0)
    shape = (*FLASH_MODE_ROWS, hidden)
    x, x1 = torch.randn(shape, dtype=input_dtype), torch.randn(shape, dtype=input_dtype) if has_x1 else None
    residual = torch.randn(shape, dtype=residual_dtype)
    rowscale = torch.rand(shape[:-1], dtype=input_dtype) + 0.5 if has_rowscale else None
    weight, weight1 = torch.randn(hidden), torch.randn(hidden) if has_weight1 else None
    bias = torch.randn(hidden) if kind == "layer_norm" else None
    bias1 = torch.randn(hidden) if has_weight1 and kind == "layer_norm" else None
    keep = dropout_keep_mask(x, dropout_p, 1234) if dropout_p else None
    grads = [torch.randn(shape, dtype=input_dtype) / FLASH_MODE_ROWS[0] for _ in range(2)]

    def ours(x, residual, weight, bias, x1, weight1, bias1):
        outs = normfuse.add_norm(x, residual, weight, bias, kind=kind, eps=1e-6, out_dtype=input_dtype,
                                 round_sum_first=round_sum_first, x1=x1, rowscale=rowscale, weight1=weight1,
                                 bias1=bias1, dropout=normfuse.Dropout(dropout_p, seed=1234))
        return outs if weight1 is not None else (outs[0], None, outs[1])

    def unfused(upcast):
        def fn(x, residual, weight, bias, x1, weight1, bias1):
            t = (x, x1, None if rowscale is None else rowscale)
            branch = _flash_branch(*(u.to(FP64) if upcast and u is not None else u for u in t), keep, dropout_p)
            branch = branch if upcast else branch.to(input_dtype)
            out, stream = _flash_unfused(branch, residual, weight, bias, kind, 1e-6, upcast)
            out1 = None if weight1 is None else _flash_unfused(branch, residual, weight1, bias1, kind, 1e-6,
                                                                upcast)[0]
            return out, out1, stream
        return fn

    runs = []
    for fn in (ours, unfused(False), unfused(True)):
        leaves = _leaves(x, residual, weight, bias, x1, weight1, bias1)
        out, out1, stream = fn(*leaves)
        gate = stream.to(residual_dtype).to(stream.dtype) if stream.dtype == FP64 else stream
        loss = (out * torch.sigmoid(gate) * grads[0].to(out.dtype)).sum()
        if out1 is not None:
            loss = loss + (out1 * grads[1].to(out1.dtype)).sum()
        loss.backward()
        runs.append((out, out1, stream, *[None if t is None else t.grad for t in leaves]))
    assert runs[0][0].dtype == input_dtype and runs[0][2].dtype == residual_dtype
    names = ("out", "out1", "residual_out", "dx", "dresidual", "dweight", "dbias", "dx1", "dweight1", "dbias1")
    for name, o, p, r in zip(names, *runs):
        assert (o is None) == (r is None), name
        if o is not None:
            _flash_rule(name, o, p, r, atol)


# ---- Liger-Kernel -------------------------------------------------------------------------

LIGER_SHAPES = ((2, 128, 512), (5, 123, 123))
LIGER_DTYPES = ((FP32, 1e-4, 1e-6), (BF16, 2e-1, 2e-2))    # (dtype, atol, rtol)
LIGER_MODES = ("llama", "gemma", "none")
LIGER_CASES = list(itertools.product(LIGER_SHAPES, LIGER_DTYPES, LIGER_MODES, (False, True)))
LIGER_DEFAULT = {c for c in LIGER_CASES if c[0] == (5, 123, 123)}


def _liger_style_norm(h, weight, mode, eps=1e-6):
    """The reference modules of Liger's tests: HF Llama (fp32 math, round, then weight), HF Gemma
    (fp32 math times 1 + w, round once), and "none" (all math in h's dtype)."""
    if mode == "none":
        return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype)
    hf = h.float()
    normed = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    if mode == "llama":
        return weight * normed.to(h.dtype)
    return (normed * (1.0 + weight.float())).to(h.dtype)


def _normfuse_modes(mode, dtype):
    return {"llama": {"norm_round_dtype": dtype}, "gemma": {"weight_offset": 1.0}, "none": {}}[mode]


@pytest.mark.parametrize("path,shape,dtype_tol,mode,fused_add", grid(LIGER_CASES, LIGER_DEFAULT, set()))
def test_liger_rms_norm(request, path, shape, dtype_tol, mode, fused_add):
    """test_rms_norm.py and test_fused_add_rms_norm.py ``test_correctness``. Their in_place axis (the
    backward may overwrite dY) has no counterpart: normfuse never writes into its inputs."""
    use_path(request, path)
    dtype, atol, rtol = dtype_tol
    torch.manual_seed(42)
    x, r = torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype)
    dh, dr = torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype)
    weight = torch.ones(shape[-1], dtype=dtype)        # the modules' initial weight
    results = []
    for ours in (False, True):
        x_, r_, w_ = _leaves(x, r, weight)
        if ours:
            out, stream = normfuse.add_norm(x_, r_ if fused_add else None, w_, kind="rms_norm", eps=1e-6,
                                            **_normfuse_modes(mode, dtype))
        else:
            stream = x_ + r_ if fused_add else None
            out = _liger_style_norm(x_ if stream is None else stream, w_, mode)
        torch.autograd.backward((out, stream) if fused_add else (out,), (dh, dr) if fused_add else (dh,))
        results.append([out, stream, w_.grad, x_.grad, r_.grad if fused_add else None])
    for name, got, expect in zip(("out", "residual_out", "dweight", "dx", "dresidual"), *results[::-1]):
        if expect is not None:
            torch.testing.assert_close(got, expect, atol=atol, rtol=rtol, msg=lambda m: f"{name}: {m}")


LIGER_FUNCTIONAL_CASES = list(itertools.product(((2, 2, 8), (9, 7, 41)), LIGER_DTYPES, ("llama", "gemma"),
                                                (False, True)))


@pytest.mark.parametrize("path,shape,dtype_tol,mode,fused_add",
                         grid(LIGER_FUNCTIONAL_CASES, set(LIGER_FUNCTIONAL_CASES)))
def test_liger_functional_equals_op(request, path, shape, dtype_tol, mode, fused_add):
    """``test_correctness_functional``: the functional API against the autograd-level entry point
    (Liger's Function.apply; here the custom op called directly), random weight."""
    use_path(request, path)
    dtype, atol, rtol = dtype_tol
    torch.manual_seed(0)
    x, r, w = torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype), torch.randn(shape[-1], dtype=dtype)
    dh, dr = torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype)
    modes = _normfuse_modes(mode, dtype)
    results = []
    for functional in (True, False):
        x_, r_ = _leaves(x, r)
        residual = r_ if fused_add else None
        if functional:
            out, stream = normfuse.add_norm(x_, residual, w, kind="rms_norm", eps=1e-6, **modes)
        else:
            out, stream, *_ = torch.ops.normfuse.add_norm_fwd(
                x_, residual, w, None, "rms_norm", 1e-6, modes.get("weight_offset", 0.0), 1.0, dtype,
                modes.get("norm_round_dtype"), dtype, fused_add)
        torch.autograd.backward((out, stream) if fused_add else (out,), (dh, dr) if fused_add else (dh,))
        results.append([out, stream if fused_add else None, x_.grad, r_.grad if fused_add else None])
    for got, expect in zip(*results):   # the same op, the same inputs: the same bits (Liger's tolerance unneeded)
        if expect is not None:
            assert_same_bits(got, expect, "functional vs op")


# ---- vLLM ---------------------------------------------------------------------------------

VLLM_TOKENS = (7, 83, 4096)
VLLM_HIDDEN = (8, 768, 769, 5120, 5125, 8192)
VLLM_DTYPES = (FP16, BF16, FP32)
# vLLM's default IR tolerances (vllm/ir/tolerances.py), used by the weightless test
VLLM_TOLERANCE = {FP32: dict(atol=1e-5, rtol=1.3e-6), FP16: dict(atol=1e-3, rtol=1e-3),
                  BF16: dict(atol=1e-3, rtol=1.6e-2)}
VLLM_CASES = list(itertools.product(VLLM_TOKENS, VLLM_HIDDEN, (False, True), VLLM_DTYPES, (False, True)))
VLLM_DEFAULT = {(83, 769, True, BF16, True), (7, 5125, True, FP16, False), (83, 768, False, FP32, True),
                (7, 8, True, FP32, False)}
VLLM_TRITON_DEFAULT = {(7, 769, True, BF16, True), (7, 8, True, FP32, False)}


def _vllm_inputs(tokens, hidden, add_residual, dtype, strided, weight_mean):
    torch.manual_seed(0)
    weight = torch.empty(hidden, dtype=dtype).normal_(mean=weight_mean, std=0.1)
    scale = 1 / (2 * hidden)
    x = torch.randn(tokens, 2 * hidden if strided else hidden, dtype=dtype)[..., :hidden]
    assert x.is_contiguous() != strided
    x *= scale
    residual = None
    if add_residual:
        residual = x.new_empty_strided(x.size(), x.stride()).normal_(std=scale)
    return x, residual, weight


def _vllm_rms_native(x, residual, weight, eps=1e-6):
    """vLLM RMSNorm's native forward: the fp32 sum normalized (and returned rounded), the normalized
    value rounded to x's dtype, then the weight multiply: normfuse's round_sum_first=False with
    norm_round_dtype=x.dtype."""
    orig = x.dtype
    h = x.float()
    if residual is not None:
        h = h + residual.float()
        residual = h.to(orig)
    h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(orig)
    return (h if weight is None else h * weight), residual


def _vllm_gemma_native(x, residual, weight, eps=1e-6):
    """vLLM GemmaRMSNorm's native forward: fp16 sums in fp32 (and returned in fp32), others in
    their dtype; fp32 math times (1 + w), rounded once."""
    orig = x.dtype
    if residual is not None:
        x = x.float() + residual.float() if orig == FP16 else x + residual
        residual = x
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.float())
    return h.to(orig), residual


def _check_vllm(got, expect, tolerance):
    for g, e in zip(got, expect):
        if e is not None:
            torch.testing.assert_close(g, e, **tolerance)


def _vllm_rms(x, residual, weight, dtype, add_residual):
    """vLLM's RMSNorm: the unrounded fp32 sum, rounded before the weight."""
    return normfuse.add_rms_norm(x, residual, weight, eps=1e-6, norm_round_dtype=dtype, round_sum_first=False)


def _vllm_gemma(x, residual, weight, dtype, add_residual):
    """vLLM's GemmaRMSNorm: ``1 + w``, an fp32 sum for fp16 activations."""
    sum_dtype = FP32 if dtype == FP16 and add_residual else None
    return normfuse.add_rms_norm(x, residual, weight, eps=1e-6, weight_offset=1.0, sum_dtype=sum_dtype,
                                 out_dtype=dtype)


# variant -> (normfuse call, vLLM's native reference, mean of the weight)
VLLM_VARIANTS = {"rms_norm": (_vllm_rms, _vllm_rms_native, 1.0),
                 "gemma_rms_norm": (_vllm_gemma, _vllm_gemma_native, 0.0)}


@pytest.mark.parametrize("variant", list(VLLM_VARIANTS))
@pytest.mark.parametrize("path,tokens,hidden,add_residual,dtype,strided",
                         grid(VLLM_CASES, VLLM_DEFAULT, VLLM_TRITON_DEFAULT))
@torch.inference_mode()
def test_vllm_rms_norm(request, path, tokens, hidden, add_residual, dtype, strided, variant):
    call, native, weight_mean = VLLM_VARIANTS[variant]
    use_path(request, path)
    x, residual, weight = _vllm_inputs(tokens, hidden, add_residual, dtype, strided, weight_mean=weight_mean)
    expect = native(x, residual, weight)
    # vLLM's own check is assert_close(atol=1e-2, rtol=1e-2), far above the sum's size here (x and
    # the residual are scaled by 1 / (2 * hidden)); normfuse reproduces the native rounding points:
    # the returned sum bit for bit, y within the rounding budget (bit for bit on the reference path)
    y, s = call(x, residual, weight, dtype, add_residual)
    y_native, s_native = expect
    if s_native is not None:
        assert_same_bits(s, s_native, "residual")
    if path == "reference":
        assert_same_bits(y, y_native, "y")
    else:
        assert_within_rounding_budget(y, y_native, "y")


VLLM_WEIGHTLESS_CASES = list(itertools.product(VLLM_TOKENS, VLLM_HIDDEN, (False, True), VLLM_DTYPES))


@pytest.mark.parametrize("path,tokens,hidden,add_residual,dtype",
                         grid(VLLM_WEIGHTLESS_CASES, {(83, 769, True, FP16), (7, 5120, False, BF16)},
                              {(7, 769, True, FP16)}))
@torch.inference_mode()
def test_vllm_rms_norm_weightless(request, path, tokens, hidden, add_residual, dtype):
    use_path(request, path)
    torch.manual_seed(0)
    x = torch.randn(tokens, hidden, dtype=dtype)
    residual = torch.randn_like(x) if add_residual else None
    expect = _vllm_rms_native(x, residual, None)
    got = normfuse.add_rms_norm(x, residual, None, eps=1e-6, norm_round_dtype=dtype, round_sum_first=False)
    _check_vllm(got, expect, VLLM_TOLERANCE[dtype])


@pytest.mark.parametrize("path", PATHS)
@torch.inference_mode()
def test_vllm_gemma_rms_norm_mixed_input_weight_dtype(request, path):
    use_path(request, path)
    torch.manual_seed(0)
    x = torch.randn(32, 1024, dtype=BF16)
    weight = torch.empty(1024).normal_(mean=0.0, std=0.1)            # fp32 weight, bf16 activations
    h = x.float()
    expect = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * (weight + 1.0)).to(BF16)
    got, _ = normfuse.add_rms_norm(x, None, weight, eps=1e-6, weight_offset=1.0)
    assert got.dtype == BF16
    # the same rounding points (fp32 math times (1 + w), rounded once): vLLM's atol of 1e-2 unneeded
    if path == "reference":
        assert_same_bits(got, expect, "y")
    else:
        assert_within_rounding_budget(got, expect, "y")


VLLM_QUANT_CASES = [(*case, scale) for case in VLLM_CASES for scale in (0.01, 1.0, 10.0)]
VLLM_QUANT_DEFAULT = {(83, 769, True, BF16, True, 10.0), (7, 5125, True, FP16, False, 0.01),
                      (83, 768, False, FP32, True, 1.0), (7, 8, True, FP32, False, 0.01)}
VLLM_QUANT_TRITON_DEFAULT = {(7, 769, True, BF16, True, 0.01), (7, 8, False, FP16, False, 10.0)}


def _vllm_rms_cuda(x, residual, weight, eps=1e-6):
    """vLLM's CUDA rms_norm / fused_add_rms_norm: the sum rounded to x's dtype (returned as the new
    residual), normalized in fp32, rounded to x's dtype, then times the weight."""
    s = x if residual is None else x + residual
    h = s.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight, \
        (None if residual is None else s)


@pytest.mark.parametrize("path,tokens,hidden,add_residual,dtype,strided,quant_scale",
                         grid(VLLM_QUANT_CASES, VLLM_QUANT_DEFAULT, VLLM_QUANT_TRITON_DEFAULT))
@torch.inference_mode()
def test_vllm_fused_rms_norm_static_fp8_quant(request, path, tokens, hidden, add_residual, dtype, strided,
                                               quant_scale):
    """``test_fused_rms_norm_quant``: (fused_add_)rms_norm_static_fp8_quant against the unfused norm
    then static_scaled_fp8_quant, q = clamp(y / scale, -448, 448) cast to e4m3fn. vLLM compares q in
    fp32 with atol 1e-3 (its fused kernel multiplies by 1 / scale); normfuse divides as the unfused
    op does: q bit for bit on the reference path, within the rounding budget on the Triton path,
    the residual bit for bit."""
    from normfuse.kernels import Fp8Quant

    use_path(request, path)
    x, residual, weight = _vllm_inputs(tokens, hidden, add_residual, dtype, strided, weight_mean=1.0)
    e4m3 = torch.float8_e4m3fn
    qmax = torch.finfo(e4m3).max
    scale = torch.tensor([quant_scale], dtype=FP32)
    y_ref, s_ref = _vllm_rms_cuda(x, residual, weight)
    q_ref = (y_ref.float() / scale).clamp(-qmax, qmax).to(e4m3)
    q, scale_out, y, s = normfuse.add_rms_norm(x, residual, weight, eps=1e-6, norm_round_dtype=dtype,
                                               quant=Fp8Quant(e4m3, scale=scale, apply="div", clamp=qmax),
                                               return_norm=True)
    assert torch.equal(scale_out, scale)
    if add_residual:
        assert_same_bits(s, s_ref, "residual")
    else:
        assert s is None
    if path == "reference":
        assert_same_bits(y, y_ref, "y")
        assert_same_bits(q, q_ref, "q")
    else:
        assert_within_rounding_budget(y, y_ref, "y")
        assert_within_rounding_budget(q, q_ref, "q")
