"""Fusions: each computes a site with a call of its own op, one module each.

    base.py            Fusion: what a fusion declares besides the hooks every step has (build, formula)
    add_norm.py        the add and its norm: add_norm(x, residual, w, b, ...), the call every site
                       starts as, which the parts (``passes/parts/``) extend
    norm_add.py        the add after the norm: x + norm(f) as one norm_add call
    qk_norm_rope.py    the q/k norms and their rotary embedding: one qk_norm_rope call per attention

The planner offers them, with the parts, in the one order of ``passes/order.py``.
``fusion_of(op)`` is the fusion that makes calls of ``op`` (a plan's op, or a call's
``record.fused_op_name``): the rewrite and the checker go through it and name no op.
"""

from __future__ import annotations

from normfuse.passes.fusions.add_norm import ADD_NORM
from normfuse.passes.fusions.base import Fusion
from normfuse.passes.fusions.norm_add import NORM_ADD
from normfuse.passes.fusions.qk_norm_rope import QK_NORM_ROPE

__all__ = ["FUSIONS", "Fusion", "fusion_of", "ADD_NORM", "NORM_ADD", "QK_NORM_ROPE"]

FUSIONS: tuple[Fusion, ...] = (ADD_NORM, NORM_ADD, QK_NORM_ROPE)
_BY_OP = {op: fusion for fusion in FUSIONS for op in fusion.ops}


def fusion_of(op: str | None) -> Fusion | None:
    """The fusion whose calls are of ``op`` (None for no fused op)."""
    return _BY_OP.get(op)
