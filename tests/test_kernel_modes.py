"""add_norm's modes (x1, rowscale, weight1/bias1, dropout) against plain PyTorch.

Each mode runs three ways, as in test_kernels.py: the candidate (normfuse.add_norm on the
reference path, or the Triton kernels under the interpreter), the same function composed of
plain torch ops in the working dtype, and that composition in fp64 with autograd. Every output
and gradient must satisfy the project's rule (normfuse.tolerances). Dropout is replayed from
the mask ``normfuse.kernels.dropout_keep_mask`` returns for the path under test.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import normfuse
from normfuse.errors import InvalidOptionError, ShapeMismatchError
from normfuse.kernels import Dropout, dropout_keep_mask
from normfuse.tolerances import within_tolerance

BF16, FP16, FP32, FP64 = torch.bfloat16, torch.float16, torch.float32, torch.float64
PATHS = ("reference", "triton")
MODES = {
    "x1": dict(x1=True),
    "rowscale": dict(rowscale=True),
    "weight1": dict(weight1=True),
    "weight1_bias1": dict(weight1=True, bias1=True),
    "dropout": dict(dropout=0.37),
    "all": dict(x1=True, rowscale=True, weight1=True, bias1=True, dropout=0.37),
}


@pytest.fixture(params=PATHS)
def path(request):
    """CPU tensors through the reference, or through the Triton kernels (interpreter)."""
    if request.param == "triton":
        request.getfixturevalue("triton_cpu")
    return request.param


def make(rows, n, dtype, kind, *, residual=True, x1=False, rowscale=False, weight1=False, bias1=False,
         dropout=0.0, seed=0):
    """The inputs of one case (leaves without grad; rowscale never takes grad)."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape, std=1.0, mean=0.0):
        return (torch.randn(*shape, generator=gen) * std + mean).to(dtype)

    bias = kind == "layer_norm"
    return dict(
        x=randn(rows, n), residual=randn(rows, n) if residual else None,
        weight=randn(n, std=0.5, mean=1.0), bias=randn(n, std=0.1) if bias else None,
        x1=randn(rows, n) if x1 else None,
        rowscale=(torch.rand(rows, generator=gen) + 0.5).to(dtype) if rowscale else None,
        weight1=randn(n, std=0.5, mean=1.0) if weight1 else None,
        bias1=randn(n, std=0.1) if bias1 else None, dropout_p=dropout)


def composed(t, keep, kind, eps, round_sum_first):
    """The modes in plain torch ops: (y, y1, s). round_sum_first: each step in the working dtype
    (what eager computes); else the branch and sum in fp32, normalized, s rounded after."""
    x, r, x1, rs, p = t["x"], t["residual"], t["x1"], t["rowscale"], t["dropout_p"]
    acc = x.dtype if round_sum_first or x.dtype == FP64 else FP32
    h = x.to(acc)
    if keep is not None:
        h = h * keep * (1.0 / (1.0 - p))              # native_dropout: input * mask * scale
    if rs is not None:
        h = (h * rs[..., None]).to(x.dtype) if round_sum_first else h * rs.to(acc)[..., None]
    if x1 is not None:
        h = h + x1.to(acc) if not round_sum_first else h + x1
    u = h if r is None else (h + r if round_sum_first else h + r.to(acc))
    n = u.shape[-1]

    def norm(w, b):
        if w is None:
            return None
        w, b = w.to(u.dtype), None if b is None else b.to(u.dtype)
        out = F.layer_norm(u, (n,), w, b, eps) if kind == "layer_norm" else F.rms_norm(u, (n,), w, eps)
        return out if kind == "layer_norm" or b is None else out + b
    y, y1 = norm(t["weight"], t["bias"]), norm(t["weight1"], t["bias1"])
    return y.to(x.dtype), None if y1 is None else y1.to(x.dtype), u.to(x.dtype)


def ours(t, kind, eps, round_sum_first, seed):
    kw = {k: t[k] for k in ("x1", "rowscale", "weight1", "bias1")}
    dropout = Dropout(t["dropout_p"], seed=seed) if t["dropout_p"] else None
    out = normfuse.add_norm(t["x"], t["residual"], t["weight"], t["bias"], kind=kind, eps=eps,
                            round_sum_first=round_sum_first, dropout=dropout, **kw)
    return (out[0], None, out[1]) if t["weight1"] is None else out


GRAD_NAMES = ("x", "residual", "weight", "bias", "x1", "weight1", "bias1")


def run_with_grads(fn, t, cotangents):
    """fn's outputs and the grads of the differentiable inputs for loss = sum(out * cotangent)."""
    t = {k: (v.detach().clone().requires_grad_(k in GRAD_NAMES) if isinstance(v, torch.Tensor) else v)
         for k, v in t.items()}
    outs = fn(t)
    loss = sum((o.double() * c).sum() for o, c in zip(outs, cotangents) if o is not None)
    leaves = [t[k] for k in GRAD_NAMES if t[k] is not None]
    grads = dict(zip([k for k in GRAD_NAMES if t[k] is not None], torch.autograd.grad(loss, leaves)))
    return outs, grads


def keep_mask(t, seed):
    return dropout_keep_mask(t["x"], t["dropout_p"], seed) if t["dropout_p"] else None


def check_modes(t, kind, round_sum_first, seed=1234, eps=1e-5):
    keep = keep_mask(t, seed)
    gen = torch.Generator().manual_seed(7)
    cot = [torch.randn(t["x"].shape, generator=gen, dtype=FP64).to(t["x"].device) for _ in range(3)]
    fp64 = {k: (v.double() if isinstance(v, torch.Tensor) else v) for k, v in t.items()}
    got = run_with_grads(lambda a: ours(a, kind, eps, round_sum_first, seed), t, cot)
    base = run_with_grads(lambda a: composed(a, keep, kind, eps, round_sum_first), t, cot)
    exact = run_with_grads(lambda a: composed(a, None if keep is None else keep.double(), kind, eps, True), fp64,
                           cot)
    for name, g, b, e in [*zip(("y", "y1", "s"), got[0], base[0], exact[0]),
                          *[(f"d{k}", got[1][k], base[1][k], exact[1][k]) for k in got[1]]]:
        if e is None:
            assert g is None, name
            continue
        assert g.dtype == b.dtype, name
        # weight grads sum over the rows: atol scales with their magnitude (the rule's default)
        ok, err, err_base, bound = within_tolerance(g, b, e, dtype=g.dtype)
        assert ok, f"{name}: error {err:.3g} > bound {bound:.3g} (plain torch's {err_base:.3g})"
    return got, base


# ---- each mode against plain torch and fp64, forward and backward -------------------------

@pytest.mark.parametrize("round_sum_first", (True, False), ids=("roundfirst", "fp32sum"))
@pytest.mark.parametrize("dtype", (BF16, FP32), ids=("bf16", "fp32"))
@pytest.mark.parametrize("kind", ("layer_norm", "rms_norm"))
@pytest.mark.parametrize("mode", list(MODES))
def test_mode_vs_fp64(path, mode, kind, dtype, round_sum_first):
    t = make(6, 96, dtype, kind, **MODES[mode])
    check_modes(t, kind, round_sum_first)


@pytest.mark.gpu
@pytest.mark.parametrize("n", (4096, 16384, 32768))
@pytest.mark.parametrize("kind", ("layer_norm", "rms_norm"))
@pytest.mark.parametrize("mode", list(MODES))
def test_gpu_modes(mode, kind, n):
    """Each mode on a CUDA/ROCm device (compiled kernels), bf16, one-block and looped rows."""
    t = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in make(64, n, BF16, kind, **MODES[mode]).items()}
    check_modes(t, kind, round_sum_first=True)


@pytest.mark.parametrize("mode,round_sum_first", [(m, i % 2 == 0) for i, m in enumerate(MODES)])
def test_mode_wide_rows(path, mode, round_sum_first):
    """Rows wider than one block: the looped forward (fp32 rows past 64 KiB) and backward
    kernels, a ragged last block, the mask regenerated in each pass."""
    kind = "layer_norm" if round_sum_first else "rms_norm"
    check_modes(make(2, 16400, FP32, kind, **MODES[mode]), kind, round_sum_first)


@pytest.mark.parametrize("mode", list(MODES))
def test_mode_bf16_looped_backward(path, mode):
    """bf16 rows of 8200: one forward block, the looped backward (rows past 16 KiB)."""
    check_modes(make(2, 8200, BF16, "layer_norm", **MODES[mode]), "layer_norm", True)


@pytest.mark.parametrize("mode", ("x1", "rowscale", "dropout", "all"))
def test_mode_without_residual(path, mode):
    """A mode alone forms the sum: s is returned (flash-attn returns it as its residual_out)."""
    t = make(5, 64, BF16, "layer_norm", residual=False, **MODES[mode])
    (y, _, s), _ = check_modes(t, "layer_norm", True)[0]
    assert s is not None and s.shape == t["x"].shape


def test_strided_inputs(path):
    """Rows with a stride (slices of wider tensors) and a strided rowscale: the same results as
    contiguous copies."""
    wide = make(6, 160, BF16, "layer_norm", **MODES["all"], seed=3)
    t = dict(wide, x=wide["x"][:, :96], residual=wide["residual"][:, 8:104], x1=wide["x1"][:, 64:],
             rowscale=torch.stack([wide["rowscale"], wide["rowscale"]], 1)[:, 0],
             weight=wide["weight"][:96], bias=wide["bias"][:96], weight1=wide["weight1"][:96],
             bias1=wide["bias1"][:96])
    assert not t["x"].is_contiguous() and not t["rowscale"].is_contiguous()
    dense = {k: (v.contiguous() if isinstance(v, torch.Tensor) else v) for k, v in t.items()}
    for got, want in zip(ours(t, "layer_norm", 1e-5, False, 8), ours(dense, "layer_norm", 1e-5, False, 8)):
        assert torch.equal(got, want)


def test_zero_rows(path):
    t = make(0, 32, BF16, "layer_norm", **MODES["all"])
    (y, y1, s), grads = run_with_grads(lambda a: ours(a, "layer_norm", 1e-5, True, 3), t,
                                       [torch.zeros(0, 32, dtype=FP64)] * 3)
    assert y.shape == y1.shape == s.shape == (0, 32)
    assert grads["weight1"].shape == (32,) and not grads["weight1"].any() and grads["x1"].shape == (0, 32)


@pytest.mark.parametrize("dtype", (BF16, FP32), ids=("bf16", "fp32"))
@pytest.mark.parametrize("mode", list(MODES))
def test_round_sum_first_equals_eager_bit_for_bit(mode, dtype):
    """Graph rounding: the forward equals the eager composition exactly, e.g.
    F.layer_norm((x * rs[..., None]).to(dtype) + x1 + r) for rowscale and x1."""
    t = make(6, 96, dtype, "layer_norm", **MODES[mode])
    keep = keep_mask(t, 99)
    for got, want in zip(ours(t, "layer_norm", 1e-5, True, 99), composed(t, keep, "layer_norm", 1e-5, True)):
        assert (got is None) == (want is None)
        if got is not None:
            assert torch.equal(got, want)
    if t["rowscale"] is not None and t["x1"] is not None and t["dropout_p"] == 0:
        x, r, x1, rs = t["x"], t["residual"], t["x1"], t["rowscale"].float()
        y, _, _ = ours(dict(t, rowscale=rs), "layer_norm", 1e-5, True, None)
        assert torch.equal(y, F.layer_norm((x * rs[..., None]).to(dtype) + x1 + r, (96,), t["weight"], t["bias"],
                                           1e-5))


@pytest.mark.parametrize("round_sum_first", (True, False), ids=("roundfirst", "fp32sum"))
@pytest.mark.parametrize("mode", list(MODES))
def test_sum_bit_exact(path, mode, round_sum_first):
    """s is the same arithmetic on both paths: each rounded step, or the one fp32 sum rounded
    once, equals the plain-torch composition bit for bit (given the path's mask)."""
    t = make(5, 80, BF16, "rms_norm", **MODES[mode])
    keep = keep_mask(t, 31)
    s = ours(t, "rms_norm", 1e-6, round_sum_first, 31)[2]
    assert torch.equal(s, composed(t, keep, "rms_norm", 1e-6, round_sum_first)[2])


def test_fp32_dropout_forward_bit_exact_both_sum_modes():
    """In fp32 every rounding of the steps is the identity: both sum modes equal the composition."""
    t = make(8, 128, FP32, "rms_norm", dropout=0.37, x1=True)
    keep = keep_mask(t, 5)
    for round_sum_first in (True, False):
        got = ours(t, "rms_norm", 1e-6, round_sum_first, 5)
        want = composed(t, keep, "rms_norm", 1e-6, True)
        assert torch.equal(got[0], want[0]) and torch.equal(got[2], want[2])


# ---- dropout ------------------------------------------------------------------------------

def test_dropout_statistics(path):
    """The keep fraction of 2^16 elements is within 4 sigma of 1 - p; the kept elements are
    scaled by exactly 1 / (1 - p) (x fp32: x * keep * scale is s without a residual)."""
    p = 0.37
    x = torch.randn(64, 1024)
    keep = dropout_keep_mask(x, p, 11)
    assert keep.dtype == torch.bool and keep.shape == x.shape
    sigma = math.sqrt(p * (1 - p) / x.numel())
    assert abs(keep.float().mean().item() - (1 - p)) <= 4 * sigma
    _, s = normfuse.add_rms_norm(x, None, None, dropout=Dropout(p, seed=11))
    assert torch.equal(s, x * keep * (1 / (1 - p)))


def test_dropout_seeds(path):
    t = make(16, 256, BF16, "rms_norm", dropout=0.37)
    args = (t["x"], t["residual"], t["weight"])
    first = normfuse.add_rms_norm(*args, dropout=Dropout(0.37, seed=3))
    again = normfuse.add_rms_norm(*args, dropout=Dropout(0.37, seed=torch.tensor(3)))
    other = normfuse.add_rms_norm(*args, dropout=Dropout(0.37, seed=4))
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    assert not torch.equal(first[1], other[1])
    assert torch.equal(dropout_keep_mask(t["x"], 0.37, 3), dropout_keep_mask(t["x"], 0.37, torch.tensor(3)))
    # a seed drawn from a generator: the same generator state gives the same mask
    drawn = [normfuse.add_rms_norm(*args, dropout=Dropout(0.37, generator=torch.Generator().manual_seed(8)))[1]
             for _ in range(2)]
    assert torch.equal(*drawn) and not torch.equal(drawn[0], first[1])


def test_dropout_p0_is_no_dropout_and_draws_nothing(path):
    t = make(8, 128, BF16, "layer_norm")
    args = (t["x"], t["residual"], t["weight"], t["bias"])
    state = torch.get_rng_state()
    assert all(torch.equal(a, b) for a, b in zip(normfuse.add_layer_norm(*args, dropout=Dropout(0.0)),
                                                 normfuse.add_layer_norm(*args)))
    assert torch.equal(torch.get_rng_state(), state)
    normfuse.add_layer_norm(*args, dropout=Dropout(0.1))  # a seed drawn from torch's generator
    assert not torch.equal(torch.get_rng_state(), state)


def test_dropout_grad_uses_forward_mask(path):
    """dx = ds * keep * scale: zero exactly where the forward dropped x, and the backward
    regenerates the mask whether s was kept (round_sum_first) or the fp32 sum rebuilt."""
    t = make(8, 64, FP32, "layer_norm", dropout=0.5)
    keep = keep_mask(t, 21)
    for round_sum_first in (True, False):
        x = t["x"].clone().requires_grad_()
        r = t["residual"].clone().requires_grad_()
        y, s = normfuse.add_layer_norm(x, r, t["weight"], t["bias"], dropout=Dropout(0.5, seed=21),
                                       round_sum_first=round_sum_first)
        (y.sum() * 0 + (y * torch.arange(64.0)).sum() + s.sum()).backward()
        assert torch.equal(x.grad == 0, ~keep)
        assert torch.allclose(x.grad, r.grad * keep * 2.0, rtol=0, atol=0)


# ---- weight1 ------------------------------------------------------------------------------

def test_y1_alone_needs_no_grad_of_y(path):
    """Only y1 used: the grads come from dy1 alone; weight's grad is None (y unused)."""
    t = make(4, 64, FP32, "layer_norm", weight1=True, bias1=True)
    w1 = t["weight1"].clone().requires_grad_()
    x = t["x"].clone().requires_grad_()
    _, y1, _ = normfuse.add_layer_norm(x, t["residual"], t["weight"], t["bias"], weight1=w1, bias1=t["bias1"])
    y1.sum().backward()
    n = F.layer_norm(t["x"] + t["residual"], (64,), None, None, 1e-5)
    assert torch.allclose(w1.grad, n.sum(0), atol=1e-5)
    assert x.grad is not None and torch.isfinite(x.grad).all()


# ---- ops: opcheck, compile ----------------------------------------------------------------

def _op_samples():
    t = make(3, 40, BF16, "layer_norm", x1=True, rowscale=True, weight1=True, bias1=True)
    x, r, w, b, x1, w1, b1 = (t[k].requires_grad_() for k in ("x", "residual", "weight", "bias", "x1", "weight1",
                                                                "bias1"))
    rs, seed = t["rowscale"], torch.tensor(17)
    yield "add_norm_fwd", (x, r, w, b, "layer_norm", 1e-5, 0.0, 1.0, BF16, None, BF16, True, True, x1, rs, w1, b1,
                           0.3, seed)
    yield "add_norm_fwd", (x, r, w, None, "rms_norm", 1e-6, 1.0, 0.5, FP32, BF16, FP32, False, False, x1, None, w1,
                           None, 0.0, None)
    yield "add_norm_fwd", (x, None, w, b, "layer_norm", 1e-5, 0.0, 1.0, BF16, None, BF16, True, False, None, rs, None,
                           None, 0.2, seed)
    w, w1 = w.detach(), w1.detach()
    dy, dy1, s = (make(3, 40, BF16, "rms_norm", seed=i)["x"] for i in (4, 5, 6))
    stats = torch.randn(3), torch.rand(3) + 0.5
    yield "add_norm_bwd", (dy, dy, s, *stats, w, "layer_norm", 0.0, 0.5, False, BF16, BF16, FP32, dy1, w1, BF16,
                           FP16, rs, 0.3, seed)
    yield "dropout_keep_mask", (x.detach(), 0.3, seed)


@pytest.mark.parametrize("name,args", list(_op_samples()), ids=lambda v: v if isinstance(v, str) else "")
def test_opcheck(path, name, args):
    torch.library.opcheck(getattr(torch.ops.normfuse, name).default, args)


@pytest.mark.parametrize("round_sum_first,store_sum", [(False, True), (True, False)])
def test_op_autograd_equals_functional(path, round_sum_first, store_sum):
    """The custom op's own autograd (what traced graphs run) gives the functional path's grads,
    also where the backward rebuilds the norm input with the forward backend's mask (the fp32
    sum normalized, or s not stored)."""
    t = make(4, 48, BF16, "layer_norm", **MODES["all"])
    names = ("x", "residual", "weight", "bias", "x1", "weight1", "bias1")
    seed = torch.tensor(77)
    runs = []
    for direct in (False, True):
        x, r, w, b, x1, w1, b1 = (t[k].clone().requires_grad_() for k in names)
        if direct:
            y, s, _, _, y1 = torch.ops.normfuse.add_norm_fwd(
                x, r, w, b, "layer_norm", 1e-5, 0.0, 1.0, BF16, None, BF16, store_sum, round_sum_first, x1,
                t["rowscale"], w1, b1, 0.37, seed)
        else:
            y, y1, s = normfuse.add_layer_norm(x, r, w, b, x1=x1, rowscale=t["rowscale"], weight1=w1, bias1=b1,
                                               dropout=Dropout(0.37, seed=seed), round_sum_first=round_sum_first)
        loss = (y.float() * 3).sum() + y1.float().square().sum() + (s.float().sum() if store_sum else 0)
        loss.backward()
        runs.append([y, y1] + [v.grad for v in (x, r, w, b, x1, w1, b1)])
    for name, functional, direct in zip(("y", "y1") + names, *runs):
        assert torch.allclose(functional.float(), direct.float(), rtol=0, atol=1e-6), name


@pytest.mark.usefixtures("fresh_dynamo")
def test_compile_fullgraph_with_modes():
    t = make(4, 64, BF16, "layer_norm", x1=True, rowscale=True, weight1=True, bias1=True, dropout=0.25)
    seed = torch.tensor(5)

    def block(x, r, x1, rs, w, b, w1, b1):
        y, y1, s = normfuse.add_layer_norm(x, r, w, b, x1=x1, rowscale=rs, weight1=w1, bias1=b1,
                                           dropout=Dropout(0.25, seed=seed))
        return (y.float() * 2 + y1.float()).sum() + s.float().square().sum()

    names = ("x", "residual", "x1", "rowscale", "weight", "bias", "weight1", "bias1")
    runs = []
    for fn in (block, torch.compile(block, fullgraph=True, backend="aot_eager")):
        leaves = [t[k].clone().requires_grad_(k != "rowscale") for k in names]
        loss = fn(*leaves)
        loss.backward()
        runs.append([loss] + [v.grad for v in leaves if v.requires_grad])
    for eager, compiled in zip(*runs):
        assert torch.equal(eager, compiled)


# ---- bad input: the error names the fix ---------------------------------------------------

@pytest.mark.parametrize("kwargs,error,words", [
    (dict(rowscale=torch.ones(4, requires_grad=True)), InvalidOptionError, ".detach()"),
    (dict(bias1=torch.zeros(8)), InvalidOptionError, "pass weight1"),
    # a Dropout checks its values when it is built: built inside pytest.raises
    (lambda: dict(dropout=Dropout(1.0)), InvalidOptionError, "[0, 1)"),
    (lambda: dict(dropout=Dropout(-0.1)), InvalidOptionError, "[0, 1)"),
    (lambda: dict(dropout=Dropout("0.1")), InvalidOptionError, "[0, 1)"),
    (lambda: dict(dropout=Dropout(0.1, seed=torch.tensor(1.5))), InvalidOptionError, "int64 CPU tensor"),
    (lambda: dict(dropout=Dropout(0.1, seed=torch.tensor([1, 2]))), InvalidOptionError, "int64 CPU tensor"),
    (lambda: dict(dropout=Dropout(0.1, seed=1, generator=torch.Generator())), InvalidOptionError, "not both"),
    (lambda: dict(dropout=Dropout(0.1, generator=1234)), InvalidOptionError, "a CPU torch.Generator"),
    (dict(x1=torch.zeros(4, 7)), ShapeMismatchError, "reshape x1"),
    (dict(rowscale=torch.ones(8)), ShapeMismatchError, "x.shape[:-1]"),
    (dict(weight1=torch.ones(7)), ShapeMismatchError, "weight1 must have shape (8,)"),
    (dict(x1=torch.zeros(4, 8, dtype=torch.int32)), normfuse.errors.UnsupportedDtypeError, "x1.to("),
])
def test_bad_mode_arguments(kwargs, error, words):
    x, r = torch.randn(4, 8), torch.randn(4, 8)
    with pytest.raises(error) as info:
        normfuse.add_rms_norm(x, r, torch.ones(8), **(kwargs() if callable(kwargs) else kwargs))
    assert words in str(info.value)


def test_op_with_dropout_needs_a_seed():
    x = torch.randn(4, 8)
    with pytest.raises(InvalidOptionError, match="without a seed; pass seed"):
        torch.ops.normfuse.add_norm_fwd(x, None, None, None, "rms_norm", 1e-6, 0.0, 1.0, FP32, None, FP32, True, True,
                                        None, None, None, None, 0.5, None)


def test_rowscale_requiring_grad_is_fine_without_grad():
    rs = torch.ones(4, requires_grad=True)
    with torch.no_grad():
        y, s = normfuse.add_rms_norm(torch.randn(4, 8), torch.randn(4, 8), None, rowscale=rs)
    assert y.shape == (4, 8)


# ---- DTensor: the modes shard like x ------------------------------------------------------

def _dtensor_modes_worker(rank):
    """x1 takes x's placement, rowscale its rows', weight1/bias1 are replicated: the outputs
    and grads equal the local tensors' run, and y1 keeps x's placement."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh

    from normfuse.kernels.sharding import register
    assert register()
    mesh = init_device_mesh("cpu", (2,))
    t = make(12, 16, FP32, "layer_norm", x1=True, rowscale=True, weight1=True, bias1=True)
    shape = (2, 6, 16)
    names = ("x", "residual", "x1", "weight", "bias", "weight1", "bias1")
    results = {}
    for placement in (Shard(0), Shard(1), Replicate()):
        def run(dist):
            leaves = [t[k].reshape(shape if t[k].dim() == 2 else -1).clone().requires_grad_() for k in names]
            rs = t["rowscale"].reshape(shape[:-1])
            if dist:
                acts = (placement,) * 3
                leaves = [distribute_tensor(v.detach(), mesh, [p]).requires_grad_()
                          for v, p in zip(leaves, acts + (Replicate(),) * 4)]
                rs = distribute_tensor(rs, mesh, [placement])
            x, r, x1, w, b, w1, b1 = leaves
            y, y1, s = normfuse.add_layer_norm(x, r, w, b, x1=x1, rowscale=rs, weight1=w1, bias1=b1)
            (y.square().sum() + y1.sin().sum() + s.cos().sum()).backward()
            outs = [y, y1, s] + [v.grad for v in leaves]
            return [o.full_tensor() if hasattr(o, "full_tensor") else o for o in outs], y1
        got, y1 = run(True)
        want, _ = run(False)
        results[str(placement)] = (tuple(y1.placements) == (placement,),
                                   max((a - e).abs().max().item() for a, e in zip(got, want)))
    return results


def test_modes_on_dtensors_match_local_tensors():
    from helpers import run_on_ranks
    for rank, results in enumerate(run_on_ranks(_dtensor_modes_worker)):
        assert len(results) == 3
        for case, (placement_kept, max_err) in results.items():
            assert placement_kept, (rank, case)
            assert max_err < 1e-5, (rank, case, max_err)
