"""Fusion parts: the steps an add_norm call takes over besides the norm and its add, one module each.

    base.py            FusionPart: the hooks each part declares besides every step's (rewrite, checker)
    channel_layout.py  the permuted (channel) layout: operands read permuted, outputs handed back
    branch_fold.py     the add's branch: a second add, drop path's per-sample scale, dropout
    gate.py            the gate of a gated norm: norm(x * act(z)), norm(x) * act(z)  (Mamba2, Qwen3-Next)
    quant.py           the fp8 quantization of the norm's output (q and its scale)
    second_norm.py     a second norm of the same value (parallel blocks): weight1 / bias1 -> y1
    modulation.py      the adaLN modulation of y: y * scale + shift (diffusion transformers)
    gated_residual.py  the gated residual branch: residual + gate * branch (diffusion transformers)

``PARTS`` lists them; the order the planner offers them in (with the fusions, ``passes/fusions/``)
is ``passes/order.py``'s. Adding a part: write its module, add it here and there; no stage of the
pass changes (docs/architecture.md walks the gate through).
"""

from __future__ import annotations

from normfuse.passes.parts.base import CallPiece, FusionPart, PlanContext
from normfuse.passes.parts.branch_fold import BRANCH_FOLD
from normfuse.passes.parts.channel_layout import CHANNEL_LAYOUT
from normfuse.passes.parts.gate import GATE
from normfuse.passes.parts.gated_residual import GATED_RESIDUAL
from normfuse.passes.parts.modulation import MODULATION
from normfuse.passes.parts.quant import QUANT
from normfuse.passes.parts.second_norm import SECOND_NORM

__all__ = ["PARTS", "FusionPart", "CallPiece", "PlanContext", "taken_parts", "folded_nodes", "BRANCH_FOLD",
           "CHANNEL_LAYOUT", "GATE", "GATED_RESIDUAL", "MODULATION", "QUANT", "SECOND_NORM"]

# (the gated residual before the branch fold: the kernel gates x before the branch's other steps, and the
# checker's formula applies the parts' steps on x in this order)
PARTS: tuple[FusionPart, ...] = (CHANNEL_LAYOUT, GATED_RESIDUAL, BRANCH_FOLD, GATE, MODULATION, QUANT, SECOND_NORM)


def taken_parts(taken: dict) -> list[tuple[FusionPart, object]]:
    """(part, what the call took of it) for the parts in ``taken`` (a Plan's), in PARTS order."""
    return [(part, taken[part.name]) for part in PARTS if part.name in taken]


def folded_nodes(taken: dict) -> list:
    """The nodes ahead of the add that the parts in ``taken`` fold into the call."""
    return [n for part, found in taken_parts(taken) for n in part.folded(found)]
