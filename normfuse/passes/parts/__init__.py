"""Fusion parts: the steps a fused call takes over besides the norm and its add, one module each.

    base.py            FusionPart: the hooks each part declares (find, plan, rewrite, report, audit, checker)
    channel_layout.py  the permuted (channel) layout: operands read permuted, outputs handed back
    add_after_norm.py  the add after the norm: x + norm(f) as one norm_add call
    branch_fold.py     the add's branch: a second add, drop path's per-sample scale, dropout
    gate.py            the gate of a gated norm: norm(x * act(z)), norm(x) * act(z)  (Mamba2, Qwen3-Next)
    quant.py           the fp8 quantization of the norm's output (q and its scale)
    second_norm.py     a second norm of the same value (parallel blocks): weight1 / bias1 -> y1
    qk_rope.py         the rotary embedding after q/k norms: one qk_norm_rope call per attention

``PARTS`` is the order the planner offers them to a call (a later part sees what earlier ones
took). Adding a part: write its module, add it here; no stage of the pass changes
(docs/architecture.md walks the gate through).
"""

from __future__ import annotations

from normfuse.passes.parts.add_after_norm import ADD_AFTER_NORM
from normfuse.passes.parts.base import CallPiece, FusionPart, PlanContext
from normfuse.passes.parts.branch_fold import BRANCH_FOLD
from normfuse.passes.parts.channel_layout import CHANNEL_LAYOUT
from normfuse.passes.parts.gate import GATE
from normfuse.passes.parts.qk_rope import QK_ROPE
from normfuse.passes.parts.quant import QUANT
from normfuse.passes.parts.second_norm import SECOND_NORM

__all__ = ["PARTS", "FusionPart", "CallPiece", "PlanContext", "taken_parts", "folded_nodes"]

PARTS: tuple[FusionPart, ...] = (CHANNEL_LAYOUT, ADD_AFTER_NORM, BRANCH_FOLD, GATE, QUANT, SECOND_NORM, QK_ROPE)


def taken_parts(taken: dict) -> list[tuple[FusionPart, object]]:
    """(part, what the call took of it) for the parts in ``taken`` (a Plan's), in PARTS order."""
    return [(part, taken[part.name]) for part in PARTS if part.name in taken]


def folded_nodes(taken: dict) -> list:
    """The nodes ahead of the add that the parts in ``taken`` fold into the call."""
    return [n for part, found in taken_parts(taken) for n in part.folded(found)]
