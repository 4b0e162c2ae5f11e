"""What every step the planner offers a call declares: ``Step``, and the values its hooks pass.

A fused call is made by one **fusion** (``passes/fusions/``: the op it calls and how it is built)
and extended by the **parts** it takes (``passes/parts/``: a step before or after the norm of
an add_norm call). Both are offered to each site's call in the one order of ``passes/order.py``,
and both answer the same stage hooks, declared here:

========  ======================================  ===================================================
stage     hook                                    what the step says
========  ======================================  ===================================================
find      ``find(index, match, in_add)``          what it recognizes at a norm (a frozen match), or None
plan      ``offer(ctx, site, found, plan)``       whether the planned call takes it (and what that changes)
plan      ``reads`` / ``spans``                   its operands / nodes that decide where the call starts
plan      ``may_drop`` / ``drop``                 whether the call goes without it when an operand is late
plan      ``exclusive``                           it changes y: no second norm, no recompute of y
record    ``nodes`` / ``folded``                  the nodes it replaces / those ahead of the add it computes
report    ``report``                              the report's fields for it
audit     ``eager_nodes`` / ``fused_bytes``       its traffic, eager and fused
checker   ``roles``                               its tensor options' symbols
========  ======================================  ===================================================

What only a fusion declares (building its call, its op's formula for the checker) is in
``fusions/base.py``; what only a part declares (what it adds to an add_norm call) in ``parts/base.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Callable, Mapping

import torch.fx as fx

if TYPE_CHECKING:
    from normfuse.passes.graph import GraphIndex

__all__ = ["Step", "BuiltCall", "PlanContext"]


@dataclass
class BuiltCall:
    """One fused call as its fusion built it (``Fusion.build``): the call, the nodes inserted
    with it (in graph order), the original node each of its outputs replaced, the original
    nodes it computes, the original value each node inserted for its arguments holds (an
    operand reshaped for the kernel), the original values its arguments read, and the outputs
    handed back permuted (index -> dims)."""

    call: fx.Node
    inserted: list[fx.Node]
    stands_for: list[tuple[int, fx.Node]]
    old_nodes: list[fx.Node]
    holds: dict[fx.Node, fx.Node] = field(default_factory=dict)
    reads: set = field(default_factory=set)
    permuted_back: dict[int, tuple[int, ...]] = field(default_factory=dict)


@dataclass
class PlanContext:
    """What a step's ``offer`` may read besides the site and its plan: the analysis (never
    written to), the options, whether the calls will be custom ops in an ATen graph (Inductor's
    post-grad pass), the sites no call may take any more, and why a norm itself cannot be fused."""

    analysis: Any                      # the analysis.Analysis being planned
    config: Any                        # the FuseConfig
    as_op: bool
    unavailable: set[int]              # site numbers excluded, or computed by a call already
    claimed: set                       # adds (and folded nodes) a call took: no other call may
    reserved: set                      # adds some norm reads its sum from (an add_norm may take them)
    norm_refusal: Callable[[Any], str | None]  # planning.refusal: why a site's norm cannot be fused
    steps: tuple = ()                  # every step, in the order they are offered (order.STEPS)
    memo: dict = field(default_factory=dict)  # what a step reads once per planning (the q/k norms' attentions)


class Step:
    """One step a call can be offered (see the module docstring). The defaults are a step that
    finds nothing, reads nothing and replaces nothing; a step overrides what it does."""

    name: str = ""            # the key of its match in SiteAnalysis.parts and Plan.taken
    exclusive: bool = True    # it changes what y is: no second norm shares the call, no linear recomputes y
    # the call's options holding tensors the checker reads -> the prefix of their symbols
    roles: Mapping[str, str] = MappingProxyType({})
    operand_name: str = "its operand"
    joins_gated_branch: bool = False  # a call that reads a gated residual branch (x * x_gate) may take it too

    # ---------------------------------------------------------------- find
    def find(self, index: GraphIndex, match, in_add=None) -> Any | None:
        """What the step recognizes at the norm ``match`` (a frozen object), or None; ``in_add``: the
        add the norm reads (find.find_input_add's, found once by the analysis), or None."""
        return None

    # ---------------------------------------------------------------- plan
    def offer(self, ctx: PlanContext, site, found, plan) -> tuple[Any, str | None]:
        """The planned call ``plan`` of ``site`` (a planning.Plan, the steps before this one in
        ``order.STEPS`` already offered) is offered the step: (what the call takes, None),
        adjusting the plan where the step changes it (e.g. the call's x, or its op), or (None,
        why not). ``found``: what ``find`` found at the site (None: nothing, or no ``find``).
        Each step checks its own option (``fuse_<name>``) here, and says why in its words."""
        return None, None

    def reads(self, found) -> tuple[fx.Node, ...]:
        """The original values the call reads for the step (its operands)."""
        return ()

    def nodes(self, found) -> tuple[fx.Node, ...]:
        """The original nodes the step stands for in the call."""
        return ()

    def folded(self, found) -> tuple[fx.Node, ...]:
        """The original nodes ahead of the add the call computes (no other call may take them;
        the kernel reads their operands, and does their casts, itself)."""
        return ()

    def may_drop(self, found) -> bool:
        """Whether the call is still made without the step when its operands come too late
        (the report then says: "<operand_name>: <why it cannot move up>")."""
        return False

    def drop(self, plan, found) -> None:
        """Undo what ``offer`` changed in the plan besides taking the step (see may_drop)."""

    def spans(self, found) -> tuple[fx.Node, ...]:
        """Original nodes besides the site's own that decide where the call starts (the first of
        them in graph order)."""
        return ()

    # ---------------------------------------------------------------- report, audit
    def report(self, record, found, fused: bool, reason: str | None) -> None:
        """Fill the report's fields for the step on ``record`` (a reporting.Site); ``fused``: the
        call takes it, else ``reason`` says why not (None: the site is not fused)."""

    def eager_nodes(self, found) -> tuple[fx.Node, ...]:
        """The nodes the audit prices as the eager cost of the step (those the call removes)."""
        return ()

    def fused_bytes(self, found, y_bytes: int, size) -> tuple[int, int]:
        """(forward, backward) bytes the call moves for the step besides the norm's own, with y of
        ``y_bytes`` (``size.bytes(node)``, ``size.numel(node)``: the audit's sizes of a node's value)."""
        return 0, 0
