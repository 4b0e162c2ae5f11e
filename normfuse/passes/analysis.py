"""Analyze: what one graph holds, computed once and never written to afterwards.

``analyze(graph) -> Analysis`` runs the first three stages of the pass, without changing
the graph:

- canonicalize: the canonical view of every node (``canonical.py``, one table of spellings);
- find: every norm, the residual add it reads, the add its output goes into (``find.py``),
  and what each fusion part (``parts/``) recognizes at it;
- classify: where each norm sits on the residual stream (``classify.py``).

Everything after it reads the ``Analysis``: the planner decides the fused calls from it
(``planning.py``), the rewrite applies those plans and records what each call replaced (``record.py``),
the audit prices them, the checker reads those records. The
analysis and every match in it are frozen: nothing downstream writes to them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Mapping

import torch.fx as fx

from normfuse.passes.canonical import canonicalize
from normfuse.passes.classify import Found, classify, sum_continues
from normfuse.passes.find import (AddMatch, NormMatch, find_elementwise_norms, find_input_add, find_norms,
                                  find_output_add)
from normfuse.passes.graph import GraphIndex
from normfuse.passes.order import STEPS
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
    sum_continues: bool = False              # the sum it reads is read by more than the norm (in_add)
    # what each fusion part (parts/) found at it: part name -> its frozen match
    parts: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}), compare=False)

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
    elementwise_norms: tuple[fx.Node, ...] = ()  # DynamicTanh / Derf: listed in the report, not sites


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
                               sum_continues(f), _parts_found(index, f))
                  for number, (f, placement, group) in enumerate(zip(found, placements, groups)))
    elementwise = tuple(find_elementwise_norms(index))
    index.freeze()
    return Analysis(index, sites, elementwise)


def _parts_found(index: GraphIndex, f: Found) -> Mapping[str, Any]:
    found = {step.name: step.find(index, f.match, f.in_add) for step in STEPS}
    return MappingProxyType({name: m for name, m in found.items() if m is not None})
