"""One fused-op case run three ways: the candidate (the op on the CPU reference path, or the
Triton kernels under the interpreter), eager PyTorch in the same dtype, and the rule in fp64
with autograd, written apart from normfuse.kernels.reference (rule64: a fault there cannot move
the yardstick too); every output and gradient held to the project's rule (normfuse.tolerances)
with its own dtype's row: |candidate - fp64| <= factor * |eager - fp64| + atol.

Shared by the kernel test modules."""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.nn.functional as F

from normfuse.kernels.add_norm import add_norm, norm_add
from normfuse.tolerances import ROUNDED_REFERENCE_BUDGET, atol, error_factor, rounding_budget, within_tolerance

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
    if case.kind == "l2_norm" and case.rows > 1 and case.dtype != FP16:  # (fp16 would hold it as subnormals)
        with torch.no_grad():  # a row whose L2 norm is below eps: F.normalize clamps it
            for t in (x, r):
                if t is not None:
                    t[0] *= 1e-7
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
    if not case.offset and not case.round_first and eager_mixes and case.kind != "l2_norm" \
            and not (case.kind == "rms_norm" and b is not None):
        if case.kind == "layer_norm":
            return F.layer_norm(u, (n_cols,), w, b, 1e-5)
        return F.rms_norm(u, (n_cols,), w, 1e-5)
    h = u.float()
    if case.kind == "l2_norm":                      # x-transformers' RMSNorm, upcast
        h = F.normalize(h, dim=-1, eps=1e-5) * n_cols ** 0.5
    else:
        if case.kind == "layer_norm":
            h = h - h.mean(-1, keepdim=True)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)
    if case.round_first:                            # HF Llama: weight * h.to(input_dtype)
        h = h.to(case.dtype)
        if w is not None and case.offset:           # (offset + weight) * h.to(input_dtype), w' in fp32
            y = (h.float() * (w.float() + case.offset)).to(torch.promote_types(h.dtype, w.dtype))
        else:
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


def narrower(*dtypes: Optional[torch.dtype]) -> torch.dtype:
    """The least precise of the floating dtypes given (None ignored)."""
    return max((d for d in dtypes if d is not None), key=lambda d: torch.finfo(d).eps)


def rule64(case: Case, x, r, w, b, rounded: bool = False):
    """The kernel rule of a case in fp64, written apart from normfuse.kernels.reference (plain torch
    ops, each mode's formula once more), so that a fault there cannot move this too.

    rounded=False: exact arithmetic (differentiable; the reference of the tolerance rule).
    rounded=True: the rule's rounding points kept (the residual scaled in its dtype, the sum in
    sum_dtype, Llama's n in the activation dtype, y in out_dtype, norm_add's out in add_dtype):
    a faithful op differs from it only where its fp32 statistics flip a rounding.
    Returns (y, s) for add_norm (s None without a residual), (out, y) for norm_add."""
    def rnd(t, dtype):
        return t.to(dtype).to(FP64) if rounded else t

    x64, r64, w64, b64 = (None if t is None else t.to(FP64) for t in (x, r, w, b))
    if r64 is not None and case.scale != 1:
        r64 = rnd(r64 * case.scale, r.dtype)

    def norm(u, in_dtype):
        cols = u.shape[-1]
        centred = u - u.sum(-1, keepdim=True) / cols if case.kind == "layer_norm" else u
        if case.kind == "l2_norm":                  # eps clamps the row's L2 norm
            n = u / torch.sqrt((u * u).sum(-1, keepdim=True)).clamp_min(1e-5) * cols ** 0.5
        else:
            n = centred / torch.sqrt((centred * centred).sum(-1, keepdim=True) / cols + 1e-5)
        if case.round_first:                        # round(norm_round_dtype, n) * w', in promote(n, w)
            n = rnd(n, case.dtype)
            out_dtype = case.dtype if w is None else torch.promote_types(case.dtype, w.dtype)
        else:
            out_dtype = in_dtype
        y = n if w64 is None else n * (w64 + case.offset)
        y = y if b64 is None else y + b64
        return rnd(y, out_dtype), out_dtype

    if case.op == "norm_add":
        y, out_dtype = norm(x64, x.dtype)
        return rnd(r64 + y, torch.promote_types(r.dtype, out_dtype)), y
    sum_dtype = case.sum_dtype or (x.dtype if r is None else torch.promote_types(x.dtype, r.dtype))
    s = rnd(x64 if r64 is None else x64 + r64, sum_dtype)
    return norm(s, sum_dtype)[0], (s if r is not None else None)


def forward_backward(fn, case, inputs, seed=1, dtypes=None):
    """Outputs and input gradients of fn under loss = sum(out0 * g0) + sum(out1 * g1).

    Each g is drawn in the dtype of the output it multiplies (``dtypes``, default the outputs' own),
    so the gradient reaching the output is g exactly in every run: no rounding of the cotangent
    adds to the errors being compared."""
    outs = fn(case, *inputs)
    gen = torch.Generator().manual_seed(seed)
    loss = 0
    for i, out in enumerate(outs):
        if out is not None:
            g = torch.randn(out.shape, generator=gen, dtype=FP64).to(dtypes[i] if dtypes else out.dtype)
            loss = loss + (out.double() * g.double().to(out.device)).sum()
    leaves = [t for t in inputs if t is not None]
    if leaves and isinstance(loss, torch.Tensor):
        grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    else:
        grads = [None] * len(leaves)
    grads = iter(grads)
    return list(outs), [None if t is None else next(grads) for t in inputs]


def check_case(case: Case, device: str = "cpu"):
    """The candidate against :func:`rule64`, every output with its own dtype's row of the table:

    - exact fp64: |candidate - fp64| <= factor * |eager - fp64| + atol, forward and backward;
    - eager itself within atol of exact fp64 (for the narrowest dtype the value passed through):
      the rule and eager agree, so neither this reference nor eager's bound can be off;
    - forward outputs against the fp64 evaluation that keeps the rule's rounding points: 16-bit
      outputs within the rounding budget (1 ulp, 1% of elements), fp32 ones to fp32 accuracy
      except where a narrower rounding on the way flipped (ROUNDED_REFERENCE_BUDGET)."""
    inputs = make_inputs(case, device=device)
    n_out = 2 if case.return_extra else 1

    def only(fn):
        return (lambda c, *t: fn(c, *t)) if case.return_extra else (lambda c, *t: (fn(c, *t)[0], None))

    cand_out, cand_grad = forward_backward(only(candidate), case, inputs)
    if not case.return_extra:   # the candidate did not return s / y
        assert cand_out[1] is None, f"{case}: returned its second output though not asked to"
    base_out, base_grad = forward_backward(only(eager), case, inputs)
    leaves = [None if t is None else t.detach().cpu().double().requires_grad_() for t in inputs]
    # the fp64 rule's cotangents drawn as the candidate's: in its outputs' dtypes
    out_dtypes = [None if o is None else o.dtype for o in cand_out + [None]]
    ref_out, ref_grad = forward_backward(only(rule64), case, leaves, dtypes=out_dtypes)
    rounded = rule64(case, *(None if t is None else t.detach().cpu() for t in inputs), rounded=True)
    names = ["out" if case.op == "norm_add" else "y", "y" if case.op == "norm_add" else "s",
             "dx", "dresidual", "dweight", "dbias"]
    for i, (name, c, e, r) in enumerate(zip(names, cand_out + cand_grad, base_out + base_grad, ref_out + ref_grad)):
        if r is None or c is None and e is None:
            continue
        assert c is not None and e is not None, f"{case}: {name} missing"
        assert c.shape == e.shape and c.dtype == e.dtype, f"{case}: {name} {c.dtype}{tuple(c.shape)} vs eager {e.dtype}{tuple(e.shape)}"
        if c.numel() == 0:
            continue
        c, e = c.cpu(), e.cpu()
        row = c.dtype
        if case.op == "norm_add" and case.return_extra and i >= n_out:
            # y's gradient is the sum of out's and y's, rounded to y's dtype (as autograd accumulates
            # it in eager): every gradient computed from it carries that rounding
            row = narrower(c.dtype, cand_out[1].dtype)
        ok, err_c, err_e, bound = within_tolerance(c, e, r, dtype=row)
        assert ok, f"{case}: {name} err {err_c:.3g} > bound {bound:.3g} (eager err {err_e:.3g}, {row} row)"
        # eager's own error: the least precise dtype the value was rounded to on the way
        # (m * atol: what the rule grants a candidate over a baseline of error atol; for 16-bit
        # values about 3 ulp at the output's magnitude, as eager's backward rounds several times)
        narrow = narrower(c.dtype, case.dtype, case.rdtype, case.sum_dtype)
        slack = error_factor(narrow) * atol(narrow) * max(1.0, r.abs().max().item())
        # (not for a LayerNorm's gradients over N <= 2 columns: exactly 0, and eager's are rounding
        # noise times rstd, which is unbounded; the rule above still bounds the candidate by it)
        degenerate = case.kind == "layer_norm" and case.n <= 2 and i >= n_out
        assert degenerate or err_e <= slack, \
            f"{case}: eager's {name} is {err_e:.3g} from the fp64 rule (table allows {slack:.3g})"
        if i < n_out:
            # norm_add's out = round(r' + y): where y's rounding flipped, out moves by y's ulp
            # (y's narrowest rounding is to the activation dtype: y itself, or Llama's n before w)
            carried = (rounded[1], case.dtype) if case.op == "norm_add" and i == 0 else None
            assert_rounded_as_rule(c, rounded[i], f"{case}: {name}", carried)


def ulp_at(t64, dtype) -> torch.Tensor:
    """One ulp of ``dtype`` at each value of the fp64 tensor t64 (its smallest normal's below it)."""
    _, exponent = torch.frexp(t64.abs().clamp(min=torch.finfo(dtype).tiny))
    return torch.finfo(dtype).eps * torch.pow(2.0, (exponent - 1).double())


def assert_rounded_as_rule(got, rounded64, what: str, carried=None) -> None:
    """A forward output against the fp64 evaluation that keeps the rule's rounding points.

    16-bit outputs: within the rounding budget (1 ulp on 1% of the elements). fp32 outputs: fp32
    statistics against fp64 ones, 1e-5 relative, except where a rounding to a narrower dtype on
    the way (Llama's n, a 16-bit sum) flipped, on at most ROUNDED_REFERENCE_BUDGET of them.
    ``carried``: (the rule's value, its dtype) of an earlier rounding this output adds to
    (norm_add's y); a flip of that rounding moves the output by one of y's ulps, which near a
    cancellation is many of the output's own, so those elements get y's ulp on top."""
    want = rounded64.to(got.dtype)
    if got.dtype in (BF16, FP16):
        if carried is None:
            assert_within_rounding_budget(got, want, what)
            return
        max_ulps, max_fraction = rounding_budget(got.dtype)
        close = ulp_at(rounded64, got.dtype) * max_ulps
        off = got != want
    else:
        max_ulps, max_fraction = 1.0, ROUNDED_REFERENCE_BUDGET
        close = 1e-5 * rounded64.abs().clamp(min=1.0)
        off = (got.double() - rounded64).abs() > close
    fraction = off.float().mean().item()
    assert fraction <= max_fraction, \
        f"{what}: {fraction:.2%} of elements off the rule's rounding (budget {max_fraction:.0%})"
    if carried is not None:
        # 2: Llama's n is rounded before the weight scales it; at y its ulp is up to twice y's own
        step = close + 2 * max_ulps * ulp_at(carried[0], carried[1])
        diff = (got.double() - rounded64).abs()
        assert (diff <= step).all(), \
            f"{what}: {int((diff > step).sum())} elements further than an ulp of out and one of y from the rule"


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
    """Distance in units in the last place between fp8/bf16/fp16 (or fp32) tensors of one dtype."""
    bits, sign_mask = {1: (torch.int8, 0x7F), 2: (torch.int16, 0x7FFF), 4: (torch.int32, 0x7FFFFFFF)}[a.element_size()]

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
    if got.numel() == 0:
        return
    ulps = ulp_distance(got, want)
    # an element near 0 that is the difference of terms of the row's size (n * w + b, r + y) carries
    # their fp32 error, many of its own ulps: there the budget is one ulp at 2^-14 of the largest value
    diff = (got.double() - want.double()).abs()
    floor = ulp_at(want.double().abs().max() * 2.0**-14, got.dtype)
    beyond = (ulps > max_ulps) & (diff > floor)
    assert not beyond.any(), (f"{what}: {int(beyond.sum())} elements more than {max_ulps} ulp apart, up to "
                              f"{ulps[beyond].max().item()} (at {want[beyond][:3].float().tolist()})")
    fraction = (ulps > 0).float().mean().item()
    assert fraction <= max_fraction, f"{what}: {fraction:.2%} of elements differ (budget {max_fraction:.0%})"
