"""add_norm's quantization epilogue (fp8 output) against the eager compositions models write.

Each spelling below is a quantization as a serving or training stack writes it in plain torch ops
(the generic amax / qmax; its reciprocal form; torchao's ``qmax / amax`` returning the reciprocal;
vLLM's minimum scale; a static scale), paired with the add_norm options that reproduce it.
* Reference path: q, scale, y and s equal the eager composition (add, F.rms_norm/F.layer_norm,
  then the spelling) bit for bit.
* Triton path (the interpreter here, the GPU under the gpu marker): y differs from eager only by
  the order of the row reduction (the rounding budget); q and scale equal the spelling applied to
  the kernel's own y bit for bit, which isolates the epilogue from the reduction order.
The peers' tests (vLLM's fused_add_rms_norm + quant, FlashInfer's fused_add_rmsnorm_quant) allow
one fp8 ulp or atol 1e-2; here nothing is allowed.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import normfuse
from normfuse import Fp8Quant
from normfuse.errors import InvalidOptionError, NormfuseError, ShapeMismatchError, UnsupportedDtypeError

from kernel_cases import BF16, FP16, FP32, assert_same_bits, assert_within_rounding_budget

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
QDTYPES = {"e4m3": E4M3, "e5m2": E5M2}
EPS = 1e-6


@pytest.fixture(params=("reference", "triton"))
def path(request):
    """CPU tensors through the reference, or through the Triton kernels (interpreter)."""
    if request.param == "triton":
        request.getfixturevalue("triton_cpu")
    return request.param


# ---- the spellings -----------------------------------------------------------------------
# Each: (add_norm options, eager(y, qdtype, group) -> (q, scale as the spelling returns it)).

def _rows(y, group):
    """fp32(y), as (..., 1 | N // G, N | G): the amax is taken over the last dim."""
    yf = y.float()
    return yf.unsqueeze(-2) if group is None else yf.unflatten(-1, (y.shape[-1] // group, group))


def _finish(q, scale, y, group):
    shape = (*y.shape[:-1], 1 if group is None else y.shape[-1] // group)
    return q.reshape(y.shape), scale.reshape(shape)


def _amax_div(y, qdtype, group):            # the generic one (FlashInfer's, TensorRT-LLM's reference)
    qmax = torch.finfo(qdtype).max
    yf = _rows(y, group)
    amax = yf.abs().amax(-1, keepdim=True).float()
    scale = amax.clamp(min=1e-12) / qmax
    return _finish((yf / scale).clamp(-qmax, qmax).to(qdtype), scale, y, group)


def _mul_reciprocal(y, qdtype, group):      # the same scale, applied as a multiply by its reciprocal
    qmax = torch.finfo(qdtype).max
    yf = _rows(y, group)
    scale = yf.abs().amax(-1, keepdim=True).clamp(min=1e-12) / qmax
    return _finish((yf * scale.reciprocal()).clamp(-qmax, qmax).to(qdtype), scale, y, group)


def _torchao(y, qdtype, group):             # torchao/TGI: qmax / amax (Python: reciprocal, then *)
    qmax = torch.finfo(qdtype).max
    yf = _rows(y, group)
    scale = qmax / yf.abs().amax(-1, keepdim=True).clamp(min=1e-12)
    q = (yf * scale).clamp(min=-qmax, max=qmax).to(qdtype)
    return _finish(q, scale.reciprocal(), y, group)


def _true_division(y, qdtype, group):       # qmax / amax as one division
    qmax = torch.finfo(qdtype).max
    yf = _rows(y, group)
    amax = yf.abs().amax(-1, keepdim=True).clamp(min=1e-12)
    scale = torch.full_like(amax, qmax) / amax
    return _finish((yf * scale).clamp(-qmax, qmax).to(qdtype), scale, y, group)


def _vllm(y, qdtype, group):                # vLLM's per-token reference: a minimum scale, no amax clamp
    qmax = torch.finfo(qdtype).max
    yf = _rows(y, group)
    scale = torch.maximum(yf.abs().amax(-1, keepdim=True) / qmax, torch.tensor(1.0 / (qmax * 512)))
    return _finish((yf / scale).clamp(-qmax, qmax).to(qdtype), scale, y, group)


def _no_clamp(y, qdtype, group):            # the cast alone bounds the values
    qmax = torch.finfo(qdtype).max
    yf = _rows(y, group)
    scale = yf.abs().amax(-1, keepdim=True) / qmax
    return _finish((yf / scale).to(qdtype), scale, y, group)


STATIC_SCALE = 0.01  # |y| up to ~5: some values pass 448 and saturate


def _static(apply, clamp):
    def eager(y, qdtype, group):
        qmax = torch.finfo(qdtype).max
        scale = torch.tensor([STATIC_SCALE if apply == "div" else 1 / STATIC_SCALE], device=y.device)
        v = y.float() / scale if apply == "div" else y.float() * scale
        return (v.clamp(-qmax, qmax) if clamp else v).to(qdtype), scale
    return eager


def _static_options(apply, clamp):
    return lambda qdtype: dict(scale=torch.tensor([STATIC_SCALE if apply == "div" else 1 / STATIC_SCALE]),
                               apply=apply, clamp=torch.finfo(qdtype).max if clamp else None)


def _clamped(**options):
    return lambda qdtype: dict(options, clamp=torch.finfo(qdtype).max)


SPELLINGS = {
    "amax_div": (_clamped(amax_min=1e-12), _amax_div),
    "mul_reciprocal": (_clamped(amax_min=1e-12, apply="mul_reciprocal"), _mul_reciprocal),
    "torchao": (_clamped(amax_min=1e-12, scale_form="max*(1/amax)", apply="mul",
                         scale_out="reciprocal"), _torchao),
    "true_division": (_clamped(amax_min=1e-12, scale_form="max/amax", apply="mul"),
                      _true_division),
    "vllm": (lambda qdtype: dict(scale_min=1.0 / (torch.finfo(qdtype).max * 512),
                                 clamp=torch.finfo(qdtype).max), _vllm),
    "no_clamp": (lambda qdtype: {}, _no_clamp),
    "static_div": (_static_options("div", True), _static("div", True)),
    "static_mul": (_static_options("mul", True), _static("mul", True)),
    "static_no_clamp": (_static_options("div", False), _static("div", False)),
}
DYNAMIC = [name for name in SPELLINGS if not name.startswith("static")]
GROUPED = ["amax_div", "torchao", "vllm"]


# ---- one case --------------------------------------------------------------------------

def inputs(rows, n, dtype, kind, residual=True, seed=0, scale=2.0):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape, std=1.0, mean=0.0):
        return (torch.randn(*shape, generator=gen) * std + mean).to(dtype)
    return dict(x=randn(rows, n, std=scale), residual=randn(rows, n) if residual else None,
                weight=randn(n, std=0.5, mean=1.0), bias=randn(n, std=0.1) if kind == "layer_norm" else None)


def eager_norm(t, kind):
    """(y, s) as a model computes them: the add in the working dtype, then torch's norm."""
    x, r = t["x"], t["residual"]
    s = x if r is None else x + r
    n = s.shape[-1]
    if kind == "layer_norm":
        return F.layer_norm(s, (n,), t["weight"], t["bias"], EPS), (None if r is None else s)
    return F.rms_norm(s, (n,), t["weight"], EPS), (None if r is None else s)


def fused(t, kind, qdtype, options, group=None, **more):
    return normfuse.add_norm(t["x"], t["residual"], t["weight"], t["bias"], kind=kind, eps=EPS,
                             quant=Fp8Quant(qdtype, group=group, **options), return_norm=True, **more)


def check(spelling, kind, dtype, qdtype, rows=5, n=256, group=None, residual=True, path="reference", seed=0):
    options, eager_quant = SPELLINGS[spelling]
    t = inputs(rows, n, dtype, kind, residual, seed)
    q, scale, y, s = fused(t, kind, qdtype, options(qdtype), group)
    y_eager, s_eager = eager_norm(t, kind)
    if path == "reference":
        assert_same_bits(y, y_eager, "y")
    else:
        assert_within_rounding_budget(y, y_eager, "y")
    if s_eager is None:
        assert s is None
    else:
        assert_same_bits(s, s_eager, "s")
    # the epilogue on the op's own y: bit for bit on every path
    q_eager, scale_eager = eager_quant(y, qdtype, group)
    assert q.dtype == qdtype and scale.dtype == FP32
    assert_same_bits(q, q_eager, f"q ({spelling})")
    assert_same_bits(scale, scale_eager, f"scale ({spelling})")
    return q, scale, y, s


# ---- the reference path: bit for bit with the eager composition ------------------------------

@pytest.mark.parametrize("qdtype", list(QDTYPES.values()), ids=list(QDTYPES))
@pytest.mark.parametrize("dtype", (BF16, FP16, FP32), ids=("bf16", "fp16", "fp32"))
@pytest.mark.parametrize("kind", ("rms_norm", "layer_norm"))
@pytest.mark.parametrize("spelling", list(SPELLINGS))
def test_reference_equals_eager(spelling, kind, dtype, qdtype):
    check(spelling, kind, dtype, qdtype)


@pytest.mark.parametrize("qdtype", list(QDTYPES.values()), ids=list(QDTYPES))
@pytest.mark.parametrize("dtype", (BF16, FP16, FP32), ids=("bf16", "fp16", "fp32"))
@pytest.mark.parametrize("group", (64, 128))
@pytest.mark.parametrize("spelling", GROUPED)
def test_reference_groups_equal_eager(spelling, group, dtype, qdtype):
    check(spelling, "rms_norm", dtype, qdtype, n=384, group=group)


SIZES = [  # (rows, N, group): one row, many short rows, 3000-ish divisible by 128, wide rows
    (1, 256, None), (123, 256, None), (123, 256, 64), (2, 3072, 128), (3, 5120, None), (2, 8192, 128),
    (2, 16384, None),
]


@pytest.mark.parametrize("residual", (True, False), ids=("res", "nores"))
@pytest.mark.parametrize("rows,n,group", SIZES)
def test_reference_sizes(rows, n, group, residual):
    for spelling in ("amax_div", "torchao") if group else ("amax_div", "torchao", "static_div"):
        check(spelling, "rms_norm", BF16, E4M3, rows, n, group, residual)


# ---- the Triton path: y within the rounding budget, the epilogue bit for bit ---------------

@pytest.mark.parametrize("qdtype", list(QDTYPES.values()), ids=list(QDTYPES))
@pytest.mark.parametrize("spelling", list(SPELLINGS))
def test_triton_epilogue(triton_cpu, spelling, qdtype):
    check(spelling, "rms_norm", BF16, qdtype, path="triton")


@pytest.mark.parametrize("qdtype", list(QDTYPES.values()), ids=list(QDTYPES))
@pytest.mark.parametrize("group", (64, 128))
@pytest.mark.parametrize("spelling", GROUPED)
def test_triton_groups(triton_cpu, spelling, group, qdtype):
    check(spelling, "rms_norm", BF16, qdtype, n=384, group=group, path="triton")


@pytest.mark.parametrize("dtype", (FP16, FP32), ids=("fp16", "fp32"))
@pytest.mark.parametrize("spelling,group", [("amax_div", None), ("torchao", 128), ("static_mul", None)])
def test_triton_layer_norm(triton_cpu, spelling, group, dtype):
    check(spelling, "layer_norm", dtype, E4M3, n=384, group=group, path="triton")


TRITON_SIZES = [
    (1, 256, None, "amax_div"), (123, 256, None, "vllm"), (123, 256, 64, "torchao"),
    (2, 3072, 128, "amax_div"), (3, 5120, None, "mul_reciprocal"), (2, 8192, 128, "vllm"),
    # rows past one block: the looped kernel (a third pass for the per-row scale; groups and a static
    # scale in the second)
    (2, 65536, None, "amax_div"), (2, 65536, 128, "torchao"), (1, 65536, None, "static_div"),
]


@pytest.mark.parametrize("rows,n,group,spelling", TRITON_SIZES)
def test_triton_sizes(triton_cpu, rows, n, group, spelling):
    check(spelling, "rms_norm", BF16, E4M3, rows, n, group, residual=rows != 1, path="triton")


def test_triton_looped_fp32_layer_norm_without_stored_sum(triton_cpu):
    """fp32 rows past 64 KiB with no residual (no s: each pass recomputes the norm input)."""
    check("true_division", "layer_norm", FP32, E5M2, 2, 16400, None, residual=False, path="triton")


@pytest.mark.slow
@pytest.mark.parametrize("qdtype", list(QDTYPES.values()), ids=list(QDTYPES))
@pytest.mark.parametrize("dtype", (BF16, FP16, FP32), ids=("bf16", "fp16", "fp32"))
@pytest.mark.parametrize("kind", ("rms_norm", "layer_norm"))
@pytest.mark.parametrize("spelling", list(SPELLINGS))
def test_triton_full_grid(triton_cpu, spelling, kind, dtype, qdtype):
    """Every spelling, kind, dtype and fp8 dtype, per row and per group (the default run takes slices)."""
    check(spelling, kind, dtype, qdtype, rows=7, n=768, path="triton")
    if spelling in DYNAMIC:
        check(spelling, kind, dtype, qdtype, rows=7, n=768, group=128, path="triton")


# ---- edges: NaN, inf, zero rows, the conversion itself --------------------------------------

try:
    import triton
    import triton.language as tl

    from normfuse.kernels.triton import _fp8_bits
except ImportError:  # pragma: no cover - platforms without triton
    triton = None

if triton is not None:
    @triton.jit
    def _convert(V, OUT, n, E5M2: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        v = tl.load(V + offs, mask=offs < n, other=0.0)
        tl.store(OUT + offs, _fp8_bits(v, E5M2).to(tl.uint8), mask=offs < n)


def test_fp8_conversion_equals_torch(triton_cpu):
    """The kernels' fp32 -> fp8 conversion equals torch's on every fp8 value, the midpoints between
    them and their neighbours (ties to even), subnormals, the saturation/overflow edges, inf, NaN."""
    for qdtype in (E4M3, E5M2):
        grid = torch.arange(256, dtype=torch.uint8).view(qdtype).float()
        finite = grid[grid.isfinite()].unique()
        mids = (finite[1:] + finite[:-1]) / 2
        big = torch.tensor([448.0, 464.0, 479.9, 480.0, 57344.0, 61439.0, 61440.0, 65536.0, 1e30])
        values = torch.cat([finite, mids, mids.nextafter(torch.tensor(float("inf"))),
                            mids.nextafter(torch.tensor(-float("inf"))), big, -big, finite * 1.0000001,
                            torch.tensor([0.0, -0.0, 1e-45, -1e-45, 2.0**-10, 2.0**-17, float("inf"), -float("inf"),
                                          float("nan")]),
                            torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 100])
        out = torch.empty(values.numel(), dtype=torch.uint8)
        _convert[(triton.cdiv(values.numel(), 1024),)](values, out, values.numel(), E5M2=qdtype == E5M2, BLOCK=1024)
        assert_same_bits(out.view(qdtype), values.to(qdtype), str(qdtype))


@pytest.mark.parametrize("spelling", ["amax_div", "torchao", "no_clamp", "vllm"])
def test_nonfinite_and_zero_rows(path, spelling):
    """A row of zeros (amax 0: NaN without a clamp), an inf weight column (amax inf) and a NaN
    (NaN row): q and scale as the eager spelling gives them, NaNs in the same places."""
    t = inputs(4, 64, BF16, "rms_norm")
    t["x"][1] = -t["residual"][1]          # s = 0: a zero row
    t["weight"][3] = float("inf")          # y[:, 3] = +-inf
    t["x"][2, 5] = float("nan")            # a NaN row
    options, eager_quant = SPELLINGS[spelling]
    for group in (None, 32):
        q, scale, y, _ = fused(t, "rms_norm", E4M3, options(E4M3), group)
        q_eager, scale_eager = eager_quant(y, E4M3, group)
        assert_same_bits(q, q_eager, "q")
        assert_same_bits(scale, scale_eager, "scale")


def test_planted_errors_are_caught(path):
    """The comparison can fail: planted in a copy of the spelling, a scale one ulp off, the amax of y
    before its rounding, another clamp, or the other division form of qmax / amax are each seen."""
    t = inputs(64, 1024, BF16, "rms_norm", seed=3)
    q, scale, y, _ = fused(t, "rms_norm", E4M3, SPELLINGS["amax_div"][0](E4M3))
    q_eager, scale_eager = _amax_div(y, E4M3, None)
    assert_same_bits(q, q_eager, "q")
    with pytest.raises(AssertionError):
        assert_same_bits(scale, scale_eager.nextafter(torch.tensor(1.0)), "scale")
    unrounded = normfuse.add_rms_norm(t["x"], t["residual"], t["weight"], EPS, out_dtype=FP32)[0]
    amax_too_early = unrounded.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 448.0
    with pytest.raises(AssertionError):
        assert_same_bits(q, (y.float() / amax_too_early).clamp(-448, 448).to(E4M3), "q")
    q_static, _, y_static, _ = fused(t, "rms_norm", E4M3, SPELLINGS["static_div"][0](E4M3))
    with pytest.raises(AssertionError):  # a clamp at 240 instead of 448
        assert_same_bits(q_static, (y_static.float() / STATIC_SCALE).clamp(-240, 240).to(E4M3), "q")
    _, scale_div, y_div, _ = fused(t, "rms_norm", E4M3, dict(scale_form="max/amax", apply="mul"))
    with pytest.raises(AssertionError):  # max/amax as one division is not Python's qmax / amax
        assert_same_bits(scale_div, 448.0 / y_div.float().abs().amax(-1, keepdim=True), "scale")


# ---- the returned values, autograd ------------------------------------------------------------

def test_return_layout_and_static_scale_is_the_given_tensor(path):
    t = inputs(3, 128, BF16, "rms_norm")
    given = torch.tensor([0.05])
    q, scale, y, s = normfuse.add_rms_norm(t["x"], t["residual"], t["weight"], quant=Fp8Quant(E4M3, scale=given))
    assert scale is given and y is None and s.shape == (3, 128) and q.dtype == E4M3
    q, scale, y, s = normfuse.add_rms_norm(t["x"], None, t["weight"], quant=Fp8Quant(E5M2, group=32),
                                           return_sum=False)
    assert scale.shape == (3, 4) and y is None and s is None
    # one group as wide as the row is the per-row scale
    _, per_row, _, _ = normfuse.add_rms_norm(t["x"], None, t["weight"], quant=Fp8Quant(E4M3, group=128))
    assert per_row.shape == (3, 1)
    # without quant: today's return values
    assert len(normfuse.add_rms_norm(t["x"], t["residual"], t["weight"])) == 2


@pytest.mark.parametrize("return_norm", (True, False))
def test_gradients_flow_through_y_and_s_unchanged(path, return_norm):
    """q and scale are not differentiable; y and s get exactly the gradients of add_norm without
    the epilogue (a training graph reading y and s is unchanged)."""
    t = inputs(4, 96, BF16, "layer_norm")
    grads, outs = [], []
    for quant in (True, False):
        leaves = {k: t[k].clone().requires_grad_() for k in ("x", "residual", "weight", "bias")}
        args = (leaves["x"], leaves["residual"], leaves["weight"], leaves["bias"])
        if quant:
            q, scale, y, s = normfuse.add_layer_norm(*args, quant=Fp8Quant(E4M3, group=32), return_norm=return_norm)
            assert not q.requires_grad and not scale.requires_grad
            outs.append(q)
        else:
            y, s = normfuse.add_layer_norm(*args)
        loss = s.float().square().sum() + (y.float().sin().sum() if return_norm or not quant else 0)
        if not return_norm and not quant:
            loss = s.float().square().sum()
        loss.backward()
        grads.append([leaves[k].grad for k in ("x", "residual", "weight", "bias")])
    for with_quant, without in zip(*grads):
        if without is None or not return_norm and with_quant is None:
            continue
        assert torch.equal(with_quant, without)


# ---- ops: opcheck, compile -------------------------------------------------------------------

def _quant_op_args(t, kind, store_y, qdtype, scale, group, form, amax_min, scale_min, apply, clamp, scale_out):
    return (t["x"], t["residual"], t["weight"], t["bias"], kind, 1e-5, 0.0, 1.0, BF16, None, BF16, True, True, None,
            None, None, None, 0.0, None, store_y, qdtype, scale, group, form, amax_min, scale_min, apply, clamp,
            scale_out)


def _op_samples():
    t = inputs(3, 64, BF16, "layer_norm")
    t = {k: (v.requires_grad_() if v is not None else None) for k, v in t.items()}
    yield _quant_op_args(t, "layer_norm", True, E4M3, None, None, "amax/max", 1e-12, None, "div", 448.0, "scale")
    yield _quant_op_args(t, "rms_norm", False, E5M2, None, 32, "max*(1/amax)", None, 1e-6, "mul", None,
                         "reciprocal")
    yield _quant_op_args(t, "rms_norm", True, E4M3, torch.tensor([0.02]), None, "amax/max", None, None,
                         "mul_reciprocal", 448.0, "scale")


@pytest.mark.parametrize("args", list(_op_samples()), ids=("per_row", "per_group", "static"))
def test_opcheck(path, args):
    torch.library.opcheck(torch.ops.normfuse.add_norm_quant_fwd.default, args)


def test_fake_shapes_and_dtypes():
    from torch._subclasses.fake_tensor import FakeTensorMode
    t = inputs(6, 256, BF16, "rms_norm")
    with FakeTensorMode() as mode:
        fake = {k: None if v is None else mode.from_tensor(v) for k, v in t.items()}
        for group, static, shape in ((None, None, (6, 1)), (64, None, (6, 4)), (None, torch.tensor([1.0]), (0,))):
            args = _quant_op_args(fake, "rms_norm", False, E5M2, None if static is None else mode.from_tensor(static),
                                  group, "amax/max", None, None, "div", None, "scale")
            y, s, mean, rstd, y1, q_bits, scale = torch.ops.normfuse.add_norm_quant_fwd(*args)
            assert q_bits.shape == (6, 256) and q_bits.dtype == torch.uint8
            assert scale.shape == shape and scale.dtype == FP32
            assert y.numel() == 0 and s.shape == (6, 256)


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("spelling,group", [("amax_div", None), ("torchao", 64), ("static_div", None)])
def test_compile_fullgraph(spelling, group):
    t = inputs(4, 128, BF16, "rms_norm")
    options = SPELLINGS[spelling][0](E4M3)

    def block(x, r, w):
        q, scale, y, s = normfuse.add_rms_norm(x, r, w, quant=Fp8Quant(E4M3, group=group, **options),
                                               return_norm=True)
        return q, scale, y.float().sum() + s.float().square().sum()

    runs = []
    for fn in (block, torch.compile(block, fullgraph=True, backend="aot_eager")):
        leaves = [t[k].clone().requires_grad_() for k in ("x", "residual", "weight")]
        q, scale, loss = fn(*leaves)
        loss.backward()
        runs.append([q.view(torch.uint8), scale, loss] + [v.grad for v in leaves])
    for eager, compiled in zip(*runs):
        assert torch.equal(eager, compiled)


def test_traced_calls_record_the_quant_op(fresh_dynamo):
    seen = []

    def backend(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes)
        return gm

    t = inputs(2, 64, BF16, "rms_norm")
    torch.compile(lambda x, r, w: normfuse.add_rms_norm(x, r, w, quant=Fp8Quant(E4M3))[0], backend=backend,
                  fullgraph=True)(t["x"], t["residual"], t["weight"])
    assert any("normfuse.add_norm_quant_fwd" in s for s in seen), seen


# ---- bad input: the error names the problem and the fix -------------------------------------

@pytest.mark.parametrize("kwargs,error,words", [
    (dict(dtype=torch.int8), UnsupportedDtypeError, "fp8 dtype"),
    (dict(dtype=torch.float8_e4m3fnuz), UnsupportedDtypeError, "torch.float8_e4m3fn"),
    (dict(group=48), InvalidOptionError, "power of two"),
    (dict(group=True), InvalidOptionError, "power of two"),
    (dict(group=256), ShapeMismatchError, "does not divide the normalized dim N=96"),
    (dict(scale=torch.tensor([1.0, 2.0])), InvalidOptionError, "1-element fp32 tensor"),
    (dict(scale=torch.tensor(1.0, dtype=torch.float16)), InvalidOptionError, "1-element fp32 tensor"),
    (dict(scale=0.5), InvalidOptionError, "1-element fp32 tensor"),
    (dict(scale=torch.tensor([1.0]), group=32), InvalidOptionError, "quant_scale=None"),
    (dict(scale=torch.tensor([1.0]), amax_min=1e-12), InvalidOptionError, "shape a dynamic scale"),
    (dict(scale=torch.tensor([1.0]), scale_out="reciprocal"), InvalidOptionError, "dynamic scale"),
    (dict(scale_form="amax/qmax"), InvalidOptionError, "Did you mean 'amax/max'?"),
    (dict(apply="multiply"), InvalidOptionError, "'div', 'mul', 'mul_reciprocal'"),
    (dict(scale_out="inverse"), InvalidOptionError, "quant_scale_out"),
    (dict(clamp=-448.0), InvalidOptionError, "> 0"),
    (dict(amax_min=float("nan")), InvalidOptionError, "finite"),
    (dict(weight1=torch.ones(96)), InvalidOptionError, "weight1"),
])
def test_bad_arguments(kwargs, error, words):
    """``kwargs``: Fp8Quant's fields, or add_norm's weight1 (the spec is built inside pytest.raises:
    it checks its own values)."""
    with pytest.raises(error) as info:
        fields = {k: v for k, v in kwargs.items() if k != "weight1"}
        normfuse.add_rms_norm(torch.randn(4, 96), torch.randn(4, 96), torch.ones(96), quant=Fp8Quant(**fields),
                              weight1=kwargs.get("weight1"))
    assert isinstance(info.value, NormfuseError) and words in str(info.value)


def test_static_scale_requiring_grad_is_refused():
    with pytest.raises(InvalidOptionError, match="detach"):
        normfuse.add_rms_norm(torch.randn(2, 8), None, None,
                              quant=Fp8Quant(E4M3, scale=torch.tensor([1.0], requires_grad=True)))


# ---- DTensor: q and the scales shard like the rows ----------------------------------------------

def _dtensor_quant_worker(rank):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh

    from normfuse.kernels.sharding import register
    assert register()
    mesh = init_device_mesh("cpu", (2,))
    t = inputs(12, 64, FP32, "rms_norm")
    results = {}
    for placement in (Shard(0), Shard(1), Replicate()):
        for group, static in ((None, None), (16, None), (None, torch.tensor([0.02]))):
            def run(dist):
                x, r = (t[k].reshape(2, 6, 64) for k in ("x", "residual"))
                w = t["weight"]
                scale_in = static
                if dist:
                    x, r = (distribute_tensor(v, mesh, [placement]) for v in (x, r))
                    w = distribute_tensor(w, mesh, [Replicate()])
                    scale_in = None if static is None else distribute_tensor(static, mesh, [Replicate()])
                q, scale, y, s = normfuse.add_rms_norm(x, r, w, quant=Fp8Quant(E4M3, scale=scale_in, group=group),
                                                       return_norm=True)
                return q, scale, y, s
            got, want = run(True), run(False)
            # gloo gathers no fp8: q is compared in fp32 (exact)
            got = [a.float() if a.dtype == E4M3 else a for a in got]
            same = all(torch.equal(a.full_tensor() if hasattr(a, "full_tensor") else a, e.float())
                       for a, e in zip(got, want))
            results[f"{placement} {group} {static is not None}"] = (
                same, tuple(got[0].placements) == (placement,))
    return results


def test_quant_on_dtensors_matches_local_tensors():
    from helpers import run_on_ranks
    for rank, results in enumerate(run_on_ranks(_dtensor_quant_worker)):
        assert len(results) == 9
        for case, (same, placement_kept) in results.items():
            assert same and placement_kept, (rank, case)


# ---- GPU: every mode, compiled kernels --------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("n", (4096, 8192))
@pytest.mark.parametrize("qdtype", list(QDTYPES.values()), ids=list(QDTYPES))
@pytest.mark.parametrize("spelling", list(SPELLINGS))
def test_gpu(spelling, qdtype, n):
    """Each spelling on a CUDA/ROCm device, bf16, per row and per group of 128: y within the rounding
    budget of eager's, q and scale bit for bit from the kernel's y."""
    options, eager_quant = SPELLINGS[spelling]
    for group in (None, 128) if spelling in DYNAMIC else (None,):
        t = {k: None if v is None else v.cuda() for k, v in inputs(256, n, BF16, "rms_norm").items()}
        opts = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in options(qdtype).items()}
        q, scale, y, s = fused(t, "rms_norm", qdtype, opts, group)
        y_eager, s_eager = eager_norm(t, "rms_norm")
        assert_within_rounding_budget(y.cpu(), y_eager.cpu(), "y")
        assert_same_bits(s.cpu(), s_eager.cpu(), "s")
        q_eager, scale_eager = eager_quant(y, qdtype, group)
        assert_same_bits(q.cpu(), q_eager.cpu(), "q")
        assert_same_bits(scale.cpu(), scale_eager.cpu(), "scale")
