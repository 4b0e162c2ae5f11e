"""Fused add+norm ops against an fp64 reference, forward and backward.

Each case runs three ways: the candidate (the op on the CPU reference path, or the Triton
kernels under the interpreter), eager PyTorch in the same dtype, and the rule in fp64 with
autograd, written apart from normfuse.kernels.reference (kernel_cases.rule64). Every output and
gradient, each with its own dtype's row, must satisfy the project's rule (normfuse.tolerances):
|candidate - fp64| <= factor * |eager - fp64| + atol; eager itself stays within the table of
fp64, and the forward outputs within the rounding budget of the rule's rounding points.
scripts/plant_faults.py plants faults in reference.py and counts the cases here that fail.
"""

from __future__ import annotations

import pytest
import torch

from normfuse.kernels.add_norm import add_norm, add_norm_ref

from kernel_cases import BF16, FP16, FP32, Case, assert_within_rounding_budget, check_case

SIZES = [1, 7, 123, 768, 1000, 3000, 4096, 5120, 8192, 65536]
DTYPE_PAIRS = [(BF16, BF16), (BF16, FP32), (FP16, FP16), (FP16, FP32), (FP32, FP32)]
MODES = {
    "plain": {},
    "nores": dict(residual=False),
    "noweight": dict(wdtype=None),
    "bias": dict(bias=True),
    "gemma": dict(offset=1.0),
    "scale": dict(scale=0.5),
    "llama": dict(round_first=True),
    "llama_bias_nosum": dict(round_first=True, bias=True, return_extra=False),
    "sum_fp32": dict(sum_dtype=FP32),
    "norm_add": dict(op="norm_add"),
    "norm_add_full": dict(op="norm_add", bias=True, scale=2.0, offset=1.0),
    "norm_add_llama": dict(op="norm_add", round_first=True, return_extra=False),
}


def size_cases(sizes=SIZES):
    for n in sizes:
        for dtype in (BF16, FP16, FP32):
            for kind in ("rms_norm", "layer_norm"):
                yield Case(kind=kind, n=n, rows=2 if n >= 8192 else 3, dtype=dtype, wdtype=dtype,
                           bias=kind == "layer_norm")


def mode_cases(n=1000, rows=4):
    for (dtype, wdtype) in DTYPE_PAIRS:
        for kind in ("rms_norm", "layer_norm"):
            for name, kw in MODES.items():
                kw = dict(kw)
                if kw.get("wdtype", 1) is not None:
                    kw["wdtype"] = wdtype
                yield Case(kind=kind, n=n, rows=rows, dtype=dtype, **kw)


# Parameters in a dtype that is neither the activations' nor fp32 (computed in fp32).
OTHER_WEIGHT_DTYPE_CASES = [
    Case(kind=kind, n=1000, rows=4, dtype=dtype, wdtype=wdtype, **MODES[mode])
    for dtype, wdtype in ((BF16, FP16), (FP16, BF16), (FP32, BF16))
    for kind in ("rms_norm", "layer_norm")
    for mode in ("bias", "llama", "norm_add")
]

EDGE_CASES = [
    Case(rows=0), Case(rows=1), Case(kind="layer_norm", rows=0, op="norm_add"),
    Case(kind="layer_norm", rows=1, n=5120, dtype=FP32, wdtype=FP32, bias=True),
    # the widest single-pass forwards (w, b loaded after the row statistics) with the looped
    # backward that rows past 16 KiB use
    Case(kind="layer_norm", n=32768, rows=2, dtype=BF16, wdtype=BF16, bias=True),
    Case(kind="layer_norm", n=32768, rows=2, dtype=FP16, wdtype=FP32, bias=True, op="norm_add"),
    Case(n=16384, rows=2, dtype=FP32, wdtype=FP32, round_first=True),
    Case(n=131072, rows=2, dtype=BF16, wdtype=FP32),           # beyond one block: looped kernels
    Case(kind="layer_norm", n=131072, rows=2, dtype=FP32, wdtype=FP32, bias=True),
    # looped kernels with a ragged last block, several rows per backward program
    Case(kind="layer_norm", n=40000, rows=5, dtype=BF16, wdtype=BF16, bias=True, op="norm_add", scale=0.5),
    Case(n=20000, rows=5, dtype=FP32, wdtype=FP32, offset=1.0, round_first=True),
    # many short rows: several rows per forward program, the last program partly past the end
    Case(n=123, rows=101, dtype=BF16, wdtype=FP32, bias=True),
    Case(kind="layer_norm", n=123, rows=101, dtype=FP16, wdtype=FP16, op="norm_add"),
    # residual stream in another dtype than the branch output (promoted sum)
    Case(n=768, rows=3, dtype=BF16, rdtype=FP32, wdtype=FP32),
    Case(kind="layer_norm", n=768, rows=3, dtype=FP16, rdtype=BF16, wdtype=FP16, bias=True, scale=0.5),
    Case(kind="layer_norm", n=768, rows=3, dtype=BF16, rdtype=FP32, wdtype=BF16, op="norm_add", round_first=True),
]

# F.normalize(s, dim=-1) * sqrt(N) (x-transformers' RMSNorm): eps clamps the L2 norm; row 0 of each
# bf16/fp32 case is below eps (kernel_cases.make_inputs), so the clamp and its zero gradient are taken
L2_CASES = [
    *(Case(kind="l2_norm", n=n, rows=4, dtype=dtype, wdtype=dtype) for n in (96, 1000) for dtype in (BF16, FP16, FP32)),
    Case(kind="l2_norm", n=1000, rows=4, dtype=BF16, wdtype=FP32, round_first=True),
    Case(kind="l2_norm", n=1000, rows=4, dtype=FP32, wdtype=None, residual=False),
    Case(kind="l2_norm", n=768, rows=4, dtype=BF16, wdtype=BF16, op="norm_add"),
    Case(kind="l2_norm", n=123, rows=101, dtype=BF16, wdtype=FP32),     # several rows per program
    Case(kind="l2_norm", n=20000, rows=5, dtype=FP32, wdtype=FP32),     # looped kernels
]

REF_CASES = [*size_cases(), *mode_cases(), *OTHER_WEIGHT_DTYPE_CASES, *EDGE_CASES, *L2_CASES]


@pytest.mark.parametrize("case", REF_CASES, ids=str)
def test_reference_path(case):
    """CPU tensors: the ops run the reference (fast eager kernels where identical)."""
    check_case(case)


TRITON_CASES = REF_CASES


@pytest.mark.parametrize("case", TRITON_CASES, ids=str)
def test_triton_path(case, triton_cpu):
    """The Triton kernels, run on CPU tensors by Triton's interpreter."""
    check_case(case)


@pytest.mark.gpu
@pytest.mark.parametrize("case", REF_CASES, ids=str)
def test_gpu(case):
    """The same grid on a CUDA/ROCm device (compiled kernels)."""
    check_case(case, device="cuda")


@pytest.mark.gpu
@pytest.mark.slow
def test_gpu_more_than_2_31_elements():
    """64-bit row offsets: the last rows of a tensor past 2^31 elements (about 17 GB in all)."""
    n, rows = 65536, 2**31 // 65536 + 2
    x = torch.randn(rows, n, device="cuda", dtype=BF16)
    r = torch.randn(rows, n, device="cuda", dtype=BF16)
    w = torch.randn(n, device="cuda", dtype=BF16)
    y, s = add_norm(x, r, w, kind="rms_norm", eps=1e-6)
    tail = slice(rows - 3, rows)
    y_ref, s_ref = add_norm_ref(x[tail].cpu(), r[tail].cpu(), w.cpu(), kind="rms_norm", eps=1e-6)
    assert torch.equal(s[tail].cpu(), s_ref)
    assert_within_rounding_budget(y[tail].cpu(), y_ref, "y")


def test_l2_norm_backward_on_channels_first_rows(triton_cpu):
    """An l2_norm of x stored channels-first (NCHW permuted): the backward takes the row kernels, whose
    l2 rule it needs (the channel kernels compute rms/layer norms only)."""
    import torch.nn.functional as F
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 16, 3, 3, generator=g).permute(0, 2, 3, 1).requires_grad_()
    w = torch.randn(16, generator=g).requires_grad_()
    y, _ = add_norm(x, None, w, kind="l2_norm", eps=1e-12)
    ref = F.normalize(x, dim=-1, eps=1e-12) * 16 ** 0.5 * w
    dy = torch.randn(y.shape, generator=g)
    got, want = torch.autograd.grad(y, (x, w), dy), torch.autograd.grad(ref, (x, w), dy)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
