"""What a fusion declares: ``Fusion``, the call of its own op that computes a site.

Every site starts as an add_norm call (``planning._choose``: the add and its norm, or the norm
alone); a fusion whose ``offer`` takes the site makes it a call of its op instead (``norm_add``
for ``x + norm(f)``, ``qk_norm_rope`` for the q/k norms and their RoPE). The rewrite asks the
plan's fusion to build the call, and the checker asks the call's fusion for its formula: neither
names an op. Besides the hooks every step has (``passes/step.py``), a fusion declares:

========  ======================================  ===================================================
stage     hook                                    what the fusion says
========  ======================================  ===================================================
plan      ``ops``                                 the plan's op names it builds (``Plan.op``), which
                                                  are also the calls' ``record.fused_op_name``
rewrite   ``build(found, plan, rewriting, modes)`` the call inserted, its outputs rerouted: a BuiltCall
checker   ``norm_kind`` / ``formula``             its norm / its outputs in exact arithmetic
checker   ``heads`` / ``reads_transposed``        rows that stand for heads / q read before its transpose
checker   ``stream_sum`` / ``stream_input``       the residual add it computes / the stream its norm reads
========  ======================================  ===================================================
"""

from __future__ import annotations

from typing import Any, Callable

import torch.fx as fx

from normfuse.passes.step import BuiltCall, Step

__all__ = ["Fusion"]


class Fusion(Step):
    """A call of one op that computes a site (see the module docstring)."""

    ops: tuple[str, ...] = ()

    # ---------------------------------------------------------------- rewrite
    def build(self, found, plan, rewriting, modes: dict) -> BuiltCall:
        """Insert the call of plan ``plan`` at the graph's insertion point (``found``: what the
        plan took of the fusion; ``modes``: the norm's modes, read off its match), reroute what
        it computes (``rewriting.replace``) and return what was built."""
        raise NotImplementedError

    # ---------------------------------------------------------------- checker
    def norm_kind(self, options: dict) -> str:
        """The norm the call computes ("rms_norm" or "layer_norm")."""
        return options["kind"]

    def formula(self, options: dict, rows: dict, normalize: Callable[..., list], ops) -> list:
        """The call's outputs in the order it returns them, in exact arithmetic over the rows of
        its arguments (``rows``: role -> a row of symbols; ``normalize(row, weight, bias)`` is
        the call's norm; ``ops`` the checker's row operations)."""
        raise NotImplementedError

    def heads(self, call: fx.Node, outputs: list[tuple[int, fx.Node]]) -> tuple[Any, int | None] | None:
        """(head_dim, rotary_dim) when the call's rows stand for heads (the checker then gives
        each head its own symbols), else None."""
        return None

    def reads_transposed(self, options: dict) -> bool:
        """Whether the call reads a value before a transpose the graph made of it (the checker
        then takes a transpose as keeping each row)."""
        return False

    def stream_sum(self, call: fx.Node) -> tuple[int, tuple[Any, Any] | None] | None:
        """(the output holding the residual stream's sum, its two operands or None when the
        add is scaled) when the call computes a stream's add, else None. The Pre-Norm
        structure check follows the stream through it."""
        return None

    def stream_input(self, call: fx.Node) -> Any:
        """The stream value the call's norm reads (the call itself standing for its sum), or
        None when the call has no such norm."""
        return None
