"""add_norm's gated norms (gate before / after the norm, silu / sigmoid) and grouped statistics
(norm_group), against the modules of the models that use them.

* Reference path: y (and s) equal HF's MambaRMSNormGated (Mamba2), NemotronHRMSNormGated,
  Qwen3NextRMSNormGated and KimiLinearRMSNormGated bit for bit, called on the same inputs.
* Gradients (dx, dresidual, dgate, dweight) and the Triton path (whose exp differs from torch's in
  the last bits) are held to the project's rule (normfuse.tolerances), three ways as in
  test_kernel_modes.py: |ours - fp64| <= factor * |HF in the working dtype - fp64| + atol, with the HF
  module itself run in fp64 as the reference.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import normfuse
from normfuse.errors import InvalidOptionError, NormfuseError, ShapeMismatchError, UnsupportedDtypeError
from normfuse.kernels import Fp8Quant, Gate
from normfuse.kernels.specs import OP_OUTPUTS
from normfuse.tolerances import within_tolerance
from normfuse.zoo import prepare_torchvision

from kernel_cases import BF16, FP32, FP64, assert_same_bits, assert_within_rounding_budget

# spawned DTensor ranks import this module without the conftest: torchvision needs its schemas first
prepare_torchvision()
pytest.importorskip("transformers")
from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearRMSNormGated  # noqa: E402
from transformers.models.mamba2.modeling_mamba2 import MambaRMSNormGated  # noqa: E402
from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHRMSNormGated  # noqa: E402
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNormGated  # noqa: E402

EPS = 1e-6


@pytest.fixture(params=("reference", "triton"))
def path(request):
    """CPU tensors through the reference, or through the Triton kernels (interpreter)."""
    if request.param == "triton":
        request.getfixturevalue("triton_cpu")
    return request.param


# ---- the models' modules and the add_norm options that reproduce them ------------------------

def _module(name, n, group, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    module = {"mamba2": lambda: MambaRMSNormGated(n, group, eps=EPS),
              "nemotron_h": lambda: NemotronHRMSNormGated(n, group, eps=EPS),
              "qwen3_next": lambda: Qwen3NextRMSNormGated(n, eps=EPS),
              "kimi_linear": lambda: KimiLinearRMSNormGated(n, eps=EPS)}[name]()
    with torch.no_grad():
        module.weight.copy_(torch.randn(n, generator=gen) * 0.5 + 1.0)
    return module.to(dtype)


def options(name, n, group, dtype):
    """add_norm's options for the module's forward on activations of ``dtype``."""
    if name in ("mamba2", "nemotron_h"):   # gate first, statistics per group, llama rounding
        return dict(gate_position="before", norm_group=group, norm_round_dtype=dtype)
    if name == "qwen3_next":               # llama rounding, then * silu(gate) in fp32, rounded to in_dtype
        return dict(gate_position="after", norm_round_dtype=dtype, gate_out_dtype=dtype)
    # kimi: the norm and weight in fp32, then * sigmoid(gate), rounded to in_dtype
    return dict(gate_position="after", gate_activation="sigmoid", out_dtype=FP32, gate_out_dtype=dtype)


MODULES = ("mamba2", "nemotron_h", "qwen3_next", "kimi_linear")
GROUPED = ("mamba2", "nemotron_h")  # only Mamba2's and NemotronH's gated norms group their statistics


def module_cases(sizes):
    """(name, n, groups) for each module and (n, groups) it takes: grouped ones only for GROUPED."""
    return [(name, n, groups) for name in MODULES for n, groups in sizes if groups == 1 or name in GROUPED]
_GATE_FIELDS = {"gate_position": "position", "gate_activation": "activation", "gate_out_dtype": "out_dtype"}


def gated(z, opts):
    """add_norm's keywords for gate z and ``opts`` (the reference's flat spelling): the gate's
    options as one Gate, the others as they are."""
    return dict({k: v for k, v in opts.items() if k not in _GATE_FIELDS},
                gate=Gate(z, **{_GATE_FIELDS[k]: v for k, v in opts.items() if k in _GATE_FIELDS}))


def inputs(rows, n, dtype, residual=True, seed=1):
    gen = torch.Generator().manual_seed(seed)

    def randn(std=1.0):
        return (torch.randn(*rows, n, generator=gen) * std).to(dtype)
    return dict(x=randn(2.0), residual=randn() if residual else None, gate=randn(1.5))


def hf(module, t):
    """(y, s): the add as a model writes it, then the module."""
    s = t["x"] if t["residual"] is None else t["x"] + t["residual"]
    return module(s, t["gate"]), (None if t["residual"] is None else s)


def ours(module, t, opts):
    return normfuse.add_rms_norm(t["x"], t["residual"], module.weight, EPS, **gated(t["gate"], opts))


# ---- the reference path: bit for bit with the modules ---------------------------------------

@pytest.mark.parametrize("residual", (True, False), ids=("res", "nores"))
@pytest.mark.parametrize("dtype", (BF16, FP32), ids=("bf16", "fp32"))
@pytest.mark.parametrize("name,n,groups", module_cases([(512, 1), (512, 8), (1024, 4), (640, 8)]))
def test_reference_equals_hf(name, n, groups, dtype, residual):
    group = n // groups
    module = _module(name, n, group, dtype)
    t = inputs((3, 5), n, dtype, residual)
    with torch.no_grad():
        y, s = ours(module, t, options(name, n, group, dtype))
        y_hf, s_hf = hf(module, t)
    assert_same_bits(y, y_hf, "y")
    if residual:
        assert_same_bits(s, s_hf, "s")
    else:
        assert s is None


def test_mamba2_with_an_fp32_weight_in_a_bf16_stream():
    """A weight left in fp32 (a model not cast to bf16): weight * h.to(bf16) promotes to fp32."""
    module = _module("mamba2", 256, 64, FP32)
    t = inputs((4,), 256, BF16)
    with torch.no_grad():
        y, _ = ours(module, t, options("mamba2", 256, 64, BF16))
        y_hf, _ = hf(module, t)
    assert y.dtype == FP32
    assert_same_bits(y, y_hf, "y")


# ---- gradients, and the Triton path: the project's rule -------------------------------------

def gated_rule(x, residual, gate, weight, bias=None, *, kind="rms_norm", eps=EPS, gate_position="before",
               gate_activation="silu", norm_group=None, acc=FP64, out_dtype=None):
    """(y, s) of a gated / grouped norm in plain torch ops, written apart from
    normfuse.kernels.reference: computed in ``acc`` from the inputs' values; the sum and y rounded
    to ``out_dtype`` when one is given (an eager composition), else left unrounded (the fp64 rule)::

        s = x + r;  a = silu(z) or sigmoid(z);  h = s * a ("before") or s
        per group of G columns: n = (h - mean?) / sqrt(mean((h - mean?)^2) + eps)
        y = round(n * w + b) * a ("after") or n * w + b
    """
    def rnd(t):
        return t if out_dtype is None else t.to(out_dtype).to(acc)

    s = x.to(acc) if residual is None else rnd(x.to(acc) + residual.to(acc))
    z = gate.to(acc)
    a = F.silu(z) if gate_activation == "silu" else torch.sigmoid(z)
    h = s * a if gate_position == "before" else s
    cols = h.shape[-1]
    hg = h.unflatten(-1, (cols // (norm_group or cols), norm_group or cols))   # (..., groups, G)
    centred = hg - hg.mean(-1, keepdim=True) if kind == "layer_norm" else hg
    n = (centred / torch.sqrt((centred * centred).mean(-1, keepdim=True) + eps)).flatten(-2)
    y = n * weight.to(acc)
    y = y if bias is None else y + bias.to(acc)
    y = rnd(y) * a if gate_position == "after" else y     # (y rounded, then gated and rounded again)
    if out_dtype is not None:
        y, s = y.to(out_dtype), s.to(out_dtype)
    return y, (None if residual is None else s)


def _run(fn, t, weight, cotangents):
    """fn's outputs and the grads of x, residual, gate and the weight under sum(out * cotangent)."""
    leaves = {k: (None if v is None else v.detach().clone().requires_grad_()) for k, v in t.items()}
    w = weight.detach().clone().requires_grad_()
    outs = fn(leaves, w)
    loss = sum((o.double() * c).sum() for o, c in zip(outs, cotangents) if o is not None)
    names = [k for k in ("x", "residual", "gate") if leaves[k] is not None]
    grads = torch.autograd.grad(loss, [leaves[k] for k in names] + [w])
    return list(outs), dict(zip(names + ["weight"], grads))


def check_three_way(name, n, group, dtype, rows=(4, 3), residual=True, seed=1):
    module = _module(name, n, group, dtype)
    t = inputs(rows, n, dtype, residual, seed)
    gen = torch.Generator().manual_seed(7)
    cot = [torch.randn(*rows, n, generator=gen, dtype=FP64) for _ in range(2)]
    opts = options(name, n, group, dtype)

    def with_weight(w):
        """The module with ``w`` as its weight (a leaf of this run)."""
        copy = type(module).__new__(type(module))
        copy.__dict__.update(module.__dict__)
        copy._parameters = {"weight": w}
        return copy

    got = _run(lambda a, w: ours(with_weight(w), a, opts), t, module.weight, cot)
    base = _run(lambda a, w: hf(with_weight(w), a), t, module.weight, cot)
    # fp64: the modules cast to fp32 by name, so the fp64 reference is the rule written out
    # (gated_rule: their formula in exact arithmetic)
    rule = {k: opts[k] for k in ("gate_position", "gate_activation", "norm_group") if k in opts}
    t64 = {k: None if v is None else v.double() for k, v in t.items()}
    exact = _run(lambda a, w: gated_rule(a["x"], a["residual"], a["gate"], w, **rule), t64, module.weight.double(),
                 cot)
    pairs = [*zip(("y", "s"), got[0], base[0], exact[0]),
             *[(f"d{k}", got[1][k], base[1][k], exact[1][k]) for k in got[1]]]
    for what, g, b, e in pairs:
        if e is None:
            continue
        assert g.dtype == b.dtype and g.shape == b.shape, what
        ok, err, err_base, bound = within_tolerance(g, b, e, dtype=g.dtype)
        assert ok, f"{name} {what}: error {err:.3g} > bound {bound:.3g} (HF's {err_base:.3g}, {g.dtype} row)"
    return got


@pytest.mark.parametrize("dtype", (BF16, FP32), ids=("bf16", "fp32"))
@pytest.mark.parametrize("name,n,groups", module_cases([(256, 1), (256, 8)]))
def test_grads_vs_fp64(path, name, n, groups, dtype):
    check_three_way(name, n, n // groups, dtype)


@pytest.mark.parametrize("name,n,groups", [("mamba2", 16384, 8), ("qwen3_next", 16400, 1), ("kimi_linear", 9000, 1)])
def test_wide_rows(path, name, n, groups):
    """Rows past one block: the looped backward (bf16 past 16 KiB; groups within a block of the
    loop, or the whole row), a ragged last block."""
    check_three_way(name, n, n // groups, BF16, rows=(2,))


def test_without_residual(path):
    check_three_way("mamba2", 128, 32, BF16, residual=False)


@pytest.mark.parametrize("kind", ("rms_norm", "layer_norm"))
@pytest.mark.parametrize("position", ("before", "after"))
def test_norm_group_and_layer_norm_vs_fp64(path, kind, position):
    """Groups and gates with layer_norm and a bias (no model spells it): three ways, the baseline the
    formula composed of torch ops in fp32 with the sum and y rounded to bf16, the reference that
    formula in fp64 (gated_rule, apart from reference.py)."""
    gen = torch.Generator().manual_seed(3)
    n, group = 256, 64
    t = {k: (torch.randn(4, n, generator=gen) * 2).to(BF16) for k in ("x", "residual", "gate")}
    w, b = (torch.randn(n, generator=gen) * 0.5 + 1).to(BF16), (torch.randn(n, generator=gen) * 0.1).to(BF16)
    opts = dict(kind=kind, eps=EPS, gate_position=position, norm_group=group)
    cot = [torch.randn(4, n, generator=gen, dtype=FP64) for _ in range(2)]

    def run(fn, tensors, weight, bias):
        leaves = {k: v.detach().clone().requires_grad_() for k, v in tensors.items()}
        wb = [weight.detach().clone().requires_grad_(), bias.detach().clone().requires_grad_()]
        outs = fn(leaves, *wb)
        loss = sum((o.double() * c).sum() for o, c in zip(outs, cot))
        return list(outs) + list(torch.autograd.grad(loss, [*leaves.values(), *wb]))

    got = run(lambda a, w_, b_: normfuse.add_norm(a["x"], a["residual"], w_, b_, **gated(a["gate"], opts)), t, w, b)
    rule = dict(kind=kind, gate_position=position, norm_group=group)
    base = run(lambda a, w_, b_: gated_rule(a["x"], a["residual"], a["gate"], w_, b_, acc=FP32, out_dtype=BF16,
                                            **rule), t, w, b)
    t64 = {k: v.double() for k, v in t.items()}
    exact = run(lambda a, w_, b_: gated_rule(a["x"], a["residual"], a["gate"], w_, b_, **rule), t64, w.double(),
                b.double())
    for what, g, b_, e in zip(("y", "s", "dx", "dresidual", "dgate", "dweight", "dbias"), got, base, exact):
        assert g.dtype == b_.dtype, what
        ok, err, err_base, bound = within_tolerance(g, b_, e, dtype=g.dtype)
        assert ok, f"{what}: error {err:.3g} > bound {bound:.3g} (torch composition's {err_base:.3g})"
    # the forward as the composition rounds it (the same rounding points, stats in fp32)
    assert_within_rounding_budget(got[0], base[0], "y")
    assert_same_bits(got[1], base[1], "s")


def test_norm_group_without_gate_equals_hf_grouping(path):
    """norm_group alone: Mamba2's grouped statistics with no gate (its forward with gate=None)."""
    module = _module("mamba2", 512, 128, BF16)
    t = inputs((6,), 512, BF16)
    with torch.no_grad():
        y, s = normfuse.add_rms_norm(t["x"], t["residual"], module.weight, EPS, norm_group=128, norm_round_dtype=BF16)
        y_hf = module(t["x"] + t["residual"])
    if path == "reference":
        assert_same_bits(y, y_hf, "y")
    else:
        assert_within_rounding_budget(y, y_hf, "y")


def test_group_not_a_power_of_two_runs_the_reference(path):
    """The Triton kernels take power-of-two groups; others run the reference on any device, with
    the same results."""
    module = _module("mamba2", 640, 80, BF16)
    t = inputs((5,), 640, BF16)
    with torch.no_grad():
        y, _ = ours(module, t, options("mamba2", 640, 80, BF16))
        assert_same_bits(y, hf(module, t)[0], "y")


def test_grad_of_gate_alone(path):
    """Only the gate requires grad: dz flows, nothing else is asked."""
    module = _module("qwen3_next", 64, 64, FP32)
    t = inputs((3,), 64, FP32)
    z = t["gate"].clone().requires_grad_()
    y, _ = normfuse.add_rms_norm(t["x"], t["residual"], module.weight.detach(), EPS,
                                 **gated(z, options("qwen3_next", 64, 64, FP32)))
    y.sum().backward()
    zr = t["gate"].clone().requires_grad_()
    module(t["x"] + t["residual"], zr).sum().backward()
    torch.testing.assert_close(z.grad, zr.grad, rtol=1e-5, atol=1e-6)


# ---- ops: opcheck, compile -------------------------------------------------------------------

def _op_samples():
    gen = torch.Generator().manual_seed(0)
    x, r, z = ((torch.randn(3, 64, generator=gen)).to(BF16).requires_grad_() for _ in range(3))
    w, b = (torch.randn(64, generator=gen).to(BF16).requires_grad_() for _ in range(2))
    yield "add_norm_fwd", (x, r, w, None, "rms_norm", 1e-6, 0.0, 1.0, BF16, BF16, BF16, True, True, None, None, None,
                           None, 0.0, None, z, "before", "silu", 16, None)
    yield "add_norm_fwd", (x, r, w, b, "layer_norm", 1e-5, 0.0, 1.0, BF16, None, FP32, True, False, None, None, None,
                           None, 0.0, None, z, "after", "sigmoid", None, BF16)
    yield "add_norm_fwd", (x, None, w, None, "rms_norm", 1e-6, 0.0, 1.0, BF16, None, BF16, False, True, None, None,
                           None, None, 0.0, None, None, "before", "silu", 32, None)
    dy, s = (torch.randn(3, 64, generator=gen).to(BF16) for _ in range(2))
    stats = torch.rand(12) + 0.5
    yield "add_norm_bwd", (dy, dy, s, torch.randn(12), stats, w.detach(), "layer_norm", 0.0, 1.0, False, BF16, BF16,
                           BF16, None, None, None, None, None, 0.0, None, z.detach(), "after", "silu", 16, b.detach())
    yield "add_norm_bwd", (dy, None, s, torch.randn(0), torch.rand(3) + 0.5, w.detach(), "rms_norm", 0.0, 1.0, False,
                           BF16, None, None, None, None, None, None, None, 0.0, None, z.detach(), "before", "sigmoid",
                           None, None)


@pytest.mark.parametrize("name,args", list(_op_samples()), ids=lambda v: v if isinstance(v, str) else "")
def test_opcheck(path, name, args):
    torch.library.opcheck(getattr(torch.ops.normfuse, name).default, args)


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("name", ("mamba2", "qwen3_next"))
def test_compile_fullgraph(name):
    module = _module(name, 128, 32, BF16)
    t = inputs((4,), 128, BF16)
    opts = options(name, 128, 32, BF16)

    def block(x, r, z, w):
        y, s = normfuse.add_rms_norm(x, r, w, EPS, **gated(z, opts))
        return y.float().square().sum() + s.float().sum()

    runs = []
    for fn in (block, torch.compile(block, fullgraph=True, backend="aot_eager")):
        leaves = [t["x"].clone().requires_grad_(), t["residual"].clone().requires_grad_(),
                  t["gate"].clone().requires_grad_(), module.weight.detach().clone().requires_grad_()]
        loss = fn(*leaves)
        loss.backward()
        runs.append([loss] + [v.grad for v in leaves])
    for eager, compiled in zip(*runs):
        assert torch.equal(eager, compiled)


def test_old_positional_calls_still_work():
    """add_norm_fwd and add_norm_bwd took new arguments at the end only: calls spelling the old ones
    (the pass's rewritten ATen graphs) are unchanged."""
    x = torch.randn(2, 16)
    y, s, mean, rstd, y1 = torch.ops.normfuse.add_norm_fwd(x, x, None, None, "rms_norm", 1e-6, 0.0, 1.0, FP32, None,
                                                           FP32, True, True, None, None, None, None)
    assert torch.equal(y, F.rms_norm(x + x, (16,), None, 1e-6))
    grads = torch.ops.normfuse.add_norm_bwd(y, None, s, mean, rstd, None, "rms_norm", 0.0, 1.0, False, FP32, None,
                                            None)
    names = OP_OUTPUTS["add_norm_bwd"]
    assert len(grads) == len(names) and grads[names.index("dgate")].numel() == 0


# ---- bad input ---------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,error,words", [
    # a Gate checks its own values when it is built: built inside pytest.raises
    (lambda: dict(gate=Gate(torch.zeros(4, 8))), ShapeMismatchError, "must have x's shape"),
    (lambda: dict(gate=Gate(torch.zeros(4, 96, dtype=torch.int32))), UnsupportedDtypeError, "gate.to(x.dtype)"),
    (lambda: dict(gate=Gate(torch.zeros(4, 96), position="inside")), InvalidOptionError, "'before', 'after'"),
    (lambda: dict(gate=Gate(torch.zeros(4, 96), activation="swish")), InvalidOptionError, "'silu', 'sigmoid'"),
    (lambda: dict(gate=Gate(torch.zeros(4, 96), activation="sigmiod")), InvalidOptionError,
     "Did you mean 'sigmoid'?"),
    (lambda: dict(norm_group=40), ShapeMismatchError, "divides the normalized dim N=96"),
    (lambda: dict(norm_group=0), ShapeMismatchError, "positive number"),
    (lambda: dict(gate=Gate(torch.zeros(4, 96)), weight1=torch.ones(96)), InvalidOptionError, "weight1"),
    (lambda: dict(norm_group=32, quant=Fp8Quant()), InvalidOptionError, "quantize the gated output"),
    (lambda: dict(gate=Gate(torch.zeros(4, 96), out_dtype=torch.int8)), UnsupportedDtypeError, "gate_out_dtype"),
])
def test_bad_arguments(kwargs, error, words):
    with pytest.raises(error) as info:
        normfuse.add_rms_norm(torch.randn(4, 96), torch.randn(4, 96), torch.ones(96), **kwargs())
    assert isinstance(info.value, NormfuseError) and words in str(info.value)


# ---- DTensor -------------------------------------------------------------------------------------

def _dtensor_gated_worker(rank):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh

    from normfuse.kernels.sharding import register
    assert register()
    mesh = init_device_mesh("cpu", (2,))
    gen = torch.Generator().manual_seed(0)
    x, r, z = (torch.randn(2, 6, 64, generator=gen) for _ in range(3))
    w = torch.randn(64, generator=gen)
    results = {}
    for placement in (Shard(0), Shard(1), Replicate()):
        for position, group in (("before", 16), ("after", None)):
            def run(dist):
                leaves = [v.clone() for v in (x, r, z)]
                wl = w.clone()
                if dist:
                    leaves = [distribute_tensor(v, mesh, [placement]) for v in leaves]
                    wl = distribute_tensor(wl, mesh, [Replicate()])
                leaves = [v.requires_grad_() for v in leaves]
                wl.requires_grad_()
                y, s = normfuse.add_rms_norm(leaves[0], leaves[1], wl, gate=Gate(leaves[2], position),
                                             norm_group=group)
                (y.square().sum() + s.sin().sum()).backward()
                outs = [y, s] + [v.grad for v in leaves] + [wl.grad]
                return [o.full_tensor() if hasattr(o, "full_tensor") else o for o in outs], y
            got, y = run(True)
            want, _ = run(False)
            results[f"{placement} {position}"] = (tuple(y.placements) == (placement,),
                                                  max((a - e).abs().max().item() for a, e in zip(got, want)))
    return results


def test_gated_on_dtensors_matches_local_tensors():
    from helpers import run_on_ranks
    for rank, results in enumerate(run_on_ranks(_dtensor_gated_worker)):
        assert len(results) == 6
        for case, (placement_kept, max_err) in results.items():
            assert placement_kept, (rank, case)
            assert max_err < 1e-5, (rank, case, max_err)


# ---- GPU ---------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("name,n,groups", module_cases([(4096, 1), (8192, 8), (16384, 8)]))
def test_gpu(name, n, groups):
    """Each module's spelling on a CUDA/ROCm device (compiled kernels), bf16, forward and backward
    under the rule, against the module run on the device."""
    group = n // groups
    module = _module(name, n, group, BF16).cuda()
    t = {k: v.cuda() for k, v in inputs((64,), n, BF16).items()}
    w = module.weight.detach()
    leaves = {k: v.clone().requires_grad_() for k, v in t.items()}
    y, s = normfuse.add_rms_norm(leaves["x"], leaves["residual"], w, EPS,
                                 **gated(leaves["gate"], options(name, n, group, BF16)))
    with torch.no_grad():
        y_hf, _ = hf(module, t)
        y64, _ = hf(_module(name, n, group, FP64).cuda(), {k: v.double() for k, v in t.items()})
    ok, err, err_base, bound = within_tolerance(y, y_hf, y64, dtype=BF16)
    assert ok, f"y: error {err:.3g} > bound {bound:.3g}"
    (y.float().sum() + s.float().sum()).backward()
    assert all(torch.isfinite(v.grad).all() for v in leaves.values())
