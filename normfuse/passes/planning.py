"""Plan: every fused call of a graph decided before the graph changes.

``plan(analysis, config) -> Planning`` reads the ``Analysis`` (never writes to it) and
decides, site by site in graph order, which call each becomes:

- add -> norm      : ``add_norm(x, residual, w, b, ...)``; the sum is an output when anything
                     else still reads it;
- a norm alone     : ``add_norm(x, None, w, b, ...)``;
- then each step found at the site (``order.STEPS``: the fusions of ``fusions/``, which make
  the call one of their own op, ``norm_add`` for ``x + norm(f)`` or ``qk_norm_rope``, and the
  parts of ``parts/``, which extend an add_norm call) is offered to the call; a step it cannot
  take keeps its reason.

A ``Plan`` carries everything decided for one call: the sites it computes, the adds it
claims, the fusion parts it takes, the operands, the rounding modes, where it goes (with the late
operands moved up before it), whether it keeps the residual stream wider
(``residual_dtype``), and the linears that recompute its output (``recompute_norm_output``).
A site no call computes gets a ``Decision`` with the reason. The rewrite applies the plans
(``rewrite.py``), the audit prices them (``cost.py``), the report is built from them
(``provenance.site_records``). Each add is folded into at most one call (the first norm,
in graph order, that claims it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx as fx

from normfuse.passes.analysis import Analysis, SiteAnalysis
from normfuse.passes.canonical import canonical, is_split_piece, mutates, node_dtype, node_shape, real_users, same_shape
from normfuse.passes.classify import stream_operand
from normfuse.passes.graph import GraphIndex
from normfuse.passes.order import STEPS, taken_steps
from normfuse.passes.parts import folded_nodes, taken_parts
from normfuse.passes.step import PlanContext
from normfuse.vocabulary import KERNEL_DTYPES, LOW_PRECISION, Placement

__all__ = ["Plan", "Decision", "Planning", "Insertion", "plan"]


@dataclass(frozen=True)
class Insertion:
    """Where a fused call goes: before ``first``, the first node that may read its outputs,
    with each late operand and what it is computed from moved up before it (graph order)."""

    first: fx.Node
    moves: tuple[fx.Node, ...] = ()
    replaces: tuple[fx.Node, ...] = ()  # placed after the site (not at its start): the values it replaces
    follows: tuple[fx.Node, ...] = ()   # ... and the views or casts of its sum the stream goes on with, moved after it


@dataclass
class Plan:
    """One fused call and everything decided for it (graph nodes are the analysed graph's)."""

    op: str                                  # one of FUSED_OPS
    sites: tuple[int, ...]                   # the sites it computes: the lead, then a paired norm
    x: Any
    residual: Any = None
    output_add: fx.Node | None = None        # the add folded after the norm (norm_add)
    residual_scale: float = 1.0
    sum_dtype: torch.dtype | None = None
    permute: tuple[int, ...] | None = None   # the kernel reads x and residual permuted by these dims
    claims: tuple[fx.Node, ...] = ()         # adds, nodes a part folded or replaces: no other call may take them
    insertion: Insertion | None = None
    residual_dtype: torch.dtype | None = None  # the call writes, or reads, a stream kept in this dtype
    widens: bool = False                     # ... it writes the sum in residual_dtype
    takes_wide: tuple[int, ...] = ()         # plans whose wide sum this call reads as it is
    recompute: tuple[fx.Node, ...] = ()      # linears reading its output that recompute it in backward
    taken: dict[str, Any] = field(default_factory=dict)  # the fusion parts it computes too: name -> match

    @property
    def lead(self) -> int:
        return self.sites[0]

    @property
    def fused_add(self) -> bool:
        return self.op in ("add_norm", "norm_add")

    @property
    def exclusive(self) -> bool:
        """A part it takes changes y: no second norm shares the call, no linear recomputes y."""
        return any(step.exclusive for step, _ in taken_steps(self.taken))


@dataclass(frozen=True)
class Decision:
    """What became of one site: the plan computing it, or why none does; and why the add next
    to it is not in its kernel (when there is one and it is not)."""

    plan: int | None = None
    reason: str | None = None
    add_reason: str | None = None
    part_reasons: dict[str, str] = field(default_factory=dict)  # fusion part found -> why the call lacks it


@dataclass
class Planning:
    """Every plan of one graph, in graph order, and a decision per site."""

    plans: list[Plan] = field(default_factory=list)
    decisions: list[Decision] = field(default_factory=list)

    def plan_of(self, number: int) -> Plan | None:
        d = self.decisions[number]
        return self.plans[d.plan] if d.plan is not None else None


# --------------------------------------------------------------------------- the norm itself

def refusal(site: SiteAnalysis) -> str | None:
    """Why the norm itself cannot become a fused op (None when it can)."""
    m = site.match
    if m.reason:
        return m.reason
    if m.hidden_size is None:
        return "hidden size unknown (no shape metadata on the graph, or a symbolic last dim)"
    dt = node_dtype(m.input)
    if dt not in KERNEL_DTYPES:
        return f"input dtype {dt} is not one the kernels take ({', '.join(map(str, KERNEL_DTYPES))})"
    for t, name in ((m.weight, "weight"), (m.bias, "bias")):
        if t is not None and node_dtype(t) not in KERNEL_DTYPES:
            return f"{name} dtype {node_dtype(t)} is not one the kernels take"
    if m.out_dtype not in KERNEL_DTYPES:
        return f"output dtype {m.out_dtype} is not one the kernels take"
    # DTensor (tensor/sequence parallel) inputs: the rows must be whole (normfuse.kernels.sharding)
    from normfuse.kernels.sharding import refusal as dtensor_refusal
    return dtensor_refusal([n.meta.get("example_value", n.meta.get("val")) for n in (m.input, m.weight, m.bias)
                            if isinstance(n, fx.Node)])


# --------------------------------------------------------------------------- one site

def _choose(analysis: Analysis, site: SiteAnalysis, claimed: set) -> tuple[Plan | None, str | None]:
    """The call a site becomes before the fusion parts are offered to it and it is placed: an
    add_norm call taking the add its norm reads, when it can, else the norm alone; or why none."""
    reason = refusal(site)
    if reason:
        return None, reason
    index, m, add = analysis.index, site.match, site.in_add
    reshaped = add is not None and add.permute is None and not same_shape(node_shape(add.node),
                                                                          node_shape(m.output))
    static = all(isinstance(d, int) for d in (node_shape(m.output) or (None,)))
    if add is not None and add.reason is None and add.node not in claimed and (static or not reshaped):
        a, b = add.operands
        # s = x + scale * residual: the scaled operand (DeepNorm) is the residual
        if add.broadcast is not None:  # the kernel reads the table (learned positions) as the residual
            x, residual = (b, a) if add.broadcast == 0 else (a, b)
        elif add.scaled is not None:
            x, residual = (b, a) if add.scaled == 0 else (a, b)
        else:
            stream = stream_operand(index, add)
            x, residual = (b, a) if stream == 0 else (a, b)
        return Plan("add_norm", (site.number,), x, residual, residual_scale=add.residual_scale,
                    sum_dtype=node_dtype(add.total)), None
    return Plan("norm", (site.number,), m.input, None, sum_dtype=node_dtype(m.input)), None


def _add_reason(site: SiteAnalysis, p: Plan | None, claimed: set, reserved: set, config) -> str | None:
    """Why the add next to a site is not in its kernel (None when the kernel holds an add, or no
    add is next to it). Called before the site's own adds are claimed."""
    if p is not None and p.fused_add:
        return None
    add, out = site.in_add, site.output_add
    if add is not None:
        return add.reason or ("the sum is folded into another norm's kernel" if add.node in claimed
                              else "the add's operands change shape on the way to the norm")
    if out is None:
        return None
    if out.reason is not None:
        return out.reason
    if out.node in claimed or out.node in reserved:
        return "the add after the norm is folded into the kernel of the norm that reads its sum"
    if not config.fuse_output_add:
        return "adds after a norm are not folded (fuse_output_add=False)"
    if site.output_chain:
        return "views or dropout sit between the norm and the add after it"
    if site.placement not in (Placement.RES_POST, Placement.SANDWICH):
        return ("the add after the norm is not a residual add of the norm's output into a stream "
                "(x + norm(F(x))): neither operand descends from the other")
    return "the add after the norm does not keep the stream's shape"


def _offer_steps(context: PlanContext, site: SiteAnalysis, p: Plan) -> dict[str, str]:
    """Offer the call each step (fusions and parts), in ``order.STEPS``; returns why the call
    lacks the steps found at its site that it does not take."""
    reasons = {}
    for step in STEPS:
        taken, reason = step.offer(context, site, site.parts.get(step.name), p)
        if taken is not None:
            p.taken[step.name] = taken
        elif reason is not None:
            reasons[step.name] = reason
    return reasons


# --------------------------------------------------------------------------- where the call goes

def _candidates(analysis: Analysis, p: Plan) -> list[fx.Node]:
    """The nodes a call stands for that decide where it starts."""
    lead = analysis.sites[p.lead]
    nodes = list(lead.match.nodes) + [lead.match.output]
    if p.op == "add_norm" and lead.in_add is not None:
        nodes += [lead.in_add.node, *lead.in_add.chain]
    if p.output_add is not None:
        nodes.append(p.output_add)
    for step, found in taken_steps(p.taken):
        nodes += step.spans(found)
    return nodes


def _place(analysis: Analysis, p: Plan, late: dict[fx.Node, int]) -> tuple[Insertion | None, str | None]:
    """Where the call goes, or why it cannot go where the site starts. An operand computed
    later (Nemotron's LayerNorm1P computes ``weight + 1`` after the residual add) moves up
    together with what it is computed from, when that is pure and reads only values computed
    before it; else the call goes where its first output is read (``_last_place``). ``late``:
    the values earlier calls replace -> where that call goes."""
    index = analysis.index
    candidates = _candidates(analysis, p)
    first = min(candidates, key=index.order.__getitem__)
    lead = analysis.sites[p.lead].match
    extra = [t for step, found in taken_steps(p.taken) for t in step.reads(found)]
    moves: list[fx.Node] = []
    operands = [t for t in (p.x, p.residual, lead.weight, lead.bias, *extra) if isinstance(t, fx.Node)]
    for operand in operands:
        if max(index.order[operand], late.get(operand, -1)) >= index.order[first]:
            moved = _movable_up(index, operand, first, set(candidates), late)
            if moved is None:
                last = _last_place(analysis, p, candidates, operands, late)
                if last is not None:  # the call where its first output is read, after every operand
                    return Insertion(last[0], replaces=last[1], follows=last[2]), None
                return None, (f"operand {operand.name} is computed after the site starts and cannot move before "
                              "it (it reads a value of the site, is not a pure primitive, or a value it reads is "
                              "written in place), nor can the call go after it")
            moves += [n for n in moved if n not in moves]
    return Insertion(first, tuple(sorted(moves, key=index.order.__getitem__))), None


def _last_place(analysis: Analysis, p: Plan, candidates: list[fx.Node], operands: list[fx.Node],
                late: dict[fx.Node, int]) -> tuple[fx.Node, tuple[fx.Node, ...], tuple[fx.Node, ...]] | None:
    """The latest place an add_norm call can go instead: before the first node outside the site
    that reads a value of it, when every operand is computed before that, none is written in
    place between the site's start and there, and of the site's nodes only the sum, y (as the
    parts give it), the outputs parts add (y1) and the pass-through nodes between the add and the norm are read outside it
    (those move after the call; any other node that stays would read the call's output before
    the call). An adaLN ``1 + scale``, computed from the block's own timestep projection after
    the add the call takes, is why. (that node, the values the call replaces, the nodes that
    move after it), or None."""
    if p.op not in ("add_norm", "norm"):
        return None
    index = analysis.index
    inside = set(candidates) | set(folded_nodes(p.taken))
    for step, found in taken_steps(p.taken):
        inside |= set(step.nodes(found))
    replaced = set(replaced_values(analysis, p))
    lead = analysis.sites[p.lead]
    chain = set(lead.in_add.chain) if p.op == "add_norm" and lead.in_add is not None else set()
    read_outside = [n for n in inside if any(u not in inside for u in n.users)]
    survivors = [n for n in read_outside if n not in replaced]
    if any(n not in chain for n in survivors):
        return None
    # a pass-through node read outside stays, and so do those between the add and it, which it reads
    follows = sorted((n for n in chain if survivors and index.order[n] <= max(map(index.order.__getitem__,
                                                                                 survivors))),
                     key=index.order.__getitem__)
    readers = [u for n in read_outside if n in replaced for u in n.users if u not in inside]
    if not readers:
        return None
    last = min(readers, key=index.order.__getitem__)
    start, end = min(index.order[n] for n in inside), index.order[last]
    if any(index.order[u] <= end for n in follows for u in n.users if u not in inside) or \
            any(index.order[a] >= end for n in follows for a in n.all_input_nodes if a not in inside):
        return None  # what reads a moved node comes before the call; or it reads a value made after it
    if any(max(index.order[t], late.get(t, -1)) >= end or t in inside for t in operands):
        return None
    if any(mutates(u) and start <= index.order.get(u, -1) <= end for t in operands for u in t.users):
        return None
    return last, tuple(replaced), tuple(follows)


def replaced_values(analysis: Analysis, p: Plan) -> tuple[fx.Node, ...]:
    """The values the call's outputs stand for: y as the parts give it, the sum, the outputs parts add (y1)."""
    y = analysis.sites[p.lead].match.output
    for part, found in taken_parts(p.taken):
        y = part.y_output(found, y)
    added = (n for part, found in taken_parts(p.taken) for n in part.added_outputs(found))
    outputs = (y, sum_node(analysis, p), *added)
    return tuple(n for n in dict.fromkeys(outputs) if n is not None)


def _movable_up(index: GraphIndex, operand: fx.Node, first: fx.Node, site: set, late: dict[fx.Node, int]
                ) -> list[fx.Node] | None:
    """``operand`` and the nodes it is computed from that come at or after ``first``, in graph
    order, when moving them all before ``first`` keeps every value: each is a get_attr or a
    pure primitive (no in-place write, no random dropout), none is part of the site, and
    nothing writes in place into them or into what they read before the site has read them
    (the fused call reads them at ``first``), and none is a value a call placed after ``first``
    replaces (``late``). None otherwise."""
    start, end = index.order[first], max(index.order[n] for n in site)
    later, stack = set(), [operand]
    while stack:
        node = stack.pop()
        if late.get(node, -1) >= start:
            return None
        if node in later or index.order[node] < start:
            continue
        if node in site or node.op not in ("get_attr", "call_function", "call_method"):
            return None
        if node.op != "get_attr" and not is_split_piece(node):
            c = index.view.get(node)
            if c is None or c.multi_output or mutates(node) or c.prim == "dropout":
                return None
        later.add(node)
        stack.extend(node.all_input_nodes)
    values = later | {a for n in later for a in n.all_input_nodes}
    if any(mutates(u) and start <= index.order.get(u, -1) <= end for a in values for u in a.users):
        return None
    return sorted(later, key=index.order.__getitem__)


# --------------------------------------------------------------------------- the residual stream and the linears

def sum_node(analysis: Analysis, p: Plan) -> fx.Node | None:
    """The node whose value a call's stream output (the sum, or norm_add's result) replaces."""
    lead = analysis.sites[p.lead]
    if p.op == "add_norm" and p.residual is not None and lead.in_add is not None:
        return lead.in_add.total
    return p.output_add if p.op == "norm_add" else None


def sum_escapes(analysis: Analysis, p: Plan) -> bool:
    """Whether anything but the call reads its sum (so the call returns it)."""
    return p.op == "add_norm" and analysis.sites[p.lead].sum_continues


def _absorbed(analysis: Analysis, p: Plan) -> set[fx.Node]:
    """The nodes a call stands for, whose readers of other values it becomes."""
    lead = analysis.sites[p.lead]
    nodes = set(lead.match.nodes)
    for number in p.sites[1:]:
        nodes |= set(analysis.sites[number].match.nodes)
    if p.op == "add_norm" and lead.in_add is not None:
        add = lead.in_add
        nodes |= {add.node, *add.chain, *add.node.all_input_nodes}
        folded = folded_nodes(p.taken)
        nodes |= {*folded, *(n for b in folded for n in b.all_input_nodes)}
    if p.output_add is not None:
        nodes.add(p.output_add)
    return nodes


def _widen(analysis: Analysis, planning: Planning, dtype: torch.dtype) -> None:
    """``residual_dtype``: each call writing a 16-bit stream sum writes it in ``dtype``; a call
    that reads such a sum as its add's operand takes it as it is, every other reader gets it
    rounded back (a fused call doing so is marked as reading the wide stream too)."""
    widened: dict[fx.Node, int] = {}  # the analysed node a wide sum replaces -> its plan
    for i, p in enumerate(planning.plans):
        if p.op == "add_norm" and p.residual is not None:
            old = p.sum_dtype
        elif p.op == "norm_add":
            old = node_dtype(p.output_add)
        else:
            continue
        if old in LOW_PRECISION:
            p.widens, p.residual_dtype = True, dtype
            if sum_escapes(analysis, p) or p.op == "norm_add":
                widened[sum_node(analysis, p)] = i
    owner = {n: j for j, q in enumerate(planning.plans) for n in _absorbed(analysis, q)}
    for node, i in widened.items():
        writer = planning.plans[i]
        for user in real_users(node):
            j = owner.get(user)
            if j is None or j == i:
                continue
            reader = planning.plans[j]
            if _takes_wide(analysis, reader, node, widened, dtype):
                reader.takes_wide += (i,)
            else:
                reader.residual_dtype = dtype
        del writer


def _takes_wide(analysis: Analysis, q: Plan, value: fx.Node, widened: dict, dtype: torch.dtype) -> bool:
    """Whether call ``q`` can read the wide ``value`` as its add's operand: the residual add's x
    or residual (norm_add: its residual), with weight and bias in a dtype the op pairs with its
    operands (an operand's dtype, or fp32)."""
    if q.residual is None or value not in ((q.x, q.residual) if q.op == "add_norm" else (q.residual,)):
        return False
    operand_dtypes = {dtype if op in widened else node_dtype(op) for op in (q.x, q.residual)}
    lead = analysis.sites[q.lead].match
    return all(t is None or node_dtype(t) in operand_dtypes | {torch.float32} for t in (lead.weight, lead.bias))


def _linear_readers(analysis: Analysis, p: Plan) -> tuple[fx.Node, ...]:
    """``recompute_norm_output``: the linears reading the call's output y, when nothing else
    reads it and their weights come before the first of them; else ()."""
    if p.op not in ("add_norm", "norm") or len(p.sites) > 1:
        return ()  # norm_add's y is not the stream's; two norms share one call
    y = analysis.sites[p.lead].match.output
    users = real_users(y)
    order = analysis.index.order
    operands = []
    for u in users:
        c = canonical(u)
        if c is None or c.prim != "linear" or c["input"] is not y or not isinstance(c["weight"], fx.Node) \
                or y in (c["weight"], c["bias"]):
            return ()
        if node_dtype(u) != node_dtype(y):
            return ()  # autocast runs the linear on y cast to 16 bits (the fp32 y of an autocast norm)
        operands += [t for t in (c["weight"], c["bias"]) if isinstance(t, fx.Node)]
    if not users or len(y.users) != len(users):
        return ()
    first = min(users, key=order.__getitem__)
    if any(order.get(t, -1) > order[first] for t in operands):
        return ()  # a weight computed after the first linear: leave these linears alone
    return tuple(sorted(users, key=order.__getitem__))


# --------------------------------------------------------------------------- the graph

def plan(analysis: Analysis, config, as_op: bool = False, excluded: Callable[[int], bool] = lambda n: False
         ) -> Planning:
    """Decide every fused call of the analysed graph (see the module docstring).

    ``config``: the FuseConfig; ``as_op``: the graph is ATen (Inductor's post-grad passes): the
    calls will be the custom ops, with no seed drawn for a folded dropout and no stream
    widening or linear recompute; ``excluded(number)``: the site is left as it was (filter_fn)."""
    planning = Planning()
    decisions: list[Decision | None] = [None] * len(analysis.sites)
    claimed: set[fx.Node] = set()
    reserved = {s.in_add.node for s in analysis.sites if s.in_add is not None and s.in_add.reason is None}
    unavailable: set[int] = set()  # sites no call may take as its second norm: excluded, or taken already
    late: dict[fx.Node, int] = {}   # values earlier calls replace -> where those calls go
    context = PlanContext(analysis, config, as_op, unavailable=unavailable, claimed=claimed, reserved=reserved,
                          norm_refusal=refusal, steps=STEPS)
    for site in analysis.sites:
        if excluded(site.number):
            decisions[site.number] = Decision(reason="excluded by filter_fn")
            unavailable.add(site.number)
    for site in analysis.sites:
        if site.number in unavailable:
            continue
        chosen, reason = _choose(analysis, site, claimed)
        part_reasons = _offer_steps(context, site, chosen) if chosen is not None else {}
        if chosen is not None:
            chosen.insertion, reason = _place(analysis, chosen, late)
            # a step whose operand comes too late: the call without it (order.py says which first)
            for step in reversed(STEPS):
                if reason and step.name in chosen.taken and step.may_drop(chosen.taken[step.name]):
                    step.drop(chosen, chosen.taken.pop(step.name))
                    part_reasons[step.name] = f"{step.operand_name}: {reason}"
                    chosen.insertion, reason = _place(analysis, chosen, late)
        if reason is None and chosen.op == "norm" and not config.standalone:
            reason = "standalone norms not rewritten (standalone=False)"
        if reason is not None:
            found_reasons = {name: found.reason for name, found in site.parts.items()
                             if getattr(found, "reason", None)}  # what the part itself could not take
            decisions[site.number] = Decision(reason=reason, add_reason=None, part_reasons=found_reasons)
            continue
        add_reason = _add_reason(site, chosen, claimed, reserved, config)
        chosen.claims = tuple(n for n in (site.in_add.node if chosen.op == "add_norm" and site.in_add is not None
                                          else None, chosen.output_add, *folded_nodes(chosen.taken),
                                          *(n for step, found in taken_steps(chosen.taken)
                                            for n in step.nodes(found))) if n is not None)
        claimed.update(chosen.claims)  # an add folded into one kernel is not folded into another
        if config.recompute_norm_output and not as_op and not chosen.exclusive:
            chosen.recompute = _linear_readers(analysis, chosen)
        # where each value the call replaces is computed now: a later call moves no reader of it above that
        late.update({n: analysis.index.order[chosen.insertion.first]
                     for n in chosen.insertion.replaces or replaced_values(analysis, chosen)})
        number = len(planning.plans)
        planning.plans.append(chosen)
        for member in chosen.sites:
            decisions[member] = Decision(plan=number, add_reason=add_reason,
                                         part_reasons=part_reasons if member == site.number else {})
            unavailable.add(member)
    planning.decisions = [d if d is not None else Decision(reason="not rewritten") for d in decisions]
    if config.residual_dtype is not None and not as_op:
        _widen(analysis, planning, config.residual_dtype)
    return planning
