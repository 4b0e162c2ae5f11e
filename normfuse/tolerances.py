"""The one tolerance table of the project.

A result passes against an fp64 reference when
    err(candidate, fp64) <= factor(dtype) * err(baseline, fp64) + atol(dtype)
where the baseline is what eager PyTorch computes in the same dtype. This is the
rule of PyTorch's accuracy minifier and flash-attn's tests: the candidate may be
a small multiple worse than eager, never arbitrarily worse.
"""

from __future__ import annotations

import torch

__all__ = ["ERROR_FACTOR", "ATOL", "ROUNDING_BUDGET", "ROUNDED_REFERENCE_BUDGET", "error_factor", "atol",
           "rounding_budget", "within_tolerance"]

# m in the rule above.
ERROR_FACTOR = {torch.float64: 2.0, torch.float32: 2.0, torch.float16: 3.0, torch.bfloat16: 3.0}

# Absolute slack for outputs of magnitude ~1 (normalized values, gradients of them).
ATOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}


# A rewrite that keeps the graph's rounding points differs from the subgraph it replaced
# only where the order of a row reduction flips a rounding of the output: by at most
# 1 ulp, on a small fraction of the elements. (max ulps, max fraction of elements that
# differ) per output dtype; fp32/fp64 outputs are held to the rule above alone.
ROUNDING_BUDGET = {torch.float16: (1.0, 0.01), torch.bfloat16: (1.0, 0.01),
                   # an fp8 output quantizes the 16-bit y: where y differs by its 1 ulp, so may q
                   torch.float8_e4m3fn: (1.0, 0.01), torch.float8_e5m2: (1.0, 0.01)}


# An fp32 output of a subgraph that rounds to a narrower dtype on the way (autocast's norm of a
# bf16 sum; an fp32 weight times n rounded to bf16) has no ulp budget: it is held to the rule
# above against the fp64 evaluation that keeps those rounding points, element by element. A
# faithful rewrite breaks the bound only where the order of a row reduction flips one of the
# narrow roundings, on at most this fraction of the elements; a dropped or moved rounding point
# breaks it almost everywhere.
ROUNDED_REFERENCE_BUDGET = 0.01


def rounding_budget(dtype: torch.dtype) -> tuple[float, float]:
    return ROUNDING_BUDGET.get(dtype, (float("inf"), 1.0))


def error_factor(dtype: torch.dtype) -> float:
    return ERROR_FACTOR.get(dtype, 2.0)


def atol(dtype: torch.dtype) -> float:
    return ATOL.get(dtype, 1e-5)


def within_tolerance(candidate: torch.Tensor, baseline: torch.Tensor, reference: torch.Tensor,
                     dtype: torch.dtype | None = None, scale_atol: float | None = None):
    """Elementwise rule applied as a max: returns (ok, err_candidate, err_baseline, bound).

    Errors are max-abs differences against ``reference`` (usually fp64). ``scale_atol``
    multiplies atol for outputs whose magnitude is far from 1 (e.g. weight gradients
    summed over many rows); by default atol scales with the reference's max magnitude
    when that exceeds 1.
    """
    dtype = dtype or candidate.dtype
    cand, base, ref = candidate.double(), baseline.double(), reference.double()
    # Non-finite values must sit where eager put them (NaN/Inf propagate as in eager);
    # the error is measured on the positions where the reference is finite.
    same_nonfinite = bool(torch.equal(cand.isnan(), base.isnan()) and
                          torch.equal(cand.isinf() & (cand > 0), base.isinf() & (base > 0)) and
                          torch.equal(cand.isinf() & (cand < 0), base.isinf() & (base < 0)))
    finite = ref.isfinite() & cand.isfinite() & base.isfinite()
    err_c = (cand - ref)[finite].abs().max().item() if finite.any() else 0.0
    err_b = (base - ref)[finite].abs().max().item() if finite.any() else 0.0
    mag = ref[finite].abs().max().item() if finite.any() else 0.0
    scale = scale_atol if scale_atol is not None else max(1.0, mag)
    bound = error_factor(dtype) * err_b + atol(dtype) * scale
    return (same_nonfinite and err_c <= bound), err_c, err_b, bound
