"""Pair each rewritten site with the original subgraph it replaced.

The checker holds two graphs of the same capture: the original (as dynamo gave it) and
the rewritten one (``FusionReport.graph_modules``). The rewrite left on the rewritten graph
module a record of each fused call (``normfuse/passes/record.py``): the original nodes it
stands for, the original value each argument carries, the original node each output
replaced, by name (the rewrite kept every name of the original). Pairing reads those names in
the two graphs; nothing is analysed again.

A ``SitePair`` says, for one fused call:
- ``nodes``: the original subgraph (graph order) the call stands for;
- ``inputs``: the original values that subgraph reads (its boundary);
- ``outputs``: (call output index, original node it replaced);
- ``args``: the original node each tensor argument of the call carries (None for None);
- ``layout``: the dims the rewrite permuted x and residual by (a channel norm's add moved
  through its permute), or None.

One call may stand for two sites (two norms of one value: ``site`` and ``partners``) and
for branch nodes folded into it (a second add, a drop-path scale, dropout).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch.fx as fx

from normfuse.passes.record import (ARG_ROLES, OPTION_ROLES, CallRecord, boundary, fused_op_name, is_fused_call,
                                    records_of, splits_of)
from normfuse.reporting import Site

__all__ = ["SitePair", "pair_sites", "as_the_pass_read", "fused_calls", "site_order"]


@dataclass
class SitePair:
    site: Site
    call: fx.Node | None = None                 # the fused call in the rewritten graph
    nodes: list[fx.Node] = field(default_factory=list)
    inputs: list[fx.Node] = field(default_factory=list)
    outputs: list[tuple[int, fx.Node]] = field(default_factory=list)
    args: dict[str, Any] = field(default_factory=dict)   # role -> original node / None / constant
    eps: float | None = None                     # the eps the original subgraph uses
    layout: tuple[int, ...] | None = None        # the call reads args["x"/"residual"].permute(*layout)
    permuted_back: dict[int, tuple[int, ...]] = field(default_factory=dict)  # output -> the dims the rewrite
    #                                              permutes it back by (the sum; a channel norm's y)
    problem: str | None = None                   # why the pair could not be formed
    partners: list[Site] = field(default_factory=list)  # other sites the same call computes
    folded: list[fx.Node] = field(default_factory=list)  # original branch nodes the call computes
    dropout: fx.Node | None = None               # the folded live dropout, whose mask the kernel draws


def fused_calls(graph: fx.Graph) -> list[fx.Node]:
    return [n for n in graph.nodes if is_fused_call(n)]


def site_order(site: Site) -> tuple[int, int]:
    return site.graph, site.number


def pair_sites(original: fx.GraphModule, rewritten: fx.GraphModule, sites: list[Site]) -> list[SitePair]:
    """One SitePair per fused call of one graph (``sites``: the report's sites of that graph)."""
    by_name = {n.name: n for n in original.graph.nodes}
    calls = {n.name: n for n in fused_calls(rewritten.graph)}
    by_number = {s.number: s for s in sites if s.fused}
    records = records_of(rewritten)
    if records is None or len(records) != len(calls):
        message = (f"the rewritten graph has {len(calls)} fused calls and "
                   f"{'no record of them' if records is None else f'{len(records)} records'}: it is not the graph "
                   "the pass rewrote")
        return [SitePair(site=s, problem=message) for s in sorted(by_number.values(), key=site_order)]
    # a node the rewrite inserted holds the value of an original node; any other keeps its name
    holds = {new: old for record in records for new, old in record.holds}

    def original_of(value: Any) -> Any:
        if not isinstance(value, fx.Node):
            return value
        return by_name.get(holds.get(value.name, value.name), _Unmapped(value.name))

    pairs = [_pair(record, calls.get(record.call), by_number, by_name, original_of) for record in records]
    return [pair for pair in pairs if pair is not None]


def as_the_pass_read(original: fx.GraphModule, rewritten: fx.GraphModule) -> fx.GraphModule:
    """The original graph whose nodes the rewritten graph's records name: ``original``, or a copy
    of it split as the pass split it (``record.GraphSplits``: the RoPEs over cats, the norms over
    slices of their rows, then the rotated pieces stored into cats of norms; the same steps on the
    same graph give the same node names)."""
    splits = splits_of(rewritten)
    if not splits:
        return original
    from normfuse.passes.dtensor_graph import hoist_from_local
    from normfuse.passes.graph import copy_graph_module
    from normfuse.passes.norm_over_slices import split_norm_over_slices, split_stores_into_cats
    from normfuse.passes.rope_over_cat import split_rope_over_cat

    split = copy_graph_module(original)
    hoist_from_local(split.graph)
    if splits.cats:
        pieces = {t for n in split.graph.nodes if n.name in splits.cats for t in n.all_input_nodes}
        split_rope_over_cat(split.graph, pieces, only=splits.cats)
    if splits.norms:
        split_norm_over_slices(split.graph, {}, only=splits.norms)
    if splits.stores:
        split_stores_into_cats(split.graph, set(), only=splits.stores)
    return split


def _pair(record: CallRecord, call: fx.Node | None, by_number: dict[int, Site], by_name: dict[str, fx.Node],
          original_of) -> SitePair | None:
    members = [by_number.get(number) for number in record.sites]
    if members[0] is None:
        return None  # the report does not list its lead as fused (a filtered report)
    pair = SitePair(site=members[0], call=call, partners=[m for m in members[1:] if m is not None],
                    eps=record.eps, layout=record.layout, permuted_back=dict(record.permuted_back))
    if call is None:
        pair.problem = f"the fused call {record.call} of the record is not in the rewritten graph"
        return pair
    missing = [name for name in (*record.nodes, *(n for _, n in record.outputs), *record.folded) if name not in by_name]
    if missing:
        pair.problem = "the record names nodes the original graph does not have: " + ", ".join(missing[:5])
        return pair
    op = fused_op_name(call)
    if pair.site.op and pair.site.op != op:
        pair.problem = f"the report says {pair.site.id} became {pair.site.op} but the graph calls {op}"
    # the arguments as the graph has them, each mapped to the original value it holds
    pair.args = {role: original_of(arg) for role, arg in zip(ARG_ROLES, call.args)}
    pair.args.update({role: original_of(call.kwargs[role]) for role in OPTION_ROLES if role in call.kwargs})
    unmapped = [f"{role}={a.name}" for role, a in pair.args.items() if isinstance(a, _Unmapped)]
    if unmapped and pair.problem is None:
        pair.problem = "arguments of the fused call have no counterpart in the original graph: " + ", ".join(unmapped)
    pair.nodes = [by_name[name] for name in record.nodes]
    pair.inputs = boundary(pair.nodes)
    pair.outputs = [(k, by_name[name]) for k, name in record.outputs]
    pair.folded = [by_name[name] for name in record.folded]
    pair.dropout = by_name[record.dropout] if record.dropout is not None else None
    return pair


class _Unmapped:
    """A rewritten-graph value with no original counterpart (named for the message)."""

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return f"<unmapped {self.name}>"
