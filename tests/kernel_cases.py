"""One fused-op case run three ways: the candidate (the op on the CPU reference path, or the
Triton kernels under the interpreter), eager PyTorch in the same dtype, and the fp64
reference with autograd; every output and gradient held to the project's rule
(normfuse.tolerances): |candidate - fp64| <= factor * |eager - fp64| + atol.

Shared by the kernel test modules."""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.nn.functional as F

from normfuse.kernels.add_norm import add_norm, add_norm_ref, norm_add, norm_add_ref
from normfuse.tolerances import within_tolerance

BF16, FP16, FP32, FP64 = torch.bfloat16, torch.float16, torch.float32, torch.float64


@dataclasses.dataclass(frozen=True)
class Case:
    kind: str = "rms_norm"
    n: int = 768
    rows: int = 5
    dtype: torch.dtype = BF16            # activations (x and residual)
    wdtype: Optional[torch.dtype] = BF16  # None: no weight
    residual: bool = True
    bias: bool = False
    offset: float = 0.0
    scale: float = 1.0
    round_first: bool = False            # norm_round_dtype = activation dtype (HF Llama)
    sum_dtype: Optional[torch.dtype] = None
    op: str = "add_norm"                 # or "norm_add"
    return_extra: bool = True            # return_sum / return_norm
    rdtype: Optional[torch.dtype] = None  # residual dtype when it differs from x's

    def __str__(self):
        fields = [f"{self.op}-{self.kind}-N{self.n}x{self.rows}", str(self.dtype)[6:],
                  f"w{str(self.wdtype)[6:] if self.wdtype else 'none'}"]
        fields += [name for name, on in (("nores", not self.residual), ("bias", self.bias),
                                         (f"off{self.offset}", self.offset), (f"scale{self.scale}", self.scale != 1),
                                         ("roundfirst", self.round_first), ("noextra", not self.return_extra)) if on]
        if self.sum_dtype:
            fields.append(f"sum{str(self.sum_dtype)[6:]}")
        if self.rdtype:
            fields.append(f"res{str(self.rdtype)[6:]}")
        return "-".join(fields)


def make_inputs(case: Case, seed: int = 0, requires_grad: bool = True, device: str = "cpu"):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape, dtype, std=1.0, mean=0.0):
        t = (torch.randn(*shape, generator=gen, dtype=FP32) * std + mean).to(device=device, dtype=dtype)
        return t.requires_grad_(requires_grad)

    x = randn(case.rows, case.n, dtype=case.dtype)
    r = randn(case.rows, case.n, dtype=case.rdtype or case.dtype) if case.residual or case.op == "norm_add" else None
    w = None
    if case.wdtype is not None:
        w = randn(case.n, dtype=case.wdtype, std=0.2, mean=0.0 if case.offset else 1.0)
    b = randn(case.n, dtype=case.wdtype or case.dtype, std=0.2) if case.bias else None
    return x, r, w, b


def modes(case: Case, dtype: Optional[torch.dtype] = None) -> dict:
    """Keyword modes of the case; ``dtype`` replaces every rounding dtype (fp64 reference)."""
    kw = dict(kind=case.kind, eps=1e-5, weight_offset=case.offset, residual_scale=case.scale)
    if case.round_first:
        kw["norm_round_dtype"] = dtype or case.dtype
    if dtype is not None:
        kw["out_dtype"] = dtype
        kw["add_dtype" if case.op == "norm_add" else "sum_dtype"] = dtype
    elif case.sum_dtype is not None:
        kw["sum_dtype"] = case.sum_dtype
    return kw


def eager_norm(u, w, b, case: Case):
    """The norm as models write it, in the activation dtype, with eager autograd."""
    n_cols = u.shape[-1]
    params = {t.dtype for t in (w, b) if t is not None}
    eager_mixes = params <= {u.dtype} or (params == {FP32} and w is not None)   # what F.layer_norm accepts
    if not case.offset and not case.round_first and eager_mixes and not (case.kind == "rms_norm" and b is not None):
        if case.kind == "layer_norm":
            return F.layer_norm(u, (n_cols,), w, b, 1e-5)
        return F.rms_norm(u, (n_cols,), w, 1e-5)
    h = u.float()
    if case.kind == "layer_norm":
        h = h - h.mean(-1, keepdim=True)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)
    if case.round_first:                            # HF Llama: weight * h.to(input_dtype)
        h = h.to(case.dtype)
        y = h if w is None else w * h
        return y if b is None else y + b
    if w is not None:                               # Gemma: h * (1 + w.float()), rounded once
        h = h * (w.float() + case.offset)
    if b is not None:
        h = h + b.float()
    return h.to(u.dtype)


def eager(case: Case, x, r, w, b):
    scaled = None if r is None else (r * case.scale if case.scale != 1 else r)
    if case.op == "norm_add":
        y = eager_norm(x, w, b, case)
        return scaled + y, y
    s = x if scaled is None else x + scaled
    if case.sum_dtype is not None:
        s = s.to(case.sum_dtype)
    return eager_norm(s, w, b, case), (s if r is not None else None)


def candidate(case: Case, x, r, w, b):
    if case.op == "norm_add":
        return norm_add(x, r, w, b, return_norm=case.return_extra, **modes(case))
    return add_norm(x, r, w, b, return_sum=case.return_extra, **modes(case))


def reference64(case: Case, x, r, w, b):
    x, r, w, b = (None if t is None else t.detach().double().requires_grad_() for t in (x, r, w, b))
    if case.op == "norm_add":
        out = norm_add_ref(x, r, w, b, return_norm=True, **modes(case, FP64))
    else:
        out = add_norm_ref(x, r, w, b, **modes(case, FP64))
    return out, (x, r, w, b)


def forward_backward(fn, case, inputs, seed=1):
    """Outputs and input gradients of fn under loss = sum(out0 * g0) + sum(out1 * g1)."""
    outs = fn(case, *inputs)
    gen = torch.Generator().manual_seed(seed)
    loss = 0
    for out in outs:
        if out is not None:
            loss = loss + (out.double() * torch.randn(out.shape, generator=gen, dtype=FP64).to(out.device)).sum()
    leaves = [t for t in inputs if t is not None]
    if leaves and isinstance(loss, torch.Tensor):
        grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    else:
        grads = [None] * len(leaves)
    grads = iter(grads)
    return list(outs), [None if t is None else next(grads) for t in inputs]


def check_case(case: Case, device: str = "cpu"):
    inputs = make_inputs(case, device=device)
    cand_out, cand_grad = forward_backward(candidate, case, inputs)
    base_out, base_grad = forward_backward(eager, case, inputs)
    (ref_out, ref_inputs) = reference64(case, *inputs)
    ref_out, ref_grad = forward_backward(lambda c, *t: ref_out, case, ref_inputs)
    if not case.return_extra:   # the candidate did not return s / y: compare what it did
        assert cand_out[1] is None
        base_out[1] = ref_out[1] = cand_out[1]
        base_out, base_grad = forward_backward(lambda c, *t: (eager(c, *t)[0], None), case, inputs)
        ref_out, ref_grad = forward_backward(lambda c, *t: (reference64(c, *t)[0][0], None), case, ref_inputs)
    names = ["out" if case.op == "norm_add" else "y", "y" if case.op == "norm_add" else "s",
             "dx", "dresidual", "dweight", "dbias"]
    for name, c, e, r in zip(names, cand_out + cand_grad, base_out + base_grad, ref_out + ref_grad):
        if r is None or c is None and e is None:
            continue
        assert c is not None and e is not None, f"{case}: {name} missing"
        assert c.shape == e.shape and c.dtype == e.dtype, f"{case}: {name} {c.dtype}{tuple(c.shape)} vs eager {e.dtype}{tuple(e.shape)}"
        if c.numel() == 0:
            continue
        ok, err_c, err_e, bound = within_tolerance(c, e, r, dtype=case.dtype)
        assert ok, f"{case}: {name} err {err_c:.3g} > bound {bound:.3g} (eager err {err_e:.3g})"


# ---- the grid ------------------------------------------------------------------------
# Full cross products are far over the time budget (the interpreter runs every program
# in Python), so the grid is three slices: every N for each dtype and kind with the
# common block; every mode at one awkward N over all (activation, weight) pairs; and
# the row and size edges.


# ---- bit-level comparisons ------------------------------------------------------------

def assert_same_bits(got, want, what: str = "") -> None:
    """got and want hold the same values bit for bit, except that NaNs need only sit in the same
    places (their sign and payload are not specified)."""
    assert got.dtype == want.dtype and got.shape == want.shape, \
        f"{what}: {got.dtype}{tuple(got.shape)} vs {want.dtype}{tuple(want.shape)}"
    got_nan, want_nan = got.float().isnan(), want.float().isnan()
    assert torch.equal(got_nan, want_nan), f"{what}: NaNs at {int((got_nan != want_nan).sum())} other places"
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[got.element_size()]
    differ = (got.view(bits) != want.view(bits)) & ~got_nan
    assert not differ.any(), (f"{what}: {int(differ.sum())} of {got.numel()} elements differ, e.g. "
                              f"{got[differ][:4].float().tolist()} vs {want[differ][:4].float().tolist()}")


def ulp_distance(a, b) -> torch.Tensor:
    """Distance in units in the last place between bf16/fp16 (or fp32) tensors of one dtype."""
    bits = torch.int16 if a.element_size() == 2 else torch.int32
    sign_mask = 0x7FFF if bits == torch.int16 else 0x7FFFFFFF

    def ordered(t):
        i = t.contiguous().view(bits).to(torch.int64)
        return torch.where(i < 0, -(i & sign_mask), i)
    return (ordered(a) - ordered(b)).abs()


def assert_within_rounding_budget(got, want, what: str = "") -> None:
    """got differs from want only as a different order of the row reduction can make it differ
    (normfuse.tolerances.rounding_budget: bf16/fp16 by at most 1 ulp on at most 1% of the elements;
    fp32 to a few ulp)."""
    from normfuse.tolerances import rounding_budget
    assert got.dtype == want.dtype and got.shape == want.shape, what
    max_ulps, max_fraction = rounding_budget(got.dtype)
    if got.dtype in (FP32, FP64):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=what)
        return
    ulps = ulp_distance(got, want)
    assert ulps.max().item() <= max_ulps, f"{what}: {ulps.max().item()} ulp apart (budget {max_ulps})"
    fraction = (ulps > 0).float().mean().item()
    assert fraction <= max_fraction, f"{what}: {fraction:.2%} of elements differ (budget {max_fraction:.0%})"
