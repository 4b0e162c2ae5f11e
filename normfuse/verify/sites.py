"""Pair each rewritten site with the original subgraph it replaced.

The checker holds two graphs of the same capture: the original (as dynamo gave it) and
the rewritten one (``FusionReport.graph_modules``). The rewrite copies the graph keeping
node names, so every node it did not touch has the same name in both. Each fused call
replaced some original nodes: its outputs stand for the norm's output, the residual
sum and the add after the norm. Analyzing the original graph again (the pass is
deterministic) gives, per site, the nodes the rewrite removed.

A ``SitePair`` says, for one fused call:
- ``nodes``: the original subgraph (graph order) the call stands for;
- ``inputs``: the original values that subgraph reads (its boundary);
- ``outputs``: (call output index, original node it replaced);
- ``args``: the original node each tensor argument of the call carries (None for None);
- ``layout``: the dims the rewrite permuted x and residual by (a channel norm's add moved
  through its permute), or None.

One call may stand for two sites (two norms of one value: ``site`` and ``partners``) and
for branch nodes folded into it (a second add, a drop-path scale, dropout: the call's
``FOLDED_META``).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import torch.fx as fx

from normfuse.passes.canonical import canonical
from normfuse.passes.find import live_dropout_p
from normfuse.passes.analysis import analyze
from normfuse.passes.rewrite import fused_op_name, is_fused_call, is_quantized, output_index
from normfuse.reporting import Site
from normfuse.vocabulary import FOLDED_META, LAYOUT_META, ROWS_META

__all__ = ["SitePair", "pair_sites", "fused_calls", "site_order"]

_ARG_ROLES = ("x", "residual", "weight", "bias")       # positional arguments of the fused call
_OPTION_ROLES = ("x1", "rowscale", "weight1", "bias1", "quant_scale", "gate")  # tensors it takes as keyword options


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

    @property
    def dropout(self) -> fx.Node | None:
        """The folded live dropout, whose mask the kernel draws (None when there is none)."""
        if not (self.call is not None and self.call.kwargs.get("dropout_p")):
            return None
        return next((n for n in self.folded if live_dropout_p(canonical(n)) is not None), None)


def fused_calls(graph: fx.Graph) -> list[fx.Node]:
    return [n for n in graph.nodes if is_fused_call(n)]


def site_order(site: Site) -> tuple[int, int]:
    return site.graph, site.number


def _op_name(call: fx.Node) -> str:
    return fused_op_name(call)


def _operand_prep(index, add, operands) -> list[fx.Node]:
    """The casts / constant scaling between an add and the operands the kernel reads."""
    prep = []
    for arg in add.all_input_nodes:
        cur = arg
        while isinstance(cur, fx.Node) and cur not in operands:
            c = index.canon(cur)
            if c is None or c.prim not in ("cast", "mul"):
                break
            prep.append(cur)
            nxt = c["input"]
            if c.prim == "mul" and not isinstance(nxt, fx.Node):
                nxt = c["other"]
            cur = nxt
    return prep


def _subgraph(index, state, op: str, reads: set, folded: list[fx.Node], partners: list, quantized: bool = False,
              gated: bool = False) -> tuple[list[fx.Node], list[tuple[int, fx.Node]]]:
    """Original nodes a fused call of ``op`` stands for, and which output replaced which node.

    ``reads``: the original values the call's arguments carry; the walk from an add to
    its operands stops there (an operand may be another site's output, casts included).
    ``folded``: branch nodes folded into the call; ``partners``: states of the other norms
    it computes; ``quantized``: the call computes the fp8 quantization of y too; ``gated``: it
    applies the norm's gate."""
    m = state.match
    nodes = list(m.nodes)
    y_node = m.output
    if gated:
        if state.gate is None:
            raise AttributeError("no gate of the norm in the original graph")
        nodes += state.gate.nodes
        if state.gate.position == "after":
            y_node = state.gate.output
    where = output_index(False, bool(partners), quantized)
    quant_outputs = []
    if quantized:
        if state.quant is None or state.quant.reason is not None:
            raise AttributeError("no quantization of the norm's output in the original graph")
        nodes += state.quant.nodes
        quant_outputs = [(where["q"], state.quant.q)]
        if state.quant.scale_node is not None:
            quant_outputs.append((where["scale"], state.quant.scale_node))
    for partner in partners:
        nodes += partner.match.nodes
    if op == "add_norm":
        add = state.in_add
        nodes += [add.node, *add.chain, *_operand_prep(index, add.node, set(add.operands) | reads)]
        for node in folded:
            nodes += [node, *_operand_prep(index, node, reads)]
        outputs = [(where["y"], y_node), (where["s"], add.node)]
    elif op == "norm_add":
        out = state.output_add
        nodes += [out.node, *_operand_prep(index, out.node, set(out.operands) | {m.output} | reads)]
        outputs = [(0, out.node), (1, m.output)]
    else:
        outputs = [(where["y"], y_node)]
    outputs += [(where["y1"], partner.match.output) for partner in partners] + quant_outputs
    unique = sorted(set(nodes), key=index.order.__getitem__)
    return unique, outputs


def _with_duplicates(index, nodes: list[fx.Node]) -> list[fx.Node]:
    """``nodes`` and the duplicates they read of their own values (model code that writes
    ``x - mean`` twice): a duplicate computes inside the subgraph, it is not an input of it."""
    inside = set(nodes)
    grown = True
    while grown:
        grown = False
        for node in _boundary(sorted(inside, key=index.order.__getitem__)):
            if index.rep.get(node) in inside:
                inside.add(node)
                grown = True
    return sorted(inside, key=index.order.__getitem__)


def _boundary(nodes: list[fx.Node]) -> list[fx.Node]:
    inside = set(nodes)
    seen: list[fx.Node] = []
    for n in nodes:
        for p in n.all_input_nodes:
            if p not in inside and p not in seen:
                seen.append(p)
    return seen


def pair_sites(original: fx.GraphModule, rewritten: fx.GraphModule, sites: list[Site]) -> list[SitePair]:
    """One SitePair per fused site of one graph (``sites``: the report's sites of that graph)."""
    analysis = analyze(original.graph)
    index, states = analysis.index, analysis.sites
    by_name = {n.name: n for n in original.graph.nodes}
    fused = sorted((s for s in sites if s.fused), key=site_order)
    calls = fused_calls(rewritten.graph)
    pairs: list[SitePair] = []
    produced: dict[fx.Node, fx.Node] = {}   # rewritten node -> original node whose value it holds

    def original_of(value: Any) -> Any:
        if not isinstance(value, fx.Node):
            return value
        if value in produced:
            return produced[value]
        return by_name.get(value.name, _Unmapped(value.name))

    groups: dict[str, list[Site]] = {}  # the sites each call computes, in site order
    for s in fused:
        groups.setdefault(s.call or s.id, []).append(s)
    if len(calls) != len(groups):
        message = (f"the rewritten graph has {len(calls)} fused calls but the report lists {len(groups)} fused "
                   "calls; the graphs do not belong together")
        return [SitePair(site=s[0], partners=s[1:], problem=message) for s in groups.values()]
    for (site, *partners), call in zip(groups.values(), calls):
        pair = SitePair(site=site, call=call, partners=partners)
        pairs.append(pair)
        number = site.number
        kind = call.kwargs.get("kind")
        if number >= len(states) or states[number].match.kind != kind:
            pair.problem = (f"site {site.id} ({site.kind}) does not line up with the fused call {call.name} "
                            f"({kind}) when the original graph is analyzed again")
            continue
        state = states[number]
        op = _op_name(call)
        if site.op and site.op != op:
            pair.problem = f"the report says {site.id} became {site.op} but the graph calls {op}"
        for role, arg in zip(_ARG_ROLES, call.args):
            if isinstance(arg, fx.Node) and LAYOUT_META in arg.meta:  # a permute the rewrite inserted
                pair.layout = arg.meta[LAYOUT_META]
                arg = arg.all_input_nodes[0]
            pair.args[role] = original_of(arg)
        for role in _OPTION_ROLES:
            arg = call.kwargs.get(role)
            if isinstance(arg, fx.Node) and ROWS_META in arg.meta:  # the rewrite's per-row view of a scale
                arg = arg.all_input_nodes[0].all_input_nodes[0]
            if role == "quant_scale" and isinstance(arg, fx.Node) and arg.name not in by_name:
                arg = arg.all_input_nodes[0]  # the rewrite's fp32 upcast of a 16-bit static scale
            if role in call.kwargs:
                pair.args[role] = original_of(arg)
        reads = {a for a in pair.args.values() if isinstance(a, fx.Node)}
        pair.folded = [by_name[name] for name in call.meta.get(FOLDED_META, ()) if name in by_name]
        if len(pair.folded) != len(call.meta.get(FOLDED_META, ())):
            pair.problem = pair.problem or "branch nodes folded into the call are missing from the original graph"
        others = [states[p.number] for p in partners if p.number < len(states)]
        try:
            pair.nodes, outputs = _subgraph(index, state, site.op or op, reads, pair.folded, others,
                                            is_quantized(call), call.kwargs.get("gate") is not None)
        except AttributeError as error:  # the analysis found no add where the report says one was fused
            pair.problem = f"the original subgraph of {site.id} cannot be rebuilt ({error})"
            continue
        pair.nodes = _with_duplicates(index, pair.nodes)
        pair.inputs = _boundary(pair.nodes)
        pair.eps = state.match.eps
        unmapped = [f"{r}={a.name}" for r, a in pair.args.items() if isinstance(a, _Unmapped)]
        if unmapped and pair.problem is None:
            pair.problem = ("arguments of the fused call have no counterpart in the original graph: "
                            + ", ".join(unmapped))
        getitems = {u.args[1]: u for u in call.users if u.target is operator.getitem}
        for k, orig in outputs:
            item = getitems.get(k)
            if item is None:
                continue
            pair.outputs.append((k, orig))
            produced[item] = orig
            for user in item.users:  # a reshape or permute the rewrite inserted stands for the output
                if user.name not in by_name and user.op == "call_method" and user.target == "reshape" \
                        or LAYOUT_META in user.meta:
                    produced[user] = orig
                if LAYOUT_META in user.meta:
                    pair.permuted_back[k] = user.meta[LAYOUT_META]
    return pairs


class _Unmapped:
    """A rewritten-graph value with no original counterpart (named for the message)."""

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return f"<unmapped {self.name}>"
