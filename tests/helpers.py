"""Comparisons the tests share, all from the project's one tolerance table
(normfuse/tolerances.py)."""

from __future__ import annotations

import torch

from normfuse.tolerances import atol, within_tolerance


def assert_close(actual: torch.Tensor, expected: torch.Tensor, msg: str = "") -> None:
    """The same computation in another order (a fused kernel's row reduction, Inductor's
    schedule): equal up to the table's atol for the dtype, scaled by the magnitude."""
    scale = max(1.0, expected.detach().abs().max().item()) if expected.numel() else 1.0
    torch.testing.assert_close(actual, expected, rtol=0, atol=atol(expected.dtype) * scale, msg=msg or None)


def assert_within(candidate: torch.Tensor, baseline: torch.Tensor, reference: torch.Tensor, msg: str = "") -> None:
    """The project's rule against an fp64 reference: at most a small multiple of eager's error."""
    ok, err, err_eager, bound = within_tolerance(candidate, baseline, reference)
    assert ok, f"{msg} error {err:.3g} > bound {bound:.3g} (eager's error {err_eager:.3g})"
