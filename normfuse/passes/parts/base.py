"""What a fusion part declares: ``FusionPart``, the hooks every stage of the pass calls.

A fused call computes the norm (and its add); a part is one more step it takes over from the
graph, before or after the norm (``parts/__init__.py`` lists them). One module per part
declares all of it, and the stages know no part by name:

========  ======================================  ===================================================
stage     hook                                    what the part says
========  ======================================  ===================================================
find      ``find(index, match)``                  what it recognizes at a norm (a frozen match), or None
plan      ``offer(ctx, site, found, plan)``       whether the planned call takes it (and what that changes)
plan      ``reads`` / ``spans``                   its operands / nodes that decide where the call starts
plan      ``may_drop`` / ``drop``                 whether the call goes without it when an operand is late
plan      ``exclusive``                           it changes y: no second norm, no recompute of y
record    ``nodes`` / ``folded``                  the nodes it replaces / those ahead of the add it computes
rewrite   ``operands`` / ``call``                 the call's x and residual / its options in the call
rewrite   ``y_output`` / ``y_read``               the node y replaces / whether the call still returns y
rewrite   ``returned`` / ``outputs``              y and s made back into the graph's / outputs it adds
rewrite   ``build`` (``builds_call``)             the call of another op it makes itself
report    ``report``                              the report's fields for it
audit     ``eager_nodes`` / ``fused_bytes``       its traffic, eager and fused
checker   ``symbolic_input`` / ``symbolic``       its step on x before the sum / its outputs' formula
checker   ``uses`` / ``roles``                    whether a call computes it / its tensor options' symbols
checker   ``check_arguments``                     its arguments for a numeric run of the call
========  ======================================  ===================================================

The kernel side of a part (its arguments, outputs and reference semantics) is in
``normfuse.kernels``; a part's module names the options it passes (``call``) and the outputs it
reads back (``outputs``) by the names the functional API gives them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Callable, Mapping

import torch.fx as fx

if TYPE_CHECKING:
    from normfuse.passes.graph import GraphIndex

__all__ = ["FusionPart", "CallPiece", "BuiltCall", "PlanContext"]


@dataclass
class BuiltCall:
    """One fused call as the rewrite built it (the add_norm call, or a call a part made itself
    with ``FusionPart.build``): the call, the nodes inserted with it (in graph order), the
    original node each of its outputs replaced, the original nodes it computes, the original
    value each node inserted for its arguments holds (an operand reshaped for the kernel), the
    original values its arguments read, and the outputs handed back permuted (index -> dims)."""

    call: fx.Node
    inserted: list[fx.Node]
    stands_for: list[tuple[int, fx.Node]]
    old_nodes: list[fx.Node]
    holds: dict[fx.Node, fx.Node] = field(default_factory=dict)
    reads: set = field(default_factory=set)
    permuted_back: dict[int, tuple[int, ...]] = field(default_factory=dict)


@dataclass
class PlanContext:
    """What a part's ``offer`` may read besides the site and its plan: the analysis (never
    written to), the options, whether the calls will be custom ops in an ATen graph (Inductor's
    post-grad pass), the sites no call may take any more, and why a norm itself cannot be fused."""

    analysis: Any                      # the analysis.Analysis being planned
    config: Any                        # the FuseConfig
    as_op: bool
    unavailable: set[int]              # site numbers excluded, or computed by a call already
    claimed: set                       # adds (and folded nodes) a call took: no other call may
    reserved: set                      # adds some norm reads its sum from (an add_norm may take them)
    norm_refusal: Callable[[Any], str | None]  # planning.refusal: why a site's norm cannot be fused


@dataclass
class CallPiece:
    """What a part puts into one rewritten call: its options (keyword arguments of the call),
    the nodes it inserted for them, and the original value each of those holds (the record)."""

    options: dict[str, Any] = field(default_factory=dict)
    inserted: list[fx.Node] = field(default_factory=list)
    holds: dict[fx.Node, fx.Node] = field(default_factory=dict)


class FusionPart:
    """One step a fused call can take over (see the module docstring). The defaults are a part
    that reads nothing, replaces nothing and adds no output; a part overrides what it does."""

    name: str = ""            # the key of its match in SiteAnalysis.parts and Plan.taken
    exclusive: bool = True    # it changes what y is: no second norm shares the call, no linear recomputes y
    # the call's options holding tensors the checker reads -> the prefix of their symbols
    roles: Mapping[str, str] = MappingProxyType({})

    # ---------------------------------------------------------------- find
    def find(self, index: GraphIndex, match) -> Any | None:
        """What the part recognizes at the norm ``match`` (a frozen object), or None."""
        return None

    # ---------------------------------------------------------------- plan
    def offer(self, ctx: PlanContext, site, found, plan) -> tuple[Any, str | None]:
        """The planned call ``plan`` of ``site`` (a planning.Plan, parts earlier in PARTS already
        taken) is offered the part: (what the call takes, None), adjusting the plan where the
        part changes it (e.g. the call's x), or (None, why not). ``found``: what ``find`` found at
        the site (None: nothing, or the part has no ``find``). Each part checks its own option
        (``fuse_<name>``) here, and says why in its words."""
        return None, None

    def reads(self, found) -> tuple[fx.Node, ...]:
        """The original values the call reads for the part (its operands)."""
        return ()

    def nodes(self, found) -> tuple[fx.Node, ...]:
        """The original nodes the part's step stands for in the call."""
        return ()

    def folded(self, found) -> tuple[fx.Node, ...]:
        """The original nodes ahead of the add the call computes (no other call may take them;
        the kernel reads their operands, and does their casts, itself)."""
        return ()

    def may_drop(self, found) -> bool:
        """Whether the call is still made without the part when its operands come too late
        (the report then says: "<operand_name>: <why it cannot move up>")."""
        return False

    def drop(self, plan, found) -> None:
        """Undo what ``offer`` changed in the plan besides taking the part (see may_drop)."""

    def spans(self, found) -> tuple[fx.Node, ...]:
        """Original nodes besides the site's own that decide where the call starts (the first of
        them in graph order)."""
        return ()

    operand_name: str = "its operand"

    # ---------------------------------------------------------------- rewrite
    builds_call: bool = False  # the part makes the call itself (another op): ``build``

    def build(self, found, plan, rewriting, modes: dict) -> BuiltCall:
        """The call of another op the part computes the site with (``builds_call``)."""
        raise NotImplementedError

    def operands(self, found, values: tuple, originals: tuple, rewriting) -> tuple[tuple, CallPiece]:
        """The call's x and residual (``values``; ``originals``: the original nodes they hold) as
        the call reads them, and the nodes inserted for that."""
        return values, CallPiece()

    def call(self, found, rewriting) -> CallPiece:
        """The part's options in the rewritten call (``rewriting``: a rewrite.Rewriting)."""
        return CallPiece()

    def y_output(self, found, y: fx.Node) -> fx.Node:
        """The original node the call's y replaces (the norm's output ``y`` unless the part
        computes a step after it)."""
        return y

    def y_read(self, found) -> bool:
        """Whether the call still returns y (False: y was read only by the part's step)."""
        return True

    def returned(self, found, name: str, value: fx.Node, original: fx.Node, rewriting
                 ) -> tuple[fx.Node, list[fx.Node], tuple[int, ...] | None]:
        """The call's output ``name`` ("y" or "s"; ``value``, its getitem) made into what the graph
        had as ``original``: (the node replacing it, the nodes inserted, the dims it is permuted
        back by, or None)."""
        return value, [], None

    def outputs(self, found, rewriting, call: fx.Node, kernel_shape: tuple, where: dict[str, int]
                ) -> tuple[list[fx.Node], list[tuple[int, fx.Node]]]:
        """The call's outputs the part adds: (nodes inserted, (output index, original node it replaces))."""
        return [], []

    # ---------------------------------------------------------------- report, audit
    def report(self, record, found, fused: bool, reason: str | None) -> None:
        """Fill the report's fields for the part on ``record`` (a reporting.Site); ``fused``: the
        call takes it, else ``reason`` says why not (None: the site is not fused)."""

    def eager_nodes(self, found) -> tuple[fx.Node, ...]:
        """The nodes the audit prices as the eager cost of the step (those the call removes)."""
        return ()

    def fused_bytes(self, found, y_bytes: int, size) -> tuple[int, int]:
        """(forward, backward) bytes the call moves for the part besides the norm's own, with y of
        ``y_bytes`` (``size.bytes(node)``, ``size.numel(node)``: the audit's sizes of a node's value)."""
        return 0, 0

    # ---------------------------------------------------------------- checker
    def uses(self, options: dict) -> bool:
        """Whether a call with these options computes the part."""
        return False

    def symbolic_input(self, options: dict, rows: dict, x: list, ops) -> list:
        """The call's x after the part's step before the sum, in exact arithmetic."""
        return x

    def symbolic(self, options: dict, rows: dict, s: list, norm, ops) -> dict[str, list] | None:
        """The call's outputs by name in exact arithmetic when the part is in it (``norm(value)``
        normalizes a row, ``ops`` holds the checker's row operations), or None to leave them to
        the plain formula."""
        return None

    def check_arguments(self, options: dict, x) -> None:
        """Turn the original run's values into what the call takes (in place), for a numeric run
        (``x``: the call's x)."""
