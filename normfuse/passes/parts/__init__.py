"""Fusion parts: the steps a fused call takes over besides the norm and its add, one module each.

    base.py   FusionPart: the hooks each part declares (find, plan, rewrite, report, audit, checker)
    gate.py   the gate of a gated norm: norm(x * act(z)), norm(x) * act(z)  (Mamba2, Qwen3-Next)
    quant.py  the fp8 quantization of the norm's output (q and its scale)

``PARTS`` is the order the planner offers them to a call (a later part sees what earlier ones
took). Adding a part: write its module, add it here; no stage of the pass changes
(docs/architecture.md walks the gate through).
"""

from __future__ import annotations

from normfuse.passes.parts.base import CallPiece, FusionPart
from normfuse.passes.parts.gate import GATE
from normfuse.passes.parts.quant import QUANT

__all__ = ["PARTS", "FusionPart", "CallPiece", "part_named"]

PARTS: tuple[FusionPart, ...] = (GATE, QUANT)


def part_named(name: str) -> FusionPart:
    return next(p for p in PARTS if p.name == name)
