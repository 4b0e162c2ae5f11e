"""What a fusion part declares: ``FusionPart``, the hooks the add_norm call's build and the checker call.

A part extends the add_norm call (``fusions/add_norm.py`` builds it): a step before the sum
(a prologue: what the call reads) or after the norm (an epilogue: what it does to y, or the
outputs it adds). ``parts/__init__.py`` lists them. Besides the hooks every step has
(``passes/step.py``: find, offer, report, audit), a part declares:

========  ======================================  ===================================================
stage     hook                                    what the part says
========  ======================================  ===================================================
rewrite   ``operands`` / ``call``                 the call's x and residual / its options in the call
rewrite   ``y_output`` / ``y_read``               the node y replaces / whether the call still returns y
rewrite   ``returned`` / ``outputs``              y and s made back into the graph's / outputs it adds
plan      ``added_outputs``                       the original nodes the outputs it adds replace
checker   ``symbolic_input`` / ``symbolic``       its step on x before the sum / its outputs' formula
checker   ``uses``                                whether a call computes it
checker   ``check_arguments``                     its arguments for a numeric run of the call
========  ======================================  ===================================================

The kernel side of a part (its arguments, outputs and reference semantics) is in
``normfuse.kernels``; a part's module names the options it passes (``call``) and the outputs it
reads back (``outputs``) by the names the functional API gives them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch.fx as fx

from normfuse.passes.step import BuiltCall, PlanContext, Step

__all__ = ["FusionPart", "CallPiece", "BuiltCall", "PlanContext"]


@dataclass
class CallPiece:
    """What a part puts into one rewritten call: its options (keyword arguments of the call),
    the nodes it inserted for them, and the original value each of those holds (the record)."""

    options: dict[str, Any] = field(default_factory=dict)
    inserted: list[fx.Node] = field(default_factory=list)
    holds: dict[fx.Node, fx.Node] = field(default_factory=dict)


class FusionPart(Step):
    """A step the add_norm call takes over besides the norm and its add (see the module
    docstring). The defaults add nothing to the call; a part overrides what it does."""

    # ---------------------------------------------------------------- rewrite
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

    def added_outputs(self, found) -> tuple[fx.Node, ...]:
        """The original nodes the outputs it adds replace (what ``outputs`` reroutes), known when the
        call is planned: read outside the site, they are the call's values, not the site's."""
        return ()

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
