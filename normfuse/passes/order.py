"""The order the planner offers each site's call its steps, written once, with the reason for
each position.

A site's call starts as an add_norm call (``planning._choose``); each step below is then
offered to it in turn (``Step.offer``), and sees what the steps before it took. A fusion
(``passes/fusions/``) that takes the site makes the call one of its own op; a part
(``passes/parts/``) extends the add_norm call. When an operand a step reads comes too late
for the call's place, the steps that may be dropped are dropped in the reverse order (the last
offered first: an earlier step may have decided what a later one took).
"""

from __future__ import annotations

from normfuse.passes.fusions import NORM_ADD, QK_NORM_ROPE
from normfuse.passes.parts import BRANCH_FOLD, CHANNEL_LAYOUT, GATE, GATED_RESIDUAL, MODULATION, QUANT, SECOND_NORM
from normfuse.passes.step import Step

__all__ = ["ORDER", "STEPS", "taken_steps"]

ORDER: tuple[tuple[Step, str], ...] = (
    (CHANNEL_LAYOUT, "first: it decides whether the call reads its operands permuted (plan.permute), which "
                     "every later step checks before it takes a site"),
    (NORM_ADD, "before the parts: a plain norm whose output goes into the stream's add becomes a norm_add "
               "call, and the gated norm, the fp8 epilogue and a second norm, offered after it, say why they do not "
               "extend that call"),
    (BRANCH_FOLD, "the add's branch (second add, drop path, dropout): it changes the add_norm call's x; only "
                  "the gated residual, later, reads what it took (a second add whose operand is gated)"),
    (GATE, "before the epilogues: a gated norm changes what y is (exclusive), which the modulation, the fp8 "
           "epilogue and the second norm after it read"),
    (MODULATION, "after the gated norm, which it does not combine with; it changes what y is (exclusive), which "
                 "the fp8 epilogue and the second norm after it read"),
    (QUANT, "an epilogue of the one y: after every step that decides what y is"),
    (SECOND_NORM, "after every step that changes y: a second norm shares the call only when none did"),
    (GATED_RESIDUAL, "after every step it does not combine with (drop path, dropout, the gated norm, the fp8 "
                     "epilogue, a second norm): it takes the call only when none of them did, and changes its x to "
                     "the branch; after the branch fold, whose second add's gated operand it takes as x"),
    (QK_NORM_ROPE, "last: it takes only a plain norm's call that no step before it extended"),
)

STEPS: tuple[Step, ...] = tuple(step for step, _ in ORDER)


def taken_steps(taken: dict) -> list[tuple[Step, object]]:
    """(step, what the call took of it) for the steps in ``taken`` (a Plan's), in ``STEPS`` order."""
    return [(step, taken[step.name]) for step in STEPS if step.name in taken]
