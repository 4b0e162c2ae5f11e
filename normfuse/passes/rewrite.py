"""Rewrite: apply the plans (``planning.py``), each one call of a fused op.

The plans were decided on the analysed graph before anything changed; here each becomes
its call, inserted where its ``Insertion`` says (late operands moved up first), its users
rerouted to the call's outputs and its old nodes erased when nothing reads them any more.
The plan's fusion builds the call (``fusions/``: the add_norm call with what each part it
takes adds, a norm_add call, a qk_norm_rope call); this module places it and records it.
Values an earlier call replaced are looked up through ``Rewriting.resolve``. Then the
stream sums a plan keeps wider (``residual_dtype``) are widened, and the linears a plan
recomputes its output for become one ``norm_linears`` call.

Each call leaves its record (``record.py``): the original nodes it stands for, the value each
argument carries and the node each output replaced; ``apply_plans`` returns them and the
pipeline hands them to the checker on the rewritten graph module.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from normfuse.kernels.add_norm import fused_add_norm, norm_add
from normfuse.kernels.specs import op_arguments, op_defaults
from normfuse.passes.analysis import Analysis
from normfuse.passes.canonical import canonical, node_dtype, real_users
from normfuse.passes.fusions import fusion_of
from normfuse.passes.fusions.add_norm import output_index
from normfuse.passes.planning import Plan, Planning
from normfuse.passes.record import CallRecord, record_call
from normfuse.passes.step import BuiltCall

__all__ = ["Rewriting", "apply_plans"]


class Rewriting:
    """The graph being rewritten and what replaced what. Starts from the analysis, which it
    never writes to; node order is the graph's own (``fx.Node`` compares by position)."""

    def __init__(self, analysis: Analysis, as_op: bool):
        self.analysis = analysis
        self.graph = analysis.index.graph
        self.as_op = as_op
        self.replaced: dict[fx.Node, fx.Node] = {}  # old node -> node holding its value now
        self.records: list[CallRecord] = []         # per call, what it replaced (record.py)

    def resolve(self, node: Any) -> Any:
        """The node that now holds the value ``node`` held before earlier rewrites."""
        while isinstance(node, fx.Node) and node in self.replaced:
            node = self.replaced[node]
        return node

    def replace(self, old: fx.Node, new: fx.Node) -> None:
        old.replace_all_uses_with(new)
        self.replaced[old] = new

    def fused_call(self, family: str, args: tuple, options: dict) -> fx.Node:
        """A call of ``family`` ("add_norm" or "norm_add") inserted at the graph's insertion point."""
        return _fused_call(self.graph, family, args, options, self.as_op)


def _fused_call(graph: fx.Graph, family: str, args: tuple, options: dict, as_op: bool) -> fx.Node:
    """One call of the functional API, or (``as_op``) of its custom op with every option
    spelled out and the fake result as its ``val`` (Inductor lowers from that)."""
    if not as_op:
        return graph.call_function(fused_add_norm if family == "add_norm" else norm_add, args, options)
    # the op's arguments by their schema names (the functional options that differ: return_sum
    # is store_sum, return_norm store_norm); the op's defaults for the rest of its modes
    op = "add_norm_fwd" if family == "add_norm" else "norm_add_fwd"
    named = dict(zip(("x", "residual", "weight", "bias"), args), **options)
    for option, argument in (("return_sum", "store_sum"), ("return_norm", "store_norm")):
        if option in named:
            named[argument] = named.pop(option)
    defaults, arguments = op_defaults(op), op_arguments(op)
    unknown = set(named) - set(arguments)
    if unknown:  # an option the op does not take would be dropped: its call would compute something else
        raise RuntimeError(f"torch.ops.normfuse.{op} takes no argument {', '.join(sorted(unknown))}; the call "
                           f"cannot be written as the custom op")
    op_args = tuple(named[name] if name in named else defaults[name] for name in arguments)
    target = getattr(torch.ops.normfuse, op).default
    call = graph.call_function(target, op_args)
    vals = [a.meta.get("val") if isinstance(a, fx.Node) else a for a in op_args]
    fake_mode = torch._guards.detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)])
    if fake_mode is not None:
        with fake_mode:
            call.meta["val"] = target(*vals)
    return call


def _insertion_point(p: Plan) -> fx.Node:
    """The plan's first node, with the late operands moved up before it (in graph order)."""
    first = p.insertion.first
    for node in p.insertion.moves:
        # an earlier call may have moved it up already, further than this one needs, or replaced it (its
        # output, placed where that call's site starts, stands for it: moving the erased node would relink it)
        if node > first and not node._erased:
            first.prepend(node)
    return first


def apply(r: Rewriting, p: Plan) -> fx.Node:
    """Insert the plan's call before its first node and reroute the users of what it computes;
    returns the call and adds its record to ``r.records``."""
    m = r.analysis.sites[p.lead].match
    fusion = fusion_of(p.op)
    modes = dict(kind=m.kind, eps=m.eps, weight_offset=m.weight_offset, residual_scale=p.residual_scale,
                 norm_round_dtype=m.norm_round_dtype, out_dtype=m.out_dtype)
    if m.group is not None:  # statistics per group of columns (only then: plain calls read as before)
        modes["norm_group"] = m.group
    with r.graph.inserting_before(_insertion_point(p)):
        built = fusion.build(p.taken.get(fusion.name), p, r, modes)
    for node in p.insertion.follows:  # the stream's views of the sum go on after the call that makes it
        p.insertion.first.prepend(node)
    call = built.call
    holds = _outputs_hold(built)
    reads = {a for a in (p.x, p.residual, m.weight, m.bias, *built.reads) if isinstance(a, fx.Node)}
    r.records.append(record_call(r.analysis, p, call, reads, built.stands_for, holds, built.permuted_back))
    call.meta["stack_trace"] = m.output.meta.get("stack_trace")
    call.meta["nn_module_stack"] = m.output.meta.get("nn_module_stack")
    _erase_dead(r.graph, [*m.nodes, *built.old_nodes])
    return call


def _outputs_hold(built: BuiltCall) -> dict[fx.Node, fx.Node]:
    """The original value each of the call's outputs holds, and each node the rewrite made of
    one (reshaped, permuted back): an output's ``getitem`` holds the node it replaced."""
    outputs, holds = dict(built.stands_for), dict(built.holds)
    for node in built.inserted:  # in insertion order: an output before what is made of it
        if node is built.call or node in holds:
            continue
        if node.target is operator.getitem and node.args[0] is built.call and node.args[1] in outputs:
            holds[node] = outputs[node.args[1]]
        elif node.all_input_nodes and node.all_input_nodes[0] in holds:
            holds[node] = holds[node.all_input_nodes[0]]
    return holds


def _erase_dead(graph: fx.Graph, nodes: list[fx.Node]) -> None:
    """Erase the plan's old nodes that nothing reads any more, last first (in graph order)."""
    # the site's own nodes are pure (arithmetic, casts, views, norm calls or norm modules)
    pending = sorted({n for n in nodes if isinstance(n, fx.Node) and n.op in ("call_function", "call_method",
                                                                             "call_module")}, reverse=True)
    for node in pending:
        if node.graph is not graph or real_users(node):
            continue
        for check in list(node.users):  # checks of a value that no longer exists
            graph.erase_node(check)
        graph.erase_node(node)


# --------------------------------------------------------------------------- after the calls

def _output(call: fx.Node, index: int) -> fx.Node | None:
    return next((u for u in call.users if u.target is operator.getitem and u.args[1] == index), None)


def _retype(node: fx.Node, dtype: torch.dtype) -> None:
    """The node's fake value with its new dtype (later stages read dtypes off the meta)."""
    for key in ("val", "example_value"):
        value = node.meta.get(key)
        if isinstance(value, torch.Tensor):
            node.meta[key] = value.to(dtype)
    node.meta.pop("tensor_meta", None)


def _widen(r: Rewriting, planning: Planning, calls: list[fx.Node]) -> None:
    """Each wide stream output goes as it is to the calls that take it (the plan says which);
    every other reader gets it rounded back to the dtype the graph had."""
    for i, p in enumerate(planning.plans):
        if not p.widens:
            continue
        call = calls[i]
        out = _output(call, fusion_of(p.op).stream_sum(call)[0])
        if out is None:
            continue
        old = node_dtype(out)
        _retype(out, p.residual_dtype)
        takers = {calls[j] for j, q in enumerate(planning.plans) if i in q.takes_wide}
        others = [u for u in out.users if u not in takers]
        if not others:
            continue
        with r.graph.inserting_after(out):
            narrow = r.graph.call_method("to", (out, old))
        narrow.meta.update({k: v for k, v in out.meta.items() if k in ("stack_trace", "nn_module_stack")})
        for key in ("val", "example_value"):
            if isinstance(out.meta.get(key), torch.Tensor):
                narrow.meta[key] = out.meta[key].to(old)
        for user in others:
            user.replace_input_with(out, narrow)


def _recompute(r: Rewriting, planning: Planning, calls: list[fx.Node]) -> None:
    """The linears a plan recomputes its output for become one ``norm_linears`` call, which
    keeps only the norm's input and recomputes y in backward with the call's own modes."""
    from normfuse.kernels.norm_linear import norm_linears

    graph = r.graph
    for i, p in enumerate(planning.plans):
        if not p.recompute:
            continue
        call, linears = calls[i], list(p.recompute)
        where = output_index(call.kwargs)
        y = _output(call, where["y"])
        users = real_users(y)
        if len(users) == 1 and users[0].op == "call_method" and users[0].target in ("reshape", "view") \
                and users[0].args[0] is y:
            y = users[0]  # the reshape the rewrite put between the add's and the norm's shapes
        operands = [(c["weight"], c["bias"]) for c in map(canonical, linears)]
        x, residual, weight, bias = call.args[:4]
        if residual is not None:  # the norm's input is the sum: make the call return it
            if not call.kwargs.get("return_sum"):
                call.kwargs = {**call.kwargs, "return_sum": True}
            inp = _output(call, where["s"])
            if inp is None:
                with graph.inserting_after(call):
                    inp = graph.call_function(operator.getitem, (call, where["s"]))
        else:
            inp = x
        modes = {k: call.kwargs[k] for k in ("kind", "eps", "weight_offset", "sum_dtype", "norm_round_dtype",
                                             "out_dtype")}
        first = min(linears)  # the first in graph order
        with graph.inserting_before(first):
            fused = graph.call_function(norm_linears, (y, inp, weight, bias, [o[0] for o in operands],
                                                       [o[1] for o in operands]), modes)
            fused.meta["stack_trace"] = first.meta.get("stack_trace")
            fused.meta["nn_module_stack"] = first.meta.get("nn_module_stack")
            for k, linear in enumerate(linears):
                out = graph.call_function(operator.getitem, (fused, k))
                out.meta.update(linear.meta)
                linear.replace_all_uses_with(out)
        for linear in linears:
            graph.erase_node(linear)


def apply_plans(analysis: Analysis, planning: Planning, as_op: bool = False) -> list[CallRecord]:
    """Rewrite the analysed graph (in place) as planned; returns each plan's call record."""
    r = Rewriting(analysis, as_op)
    calls = [apply(r, p) for p in planning.plans]
    _widen(r, planning, calls)
    _recompute(r, planning, calls)
    for node in list(r.graph.nodes):  # parameters read only by a norm that is gone now
        if node.op == "get_attr" and not node.users:
            r.graph.erase_node(node)
    return r.records
