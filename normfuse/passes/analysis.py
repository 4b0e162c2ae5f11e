"""Analyze: what one graph holds, computed once and never written to afterwards.

``analyze(graph) -> Analysis`` runs the first three stages of the pass, without changing
the graph:

- canonicalize: the canonical view of every node (``canonical.py``, one table of spellings);
- find: every norm, the residual add it reads, the add its output goes into (``find.py``),
  its gate (``gate.py``) and the fp8 quantization of its output (``quant.py``);
- classify: where each norm sits on the residual stream (``classify.py``).

Everything after it reads the ``Analysis``: the planner decides the fused calls from it
(``planning.py``), the rewrite applies those plans, the audit prices them, the checker
re-analyzes the original graph to pair each rewritten site with what it replaced. The
analysis and every match in it are frozen: nothing downstream writes to them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch.fx as fx

from normfuse.passes.canonical import canonicalize
from normfuse.passes.classify import Found, classify
from normfuse.passes.find import AddMatch, NormMatch, find_input_add, find_norms, find_output_add
from normfuse.passes.graph import GraphIndex
from normfuse.passes.gate import GateMatch, find_gate
from normfuse.passes.quant import QuantMatch, find_quant
from normfuse.vocabulary import Placement

__all__ = ["Analysis", "SiteAnalysis", "analyze"]


@dataclass(frozen=True)
class SiteAnalysis:
    """One norm of the graph: its match, the adds next to it, and its placement."""

    number: int                              # its place among the graph's norms, in graph order
    match: NormMatch
    in_add: AddMatch | None                  # the residual add whose sum the norm reads
    output_add: AddMatch | None              # the add the norm's output goes into
    output_chain: tuple[fx.Node, ...]        # views / identity dropout between the norm and that add
    placement: Placement
    group: tuple[int, ...]                   # the norms that read the same value (itself included)
    quant: QuantMatch | None = None          # the fp8 quantization of its output, when the graph has one
    gate: GateMatch | None = None            # its gate (Mamba2's and Qwen3-Next's gated norms)

    @property
    def input_is_add(self) -> bool:
        return self.in_add is not None

    @property
    def output_feeds_add(self) -> bool:
        return self.output_add is not None


@dataclass(frozen=True)
class Analysis:
    """A graph's canonical view and its norms, in graph order."""

    index: GraphIndex
    sites: tuple[SiteAnalysis, ...]


def analyze(graph: fx.Graph, stage: Callable[[str], None] = lambda name: None) -> Analysis:
    """Canonicalize, find and classify, without changing the graph. ``stage(name)`` is called
    as each stage starts (a failure names it)."""
    stage("canonicalize")
    index = GraphIndex(graph, canonicalize(graph))
    stage("find")
    found = []
    for match in find_norms(index):
        out = find_output_add(index, match)
        found.append(Found(match, find_input_add(index, match), *(out if out is not None else (None, ()))))
    stage("classify")
    placements, groups = classify(index, found)
    sites = tuple(SiteAnalysis(number, f.match, f.in_add, f.output_add, tuple(f.output_chain), placement, group,
                               find_quant(index, f.match.output), find_gate(index, f.match))
                  for number, (f, placement, group) in enumerate(zip(found, placements, groups)))
    index.freeze()
    return Analysis(index, sites)
